"""Every built-in drafter's per-sequence state (speculative/base.py Drafter.save_state / restore_state / forget): put
into a fresh session it saves again as it was and continues as the session it came from; a state with an entry
missing or of the wrong kind is a StateError (never another exception); a drafter without the methods refuses. And a
slot file of a bfloat16 cache (runtime/slot_file.py) round-trips bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spec_cli.errors import StateError
from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.session import open_session
from spec_cli.runtime.slot_file import restore_slot, save_slot
from spec_cli.speculative.base import Drafter, SpecParams, StateUnsupported
from tests.server_harness import PROMPTS, make_session
from tests.tiny_dflash import write_tiny_dflash, write_tiny_dspark
from tests.tiny_eagle3 import write_tiny_eagle3
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_mtp import write_tiny_mtp_gguf

GREEDY = SamplingParams(temp=0.0, ignore_eos=True)
SMALL_MAPS = dict(ngram_map_k_size_n=2, ngram_map_k_size_m=8, ngram_map_k4v_size_n=2, ngram_map_k4v_size_m=8)
CHAINS = ["n-gram family", "draft-simple", "draft-mtp", "draft-eagle3", "draft-dflash", "draft-dspark", "suffix",
          "draft-simple, another vocabulary"]


@pytest.fixture(scope="module")
def chains(tmp_path_factory, tiny_model_path, tiny_close_draft_path, tiny_other_vocab_path):
    """name -> a function opening a fresh two-sequence session of that chain."""
    d = tmp_path_factory.mktemp("states")
    mtp = write_tiny_mtp_gguf(d / "mtp.gguf")
    target4 = write_tiny_gguf(d / "target4.gguf", arch="llama", seed=11, n_layer=4)
    head = write_tiny_eagle3(d / "head.gguf", target4).path
    dflash = write_tiny_dflash(d / "dflash.gguf", target4, n_draft=150).path
    dspark = write_tiny_dspark(d / "dspark.gguf", target4)[0].path
    return {
        "n-gram family": lambda: make_session(tiny_model_path, 2, "ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,"
                                              "ngram-cache", **SMALL_MAPS),
        "draft-simple": lambda: make_session(tiny_model_path, 2, "draft-simple", tiny_close_draft_path,
                                             draft_vocab=40),  # fewer rows than the vocabulary: tokens get seen
        "draft-mtp": lambda: make_session(mtp, 2, "draft-mtp"),
        "draft-eagle3": lambda: make_session(target4, 2, "draft-eagle3", head),
        "draft-dflash": lambda: make_session(target4, 2, "draft-dflash", dflash, draft_max=4),
        "draft-dspark": lambda: make_session(target4, 2, "ngram-mod,draft-dspark", dspark, draft_max=4),
        "suffix": lambda: make_session(tiny_model_path, 2, "suffix"),
        "draft-simple, another vocabulary": lambda: make_session(tiny_model_path, 2, "draft-simple",
                                                                 tiny_other_vocab_path),
    }


def generate_on(session, seq: int, prompt: list[int], n: int, n_cached: int = 0):
    """One request on sequence `seq` to its end -> (tokens it holds, id_last, drafted, accepted)."""
    gen = session.generator()
    gen.start(seq, prompt, GREEDY, n, n_cached=n_cached)
    while not gen.active[seq].done:
        gen.step()
    s = gen.active[seq]
    gen.finish(seq)  # the drafters hear that the request ended (suffix keeps its output)
    return s.tokens, s.id_last, s.n_drafted, s.n_accepted


def prompt_of(session, i: int) -> list[int]:
    return session.engine.tokenizer.encode(PROMPTS[i], add_special=True, parse_special=True)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("chain", CHAINS)
def test_a_state_put_into_a_fresh_session_continues_as_its_origin(chains, chain):
    origin, fresh = chains[chain](), chains[chain]()
    generate_on(origin, 1, prompt_of(origin, 3), 20)  # the other sequence's share of the shared state
    tokens, id_last, *_ = generate_on(origin, 0, prompt_of(origin, 0), 40)
    state, n_vocab = origin.chain.save_state(0), origin.engine.tokenizer.n_vocab
    fresh.engine.ctx.restore_seq(0, origin.engine.ctx.seq_state(0))
    fresh.chain.restore_state(0, state, n_vocab)
    assert_same(fresh.chain.save_state(0), state)
    again = tokens + [id_last]
    expected = generate_on(origin, 0, again, 24, n_cached=len(tokens))
    assert expected[2] > 0  # it drafted
    assert generate_on(fresh, 0, again, 24, n_cached=len(tokens)) == expected


@pytest.mark.parametrize("chain", CHAINS)
def test_every_entry_of_a_state_is_checked(chains, chain):
    """Each entry left out, or replaced by an array of another kind, is a StateError; the sequence is then forgotten
    and the whole state still restores."""
    origin, fresh = chains[chain](), chains[chain]()
    generate_on(origin, 0, prompt_of(origin, 0), 30)
    state, n_vocab = origin.chain.save_state(0), origin.engine.tokenizer.n_vocab
    for key in state:
        for broken in ({k: v for k, v in state.items() if k != key},
                       {**state, key: np.zeros((2, 2, 2), dtype=np.float32)}):
            with pytest.raises(StateError):
                fresh.chain.restore_state(0, broken, n_vocab)
            fresh.chain.forget(0)
    fresh.chain.restore_state(0, state, n_vocab)
    assert_same(fresh.chain.save_state(0), state)


def test_forget_empties_a_sequence_and_leaves_the_others(chains):
    session = chains["draft-simple"]()
    generate_on(session, 0, prompt_of(session, 0), 12)
    generate_on(session, 1, prompt_of(session, 1), 12)
    other = session.chain.save_state(1)
    session.chain.forget(0)
    assert session.chain.slot_info(0) == {"draft-simple": {"n_kv": 0}}
    assert_same(session.chain.save_state(1), other)


def test_a_drafter_without_the_methods_refuses():
    class Bare(Drafter):
        name = "bare"

        def draft(self, params):
            pass

    with pytest.raises(StateUnsupported, match="'bare' does not implement save_state"):
        Bare().save_state(0)
    with pytest.raises(StateUnsupported):
        Bare().restore_state(0, {}, 10)


def test_a_bfloat16_cache_round_trips_and_a_float32_server_refuses_it(tiny_model_path, tmp_path):
    """bf16 (CUDA's KV dtype, here on the CPU) travels as its 16-bit patterns; a file of another KV dtype is a
    StateError naming it."""
    def session(dtype: str):
        spec = SpecParams(types=["ngram-mod"], draft_max=6, ngram_mod_n_match=3, ngram_mod_n_min=1)
        return open_session(EngineOptions(model=str(tiny_model_path), n_ctx=256, device="cpu", dtype=dtype,
                                          spec=spec))

    saved = session("bf16")
    tokens, *_ = generate_on(saved, 0, prompt_of(saved, 0), 12)
    path = tmp_path / "bf16.slot"
    save_slot(saved, 0, tokens, path)
    restored = session("bf16")
    with open(path, "rb") as f:
        assert restore_slot(restored, 0, f) == tokens
    for (k, v), (k2, v2) in zip(saved.engine.ctx.kv, restored.engine.ctx.kv):
        n = len(tokens)
        assert k.dtype == torch.bfloat16 and torch.equal(k[0, :, :n], k2[0, :, :n])
        assert torch.equal(v[0, :, :n], v2[0, :, :n])
    with open(path, "rb") as f, pytest.raises(StateError, match="kv_dtype"):
        restore_slot(session("f32"), 0, f)
