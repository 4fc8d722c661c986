"""MTP (NextN) drafting: the GGUF layout round trip, the hidden-state shift (every draft equals a from-scratch run of the
head on (token_p, h_{p-1}), and a head reading another position would draft differently), the state kept after a
partial acceptance, greedy losslessness alone and in a chain for one and four sequences, and head distillation."""

from __future__ import annotations

import dataclasses
import json
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from spec_cli.errors import SpecCliError
from spec_cli.model import mtp_head as mtp_module
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.gguf_file import GGUFFile
from spec_cli.model.loader import load_model
from spec_cli.model.mtp_head import load_mtp_head
from spec_cli.model.qlinear import QLinear
from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.generate import SpecOverrides, generate
from spec_cli.runtime.session import open_session
from spec_cli.speculative import head_drafter
from spec_cli.speculative.base import DraftParams, SpecParams
from spec_cli.text.prompt_sets import quoted_stdlib_files
from spec_cli.text.tokenizer import Tokenizer
from spec_cli.train.data import generation_prompts, stdlib_documents, token_windows
from spec_cli.train.mtp import TrainConfig, draft_vocabulary, train
from spec_cli.train.mtp_features import head_forward
from tests.draft_recorder import record_drafts
from tests.tiny_mtp import write_tiny_mtp_gguf

GREEDY = SamplingParams(temp=0.0)
PROMPTS = [
    [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42],
    [60, 61, 62, 60, 61, 62, 60, 61, 62, 60, 61],
    [70, 71, 72, 73, 74, 70, 71, 72, 73],
    [80, 81, 82, 83, 80, 81, 82, 83, 80, 81],
]
N_PREDICT = 32


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    return write_tiny_mtp_gguf(tmp_path_factory.mktemp("mtp") / "tiny-mtp.gguf")


def make_session(path, spec_types: str = "", n_seq: int = 1, **spec):
    """A session whose chain holds the requested n-gram drafters and, for `draft-mtp`, an MTP drafter."""
    params = SpecParams(types=[t for t in spec_types.split(",") if t], draft_max=6, draft_p_min=0.0,
                        ngram_mod_n_match=3, ngram_mod_n_min=1, ngram_mod_n_max=8, **spec)
    return open_session(EngineOptions(model=str(path), n_ctx=128 * n_seq, n_seq=n_seq, device="cpu", spec=params))


def run_all(session, prompts):
    """Greedy outputs of all prompts generated together, one sequence each."""
    session.reset()
    gen = session.generator()
    outs = {seq: list(gen.start(seq, p, GREEDY, N_PREDICT).tokens) for seq, p in enumerate(prompts)}
    while emitted := gen.step():
        for e in emitted:
            outs[e.seq].extend(e.tokens)
    return [outs[s] for s in range(len(prompts))]


@pytest.fixture(scope="module")
def plain_outputs(mtp_path):
    session = make_session(mtp_path)
    return [run_all(session, [p])[0] for p in PROMPTS]


# --- model side -----------------------------------------------------------------------------------------------


def test_gguf_layout_and_loading(mtp_path, tmp_path):
    gf = GGUFFile(mtp_path)
    base = GGUFFile(mtp_path.with_name(mtp_path.stem + "-base.gguf"))
    assert gf.metadata["llama.block_count"] == base.metadata["llama.block_count"] + 1 == 2
    assert gf.metadata["llama.nextn_predict_layers"] == 1
    assert {"blk.1.nextn.eh_proj.weight", "blk.1.nextn.enorm.weight", "blk.1.nextn.hnorm.weight",
            "blk.1.nextn.shared_head_norm.weight", "blk.1.attn_q.weight", "blk.1.ffn_down.weight"} <= set(gf.tensors)
    assert gf.tensors["blk.1.nextn.eh_proj.weight"].shape == (64, 128)  # ggml ne = [2 * n_embd, n_embd]
    for name, info in base.tensors.items():  # every original tensor copied byte for byte
        assert gf.tensors[name].qtype == info.qtype and np.array_equal(gf.data(name), base.data(name))
    for key, value in base.metadata.items():
        if key != "llama.block_count":
            assert gf.metadata[key] == value

    lm = load_model(mtp_path, device="cpu")
    assert (lm.config.n_layer, lm.config.n_layer_main, lm.config.n_nextn) == (2, 1, 1)
    head = load_mtp_head(lm)
    assert head.head_norm is not None and head.head is None and head.embed is None
    assert load_mtp_head(load_model(base.path, device="cpu")) is None
    # the NextN block is not part of the main stack: same logits as the model without it
    batch = Batch()
    for i, t in enumerate(PROMPTS[0]):
        batch.add(t, i, 0, True)
    with_head = Context(lm, n_ctx=64).decode(batch).logits
    without = Context(load_model(base.path, device="cpu"), n_ctx=64).decode(batch).logits
    torch.testing.assert_close(with_head, without, atol=0, rtol=0)

    own = load_mtp_head(load_model(write_tiny_mtp_gguf(tmp_path / "own.gguf", own_embed=True), device="cpu"))
    assert torch.equal(own.embed_tokens(torch.tensor([3, 9])), lm.model.tok_embd(torch.tensor([3, 9])))


# --- the hidden-state shift and rollback ----------------------------------------------------------------------


def reference_draft(head, lm, prompt: list[int], id_last: int, n: int, shift: int = 1, start: int = 0) -> list[int]:
    """Greedy drafts by brute force: the target run afresh over the committed tokens, then for every draft position
    the head run afresh over the rows from target position `start` (a restart window: head position 0, reading no
    hidden state), row p reading feed[p - shift] (feed = target hidden states of the committed positions, then the
    head's own outputs at the drafted ones). shift=1 is the NextN definition."""
    batch = Batch()
    for i, t in enumerate(prompt):
        batch.add(t, i, 0, False)
    feed = Context(lm, n_ctx=len(prompt) + n + 2).decode(batch, hidden=True).hidden[start:]  # [P - start, D]
    tokens, drafts = prompt[start:] + [id_last], []
    with torch.no_grad():
        for _ in range(n):
            prev = torch.zeros(len(tokens), feed.shape[1])
            prev[shift:] = feed[: len(tokens) - shift]
            out = head_forward(head, torch.tensor([tokens]), prev[None])[0]  # [T, D]
            drafts.append(int(head.logits(out[-1]).argmax()))
            tokens.append(drafts[-1])
            feed = torch.cat((feed, out[-1:]))
    return drafts


@pytest.mark.parametrize("n_seq", [1, 4])
@pytest.mark.parametrize("defer_max", [head_drafter.DEFER_MAX, 0])
def test_drafts_follow_the_shifted_hidden_states(mtp_path, monkeypatch, n_seq, defer_max):
    """defer_max 0: head rows are decoded in process() itself, up to each verify batch's first row.
    Under reeval rollback every committed head row reads the target's hidden state, as the reference does."""
    monkeypatch.setattr(head_drafter, "DEFER_MAX", defer_max)
    session = make_session(mtp_path, "draft-mtp", n_seq=n_seq, mtp_rollback="reeval")
    calls = record_drafts(session)
    run_all(session, PROMPTS[:n_seq])
    stats = session.chain.stats["draft-mtp"]
    assert 0 < stats.n_acc_tokens < stats.n_gen_tokens, "needs partial acceptance to exercise the rollback"
    head, lm = session.chain.drafters[-1].ctx.head, session.engine.target
    wrong_shift_differs = False
    for prompt, id_last, drafted in calls[:8]:
        assert drafted == reference_draft(head, lm, prompt, id_last, len(drafted))
        wrong_shift_differs |= drafted != reference_draft(head, lm, prompt, id_last, len(drafted), shift=2)
    assert wrong_shift_differs, "a head reading h_{p-2} drafts the same: the test could not see a wrong shift"


def head_rows_decoded(drafter) -> list[int]:
    """Wrap the MTP drafter's head decodes: the number of rows of each."""
    sizes, inner = [], drafter._decode

    def decode(batch):
        sizes.append(len(batch))
        return inner(batch)

    drafter._decode = decode
    return sizes


@pytest.mark.parametrize("rollback", ["partial", "reeval"])
def test_partial_acceptance_keeps_committed_state_only(mtp_path, rollback):
    """After a verify that keeps id_last and one of three draft tokens: the target cache and the pending hidden state
    are the committed ones; the seed row stays (it read the target's hidden state); partial rollback keeps the
    accepted draft token's head row as drafted and decodes nothing more before the next draft, reeval re-decodes it
    from the target's hidden state, so that the next draft equals a from-scratch run of the head."""
    session = make_session(mtp_path, "draft-mtp", mtp_rollback=rollback)
    drafter = session.chain.drafters[-1]
    prompt = PROMPTS[0]
    session.reset()
    gen = session.generator()
    id_last = gen.start(0, prompt, GREEDY, N_PREDICT).tokens[0]
    pos0 = len(prompt)
    p = DraftParams(0, 3, pos0, id_last, list(prompt))
    drafter.draft([p])
    assert len(p.result) == 3
    drafted_k = drafter.ctx.kv[0][0][0, :, pos0: pos0 + 3].clone()  # head rows of id_last, d1, d2
    batch = Batch()
    for i, t in enumerate([id_last] + p.result):
        batch.add(t, pos0 + i, 0, True)
    out = session.engine.ctx.decode(batch)
    drafter.process(batch)
    drafter.accept(0, 1, False)  # the target kept id_last and the first draft token
    keep = pos0 + 2
    kept_rows = keep if rollback == "partial" else pos0 + 1
    assert drafter.target_cache.tokens[0] == prompt + [id_last, p.result[0]]
    assert drafter.n_done[0] == kept_rows and drafter.ctx.lengths[0] == kept_rows
    assert torch.equal(drafter.ctx.kv[0][0][0, :, pos0: kept_rows], drafted_k[:, : kept_rows - pos0])
    torch.testing.assert_close(drafter.ctx.feed[0, keep], out.features[1, 0])  # held back: the last kept row's
    session.engine.ctx.seq_rm(0, keep)
    sizes = head_rows_decoded(drafter)
    q = DraftParams(0, 3, keep, 5, prompt + [id_last, p.result[0]])
    drafter.draft([q])
    assert sizes[0] == 1 + keep - kept_rows  # the seed row, behind the re-decoded accepted rows
    if rollback == "reeval":
        assert q.result == reference_draft(drafter.ctx.head, session.engine.target, q.prompt, 5, 3)


def test_the_prompts_head_rows_are_decoded_with_the_prompt(mtp_path):
    """`begin` (inside the prompt's processing) decodes the prompt's head rows, so the first draft decodes its seed
    row alone, not the prompt behind it."""
    session = make_session(mtp_path, "draft-mtp")
    session.reset()
    drafter = session.chain.drafters[-1]
    id_last = session.generator().start(0, PROMPTS[0], GREEDY, N_PREDICT).tokens[0]
    assert drafter.n_done[0] == drafter.ctx.lengths[0] == len(PROMPTS[0])
    sizes = head_rows_decoded(drafter)
    p = DraftParams(0, 2, len(PROMPTS[0]), id_last, list(PROMPTS[0]))
    drafter.catch_up([p])
    drafter.draft([p])
    assert sizes == [1, 1] and p.result == reference_draft(drafter.ctx.head, session.engine.target, PROMPTS[0],
                                                           id_last, 2)


def test_a_verify_batch_past_its_first_row_waits_for_accept(mtp_path, monkeypatch):
    """`process` decoding a backlog (more than DEFER_MAX rows) stops at a verify batch's first row: the rows after
    it hold draft tokens the verify may reject (an n-gram draft of 16), decoded only once accepted."""
    monkeypatch.setattr(head_drafter, "DEFER_MAX", 0)
    session = make_session(mtp_path, "draft-mtp")
    session.reset()
    drafter = session.chain.drafters[-1]
    id_last = session.generator().start(0, PROMPTS[0], GREEDY, N_PREDICT).tokens[0]
    pos0 = len(PROMPTS[0])
    batch = Batch()
    for i, t in enumerate([id_last, 1, 2, 3]):  # another drafter's draft of three tokens
        batch.add(t, pos0 + i, 0, True)
    session.engine.ctx.decode(batch)
    sizes = head_rows_decoded(drafter)
    drafter.process(batch)
    assert sizes == [1] and drafter.n_done[0] == pos0 + 1  # id_last's row only
    drafter.accept(0, 0, True)  # all three rejected
    assert drafter.n_done[0] == drafter.ctx.lengths[0] == pos0 + 1 and sizes == [1]


@pytest.mark.parametrize("window", [head_drafter.RESTART_WINDOW, 3])
def test_an_unused_head_decodes_nothing_and_catches_up_exactly_when_asked_again(mtp_path, plain_outputs, monkeypatch,
                                                                               window):
    """Not asked for IDLE_STEPS target decodes (per-request types here; the adaptive planner drops a head alike),
    the head stops decoding committed rows; asked again, `catch_up` decodes the backlog from the hidden states the
    feed kept, or, more than `window` rows behind, restarts the head from the last `window` positions: its drafts
    are a from-scratch head's over those rows (reeval) and the output is plain's."""
    monkeypatch.setattr(head_drafter, "DEFER_MAX", 4)
    monkeypatch.setattr(head_drafter, "RESTART_WINDOW", window)
    session = make_session(mtp_path, "draft-mtp", mtp_rollback="reeval")
    session.reset()
    drafter = session.chain.drafters[-1]
    sizes = head_rows_decoded(drafter)
    calls = record_drafts(session)
    gen = session.generator()
    out = list(gen.start(0, PROMPTS[0], GREEDY, N_PREDICT, SpecOverrides(types=set())).tokens)
    s = gen.active[0]
    while s.n_generated < N_PREDICT // 2:
        out += [t for e in gen.step() for t in e.tokens]
    assert s.n_drafted == 0 and sum(sizes) <= len(PROMPTS[0]) + head_drafter.IDLE_STEPS + 1  # only while not idle
    backlog = len(drafter.target_cache.tokens[0]) - drafter.n_done[0]
    assert backlog > 4
    del sizes[:]
    s.spec.types = None  # draft-mtp may draft again
    while not s.done:
        out += [t for e in gen.step() for t in e.tokens]
    assert out == plain_outputs[0] and s.n_accepted > 0
    restarted = backlog > window
    assert sizes[0] == (window if restarted else backlog) and (drafter.offset[0] > 0) == restarted
    head, lm, start = drafter.ctx.head, session.engine.target, drafter.offset[0]
    assert calls and all(drafted == reference_draft(head, lm, prompt, id_last, len(drafted), start=start)
                         for prompt, id_last, drafted in calls)


def test_a_cached_prefix_shorter_than_the_window_restarts_the_head_at_its_end(mtp_path, plain_outputs, monkeypatch):
    """A restarted head's feed holds no hidden states before its window: a next request on the sequence whose cached
    prefix ends before the window restarts the head where the prefix ends (its first row reading none), so its drafts
    are a from-scratch head's over the rows from there, and the output is plain's."""
    monkeypatch.setattr(head_drafter, "RESTART_WINDOW", 3)
    session = make_session(mtp_path, "draft-mtp", mtp_rollback="reeval")
    session.reset()
    drafter = session.chain.drafters[-1]
    gen = session.generator()
    gen.start(0, PROMPTS[0], GREEDY, N_PREDICT, SpecOverrides(types=set()))
    s = gen.active[0]
    while s.n_generated < N_PREDICT // 2:
        gen.step()
    s.spec.types = None
    while not s.done:
        gen.step()
    gen.finish(0)
    n_cached = 5
    assert drafter.offset[0] > n_cached  # restarted from a window past the prefix the next request reuses
    prompt = PROMPTS[0][:n_cached] + PROMPTS[1]
    calls = record_drafts(session)
    out = list(gen.start(0, prompt, GREEDY, N_PREDICT, n_cached=n_cached).tokens)
    assert drafter.offset[0] == n_cached
    while emitted := gen.step():
        out += [t for e in emitted for t in e.tokens]
    plain = make_session(mtp_path)
    assert out == run_all(plain, [prompt])[0]
    head, lm = drafter.ctx.head, session.engine.target
    assert calls and all(drafted == reference_draft(head, lm, p, id_last, len(drafted), start=n_cached)
                         for p, id_last, drafted in calls)


# --- losslessness -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chain", ["draft-mtp", "ngram-mod,draft-mtp"])
@pytest.mark.parametrize("n_seq", [1, 4])
@pytest.mark.parametrize("rollback", ["partial", "reeval"])
def test_greedy_speculation_equals_plain(mtp_path, plain_outputs, chain, n_seq, rollback):
    session = make_session(mtp_path, chain, n_seq=n_seq, mtp_rollback=rollback)
    outs = run_all(session, PROMPTS[:n_seq])
    assert outs == plain_outputs[:n_seq]
    stats = session.chain.stats["draft-mtp"]
    assert stats.n_gen_tokens > 0 and stats.n_acc_tokens > 0
    assert max(len(stats.n_gen_tokens_per_pos), 1) <= 3  # MTP's own default length cap, below --draft-max 6


# --- the light head on the CPU: Q8_0 linears, a draft vocabulary ---------------------------------------------


def drafted_tokens(session) -> list[int]:
    calls = record_drafts(session)
    run_all(session, PROMPTS)
    return [t for _, _, drafted in calls for t in drafted]


def test_draft_vocabulary_maps_rows_back_to_token_ids(tmp_path, plain_outputs, mtp_path):
    """A shuffled whole vocabulary must draft exactly what no vocabulary drafts (row i is token vocab[i]); a
    half vocabulary drafts only its own tokens and stays lossless."""
    n_vocab = load_model(mtp_path, device="cpu").config.n_vocab
    shuffled = torch.randperm(n_vocab, generator=torch.Generator().manual_seed(0)).tolist()
    everything = drafted_tokens(make_session(mtp_path, "draft-mtp", n_seq=4))
    path = write_tiny_mtp_gguf(tmp_path / "shuffled.gguf", draft_vocab=shuffled)
    assert GGUFFile(path).metadata["spec_cli.nextn_draft_vocab"] == shuffled
    assert drafted_tokens(make_session(path, "draft-mtp", n_seq=4)) == everything

    half = sorted(set(shuffled[: n_vocab // 2]) | {everything[0]})
    session = make_session(write_tiny_mtp_gguf(tmp_path / "half.gguf", draft_vocab=half), "draft-mtp", n_seq=4)
    drafted = drafted_tokens(session)
    assert drafted and set(drafted) <= set(half) and set(everything) - set(half)
    assert run_all(session, PROMPTS) == plain_outputs


def test_bad_draft_vocabulary_is_a_clear_error(tmp_path):
    from spec_cli.errors import SpecCliError

    path = write_tiny_mtp_gguf(tmp_path / "bad.gguf", draft_vocab=[1, 2, 10**6])
    with pytest.raises(SpecCliError, match="outside the vocabulary"):
        load_mtp_head(load_model(path, device="cpu"))


def test_q8_head_and_output_draft_like_the_float_head(mtp_path):
    """What `--dtype q` gives the head: Q8_0 block and eh_proj (mtp._quantize), and a Q8_0 output matrix shared
    with the target. Logits stay close to float32, and greedy speculation stays lossless."""
    session = make_session(mtp_path, "draft-mtp", n_seq=4)
    head = session.chain.drafters[-1].ctx.head
    tokens, prev = torch.tensor([PROMPTS[0]]), torch.randn(1, len(PROMPTS[0]), head.cfg.n_embd)
    with torch.no_grad():
        reference = head.logits(head_forward(head, tokens, prev))
        mtp_module._quantize(head)
        (qtype, raw), = session.engine.target.model.output.segments  # the tiny model's float32 output rows
        assert qtype == GGMLQuantizationType.F32
        session.engine.target.model.output = QLinear.from_float(raw.view(torch.float32))
        quantized = head.logits(head_forward(head, tokens, prev))
    assert all(qtype == GGMLQuantizationType.Q8_0 for m in head.block.modules() if isinstance(m, QLinear)
               for qtype, _ in m.segments)
    assert float((quantized - reference).abs().max()) < 0.05 * float(reference.abs().max())
    plain = session.renew(types=[])  # plain decoding of the same (now Q8_0-output) target
    expected = [run_all(plain, [p])[0] for p in PROMPTS]
    session = plain.renew(types=["draft-mtp"])
    assert run_all(session, PROMPTS) == expected
    assert session.stats["draft-mtp"].n_acc_tokens > 0


# --- distillation -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "bf16"])  # what mtp-train loads: float32, or bf16 where the CPU has it
def test_training_lowers_the_loss_and_round_trips(tiny_model_path, tmp_path, dtype):
    target = load_model(tiny_model_path, device="cpu", dtype=dtype)
    cfg = TrainConfig(steps=30, lr=3e-3, seq_len=32, batch=8, data_tokens=32 * 24, gen_tokens=32 * 4,
                      eval_tokens=32 * 4, checkpoint_every=10, draft_vocab=100)
    losses = []
    out = tmp_path / "tiny-trained-mtp.gguf"
    result = train(target, out, cfg, lambda p: losses.append(p.info["loss"]) if p.stage == "train" else None)
    assert len(losses) == cfg.steps and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    assert result.steps == cfg.steps and 0.0 <= result.acc_before <= 1.0 and 0.0 <= result.acc_after <= 1.0

    lm = load_model(out, device="cpu")
    assert (lm.config.n_layer_main, lm.config.n_nextn) == (target.config.n_layer, 1)
    assert load_mtp_head(lm).draft_vocab.shape == (100,)
    trained = torch.load(out.with_suffix(".ckpt.pt"))["module"]
    loaded = load_mtp_head(lm).state_dict()
    assert trained.keys() == loaded.keys()
    for name, t in trained.items():
        torch.testing.assert_close(loaded[name], t, atol=0, rtol=0)
    session = make_session(out, "draft-mtp")
    plain = make_session(out)
    for prompt in PROMPTS[:2]:
        assert run_all(session, [prompt]) == run_all(plain, [prompt])
    assert session.chain.stats["draft-mtp"].n_gen_tokens > 0



def test_draft_vocabulary_is_the_most_frequent_tokens_then_by_id():
    tokens = torch.tensor([[5, 5, 5, 2, 2, 9], [9, 11, 2, 5, 3, 3]])
    assert draft_vocabulary(tokens, 12, 6) == [5, 2, 3, 9, 11, 0]
    assert draft_vocabulary(tokens, 12, 0) is None and draft_vocabulary(tokens, 12, 12) is None


def test_training_data_leaves_out_prompt_set_sources(tiny_model_path):
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    excluded = {path.relative_to(root).as_posix() for path in quoted_stdlib_files()}
    assert excluded, "the built-in prompt sets quote standard-library sources"
    docs = stdlib_documents()
    assert not excluded & {name for name, _ in docs}

    tok = Tokenizer.from_metadata(GGUFFile(tiny_model_path).metadata)
    snippets = token_windows(tok, docs[:20], 300, 3, random.Random(0))
    prompts = generation_prompts(tok, snippets, 256)  # the model's chat template around a request and a snippet
    assert prompts.shape == (3, 256)
    text = tok.decode(prompts[0].tolist())
    assert text.startswith("<|im_start|>user") and text.endswith("<|im_start|>assistant\n")


def test_text_windows_spread_over_documents(tiny_model_path):
    """As many windows as documents take one from each, however long some are; more take the rest in turns."""
    tok = Tokenizer.from_metadata(GGUFFile(tiny_model_path).metadata)
    docs = [(f"long{c}", f"{c} " * 4000) for c in "xyz"] + [(c, f"{c} " * 300) for c in "abcdef"]
    letters = lambda w: {next(iter(set(tok.decode(row.tolist()).split()))) for row in w}  # noqa: E731
    assert letters(token_windows(tok, docs, 64, 9, random.Random(0))) == set("xyzabcdef")
    more = token_windows(tok, docs, 64, 40, random.Random(1))
    assert more.shape == (40, 64) and letters(more) == set("xyzabcdef")
    with pytest.raises(SpecCliError, match="windows"):
        token_windows(tok, docs[3:], 64, 1000, random.Random(0))


def test_spec_type_mtp_through_the_engine(mtp_path):
    """`--spec-type mtp` opened by open_session: greedy output equals plain output, and the head drafts."""
    from spec_cli.options import spec_types

    plain = open_session(EngineOptions(model=str(mtp_path), n_ctx=128, device="cpu"))
    spec = open_session(EngineOptions(model=str(mtp_path), n_ctx=128, device="cpu",
                                      spec=SpecParams(types=spec_types("ngram-mod,mtp"), draft_max=3,
                                                      draft_p_min=0.0, ngram_mod_n_match=3, ngram_mod_n_min=1)))
    assert [d.name for d in spec.chain.drafters] == ["ngram-mod", "draft-mtp"]
    for prompt in PROMPTS:
        expected, got = [], []
        plain.reset()
        generate(plain.generator(), prompt, GREEDY, N_PREDICT, on_emit=lambda e: expected.extend(e.tokens))
        spec.reset()
        generate(spec.generator(), prompt, GREEDY, N_PREDICT, on_emit=lambda e: got.extend(e.tokens))
        assert got == expected
    assert spec.chain.stats["draft-mtp"].n_gen_tokens > 0


def test_hidden_state_capture_lives_with_the_session_that_reads_it(mtp_path):
    """draft-mtp's session keeps the target capturing its final pre-norm state (target features on request: the
    tap at layer id n_layer); the next session without it, or closing it, stops the capture (it used to outlive the
    chain). The engine itself cannot be rewired."""
    session = make_session(mtp_path, "ngram-mod,draft-mtp")
    ctx = session.engine.ctx
    final = (ctx.config.n_layer_main,)
    assert ctx.taps == final
    plain = session.renew(types=["ngram-mod"])
    assert plain.types == ["ngram-mod"] and ctx.taps == ()
    again = plain.renew(types=["draft-mtp"])
    assert again.types == ["draft-mtp"] and ctx.taps == final
    again.close()
    assert ctx.taps == () and ctx.last_features is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        session.engine.ctx = None


def test_mtp_on_a_model_without_head_is_a_clear_error(tiny_model_path):
    from spec_cli.errors import SpecCliError

    with pytest.raises(SpecCliError, match="MTP"):
        open_session(EngineOptions(model=str(tiny_model_path), device="cpu", spec=SpecParams(types=["draft-mtp"])))


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])  # mtp's default; --outtype
def test_mtp_train_command_writes_a_loadable_head(capsys, monkeypatch, tiny_model_path, tmp_path, outtype):
    from tests.test_cli import cli

    out_path = tmp_path / "cli-mtp.gguf"
    code, out, err = cli(capsys, monkeypatch, "mtp-train", "-m", str(tiny_model_path), "-o", str(out_path),
                         "--steps", "3", "--seq-len", "32", "--batch", "2", "--data-tokens", "256", "--gen-tokens", "64",
                         "--eval-tokens", "64", "--draft-vocab", "50", "--outtype", outtype, "-dev", "cpu", "--json")
    assert code == 0, err
    head_block = f"blk.{GGUFFile(tiny_model_path).metadata['llama.block_count']}."
    matrices = {t.tensor_type.name for t in GGUFReader(str(out_path)).tensors
                if t.name.startswith(head_block) and len(t.shape) == 2}
    assert matrices == {outtype.upper()}
    result = json.loads(out)
    assert result["steps"] == 3 and Path(result["out_path"]) == out_path
    # stderr is not a terminal here (as in a log file): a line per tenth of each stage, not rich's bars at the end
    lines = [line.split(" (")[0] for line in err.splitlines() if line.startswith(("generate ", "train ", "eval "))]
    assert lines[-5:] == ["train 1/3", "train 2/3", "train 3/3", "eval 0/1", "eval 1/1"], err
    assert "acceptance" in err.splitlines()[-1] and "loss" in err and "━" not in err
    head = load_mtp_head(load_model(out_path, device="cpu"))
    assert head is not None and head.draft_vocab.shape == (50,)
    code, _, err = cli(capsys, monkeypatch, "mtp-train", "-m", str(tiny_model_path), "-o", str(out_path),
                       "--draft-vocab", "-1")
    assert code == 2 and "--draft-vocab" in err
