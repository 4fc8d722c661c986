"""--compile (spec_cli/model/compiled.py): the decode/verify step compiled with torch.compile gives what eager gives.

On the float path (--dtype f32: inductor's own kernels around torch's matmuls) the logits are eager's bits. Through
the public API (plain, ngram-simple and draft-simple, whose draft model is compiled too; 1 and 4 sequences) and
through the installed console script, compiled == eager token for token. On the default CPU path (the kernels,
--dtype q: a step's blocks are one C++ call) `--compile on` says so in one line and runs eager. The time spent
compiling is left out of the prompt and generation timings.

Kept lean for CI: tiny models, few shapes, one inductor cache directory for the whole session.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest
import torch
from gguf import GGMLQuantizationType as T

from spec_cli.model import kernels
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.loader import load_model
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import default
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.generate import generate
from spec_cli.runtime.session import open_session
from spec_cli.speculative.base import SpecParams
from tests.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="no torch.compile")

GREEDY = SamplingParams(temp=0.0)
PROMPTS = [[5, 17, 42, 99, 7, 250, 31, 64, 12, 200, 3, 77], [101, 102, 103, 101, 102, 103, 101],
           [7, 7, 7, 8, 9], [200, 13, 57, 91, 33, 200, 13, 57, 91]]
N_PREDICT = 16


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    """torch's compile caches in a directory of the tests' own (not the user's ~/.cache/spec-cli)."""
    path = str(tmp_path_factory.mktemp("torch-compile"))
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    yield path
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def rows(tokens, start=0, seq=0) -> Batch:
    b = Batch()
    for i, t in enumerate(tokens):
        b.add(t, start + i, seq, True)
    return b


def one_row_at_a_time(lm, tokens) -> torch.Tensor:
    ctx = Context(lm, n_ctx=64)
    return torch.cat([ctx.decode(rows(tokens[i : i + 1], start=i)).logits for i in range(len(tokens))])


@pytest.fixture(scope="module")
def q_model_path(tmp_path_factory):
    """A tiny Q8_0 model, on the kernels' one-call block stack."""
    if not kernels.available():
        pytest.skip("the compiled kernels were not built")
    return write_tiny_gguf(tmp_path_factory.mktemp("q") / "tiny-q8_0.gguf", arch="llama", seed=7, qtype=T.Q8_0)


def four_sequences_in_verify_batches(ctx) -> list[torch.Tensor]:
    """3 sequences' first 5 rows in one decode, then batches of 1-3 rows of every sequence (the 4th starts late)."""
    got = [[] for _ in PROMPTS]
    b = Batch()
    for seq in range(3):
        for i, t in enumerate(PROMPTS[seq][:5]):
            b.add(t, i, seq, True)
    out = ctx.decode(b).logits
    for seq in range(3):
        got[seq].append(out[5 * seq : 5 * seq + 5])
    pos = [5, 5, 5, 0]
    full = [p + [1, 2, 3, 4] for p in PROMPTS]
    while any(pos[s] < len(full[s]) for s in range(4)):
        b, owners = Batch(), []
        for seq in range(4):
            for t in full[seq][pos[seq] : pos[seq] + 1 + seq % 3]:
                b.add(t, pos[seq], seq, True)
                owners.append(seq)
                pos[seq] += 1
        out = ctx.decode(b).logits
        for seq in range(4):
            got[seq].append(out[[i for i, o in enumerate(owners) if o == seq]])
    return [torch.cat(g) for g in got]


def test_compile_on_runs_the_quantized_cpu_path_eager_with_a_note(q_model_path, capfd):
    """The blocks are one C++ call there: a graph around it can only add overhead, so `on` leaves the step eager
    and says so once per model; the float path of the same file still compiles."""
    lm = load_model(q_model_path, device="cpu")
    assert lm.weights == "q"
    capfd.readouterr()
    assert all(Context(lm, n_ctx=32, compile="on").step is None for _ in range(2))
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "--compile on: tiny-q8_0's decoder blocks run as one C++ call" in err
    assert "running it eager" in err
    assert Context(load_model(q_model_path, device="cpu", dtype="f32"), n_ctx=32, compile="on").step is not None


def test_compile_time_is_left_out_of_the_prompt_and_generation_times(tiny_model_path):
    """A compile inside the prompt and the first step (dynamo's caches emptied: they compile again) goes to
    t_compile_ms; prompt, generation and compile add up to no more than the wall time."""
    torch._dynamo.reset()
    gen = session(tiny_model_path, compile="on", dtype="f32").generator()
    t0 = time.perf_counter()
    generate(gen, PROMPTS[0], GREEDY, N_PREDICT)
    wall_ms = (time.perf_counter() - t0) * 1000
    tm = gen.timings
    assert tm.t_compile_ms > 0
    assert tm.t_prompt_ms + tm.t_gen_ms + tm.t_compile_ms <= wall_ms
    assert tm.t_prompt_ms < tm.t_compile_ms  # a 12-token prompt on 2 tiny blocks, against dynamo's tracing


def test_cuda_graph_step_layout_keeps_the_logits(tiny_model_path):
    """cuda_graphs.StepGraphs run without capture on the CPU (float weights: the torch ops a CUDA graph replays):
    the static index buffer, padded rows writing the cell after their sequence's last row, the logits computed in
    the step for every padded row and gathered, and a step that fills a sequence's context (sequence 0's last rows:
    its padded rows write the spare cell) give each sequence's eager logits (up to float sums over padded shapes)."""
    from spec_cli.model import compiled
    from spec_cli.model.compiled import CompiledStep
    from spec_cli.model.cuda_graphs import StepGraphs

    lm = load_model(tiny_model_path, device="cpu", dtype="f32")
    refs = [one_row_at_a_time(lm, p + [1, 2, 3, 4]) for p in PROMPTS]

    def graph_context(n_ctx: int, n_seq: int) -> Context:
        ctx = Context(lm, n_ctx=n_ctx, n_seq=n_seq)
        ctx.step = CompiledStep("tiny", cuda=False, pad=True)
        ctx.step._fn = compiled._layers  # the step's layout is under test, not inductor (a compile per shape)
        ctx.graphs = StepGraphs(ctx, capture=False)
        return ctx

    ctx = graph_context(4 * 16, 4)  # 16 cells per sequence: sequence 0 fills its own
    for seq, logits in enumerate(four_sequences_in_verify_batches(ctx)):
        torch.testing.assert_close(logits, refs[seq], rtol=1e-4, atol=1e-4, msg=f"sequence {seq}")
    assert (4, 8) in ctx.graphs.buffers and ctx.graphs.logits  # 3 groups of 5 rows: padded to 4 x 8
    # a step that fills the context with a padded row: 13 rows, then 3 padded to 4 (the 4th writes the spare cell)
    ctx, full = graph_context(16, 1), PROMPTS[0] + [1, 2, 3, 4]
    got = torch.cat([ctx.decode(rows(full[:13])).logits, ctx.decode(rows(full[13:], start=13)).logits])
    torch.testing.assert_close(got, refs[0], rtol=1e-4, atol=1e-4)
    assert (1, 4) in ctx.graphs.buffers


def test_float_path_compiled_logits_are_bit_identical(tiny_model_path):
    """--dtype f32: inductor's kernels around torch's matmuls and SDPA, on the same (unpadded) shapes as eager; the
    norms (and gemma's GELU-tanh) stay the eager ops as custom ops, so the logits are eager's bits. (gemma3 too,
    checked by hand: it compiles for 40 s here, too long for CI.) Two graphs: the 5-row chunk's (as many keys as
    rows) serves the 7 rows after it (7 rows, 12 keys: rows and keys are symbols of their own), one more for one row
    (dynamo specializes a size of 1)."""
    lm = load_model(tiny_model_path, device="cpu", dtype="f32")
    logits = {}
    for mode in ("off", "on"):
        torch._dynamo.reset()  # the graphs of earlier tests would serve these steps: counted from none
        ctx = Context(lm, n_ctx=64, compile=mode)
        out = [ctx.decode(rows(PROMPTS[0][:5])).logits, ctx.decode(rows(PROMPTS[0][5:], start=5)).logits]
        for i in range(10):
            out.append(ctx.decode(rows([int(out[-1][-1].argmax())], start=len(PROMPTS[0]) + i)).logits)
        logits[mode] = torch.cat(out)
        assert (ctx.step is not None and ctx.step.stats.calls == 12) == (mode == "on")
    assert ctx.step.stats.graphs == 2
    assert torch.equal(logits["on"], logits["off"])


def session(model, spec_types="", draft=None, n_seq=1, compile="off", device="cpu", dtype=default("dtype")):
    params = SpecParams(types=[t for t in spec_types.split(",") if t], draft_max=4, draft_p_min=0.0,
                        ngram_simple_size_n=2, ngram_simple_size_m=8)
    return open_session(EngineOptions(model=str(model), model_draft=str(draft) if draft else None, n_ctx=128 * n_seq,
                                      n_seq=n_seq, device=device, compile=compile, spec=params, dtype=dtype))


def outputs(s, n_seq: int) -> list[list[int]]:
    """Greedy continuations of the first n_seq prompts, decoded side by side."""
    gen = s.generator()
    outs = {seq: list(gen.start(seq, PROMPTS[seq], GREEDY, N_PREDICT).tokens) for seq in range(n_seq)}
    while emitted := gen.step():
        for e in emitted:
            outs[e.seq].extend(e.tokens)
    return [outs[seq] for seq in range(n_seq)]


@pytest.mark.parametrize("n_seq", [1, 4])
@pytest.mark.parametrize("chain", ["", "ngram-simple", "draft-simple"])
def test_compiled_equals_eager_through_the_api(tiny_model_path, tiny_draft_path, chain, n_seq):
    draft = tiny_draft_path if "draft-simple" in chain else None
    eager = outputs(session(tiny_model_path, chain, draft, n_seq, dtype="f32"), n_seq)
    s = session(tiny_model_path, chain, draft, n_seq, compile="on", dtype="f32")
    assert outputs(s, n_seq) == eager
    contexts = [s.engine.ctx] + ([s.engine.draft_ctx] if draft else [])
    assert all(c.step is not None and c.step.stats.calls > 0 for c in contexts)
    if chain:
        assert s.pooled_stats().n_acc_tokens > 0  # drafts were verified (else the chain proves nothing)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (docs/cuda.md)")
@pytest.mark.parametrize("n_seq", [1, 4])
@pytest.mark.parametrize("chain", ["ngram-simple", "draft-simple"])
def test_cuda_graphs_speculation_equals_plain(tiny_model_path, tiny_draft_path, chain, n_seq):
    """Under CUDA graphs compiled != eager (inductor fuses bf16 ops in another order: docs/cuda.md); what must hold
    is that speculation, its k-row verify steps replayed from other graphs than one-row decodes, equals plain."""
    draft = tiny_draft_path if "draft-simple" in chain else None
    plain = outputs(session(tiny_model_path, n_seq=n_seq, compile="on", device="cuda"), n_seq)
    s = session(tiny_model_path, chain, draft, n_seq, compile="on", device="cuda")
    assert outputs(s, n_seq) == plain
    assert s.pooled_stats().n_acc_tokens > 0


def test_auto_leaves_the_cpu_eager(tiny_model_path):
    """--compile auto: on only where it measurably wins (README): not on the CPU paths."""
    for dtype in ("q", "f32"):
        lm = load_model(tiny_model_path, device="cpu", dtype=dtype)
        assert Context(lm, n_ctx=32, compile="auto").step is None


def console_runs(model, inductor_cache, dtype: str) -> dict[str, subprocess.CompletedProcess]:
    """`spec-cli run ... --json` with --compile off and on."""
    base = ["spec-cli", "run", "-m", str(model), "-p", "abc abc abc abc", "-n", "12", "--temp", "0", "--json",
            "-t", "1", "--dtype", dtype]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
    runs = {mode: subprocess.run(base + ["--compile", mode], capture_output=True, text=True, env=env, timeout=600)
            for mode in ("off", "on")}
    for mode, r in runs.items():
        assert r.returncode == 0, f"--compile {mode}: {r.stderr}"
    assert json.loads(runs["on"].stdout)["content"] == json.loads(runs["off"].stdout)["content"]
    assert "compiling" not in runs["off"].stderr and "--compile" not in runs["off"].stderr
    return runs


@pytest.mark.skipif(shutil.which("spec-cli") is None, reason="the console script is not installed")
def test_console_script_compiled_equals_eager(tiny_model_path, inductor_cache):
    err = console_runs(tiny_model_path, inductor_cache, "f32")["on"].stderr
    assert "compiling tiny-llama decode step (1 x 1 rows) with torch.compile ... done in" in err


@pytest.mark.skipif(shutil.which("spec-cli") is None, reason="the console script is not installed")
def test_console_script_compile_on_runs_the_quantized_path_eager_with_a_note(q_model_path, inductor_cache):
    err = console_runs(q_model_path, inductor_cache, "auto")["on"].stderr
    notes = [line for line in err.splitlines() if "--compile on" in line]
    assert len(notes) == 1 and "one C++ call" in notes[0] and "running it eager" in notes[0]
    assert "decode step" not in err  # no compile line
