"""Batch invariance of the default CPU path (GGUF blocks kept quantized, spec_cli/model/kernels): a sequence's float32
logits are BIT-identical (torch.equal) however its rows are batched:

(i)   prefill one row at a time == the whole prompt in one decode == decodes of 3 rows == 3-row ubatches;
(ii)  a row decoded alone == the same row as the first of a k-row verify batch (k = 1..8) whose other rows are
      drafts, partly accepted (their logits too) and partly rejected then rolled back with seq_rm;
(iii) sequences decoded beside each other in one Batch (4 sequences, different lengths and rows per decode,
      rows interleaved, some without logits, some followed by draft rows that are then rolled back) == each
      sequence alone;
(iv)  a prompt whose prefix is already in the cache (the same call's earlier decode, a longer cached sequence cut
      back with seq_rm, or a prefix copied from another sequence) == the whole prompt decoded at once.

On tiny models with quantized weights (several block types, mixed in a model as Q4_K_M files mix them), llama,
qwen2 (biases) and gemma3 (sliding-window layers: sequences run past the 8-token window), on 1 and 2 threads,
with the AVX2 kernels and, for two models, the scalar ones. References are computed on 1 thread.
"""

from __future__ import annotations

import random

import pytest
import torch
from gguf import GGMLQuantizationType as T

from spec_cli.model import kernels
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.loader import load_model
from spec_cli.model.qlinear import QLinear
from tests.tiny_gguf import K_DIMS, write_tiny_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels were not built")

Q4_K_M = {"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K, "output.weight": T.Q6_K}
MODELS = {  # name: write_tiny_gguf arguments
    "llama-q8_0": dict(arch="llama", qtype=T.Q8_0),
    "llama-q4_0-mixed": dict(arch="llama", qtype=T.Q4_0, qtype_overrides={
        "attn_k.weight": T.Q5_0, "attn_v.weight": T.Q5_1, "ffn_down.weight": T.Q4_1, "output.weight": T.Q8_0}),
    "llama-q4_k_m": dict(arch="llama", qtype=T.Q4_K, dims=K_DIMS,
                         qtype_overrides={**Q4_K_M, "attn_k.weight": T.Q5_K, "ffn_up.weight": T.F16}),
    "qwen2-q5_0": dict(arch="qwen2", qtype=T.Q5_0),
    "gemma3-q8_0": dict(arch="gemma3", qtype=T.Q8_0, n_layer=6),
    "gemma3-q4_k_m": dict(arch="gemma3", qtype=T.Q4_K, dims=K_DIMS, n_layer=6, qtype_overrides=Q4_K_M),
}
CASES = [(name, "avx2") for name in MODELS] + [("llama-q4_k_m", "scalar"), ("gemma3-q8_0", "scalar")]

N_CTX = 64  # per sequence
PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 200, 3, 77, 150, 9, 88, 120, 45, 66, 230, 11, 1, 2, 3, 300]
OTHERS = [  # the sequences decoded beside PROMPT in (iii), of different lengths
    [101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117],
    [7, 7, 7, 8, 9],
    [200, 13, 57, 91, 33, 250, 251, 252, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38],
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            path = write_tiny_gguf(tmp_path_factory.mktemp("inv") / f"{name}.gguf", seed=7, **MODELS[name])
            loaded = load_model(path, device="cpu")
            assert loaded.weights == "q"
            assert all(isinstance(m, QLinear) for m in (loaded.model.output, loaded.model.layers[0].attn.qkv,
                                                        loaded.model.layers[0].ffn.gate_up))
            cache[name] = loaded
        return cache[name]

    return get


_REFERENCE: dict[tuple[str, str, tuple[int, ...]], torch.Tensor] = {}


def set_threads(n: int) -> int:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    return old


def one_row_at_a_time(lm, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), n_vocab]: each token decoded by itself, in a fresh single-sequence context."""
    ctx = Context(lm, n_ctx=N_CTX)
    return torch.cat([ctx.decode(rows(tokens[i : i + 1], start=i)).logits for i in range(len(tokens))])


def reference(name: str, isa: str, lm, tokens: list[int]) -> torch.Tensor:
    """one_row_at_a_time on 1 thread with the case's kernels (cached)."""
    key = (name, isa, tuple(tokens))
    if key not in _REFERENCE:
        old = set_threads(1)
        try:
            _REFERENCE[key] = one_row_at_a_time(lm, tokens)
        finally:
            torch.set_num_threads(old)
    return _REFERENCE[key]


@pytest.fixture(params=CASES, ids=[f"{n}-{i}" for n, i in CASES])
def case(request, models):
    """(name, isa, loaded model, reference logits of PROMPT), run on 1 and then 2 threads (see `threads`)."""
    name, isa = request.param
    if isa == "avx2" and not kernels.has_avx2():
        pytest.skip("this CPU has no AVX2/FMA/F16C")
    kernels.use_avx2(isa == "avx2")
    lm = models(name)
    yield name, isa, lm, reference(name, isa, lm, PROMPT)
    kernels.use_avx2(True)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    old = set_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def rows(tokens, start=0, seq=0, logits=True) -> Batch:
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, start + i, seq, logits)
    return b


def assert_bit_identical(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.equal(got, want):
        bad = (got != want).any(dim=-1).nonzero().flatten().tolist()
        diff = (got - want).abs().max().item()
        raise AssertionError(f"{what}: logits differ in rows {bad} (of {got.shape[0]}), max |diff| {diff:.3g}, "
                             f"argmax {got[bad].argmax(-1).tolist()} vs {want[bad].argmax(-1).tolist()}")


def test_reference_logits_are_sane(case):
    name, _, lm, ref = case
    assert ref.shape == (len(PROMPT), lm.config.n_vocab) and torch.isfinite(ref).all()
    if name.startswith("gemma3"):
        assert lm.config.sliding_window == 8 and len(PROMPT) > 2 * lm.config.sliding_window


# --- (i) prefill ---------------------------------------------------------------------------------------------

def test_prefill_one_row_at_a_time_equals_one_batch_and_chunks(case, threads):
    name, isa, lm, ref = case
    assert_bit_identical(one_row_at_a_time(lm, PROMPT), ref, f"{name} [{isa}, {threads}t] one row at a time")
    whole = Context(lm, n_ctx=N_CTX).decode(rows(PROMPT)).logits
    assert_bit_identical(whole, ref, f"{name} [{isa}, {threads}t] the prompt in one decode")
    ctx = Context(lm, n_ctx=N_CTX)
    chunked = torch.cat([ctx.decode(rows(PROMPT[i : i + 3], start=i)).logits for i in range(0, len(PROMPT), 3)])
    assert_bit_identical(chunked, ref, f"{name} [{isa}, {threads}t] decodes of 3 rows")
    ubatched = Context(lm, n_ctx=N_CTX, n_ubatch=3).decode(rows(PROMPT)).logits
    assert_bit_identical(ubatched, ref, f"{name} [{isa}, {threads}t] one decode in 3-row ubatches")
    ctx = Context(lm, n_ctx=N_CTX)  # uneven chunks, only the last row of each asking for logits
    got, start = [], 0
    for size in (1, 7, 2, 5, 9):
        b = rows(PROMPT[start : start + size], start=start, logits=False)
        b.logits[-1] = True
        got.append(ctx.decode(b).logits)
        start += size
    ends = [0, 7, 9, 14, 23]
    assert_bit_identical(torch.cat(got), ref[ends], f"{name} [{isa}, {threads}t] chunks of 1, 7, 2, 5, 9 rows")


# --- (ii) verify batches ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", range(1, 9))
def test_verify_batch_rows_equal_single_row_decodes(case, threads, k):
    """Speculative verification: [last token, k - 1 drafts] in one decode; a random number of the drafts are
    PROMPT's next tokens (accepted: their logits must equal the reference too), the rest arbitrary tokens
    (rejected, rolled back with seq_rm before the next verify)."""
    name, isa, lm, ref = case
    rng = random.Random(1000 * k + threads)
    n_vocab = lm.config.n_vocab
    ctx = Context(lm, n_ctx=N_CTX)
    ctx.decode(rows(PROMPT[:3]))
    p = 3  # next position to verify
    while p < len(PROMPT):
        n_accept = min(rng.randint(0, k - 1), len(PROMPT) - p - 1)
        drafts = PROMPT[p + 1 : p + 1 + n_accept]
        drafts += [rng.randrange(n_vocab) for _ in range(k - 1 - n_accept)]
        logits = ctx.decode(rows([PROMPT[p]] + drafts, start=p)).logits
        assert logits.shape[0] == k
        assert_bit_identical(logits[: 1 + n_accept], ref[p : p + 1 + n_accept],
                             f"{name} [{isa}, {threads}t] k={k} verify at position {p} ({n_accept} accepted)")
        p += 1 + n_accept
        ctx.seq_rm(0, p)
        assert ctx.pos_max(0) == p - 1


# --- (iii) server slots ------------------------------------------------------------------------------------------

def test_sequences_beside_others_equal_each_alone(case, threads):
    """Server slots: each decode takes 0, 1 or several rows of each sequence, interleaved; like speculative slots,
    a sequence's real rows may be followed by rejected draft rows, rolled back after the decode."""
    name, isa, lm, ref = case
    seqs = [PROMPT] + OTHERS  # sequence id = index
    refs = [ref] + [reference(name, isa, lm, s) for s in OTHERS]
    ctx = Context(lm, n_ctx=4 * N_CTX, n_seq=4)
    rng = random.Random(threads)
    done = [0] * 4
    got: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(4)]
    step = 0
    while any(done[s] < len(seqs[s]) for s in range(4)):
        if step == 1:  # a long prefill beside one-row steps
            counts = [1, 1, 0, 20]
        else:
            counts = [rng.choice([0, 1, 1, 2, 3, 5]) for _ in range(4)]
        per_seq = []  # [(sequence, position, token, real)] in position order
        for s in range(4):
            n = min(counts[s], len(seqs[s]) - done[s])
            n_junk = rng.choice([0, 0, 1, 3]) if n and step != 1 else 0
            per_seq.append([(s, done[s] + i, seqs[s][done[s] + i], True) for i in range(n)]
                           + [(s, done[s] + n + i, rng.randrange(lm.config.n_vocab), False) for i in range(n_junk)])
            done[s] += n
        # interleave the sequences' rows at random, each sequence's rows in position order
        order, batch = [], Batch()
        while any(per_seq):
            s = rng.choice([s for s in range(4) if per_seq[s]])
            order.append(per_seq[s].pop(0))
        if not order:
            continue
        for s, pos, token, _ in order:
            batch.add(token, pos, s, rng.random() < 0.7)
        out = ctx.decode(batch).logits
        flagged = [row for row, want in zip(order, batch.logits) if want]
        assert out.shape[0] == len(flagged)
        for (s, pos, _, real), logits in zip(flagged, out):
            if real:
                got[s].append((pos, logits))
        for s in range(4):
            ctx.seq_rm(s, done[s])  # drop the draft rows
        step += 1
    for s in range(4):
        positions = [pos for pos, _ in got[s]]
        assert_bit_identical(torch.stack([row for _, row in got[s]]), refs[s][positions],
                             f"{name} [{isa}, {threads}t] sequence {s} beside the others")
    assert ctx.lengths == [len(s) for s in seqs]


# --- (iv) prompt cache -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_cached", [1, 8, 13, len(PROMPT) - 1])
def test_cached_prefix_equals_the_whole_prompt_at_once(case, threads, n_cached):
    name, isa, lm, ref = case
    what = f"{name} [{isa}, {threads}t] {n_cached} tokens cached"
    whole = Context(lm, n_ctx=N_CTX).decode(rows(PROMPT)).logits
    # the prefix decoded by an earlier call
    ctx = Context(lm, n_ctx=N_CTX)
    ctx.decode(rows(PROMPT[:n_cached]))
    rest = ctx.decode(rows(PROMPT[n_cached:], start=n_cached)).logits
    assert_bit_identical(rest, whole[n_cached:], what + " (earlier decode)")
    # a longer cached sequence (an earlier request's prompt and answer) cut back to the common prefix
    ctx = Context(lm, n_ctx=N_CTX)
    ctx.decode(rows(PROMPT[:n_cached] + [300, 301, 302, 7, 8, 9]))
    ctx.seq_rm(0, n_cached)
    rest = ctx.decode(rows(PROMPT[n_cached:], start=n_cached)).logits
    assert_bit_identical(rest, whole[n_cached:], what + " (cut back with seq_rm)")
    # the prefix copied from another sequence, then the rest one row at a time
    ctx = Context(lm, n_ctx=2 * N_CTX, n_seq=2)
    ctx.decode(rows(PROMPT[:n_cached] + [11, 12], seq=1))
    ctx.seq_cp(1, 0, 0, n_cached)
    rest = torch.cat([ctx.decode(rows([PROMPT[i]], start=i)).logits for i in range(n_cached, len(PROMPT))])
    assert_bit_identical(rest, whole[n_cached:], what + " (copied from another sequence)")
