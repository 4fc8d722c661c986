"""draft-eagle3: heads in llama.cpp's eagle3 layout written with gguf's writer (tests/tiny_eagle3.py) load and
compute what a plain-torch forward of their Hugging Face weights computes (permuted q/k, interleaved-pair rope, the
optional norms, the PR branches' names, d2t); every draft equals a from-scratch run of that reference over the
target's features (the held-back pair, the pre-norm state fed back, rollback by position); greedy output equals
plain alone and chained, for one and four sequences, with and without a cached prompt prefix; bad files are clear
errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from spec_cli.errors import SpecCliError, UsageError
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.eagle3_file import load_eagle3_head
from spec_cli.model.head_context import HeadContext
from spec_cli.model.loader import load_model
from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.session import open_session
from spec_cli.speculative.base import DraftParams, SpecParams
from tests.draft_recorder import record_drafts
from tests.tiny_eagle3 import reference_fuse, reference_rows, rewritten, write_tiny_eagle3
from tests.tiny_gguf import write_tiny_gguf

GREEDY = SamplingParams(temp=0.0, ignore_eos=True)  # outputs of N_PREDICT tokens whatever the tiny model says
PROMPTS = [
    [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42],
    [60, 61, 62, 60, 61, 62, 60, 61, 62, 60, 61],
    [70, 71, 72, 73, 74, 70, 71, 72, 73],
    [80, 81, 82, 83, 80, 81, 82, 83, 80, 81],
]
N_PREDICT = 24
VARIANTS = {
    "own-output": {},
    "target-output": {"n_draft": None},
    "own-embedding": {"own_embed": True},
    "norm-before-residual": {"norm_before_residual": True},
    "norm-before-fc": {"norm_before_fc": True},
    "pr-branch": {"pr_branch": True},
}


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("eagle3") / "target.gguf", arch="llama", seed=11, n_layer=4)


@pytest.fixture(scope="module")
def heads(target_path, tmp_path_factory):
    """name -> TinyEagle3, one file per layout variant."""
    d = tmp_path_factory.mktemp("heads")
    return {name: write_tiny_eagle3(d / f"{name}.gguf", target_path, seed=i, **kw)
            for i, (name, kw) in enumerate(VARIANTS.items())}


def make_session(target_path, head_path, spec_types="draft-eagle3", n_seq=1, draft_max=4, **spec):
    """A session on the tiny target with -md head_path (None: none): p-min 0 and short n-gram matches unless `spec`
    says otherwise."""
    params = SpecParams(types=[t for t in spec_types.split(",") if t], draft_max=draft_max,
                        **{"draft_p_min": 0.0, "ngram_mod_n_match": 3, "ngram_mod_n_min": 1, "ngram_mod_n_max": 8,
                           **spec})
    return open_session(EngineOptions(model=str(target_path), model_draft=str(head_path) if head_path else None,
                                      n_ctx=128 * n_seq, n_seq=n_seq, device="cpu", spec=params))


def run_all(session, prompts, n_cached=0):
    """Greedy outputs of all prompts generated together, one sequence each."""
    gen = session.generator()
    outs = {seq: list(gen.start(seq, p, GREEDY, N_PREDICT, n_cached=n_cached).tokens) for seq, p in enumerate(prompts)}
    while emitted := gen.step():
        for e in emitted:
            outs[e.seq].extend(e.tokens)
    for seq in outs:
        gen.finish(seq)
    return [outs[s] for s in range(len(prompts))]


@pytest.fixture(scope="module")
def plain_outputs(target_path):
    session = make_session(target_path, None, "")
    return [run_all(session, [p])[0] for p in PROMPTS]


def target_features(lm, layers, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), 3, H_t]: the tapped layers' inputs over `tokens` (Context.set_taps, tested on its own)."""
    ctx = Context(lm, n_ctx=len(tokens) + 1)
    ctx.set_taps(layers)
    ctx.decode(Batch(list(tokens), list(range(len(tokens))), [0] * len(tokens), [False] * len(tokens)))
    return ctx.features_of(tuple(layers))


# --- the file and the forward -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_head_computes_what_the_hf_weights_compute(target_path, heads, variant):
    tiny = heads[variant]
    lm = load_model(target_path, device="cpu", dtype="f32")
    head = load_eagle3_head(tiny.path, lm)
    assert head.target_layers == tiny.layers
    assert (head.draft_vocab is None) == (tiny.d2t is None)
    if tiny.d2t is not None:
        assert head.draft_vocab.tolist() == tiny.d2t  # absolute ids, or the PR branch's offsets resolved
    tokens = PROMPTS[0][:12]
    feats = target_features(lm, tiny.layers, tokens)
    g = head.fuse(feats)
    torch.testing.assert_close(g, reference_fuse(tiny, feats), rtol=1e-4, atol=1e-4)
    # rows (x_{t+1}, g_t) at positions 0..T-2 through the head's own context
    ctx = HeadContext(head, n_ctx=32)
    rows = tokens[1:]
    ctx.set_feed([0] * len(rows), list(range(len(rows))), g[: len(rows)])
    out = ctx.decode(Batch(rows, list(range(len(rows))), [0] * len(rows), [True] * len(rows)), hidden=True)
    ref_h, ref_logits = reference_rows(tiny, rows, g[: len(rows)])
    torch.testing.assert_close(out.hidden, ref_h, rtol=1e-4, atol=1e-4)
    ids = head.draft_vocab if head.draft_vocab is not None else torch.arange(out.logits.shape[1])
    torch.testing.assert_close(out.logits, ref_logits[:, ids], rtol=1e-4, atol=1e-4)


def test_quantized_file_and_q8_head_draft_like_the_float_head(target_path, tmp_path):
    """A Q8_0 file is kept as its blocks, a float one quantized to Q8_0 for the kernels (target weights kept
    quantized): both compute the float reference within Q8_0's error."""
    q8_target = write_tiny_gguf(tmp_path / "q8.gguf", arch="llama", seed=11, n_layer=4, qtype=T.Q8_0)
    lm = load_model(q8_target, device="cpu")
    assert lm.weights == "q"
    tokens = PROMPTS[1]
    for qtype in (T.F32, T.Q8_0):
        tiny = write_tiny_eagle3(tmp_path / f"h-{qtype.name}.gguf", q8_target, seed=3, qtype=qtype)
        head = load_eagle3_head(tiny.path, lm)
        assert type(head.attn.qkv).__name__ == "QLinear" and head.attn.wq is None
        feats = target_features(lm, tiny.layers, tokens)
        ctx = HeadContext(head, n_ctx=32)
        rows = tokens[1:]
        g = head.fuse(feats)[: len(rows)]
        ctx.set_feed([0] * len(rows), list(range(len(rows))), g)
        out = ctx.decode(Batch(rows, list(range(len(rows))), [0] * len(rows), [True] * len(rows)), hidden=True)
        ref_h, _ = reference_rows(tiny, rows, reference_fuse(tiny, feats)[: len(rows)])
        assert (out.hidden - ref_h).abs().max() < 0.05 * ref_h.abs().max()
        # the kernels' attention (qkv_prep + attention over the cache) computes what torch's SDPA does
        n = len(rows)
        plan = ctx.forward_plan(torch.arange(n)[None], torch.arange(n), torch.zeros(n, dtype=torch.long),
                                torch.arange(n), slice(0, 1), n)
        k, v = (torch.zeros_like(c) for c in ctx.kv[0])
        sdpa = head(torch.tensor([rows]), g[None], plan, head.rope(plan.positions, len(rows)), k, v)[0]
        torch.testing.assert_close(out.hidden, sdpa, rtol=1e-4, atol=1e-4)


# --- the draft loop -------------------------------------------------------------------------------------------


def reference_draft(tiny, lm, prompt: list[int], id_last: int, n: int, start: int = 1) -> list[int]:
    """Greedy drafts by brute force: the target's features of the committed tokens, then for every draft position
    the HF reference run afresh over the rows from target position `start`: (x_p, g_{p-1}) for the committed tokens,
    the seed (id_last, g of the last committed position), then (draft token, the pre-norm state of the row
    before)."""
    g = reference_fuse(tiny, target_features(lm, tiny.layers, prompt))
    tokens, feed, drafts = prompt[start:] + [id_last], list(g[start - 1 :]), []
    for _ in range(n):
        h, logits = reference_rows(tiny, tokens, torch.stack(feed))
        drafts.append(int(logits[-1].argmax()))
        tokens.append(drafts[-1])
        feed.append(h[-1])
    return drafts


@pytest.mark.parametrize("n_seq", [1, 4])
@pytest.mark.parametrize("variant", ["own-output", "norm-before-residual"])
def test_every_draft_is_the_reference_run_over_the_target_features(target_path, heads, plain_outputs, n_seq,
                                                                   variant):
    tiny = heads[variant]
    session = make_session(target_path, tiny.path, n_seq=n_seq, verify="match")
    calls = record_drafts(session)
    assert run_all(session, PROMPTS[:n_seq]) == plain_outputs[:n_seq]
    lm = session.engine.target
    assert calls and all(drafted == reference_draft(tiny, lm, prompt, id_last, len(drafted))
                         for prompt, id_last, drafted in calls)


def test_the_held_back_pair_and_rollback_by_position(target_path, heads):
    """After the prompt the head holds rows (x_1, g_0) .. (x_{P-1}, g_{P-2}) and holds back g_{P-1}; the draft's seed
    row reads it at position P-1; after a verify that keeps one draft token only the seed row stays (the target's
    features overwrite the draft's rows by position) and the held-back feature is the kept row's."""
    tiny = heads["own-output"]
    session = make_session(target_path, tiny.path)
    drafter = session.chain.drafters[-1]
    gen = session.generator()
    prompt = PROMPTS[0]
    id_last = gen.start(0, prompt, GREEDY, N_PREDICT).tokens[0]
    P = len(prompt)
    assert drafter.offset[0] == 1 and drafter.ctx.lengths[0] == P - 1  # begin() decoded the prompt's rows
    g = drafter.ctx.head.fuse(session.engine.ctx.last_features)
    torch.testing.assert_close(drafter.ctx.feed[0, P - 1], g[P - 1])  # held back for the seed row
    p = DraftParams(0, 3, P, id_last, list(prompt))
    drafter.draft([p])
    assert len(p.result) == 3 and drafter.ctx.lengths[0] == P + 2  # seed + 2 fed rows
    batch = Batch()
    for i, t in enumerate([id_last] + p.result):
        batch.add(t, P + i, 0, True)
    out = session.engine.ctx.decode(batch)
    drafter.process(batch)
    session.engine.ctx.seq_rm(0, P + 2)
    drafter.accept(0, 1, False)
    assert drafter.n_done[0] == P + 1 and drafter.ctx.lengths[0] == P  # the seed row (id_last, g_{P-1}) stays
    torch.testing.assert_close(drafter.ctx.feed[0, P + 1], drafter.ctx.head.fuse(out.features[1:2])[0])


# --- losslessness -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chain", ["draft-eagle3", "ngram-mod,draft-eagle3"])
@pytest.mark.parametrize("n_seq", [1, 4])
def test_greedy_speculation_equals_plain(target_path, heads, plain_outputs, chain, n_seq):
    session = make_session(target_path, heads["own-output"].path, chain, n_seq=n_seq)
    assert run_all(session, PROMPTS[:n_seq]) == plain_outputs[:n_seq]
    assert session.chain.stats["draft-eagle3"].n_gen_tokens > 0


@pytest.mark.parametrize("chain", ["draft-eagle3", "ngram-mod,draft-eagle3"])
def test_a_cached_prompt_prefix_keeps_the_output(target_path, heads, chain):
    """A second request reusing the first's prompt prefix from the KV cache (the server's prompt cache): the head
    restarts where the prefix ends or keeps its rows, and the output is plain's."""
    session = make_session(target_path, heads["own-output"].path, chain)
    plain = make_session(target_path, None, "")
    for n_cached in (0, 6, 2):
        first, second = PROMPTS[0], PROMPTS[0][:6] + PROMPTS[2]
        assert run_all(session, [first]) == run_all(plain, [first])
        assert run_all(session, [second], n_cached=n_cached) == run_all(plain, [second], n_cached=n_cached)


# --- bad files ------------------------------------------------------------------------------------------------


def test_a_head_for_another_target_is_a_clear_error(tmp_path, target_path):
    wide = write_tiny_gguf(tmp_path / "wide.gguf", seed=1, n_layer=4, dims={"n_embd": 128, "n_ff": 128})
    other = write_tiny_eagle3(tmp_path / "other.gguf", wide, target_hidden=128)
    with pytest.raises(SpecCliError, match="hidden size 128"):
        make_session(target_path, other.path)
    deep = write_tiny_eagle3(tmp_path / "deep.gguf", target_path, layers=(1, 2, 9))
    with pytest.raises(SpecCliError, match="target layers"):
        make_session(target_path, deep.path)
    with pytest.raises(SpecCliError, match="not an EAGLE-3 draft"):
        load_eagle3_head(target_path, load_model(target_path, device="cpu"))
    ok = write_tiny_eagle3(tmp_path / "ok.gguf", target_path).path
    misshapen = rewritten(ok, tmp_path / "misshapen.gguf", arrays={"blk.0.ffn_up.weight": np.zeros((50, 64))})
    with pytest.raises(SpecCliError, match="ffn.w_up has shape \\[50, 64\\], \\[96, 64\\] expected"):
        load_eagle3_head(misshapen, load_model(target_path, device="cpu"))
    with pytest.raises(UsageError, match="needs an EAGLE-3 draft"):
        make_session(target_path, None)
