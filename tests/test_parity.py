"""Parity with llama.cpp on the real GGUF models: greedy tokens from tests/reference (llama.cpp via llama-cpp-python).

Both engines multiply the GGUF weight blocks with activations quantized to 8 bits per block (ggml's rule; ours in
spec_cli/model/kernels). Bit-exact agreement would need every earlier float operation to match too: any difference flips
some roundings of the 8-bit codes, so the two engines' logits differ by about what that quantization itself costs.
Measured with scripts/logit_diff.py (teacher-forced, median over positions of the largest |logit difference|):
0.73 smollm2-135m, 1.35 gemma3-270m, 0.37 qwen2.5-coder-0.5b, 0.49 qwen2.5-coder-1.5b, about the same as between our
own 8-bit and float32 paths (0.64, 1.26, 0.33, 0.42). So the teacher-forced test feeds llama.cpp's tokens and requires
the same argmax wherever its margin is clear of that noise, and every disagreement to be a near tie in our logits
too (the margins are printed in the failure message).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.loader import load_model
from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.generate import generate
from spec_cli.runtime.session import open_session
from tests.real_models import real_model, reference

CLEAR_MARGIN = 0.5  # llama.cpp logit margin above which we must pick llama.cpp's token
NEAR_TIE = 0.5  # our own margin for a tolerated disagreement
FREE_RUN_MARGIN = 0.25  # free-running greedy output must equal llama.cpp's up to its first margin below this

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("two_threads")]


@pytest.mark.parametrize("dtype", ["auto", "f32"])  # auto = weights kept quantized (qlinear.py)
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_teacher_forced_argmax_matches_llamacpp(name, dtype):
    loaded = load_model(real_model(name), device="cpu", dtype=dtype)
    for case in reference(name)["greedy"]:
        prompt, output = case["prompt_ids"], case["output_ids"]
        batch = Batch()
        for i, tok in enumerate(prompt + output):
            batch.add(tok, i, 0, i >= len(prompt) - 1)
        logits = Context(loaded, n_ctx=1024).decode(batch).logits[: len(output)]
        ours = logits.argmax(-1).tolist()
        problems = []
        for i, (mine, theirs) in enumerate(zip(ours, output)):
            if mine == theirs:
                continue
            their_margin = case["top1_minus_top2_logit"][i]
            our_margin = float(logits[i, mine] - logits[i, theirs])
            if their_margin > CLEAR_MARGIN or our_margin > NEAR_TIE:
                problems.append(f"step {i}: ours {mine} theirs {theirs}, margins llama.cpp {their_margin:.3f} ours "
                                f"{our_margin:.3f}")
        assert not problems, f"{name}/{case['id']}: " + "; ".join(problems)


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_free_running_greedy_matches_llamacpp_up_to_the_first_near_tie(name):
    session = open_session(EngineOptions(model=str(real_model(name)), n_ctx=1024, device="cpu"))
    for case in reference(name)["greedy"]:
        margins = case["top1_minus_top2_logit"]
        safe = next((i for i, m in enumerate(margins) if m < FREE_RUN_MARGIN), len(margins))
        if safe == 0:
            continue
        session.reset()
        out: list[int] = []
        generate(session.generator(), case["prompt_ids"], SamplingParams(temp=0.0), safe,
                 on_emit=lambda e: out.extend(e.tokens))
        eog = session.engine.tokenizer.eog_ids
        expected = [t for t in case["output_ids"][:safe] if t not in eog]  # EOG is not emitted
        assert out == expected, f"{name}/{case['id']}"


def test_run_command_prints_llamacpp_continuation():
    """The issue's acceptance command, end to end through the CLI."""
    case = next(c for c in reference("qwen2.5-coder-0.5b")["greedy"] if c["id"] == "fibonacci")
    proc = subprocess.run(
        [sys.executable, "-m", "spec_cli", "run", "-m", str(real_model("qwen2.5-coder-0.5b")), "-p", case["prompt_text"],
         "-n", str(case["n_predict"]), "--temp", "0"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(case["prompt_text"] + case["output_text"])
    assert "generation" in proc.stderr  # the summary table


def test_near_tie_divergence_is_shown_with_its_margin():
    """smollm2 'fibonacci': llama.cpp picks 2822 at step 13 with a 0.107 margin; we pick another token by a margin
    within the engines' logit noise. Both engines agree everywhere the margin is clear (test above); this pins the
    known near tie."""
    case = next(c for c in reference("smollm2-135m")["greedy"] if c["id"] == "fibonacci")
    loaded = load_model(real_model("smollm2-135m"), device="cpu")
    tokens = case["prompt_ids"] + case["output_ids"][:13]
    batch = Batch()
    for i, tok in enumerate(tokens):
        batch.add(tok, i, 0, i == len(tokens) - 1)
    logits = Context(loaded, n_ctx=256).decode(batch).logits[0]
    top2 = torch.topk(logits, 2)
    assert case["top1_minus_top2_logit"][13] < 0.15
    assert float(top2.values[0] - logits[case["output_ids"][13]]) < NEAR_TIE
