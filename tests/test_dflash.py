"""draft-dflash: drafters in llama.cpp's dflash layout written with gguf's writer (tests/tiny_dflash.py) load and
compute what a plain-torch forward of their Hugging Face weights computes (the injected context, the non-causal block,
q/k norms, NeoX rope, d2t, the PR branches' names), on torch's ops and on the CPU kernels; every draft is the
reference block's argmax over the target's features, in one forward per draft call; the block's keys and values are
dropped and the cache follows the target's; greedy output equals plain alone and chained, for one and four
sequences, with and without a cached prompt prefix; rejection sampling at T > 0 keeps the target's distribution;
bad files are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from spec_cli.errors import SpecCliError, UsageError
from spec_cli.model.batch import Batch
from spec_cli.model.dflash_file import load_dflash_head
from spec_cli.model.dflash_head import DFlashContext, DFlashHead
from spec_cli.model.loader import load_model
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.session import open_session
from spec_cli.speculative.base import DraftParams, SpecParams
from tests.draft_recorder import record_drafts
from tests.head_checks import assert_rejection_keeps_the_distribution
from tests.test_eagle3 import GREEDY, N_PREDICT, PROMPTS, run_all, target_features
from tests.test_eagle3 import make_session as head_session
from tests.tiny_dflash import (
    MASK,
    reference_block_logits,
    reference_fuse,
    write_tiny_dflash,
)
from tests.tiny_eagle3 import rewritten
from tests.tiny_gguf import write_tiny_gguf

VARIANTS = {
    "target-output": {},
    "own-output": {"n_draft": 150},
    "one-layer": {"n_layer": 1, "layers": (2,)},
    "pr-branch": {"pr_branch": True},
}


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("dflash") / "target.gguf", arch="llama", seed=11, n_layer=4)


@pytest.fixture(scope="module")
def drafters(target_path, tmp_path_factory):
    """name -> TinyDFlash, one file per layout variant."""
    d = tmp_path_factory.mktemp("drafters")
    return {name: write_tiny_dflash(d / f"{name}.gguf", target_path, seed=i, **kw)
            for i, (name, kw) in enumerate(VARIANTS.items())}


def make_session(target_path, path, spec_types="draft-dflash", **kw):
    return head_session(target_path, path, spec_types, **kw)


@pytest.fixture(scope="module")
def plain_outputs(target_path):
    session = make_session(target_path, None, "")
    return [run_all(session, [p])[0] for p in PROMPTS]


def block_logits(head: DFlashHead, g: torch.Tensor, block: list[int], n_seq: int = 1) -> torch.Tensor:
    """The drafter's logits of `block` after the context g [P, H], decoded as sequence n_seq - 1 of a context whose
    other sequences hold the same context and a shorter block (blocks of several sequences in one decode)."""
    ctx = DFlashContext(head, 64, n_seq=n_seq)
    P, batch = g.shape[0], Batch()
    for seq in range(n_seq):
        ctx.inject([seq] * P, list(range(P)), g)
        rows = block if seq == n_seq - 1 else block[:2]
        for i, t in enumerate(rows):
            batch.add(t, P + i, seq, seq == n_seq - 1)
    return ctx.decode(batch).logits


# --- the file and the forward -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafter_computes_what_the_hf_weights_compute(target_path, drafters, variant):
    tiny = drafters[variant]
    lm = load_model(target_path, device="cpu", dtype="f32")
    head = load_dflash_head(tiny.path, lm)
    assert head.target_layers == tiny.layers and head.layout.block_size == tiny.block_size
    assert head.layout.mask_token == MASK and len(head.layers) == tiny.n_layer
    assert (head.draft_vocab is None) == (tiny.d2t is None)
    feats = target_features(lm, tiny.layers, PROMPTS[0][:12])
    g = head.fuse(feats)
    torch.testing.assert_close(g, reference_fuse(tiny, feats), rtol=1e-4, atol=1e-4)
    block = [42] + [MASK] * 5
    ref = reference_block_logits(tiny, g, block)
    ids = head.draft_vocab if head.draft_vocab is not None else torch.arange(ref.shape[1])
    for n_seq in (1, 3):
        torch.testing.assert_close(block_logits(head, g, block, n_seq), ref[:, ids], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ref, reference_block_logits(tiny, g, block, causal=True))  # the mask matters


def test_quantized_drafter_on_the_kernels_computes_the_float_reference(target_path, tmp_path):
    """A Q8_0 file is kept as its blocks, a float one quantized to Q8_0 (target weights kept quantized): the
    kernels' injection and block attention compute the reference within Q8_0's error, and what torch's ops compute
    on the same weights."""
    q8_target = write_tiny_gguf(tmp_path / "q8.gguf", arch="llama", seed=11, n_layer=4, qtype=T.Q8_0)
    lm = load_model(q8_target, device="cpu")
    assert lm.weights == "q"
    for qtype in (T.F32, T.Q8_0):
        tiny = write_tiny_dflash(tmp_path / f"d-{qtype.name}.gguf", q8_target, seed=3, n_draft=150, qtype=qtype)
        head = load_dflash_head(tiny.path, lm)
        assert type(head.layers[0].attn.qkv).__name__ == "QLinear" and head.layers[0].attn.wq is None
        feats = target_features(lm, tiny.layers, PROMPTS[1])
        g = head.fuse(feats)
        block = [61] + [MASK] * 6
        ref = reference_block_logits(tiny, reference_fuse(tiny, feats), block)[:, head.draft_vocab]
        kernels = block_logits(head, g, block, n_seq=2)
        assert (kernels - ref).abs().max() < 0.05 * ref.abs().max()
        head.on_kernels = lambda x, k_cache: False  # the same weights through torch's ops
        torch.testing.assert_close(block_logits(head, g, block, n_seq=2), kernels, rtol=1e-4, atol=1e-4)


# --- the drafter ------------------------------------------------------------------------------------------


def reference_draft(tiny, lm, prompt: list[int], id_last: int, n: int, mask: int = MASK) -> list[int]:
    """The greedy draft by brute force: the reference block [id_last, mask x n] over the target's features of the
    committed tokens, its rows 1..n's argmax."""
    g = reference_fuse(tiny, target_features(lm, tiny.layers, prompt))
    return reference_block_logits(tiny, g, [id_last] + [mask] * n)[1:].argmax(-1).tolist()


@pytest.mark.parametrize("n_seq", [1, 4])
@pytest.mark.parametrize("variant", ["target-output", "own-output"])
def test_every_draft_is_the_reference_block_in_one_forward(target_path, drafters, plain_outputs, n_seq, variant):
    tiny = drafters[variant]
    session = make_session(target_path, tiny.path, n_seq=n_seq, verify="match")
    drafter = session.chain.drafters[-1]
    forwards, draft = [], drafter.draft

    def counted(params):  # the drafter's decodes during each draft call
        n0 = drafter.ctx.n_decode
        draft(params)
        forwards.append(drafter.ctx.n_decode - n0)

    drafter.draft = counted
    calls = record_drafts(session)
    assert run_all(session, PROMPTS[:n_seq]) == plain_outputs[:n_seq]
    lm = session.engine.target
    assert calls and all(drafted == reference_draft(tiny, lm, prompt, id_last, len(drafted))
                         for prompt, id_last, drafted in calls)
    assert max(len(d) for _, _, d in calls) == 4 and set(forwards) == {1}  # whole blocks, one forward per call


def test_the_block_is_dropped_and_the_cache_follows_the_target(target_path, drafters):
    """After the prompt the cache holds its P positions; a draft leaves it there (the block's keys and values
    dropped); the verify batch injects its rows and accept() cuts after the accepted ones, whose keys are the
    target's features' (not the block's)."""
    tiny = drafters["target-output"]
    session = make_session(target_path, tiny.path, draft_max=6)
    drafter = session.chain.drafters[-1]
    assert drafter.n_max == 6
    gen = session.generator()
    prompt = PROMPTS[0]
    id_last = gen.start(0, prompt, GREEDY, N_PREDICT).tokens[0]
    P = len(prompt)
    assert drafter.ctx.lengths[0] == P
    p = DraftParams(0, 6, P, id_last, list(prompt))
    drafter.draft([p])
    assert len(p.result) == 6 and drafter.ctx.lengths[0] == P
    batch = Batch()
    for i, t in enumerate([id_last] + p.result):
        batch.add(t, P + i, 0, True)
    session.engine.ctx.decode(batch)
    drafter.process(batch)
    assert drafter.ctx.lengths[0] == P + 7
    session.engine.ctx.seq_rm(0, P + 3)
    drafter.accept(0, 2, False)
    assert drafter.ctx.lengths[0] == P + 3
    fresh = DFlashContext(drafter.head, 64)
    tokens = prompt + [id_last] + p.result[:2]
    fresh.inject([0] * len(tokens), list(range(len(tokens))),
                 drafter.head.fuse(target_features(session.engine.target, tiny.layers, tokens)))
    for (k, v), (k2, v2) in zip(drafter.ctx.kv, fresh.kv):
        torch.testing.assert_close(k[0, :, : P + 3], k2[0, :, : P + 3])
        torch.testing.assert_close(v[0, :, : P + 3], v2[0, :, : P + 3])


def test_draft_max_is_clamped_to_the_block(target_path, drafters, tmp_path):
    """At most block_size - 1 tokens a draft, and with four sequences their blocks fit one ubatch."""
    tiny = write_tiny_dflash(tmp_path / "b4.gguf", target_path, block_size=4)
    session = make_session(target_path, tiny.path, draft_max=16)
    assert session.chain.drafters[-1].n_max == 3
    opts = EngineOptions(model=str(target_path), model_draft=str(drafters["target-output"].path), n_ctx=512, n_seq=4,
                         n_ubatch=20, device="cpu", spec=SpecParams(types=["draft-dflash"], draft_max=16))
    assert open_session(opts).chain.drafters[-1].n_max == 4  # 4 blocks of 5 rows in 20


# --- losslessness -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chain", ["draft-dflash", "ngram-mod,draft-dflash"])
@pytest.mark.parametrize("n_seq", [1, 4])
def test_greedy_speculation_equals_plain(target_path, drafters, plain_outputs, chain, n_seq):
    session = make_session(target_path, drafters["own-output"].path, chain, n_seq=n_seq)
    assert run_all(session, PROMPTS[:n_seq]) == plain_outputs[:n_seq]
    assert session.chain.stats["draft-dflash"].n_gen_tokens > 0


@pytest.mark.parametrize("n_seq", [1, 4])
def test_greedy_speculation_with_draft_max_auto_equals_plain(target_path, drafters, plain_outputs, n_seq):
    """--draft-max auto: the planner caps each block and cuts each draft (a flat verify cost: long blocks pay)."""
    session = make_session(target_path, drafters["target-output"].path, "ngram-mod,draft-dflash", n_seq=n_seq,
                           draft_max=16, adaptive=True)
    session.engine.costs.set_points({1: 1.0, 16: 1.05, 64: 4.0})
    assert session.chain.planner.per_call == {"draft-dflash"}
    assert run_all(session, PROMPTS[:n_seq]) == plain_outputs[:n_seq]
    stats = session.chain.stats["draft-dflash"]
    assert stats.n_gen_tokens > 0 and len(stats.n_gen_tokens_per_pos) <= 7  # block_size 8


@pytest.mark.parametrize("chain", ["draft-dflash", "ngram-mod,draft-dflash"])
def test_a_cached_prompt_prefix_keeps_the_output(target_path, drafters, chain):
    """A second request reusing the first's prompt prefix from the KV cache (the server's prompt cache): the
    drafter's cache is cut where the prefix ends, and the output is plain's."""
    session = make_session(target_path, drafters["target-output"].path, chain)
    plain = make_session(target_path, None, "")
    for n_cached in (0, 6, 2):
        first, second = PROMPTS[0], PROMPTS[0][:6] + PROMPTS[2]
        assert run_all(session, [first]) == run_all(plain, [first])
        assert run_all(session, [second], n_cached=n_cached) == run_all(plain, [second], n_cached=n_cached)
    assert session.chain.stats["draft-dflash"].n_gen_tokens > 0


def test_rejection_sampling_keeps_the_target_distribution(target_path, drafters):
    """q = the block row's distribution under the target's sampler settings (a random drafter over the whole
    vocabulary: some of its drafts are accepted, some rejected)."""
    session = make_session(target_path, drafters["target-output"].path, verify="rejection", draft_max=3)
    assert_rejection_keeps_the_distribution(session, PROMPTS[1])


# --- bad files ------------------------------------------------------------------------------------------------


def test_a_drafter_for_another_target_or_a_bad_file_is_a_clear_error(tmp_path, target_path):
    lm = load_model(target_path, device="cpu")
    wide = write_tiny_gguf(tmp_path / "wide.gguf", seed=1, n_layer=4, dims={"n_embd": 128, "n_ff": 128})
    other = write_tiny_dflash(tmp_path / "other.gguf", wide, target_hidden=128)
    with pytest.raises(SpecCliError, match="width 128; this target's hidden size is 64"):
        make_session(target_path, other.path)
    deep = write_tiny_dflash(tmp_path / "deep.gguf", target_path, layers=(1, 2, 9))
    with pytest.raises(SpecCliError, match="target layers"):
        make_session(target_path, deep.path)
    with pytest.raises(SpecCliError, match="not a DFlash draft"):
        load_dflash_head(target_path, lm)
    swa = write_tiny_dflash(tmp_path / "swa.gguf", target_path, extra_keys={"dflash.attention.sliding_window": 64})
    with pytest.raises(SpecCliError, match="sliding_window is set"):
        load_dflash_head(swa.path, lm)
    ok = write_tiny_dflash(tmp_path / "ok.gguf", target_path).path
    misshapen = rewritten(ok, tmp_path / "misshapen.gguf", arrays={"blk.1.ffn_up.weight": np.zeros((50, 64))})
    with pytest.raises(SpecCliError, match="layers.1.ffn.w_up has shape \\[50, 64\\], \\[96, 64\\] expected"):
        load_dflash_head(misshapen, lm)
    missing = rewritten(ok, tmp_path / "missing.gguf", drop=("blk.0.attn_k_norm.weight",))
    with pytest.raises(SpecCliError, match="missing tensors for layers.0.attn.k_norm"):
        load_dflash_head(missing, lm)
    extra = rewritten(ok, tmp_path / "extra.gguf", arrays={"blk.0.attn_sinks.weight": np.zeros(4)})
    with pytest.raises(SpecCliError, match="unexpected tensor blk.0.attn_sinks.weight"):
        load_dflash_head(extra, lm)
    with pytest.raises(UsageError, match="needs a DFlash draft"):
        make_session(target_path, None)
