"""draft-train --type eagle3 on a tiny target: the loss falls and the held-out acceptance rises; the written file is
llama.cpp's eagle3 layout (read back here with gguf's reader into the Hugging Face layout, the reference of
tests/tiny_eagle3.py computes its drafts); the trained head accepts more than the untrained one at run time, stays
lossless (greedy, alone and chained, one and four sequences; rejection sampling keeps the target's distribution at
T > 0); the training requests are none of the built-in prompt sets'."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from spec_cli.model.loader import load_model
from spec_cli.model.sampling import SamplingParams
from spec_cli.text.prompt_sets import expand, load_prompt_set
from spec_cli.train import eagle3_data, requests
from spec_cli.train.eagle3 import Eagle3TrainConfig, train
from spec_cli.train.requests import all_requests, documentation
from tests.draft_recorder import record_drafts
from tests.head_checks import (
    GGUFContents,
    assert_it_learned,
    assert_rejection_keeps_the_distribution,
    n_accepted,
    trained_and_untrained,
    training_prompts,
)
from tests.test_eagle3 import make_session, reference_draft
from tests.tiny_eagle3 import N_HEAD, N_KV, TinyEagle3
from tests.tiny_gguf import write_tiny_gguf

GREEDY = SamplingParams(temp=0.0, ignore_eos=True)
CFG = Eagle3TrainConfig(steps=200, lr=3e-3, seq_len=32, batch=4, data_tokens=32 * 96, gen_tokens=32 * 64,
                        eval_tokens=32 * 8, ttt_steps=3, draft_vocab=150, checkpoint_every=50)


def test_the_estimate_drafts_along_the_targets_path():
    # the target would have written 8 after [5, 6, 7]; the text goes on with 9. The draft anchored at position 1
    # (fed 7) predicts 8; its next step would be fed 8 at run time and the window's 9 in the estimate: not counted
    tokens = torch.tensor([[5, 6, 7, 9, 10, 11, 12, 13]])
    top1 = torch.tensor([[6, 7, 8, 10, 11, 12, 13, eagle3_data.UNKNOWN]])
    w = eagle3_data.Windows(tokens, torch.zeros(1, 8, 1, 1), torch.zeros(1, 8, 1), top1)
    anchors = torch.tensor([[1, 2, 5]])
    targets = eagle3_data.path_targets(w, anchors + 1, 3)  # a draft at anchor a is fed the token at a + 1
    assert targets.tolist() == [[[8, -1, -1], [10, 11, 12], [13, -1, -1]]]


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("train") / "target.gguf", arch="llama", seed=11, n_layer=4)


@pytest.fixture(scope="module")
def trained(target_path, tmp_path_factory):
    """(the trained head's path, its TrainResult, the training losses, the untrained head's path)."""
    return trained_and_untrained(train, target_path, tmp_path_factory.mktemp("heads"), CFG)


def test_training_lowers_the_loss_and_raises_the_held_out_acceptance(trained):
    _, result, losses, _ = trained
    assert_it_learned(result, losses, CFG.steps)


def test_the_trained_head_accepts_more_than_the_untrained_one(target_path, trained):
    path, _, _, untrained = trained
    assert n_accepted(make_session, target_path, path) > n_accepted(make_session, target_path, untrained) + 4


def read_back(path, target_path) -> TinyEagle3:
    """The written file read with gguf's reader into the Hugging Face layout the reference computes with."""
    head, target = GGUFContents(path), GGUFContents(target_path)
    arr, value = head.array, head.value

    def to_half_split(w, n_head):  # llama's interleaved rope order -> HF's
        d = w.shape[0] // n_head
        order = np.argsort(np.arange(d).reshape(2, d // 2).T.reshape(-1))
        return w.reshape(n_head, d, -1)[:, order].reshape(w.shape)

    hf = {"fc": arr("fc.weight"), "input_layernorm": arr("blk.0.attn_norm.weight"),
          "hidden_norm": arr("blk.0.attn_norm_2.weight"), "q_proj": to_half_split(arr("blk.0.attn_q.weight"), N_HEAD),
          "k_proj": to_half_split(arr("blk.0.attn_k.weight"), N_KV), "v_proj": arr("blk.0.attn_v.weight"),
          "o_proj": arr("blk.0.attn_output.weight"), "post_attention_layernorm": arr("blk.0.ffn_norm.weight"),
          "gate_proj": arr("blk.0.ffn_gate.weight"), "up_proj": arr("blk.0.ffn_up.weight"),
          "down_proj": arr("blk.0.ffn_down.weight"), "norm": arr("output_norm.weight"), "lm_head": arr("output.weight")}
    return TinyEagle3(path, tuple(int(v) for v in value("eagle3.target_layers")), hf, head.tensors["d2t"].data.tolist(),
                      target_embd=target.array("token_embd.weight"), target_out=target.array("output.weight"))


def test_the_file_is_llama_cpps_layout_and_drafts_as_its_reference(target_path, trained):
    path, _, _, _ = trained
    reader = GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "eagle3"
    assert [int(v) for v in reader.fields["eagle3.target_layers"].contents()] == [2, 2, 1]  # [2, N//2, N-3], N = 4
    assert reader.fields["eagle3.target_hidden_size"].contents() == 64
    assert "token_embd.weight" not in {t.name for t in reader.tensors}  # the target's
    d2t = next(t for t in reader.tensors if t.name == "d2t")
    assert d2t.tensor_type.name == "I64" and list(d2t.data) == sorted(d2t.data) and len(d2t.data) == CFG.draft_vocab
    tiny = read_back(path, target_path)
    session = make_session(target_path, path, n_seq=2, verify="match")
    calls = record_drafts(session)
    prompts = training_prompts(target_path, 2)
    gen = session.generator()
    for seq, p in enumerate(prompts):
        gen.start(seq, p, GREEDY, 24)
    while gen.step():
        pass
    lm = session.engine.target
    assert session.chain.stats["draft-eagle3"].n_acc_tokens > 0  # rows of accepted drafts re-decoded by position
    assert calls and all(drafted == reference_draft(tiny, lm, prompt, id_last, len(drafted))
                         for prompt, id_last, drafted in calls)


@pytest.mark.parametrize("chain", ["draft-eagle3", "ngram-mod,draft-eagle3"])
@pytest.mark.parametrize("n_seq", [1, 4])
def test_greedy_speculation_with_the_trained_head_equals_plain(target_path, trained, chain, n_seq):
    from tests.test_eagle3 import run_all

    prompts = training_prompts(target_path, n_seq)
    session = make_session(target_path, trained[0], chain, n_seq=n_seq)
    assert run_all(session, prompts) == run_all(make_session(target_path, None, "", n_seq=n_seq), prompts)
    assert session.chain.stats["draft-eagle3"].n_acc_tokens > 0


def test_rejection_sampling_keeps_the_target_distribution(target_path, trained):
    """q = the head's distribution over its draft vocabulary mapped to target ids (0 elsewhere)."""
    session = make_session(target_path, trained[0], verify="rejection", draft_max=3)
    assert_rejection_keeps_the_distribution(session, training_prompts(target_path, 1)[0])


def test_training_requests_are_not_the_built_in_prompt_sets():
    builtin = [expand(m["content"]) for name in ("chat", "writing", "qa", "summarize", "code-edit")
               for p in load_prompt_set(name).prompts for m in p.messages or []]
    requests = all_requests()
    assert len({r.turns for r in requests}) == len(requests) > 500
    assert all(len(r.turns) % 2 for r in requests)  # the target answers a user's turn
    turns = [t for r in requests for t in r.turns]
    assert not any(t in text or text in t for t in turns for text in builtin)
    docs = documentation()
    assert len(docs) > 50 and not any(doc in text for _, doc, _ in docs for text in builtin)
    held = [r for r in requests if r.held_out]
    assert 0.05 < len(held) / len(requests) < 0.2
    assert any(len(r.turns) == 3 for r in held)
    assert any(r.turns[0].startswith("Here is some documentation") for r in held)


def test_resuming_reuses_the_data_unless_the_requests_changed(target_path, tmp_path, monkeypatch):
    loaded = load_model(target_path, device="cpu", dtype="f32")
    cfg = Eagle3TrainConfig(seq_len=32, batch=2, data_tokens=32 * 4, gen_tokens=32 * 2, eval_tokens=32 * 2)
    out, layers = tmp_path / "head.gguf", (1, 2, 3)

    def stages(resume: bool) -> set[str]:
        seen = set()
        eagle3_data.cached_windows(loaded, layers, cfg, out, resume, lambda p: seen.add(p.stage))
        return seen

    assert "generate" in stages(False)
    assert stages(True) == set()  # the same settings and sources: read back
    more = (*requests.all_requests(), requests.templated("Write a haiku about resuming."))
    for module in (requests, eagle3_data):
        monkeypatch.setattr(module, "all_requests", lambda: more)
    assert "generate" in stages(True)


def test_the_training_time_test_computes_the_draft_recursion(target_path, trained):
    """ttt_states' step j for anchor a (attending to the real rows up to a and the anchor's own earlier steps) is
    the draft loop's j-th row: the reference run over the committed rows, then rows fed the state before them."""
    from spec_cli.model.eagle3_file import load_eagle3_head
    from spec_cli.train.eagle3 import ttt_states
    from tests.test_eagle3 import target_features
    from tests.tiny_eagle3 import reference_fuse, reference_rows

    path = trained[0]
    tiny = read_back(path, target_path)
    lm = load_model(target_path, device="cpu", dtype="f32")
    head = load_eagle3_head(path, lm)  # float weights (the target's are): the head trains on these
    tokens = training_prompts(target_path, 1)[0] + [40, 41, 42, 43, 44, 45]
    g = reference_fuse(tiny, target_features(lm, tiny.layers, tokens))
    with torch.no_grad():
        states = ttt_states(head, torch.tensor([tokens]), head.fuse(target_features(lm, tiny.layers, tokens))[None], 3)
    for a in (3, len(tokens) - 5):
        rows, feed = tokens[1 : a + 2], list(g[: a + 1])  # committed rows and the seed row (x_{t+1}, g_t), t <= a
        for j in range(3):
            h, _ = reference_rows(tiny, rows, torch.stack(feed))
            torch.testing.assert_close(states[j][0, a], h[-1], rtol=2e-3, atol=2e-3)
            rows.append(tokens[a + j + 2])
            feed.append(h[-1])
