"""Context invariants: cache == no cache, chunked == one-shot prefill, seq_rm + re-decode == never decoded,
sequences isolated, seq_cp shares a prefix, sliding-window layers see only their window."""

from __future__ import annotations

import pytest
import torch

from spec_cli.errors import SpecCliError
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.loader import load_model

TOKENS = [5, 17, 42, 99, 7, 250, 31, 64, 12, 200, 3, 77, 150, 9, 88, 120, 45, 66, 230, 11]
ATOL = 1e-4


def rows(tokens, start=0, seq=0, logits=True) -> Batch:
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, start + i, seq, logits)
    return b


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return load_model(tiny_model_path, device="cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_incremental_decode_equals_full_forward(tiny_arch_path, arch):
    lm = load_model(tiny_arch_path(arch), device="cpu")
    full = Context(lm, n_ctx=64).decode(rows(TOKENS)).logits
    ctx = Context(lm, n_ctx=64)
    step = torch.cat([ctx.decode(rows([t], start=i)).logits for i, t in enumerate(TOKENS)])
    assert full.shape == (len(TOKENS), lm.config.n_vocab)
    torch.testing.assert_close(step, full, atol=ATOL, rtol=0)


def test_chunked_prefill_equals_one_shot(tiny):
    one = Context(tiny, n_ctx=64).decode(rows(TOKENS)).logits
    chunked = Context(tiny, n_ctx=64, n_batch=64, n_ubatch=3).decode(rows(TOKENS)).logits
    torch.testing.assert_close(chunked, one, atol=ATOL, rtol=0)


def test_seq_rm_then_redecode_equals_never_decoded(tiny):
    prefix, rejected, actual = TOKENS[:8], [1, 2, 3, 4], TOKENS[8:12]
    clean = Context(tiny, n_ctx=64)
    clean.decode(rows(prefix))
    expected = clean.decode(rows(actual, start=8)).logits
    ctx = Context(tiny, n_ctx=64)
    ctx.decode(rows(prefix))
    ctx.decode(rows(rejected, start=8))
    assert ctx.pos_max(0) == 11
    ctx.seq_rm(0, 8)
    assert ctx.pos_max(0) == 7
    torch.testing.assert_close(ctx.decode(rows(actual, start=8)).logits, expected, atol=ATOL, rtol=0)


def test_sequences_in_one_batch_are_isolated(tiny):
    a, b = TOKENS[:6], TOKENS[6:15]
    alone_a = Context(tiny, n_ctx=64).decode(rows(a)).logits
    alone_b = Context(tiny, n_ctx=64).decode(rows(b)).logits
    ctx = Context(tiny, n_ctx=128, n_seq=3)
    batch = Batch()
    for i, t in enumerate(b):  # sequence 2 first, interleaved order must not matter
        batch.add(t, i, 2, True)
    for i, t in enumerate(a):
        batch.add(t, i, 0, True)
    out = ctx.decode(batch).logits
    torch.testing.assert_close(out[: len(b)], alone_b, atol=ATOL, rtol=0)
    torch.testing.assert_close(out[len(b) :], alone_a, atol=ATOL, rtol=0)
    assert ctx.n_ctx_seq == 128 // 3 and ctx.pos_max(1) == -1


def test_sequences_on_the_kernels_decode_their_rows_unpadded(tiny, monkeypatch):
    """A verify step of 1 + 7 rows beside three one-row sequences computes those 11 rows, not [4, 8] = 32, and each
    sequence's logits are the ones it gets padded: the kernels take every row's sequence and position."""
    from spec_cli.model import kernels

    rows_run = []
    blocks = kernels.blocks
    monkeypatch.setattr(kernels, "blocks", lambda stack, x, *a, **k: rows_run.append(x.shape[0]) or
                        blocks(stack, x, *a, **k))
    prompts = [TOKENS[:5], TOKENS[5:8], TOKENS[8:14], TOKENS[14:16]]
    step = Batch()
    for seq, p in enumerate(prompts):
        for t in ([TOKENS[16]] if seq else TOKENS[12:20]):
            step.add(t, len(p) + sum(1 for s in step.seq_ids if s == seq), seq, True)
    outs = {}
    for ragged in (True, False):
        monkeypatch.setattr(Context, "ragged", property(lambda self, r=ragged: r))
        ctx = Context(tiny, n_ctx=4 * 32, n_seq=4)
        for seq, p in enumerate(prompts):
            ctx.decode(rows(p, seq=seq))
        rows_run.clear()
        outs[ragged] = ctx.decode(step).logits
        assert rows_run == [len(step) if ragged else 4 * 8] and ctx.step_rows(step) == rows_run[0]
    assert torch.equal(outs[True], outs[False])  # bit for bit: each row's arithmetic is its own


def test_seq_cp_shares_a_prefix(tiny):
    ctx = Context(tiny, n_ctx=128, n_seq=2)
    ctx.decode(rows(TOKENS[:10]))
    ctx.seq_cp(0, 1, 0, 6)
    assert ctx.pos_max(1) == 5
    got = ctx.decode(rows(TOKENS[6:9], start=6, seq=1)).logits
    expected = Context(tiny, n_ctx=64).decode(rows(TOKENS[:9])).logits[6:]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_hidden_states_are_pre_norm_and_feed_the_logits(tiny):
    out = Context(tiny, n_ctx=64).decode(rows(TOKENS[:5], logits=True), hidden=True)
    assert out.hidden.shape == (5, tiny.config.n_embd)
    torch.testing.assert_close(tiny.model.logits(out.hidden), out.logits, atol=ATOL, rtol=0)


def test_only_flagged_rows_return_logits(tiny):
    b = rows(TOKENS[:5], logits=False)
    b.logits[2] = b.logits[4] = True
    out = Context(tiny, n_ctx=64).decode(b)
    full = Context(tiny, n_ctx=64).decode(rows(TOKENS[:5])).logits
    torch.testing.assert_close(out.logits, full[[2, 4]], atol=ATOL, rtol=0)


def test_sliding_window_layers_forget_old_tokens(tiny_arch_path):
    # tiny gemma3: window 8, blocks 0-4 sliding, block 5 global. Changing the first tokens must change the last
    # logits (the global block sees them) ...
    # 6 blocks x 7 earlier tokens each = a 42-token receptive field, so position 59 cannot see positions 0-2.
    lm = load_model(tiny_arch_path("gemma3"), device="cpu")
    long = TOKENS * 3
    other = [101, 102, 103] + long[3:]
    base = Context(lm, n_ctx=128).decode(rows(long)).logits[-1]
    changed = Context(lm, n_ctx=128).decode(rows(other)).logits[-1]
    assert not torch.allclose(base, changed, atol=1e-3)
    # ... but with every block sliding, the window hides them completely
    lm.config.swa_layers[5] = True
    lm.model.layers[5].swa = lm.model.layers[5].attn.swa = True
    base = Context(lm, n_ctx=128).decode(rows(long)).logits[-1]
    changed = Context(lm, n_ctx=128).decode(rows(other)).logits[-1]
    torch.testing.assert_close(base, changed, atol=1e-5, rtol=0)


def test_bad_batches_are_clear_errors(tiny):
    ctx = Context(tiny, n_ctx=16)
    with pytest.raises(SpecCliError, match="consecutive"):
        ctx.decode(rows([1, 2], start=3))
    with pytest.raises(SpecCliError, match="context full"):
        ctx.decode(rows(list(range(1, 18))))
    with pytest.raises(SpecCliError, match="out of range"):
        ctx.decode(rows([tiny.config.n_vocab]))
    with pytest.raises(SpecCliError, match="sequence id"):
        ctx.decode(rows([1], seq=1))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_bf16_weights_pick_the_same_tokens_as_f32(tiny_arch_path, arch):
    f32 = Context(load_model(tiny_arch_path(arch), device="cpu", dtype="f32"), n_ctx=64).decode(rows(TOKENS)).logits
    bf16 = Context(load_model(tiny_arch_path(arch), device="cpu", dtype="bf16"), n_ctx=64).decode(rows(TOKENS)).logits
    assert bf16.dtype == torch.float32
    assert torch.equal(bf16.argmax(-1), f32.argmax(-1))
    torch.testing.assert_close(bf16, f32, atol=0.5, rtol=0)
