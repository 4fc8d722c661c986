"""Target features on request (Context.set_taps): every decode returns the inputs of the tapped layers for every row
(prompt chunks, verify batches, several sequences in one batch), equal to the layer inputs of a cache-free reference
forward, on every path (the float torch ops, the kernels' one-call block stack, the compiled step, the CUDA graphs'
step layout run on the CPU); nothing is captured where no drafter asks."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from spec_cli.errors import SpecCliError
from spec_cli.model import compiled, kernels
from spec_cli.model.batch import Batch
from spec_cli.model.context import Context
from spec_cli.model.loader import load_model
from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.generate import generate
from spec_cli.runtime.session import open_session
from spec_cli.speculative.base import SpecParams
from spec_cli.train.target_pass import causal_plan, scratch_kv
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_mtp import write_tiny_mtp_gguf

PROMPTS = [[40, 41, 42, 43, 44, 45, 46, 47, 40, 41], [60, 61, 62, 60, 61, 62, 60], [7, 7, 7, 8, 9, 10],
           [200, 13, 57, 91, 33, 200, 13, 57]]
N_LAYER = 3
TAPS = (0, 1, 3)  # the embedding (layer 0's input), a middle layer's input, the final pre-norm state


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("taps")
    return {"f32": write_tiny_gguf(d / "f32.gguf", seed=5, n_layer=N_LAYER),
            "q8_0": write_tiny_gguf(d / "q8.gguf", seed=5, n_layer=N_LAYER, qtype=T.Q8_0)}


def reference(lm, tokens: list[int], per_block: bool = False) -> torch.Tensor:
    """[T, len(TAPS), D]: the tapped layers' inputs of one sequence in a cache-free forward, read by hooks on the
    blocks (`per_block`: the kernels' block-by-block path instead of the one-call stack)."""
    model, seen = lm.model, {}
    hooks = [layer.register_forward_pre_hook(lambda _m, args, i=i: seen.__setitem__(i, args[0].clone()))
             for i, layer in enumerate(model.layers)]
    saved = model.kernel_stack
    if per_block:
        model.kernel_stack = lambda x, kv: None
    try:
        with torch.inference_mode():
            tok = torch.tensor([tokens])
            kv = [scratch_kv(lm.config, 1, len(tokens), model.dtype, d) for d in model.layer_devices]
            seen[N_LAYER] = model.forward_hidden(tok, causal_plan(1, len(tokens), lm.config, tok.device), kv)
    finally:
        model.kernel_stack = saved
        for h in hooks:
            h.remove()
    return torch.stack([seen[i].reshape(len(tokens), -1) for i in TAPS], dim=1)


def mixed_batches(ctx: Context) -> list[torch.Tensor]:
    """Each sequence's features when three prompts start in one decode and all four then advance in verify-like
    batches of 1-3 rows of every sequence (the fourth starting late)."""
    got: list[list[torch.Tensor]] = [[] for _ in PROMPTS]
    pos = [0] * len(PROMPTS)
    first = True
    while any(pos[s] < len(PROMPTS[s]) for s in range(len(PROMPTS))):
        b, owners = Batch(), []
        for seq, prompt in enumerate(PROMPTS):
            n = (4 if seq < 3 else 0) if first else 1 + seq % 3
            for t in prompt[pos[seq] : pos[seq] + n]:
                b.add(t, pos[seq], seq, True)
                owners.append(seq)
                pos[seq] += 1
        out = ctx.decode(b)
        assert out.features.shape == (len(b), len(TAPS), ctx.config.n_embd)
        assert out.features is ctx.last_features
        for seq in range(len(PROMPTS)):
            got[seq].append(out.features[[i for i, o in enumerate(owners) if o == seq]])
        first = False
    return [torch.cat(g) for g in got]


def test_float_path_features_are_the_layer_inputs(paths):
    lm = load_model(paths["f32"], device="cpu", dtype="f32")
    ctx = Context(lm, n_ctx=4 * 32, n_seq=4)
    ctx.set_taps(reversed(TAPS))  # any order: kept sorted
    assert ctx.taps == TAPS
    for seq, feats in enumerate(mixed_batches(ctx)):
        # batch composition changes torch's float sums in the last bits only
        torch.testing.assert_close(feats, reference(lm, PROMPTS[seq]), rtol=1e-5, atol=1e-5, msg=f"sequence {seq}")
    assert ctx.n_tapped_rows == sum(map(len, PROMPTS))


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels were not built")
def test_kernel_stack_copies_the_layer_inputs_bit_for_bit(paths):
    lm = load_model(paths["q8_0"], device="cpu")
    assert lm.weights == "q"
    ctx = Context(lm, n_ctx=4 * 32, n_seq=4)
    ctx.set_taps(TAPS)
    assert lm.model.kernel_stack(torch.zeros(1, 1, lm.config.n_embd), ctx.kv) is not None  # the one-call path
    for seq, feats in enumerate(mixed_batches(ctx)):
        assert torch.equal(feats, reference(lm, PROMPTS[seq], per_block=True)), f"sequence {seq}"


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels were not built")
def test_compiled_step_returns_the_eager_features(paths):
    """The float path compiles (the kernels' path runs eager under --compile on): the same features, bit for bit."""
    lm = load_model(paths["f32"], device="cpu", dtype="f32")
    eager = Context(lm, n_ctx=4 * 32, n_seq=4)
    eager.set_taps(TAPS)
    ctx = Context(lm, n_ctx=4 * 32, n_seq=4, compile="on")
    ctx.set_taps(TAPS)
    for seq, (a, b) in enumerate(zip(mixed_batches(ctx), mixed_batches(eager))):
        assert torch.equal(a, b), f"sequence {seq}"
    assert ctx.step.stats.calls >= 3


def test_cuda_graph_step_layout_returns_the_features(paths):
    """cuda_graphs.StepGraphs without capture on the CPU (the step a CUDA graph replays, padded to its buckets): the
    features buffer of the padded shape, gathered in batch order."""
    from spec_cli.model.compiled import CompiledStep
    from spec_cli.model.cuda_graphs import StepGraphs

    lm = load_model(paths["f32"], device="cpu", dtype="f32")
    ctx = Context(lm, n_ctx=4 * 32, n_seq=4)
    ctx.step = CompiledStep("tiny", cuda=False, pad=True)
    ctx.step._fn = compiled._layers  # the layout is under test, not inductor
    ctx.graphs = StepGraphs(ctx, capture=False)
    ctx.set_taps(TAPS)
    for seq, feats in enumerate(mixed_batches(ctx)):
        torch.testing.assert_close(feats, reference(lm, PROMPTS[seq]), rtol=1e-4, atol=1e-4, msg=f"sequence {seq}")
    assert any(key[2] == TAPS for key in ctx.graphs.features)


def test_taps_out_of_range_and_features_never_asked_for_are_clear_errors(paths):
    lm = load_model(paths["f32"], device="cpu", dtype="f32")
    ctx = Context(lm, n_ctx=32)
    with pytest.raises(SpecCliError, match="layers 0..2"):
        ctx.set_taps([N_LAYER + 1])
    ctx.set_taps([1])
    ctx.decode(Batch([1, 2], [0, 1], [0, 0], [False, True]))
    with pytest.raises(SpecCliError, match="not captured"):
        ctx.features_of((2,))
    assert ctx.features_of((1,)).shape == (2, 1, lm.config.n_embd)


@pytest.mark.parametrize("types", ["", "ngram-mod,ngram-simple"])
def test_a_run_without_a_hidden_state_drafter_captures_nothing(tiny_model_path, types):
    spec = SpecParams(types=[t for t in types.split(",") if t], draft_max=4)
    session = open_session(EngineOptions(model=str(tiny_model_path), n_ctx=128, device="cpu", spec=spec))
    generate(session.generator(), PROMPTS[0] * 2, SamplingParams(temp=0.0), 24)
    ctx = session.engine.ctx
    assert ctx.taps == () and ctx.n_tapped_rows == 0 and ctx.last_features is None
    assert ctx.n_decode > 1


def test_taps_live_with_the_session_whose_drafter_reads_them(tmp_path):
    """draft-mtp reads the final pre-norm state (layer id n_layer) through the same interface; a session without it
    stops the capture."""
    path = write_tiny_mtp_gguf(tmp_path / "mtp.gguf")
    spec = SpecParams(types=["draft-mtp"], draft_max=3, draft_p_min=0.0)
    session = open_session(EngineOptions(model=str(path), n_ctx=128, device="cpu", spec=spec))
    ctx = session.engine.ctx
    assert ctx.taps == (ctx.config.n_layer_main,)
    generate(session.generator(), PROMPTS[0], SamplingParams(temp=0.0), 12)
    captured = ctx.n_tapped_rows
    assert captured >= len(PROMPTS[0])
    plain = session.renew(types=["ngram-mod"])
    assert ctx.taps == () and ctx.last_features is None
    generate(plain.generator(), PROMPTS[1], SamplingParams(temp=0.0), 12)
    assert ctx.n_tapped_rows == captured


@pytest.mark.parametrize("dtype", ["f32", "q"])
def test_taps_in_any_order_and_repeated_come_back_as_asked(paths, dtype):
    """Transformer.forward_tapped with taps out of order and repeated (EAGLE-3's default layers of a shallow target
    repeat one): each column is its layer's input, on the float path and the kernels' stack alike."""
    lm = load_model(paths["q8_0" if dtype == "q" else "f32"], device="cpu", dtype=dtype)
    tokens = PROMPTS[0]
    kv = [scratch_kv(lm.config, 1, len(tokens), lm.model.dtype, d) for d in lm.model.layer_devices]
    with torch.inference_mode():
        _, out = lm.model.forward_tapped(torch.tensor([tokens]), causal_plan(1, len(tokens), lm.config,
                                                                             torch.device("cpu")), kv, (3, 1, 1, 0))
    ref = reference(lm, tokens, per_block=dtype == "q")  # columns of TAPS = (0, 1, 3)
    assert torch.equal(out[0], ref[:, [2, 1, 1, 0]])
