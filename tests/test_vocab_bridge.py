"""A draft model with another vocabulary than the target's drafts through the tokens they share: the bridge's
mapping (bytes, control texts, splits), greedy output == plain (one and four sequences), rejection sampling keeps
the target's distribution, drafts end at a token without a counterpart and the statistics count them; a pair that
shares too little is refused with the figure, through the installed `spec-cli`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from spec_cli.model.gguf_file import GGUFFile
from spec_cli.model.sampling import SamplingParams
from spec_cli.speculative.vocab_bridge import VocabBridge, vocab_bridge
from spec_cli.text.tokenizer import Tokenizer
from tests.test_generate import GREEDY, N_PREDICT, PROMPTS, make_session, run
from tests.test_generate_sampling import exact_two_token_distribution
from tests.tiny_gguf import N_VOCAB, RENAMED, REVERSED, write_tiny_gguf

SCRIPT = Path(sys.executable).with_name("spec-cli")


def tokenizer(path) -> Tokenizer:
    return Tokenizer.from_metadata(GGUFFile(path).metadata)


def test_the_bridge_maps_tokens_by_their_bytes_and_control_texts(tiny_model_path, tiny_other_vocab_path):
    target, draft = tokenizer(tiny_model_path), tokenizer(tiny_other_vocab_path)
    bridge = vocab_bridge(target, draft, GGUFFile(tiny_other_vocab_path).metadata)
    assert isinstance(bridge, VocabBridge) and bridge.n_shared == N_VOCAB - len(RENAMED)
    for t in (40, 300, target.eos_id):  # a byte, a merge, <|im_end|> (a control token, by its text)
        (d,) = bridge.draft_tokens(t)
        assert d == REVERSED.index(t) and bridge.to_target[d] == t
    assert bridge.to_target[REVERSED.index(281)] == -1  # 'Ġbx' is no target token
    # 'Ġb' has no counterpart: the draft reads its bytes, ' ' and 'b' (tokens 0-255 are the bytes in either order)
    assert target.token_to_piece(281) == b" b"
    assert bridge.draft_tokens(281) == (REVERSED.index(ord(" ")), REVERSED.index(ord("b")))


def test_one_vocabulary_needs_no_bridge(tiny_model_path, tiny_draft_path):
    assert vocab_bridge(tokenizer(tiny_model_path), tokenizer(tiny_draft_path), GGUFFile(tiny_draft_path).metadata) \
        is None
    assert make_session(tiny_model_path, "draft-simple", draft=tiny_draft_path).engine.draft_bridge is None


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_path):
    session = make_session(tiny_model_path)
    return [run(session, prompt)[0] for prompt in PROMPTS]


def test_greedy_through_the_bridge_equals_plain_one_sequence(tiny_model_path, tiny_other_vocab_path, plain_outputs):
    session = make_session(tiny_model_path, "draft-simple", draft=tiny_other_vocab_path)
    accepted = 0
    for prompt, expected in zip(PROMPTS, plain_outputs):
        out, seq = run(session, prompt)
        assert out == expected
        accepted += seq.n_accepted
    st = session.chain.stats["draft-simple"]
    assert accepted > 0 and st.n_mapped >= st.n_gen_tokens > 0
    assert st.n_unmapped > 0  # some draft ended at a renamed token


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "auto"])
def test_greedy_through_the_bridge_equals_plain_four_sequences(tiny_model_path, tiny_other_vocab_path, plain_outputs,
                                                               adaptive):
    session = make_session(tiny_model_path, "draft-simple", draft=tiny_other_vocab_path, n_seq=4, adaptive=adaptive)
    gen = session.generator()
    outs = {seq: list(gen.start(seq, prompt, GREEDY, N_PREDICT).tokens) for seq, prompt in enumerate(PROMPTS)}
    seqs = dict(gen.active)
    while emitted := gen.step():
        for e in emitted:
            outs[e.seq].extend(e.tokens)
    assert [outs[seq] for seq in range(len(PROMPTS))] == plain_outputs
    assert sum(s.n_accepted for s in seqs.values()) > 0


def test_rejection_sampling_through_the_bridge_keeps_the_target_distribution(tiny_model_path, tmp_path):
    """A close draft (perturbed weights) over the reversed vocabulary, one of the likely tokens renamed (q = 0 there):
    the first two tokens' frequencies match the exact target distribution."""
    draft = write_tiny_gguf(tmp_path / "close-reversed.gguf", seed=0, perturb=0.15, token_order=REVERSED,
                            vocab_changes={"rename_tokens": [61]})
    params = dict(temp=1.5, top_k=3, top_p=1.0, min_p=0.0)
    session = make_session(tiny_model_path, "draft-simple", draft=draft, verify="rejection", draft_max=3)
    prompt = PROMPTS[1]
    exact = exact_two_token_distribution(session, prompt, SamplingParams(**params))
    n, counts, accepted, drafted = 600, Counter(), 0, 0
    for seed in range(n):
        out, seq = run(session, prompt, 4, sampling=SamplingParams(seed=seed, **params))
        counts[tuple(out[:2])] += 1
        accepted += seq.n_accepted
        drafted += seq.n_drafted
    tv = 0.5 * sum(abs(counts[k] / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    assert tv < 0.12, f"total variation {tv:.3f}"
    assert drafted > 0 and 0 < accepted < drafted


def spec_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_cli_drafts_with_another_vocabulary_and_counts_the_mapped_tokens(tiny_model_path, tiny_other_vocab_path):
    common = ["-m", str(tiny_model_path), "-p", "abc abc abc abc abc", "-n", "32", "--temp", "0", "--json"]
    plain = spec_cli("run", *common)
    spec = spec_cli("speculative-simple", *common, "-md", str(tiny_other_vocab_path), "--draft-max", "4",
                    "--draft-p-min", "0")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    assert out["content"] == json.loads(plain.stdout)["content"]
    [st] = out["drafters"]
    assert st["n_acc_tokens"] > 0 and st["n_mapped"] >= st["n_gen_tokens"]
    assert out["draft_vocabulary"]["shared_tokens"] == N_VOCAB - len(RENAMED)
    text = spec_cli("speculative-simple", *common[:-1], "-md", str(tiny_other_vocab_path), "--log-format", "text")
    assert "#mapped tokens = " in text.stderr + text.stdout


def test_cli_drafts_where_the_draft_tokens_outnumber_the_context(tiny_model_path, tiny_other_vocab_path):
    """' b' is one target token and two draft tokens (281 has no counterpart): 60 of them are 119 draft positions of a
    128-position context, so the draft cache holds the last window of the history only; the output is plain's."""
    common = ["-m", str(tiny_model_path), "-p", " ".join(["b"] * 60), "-n", "40", "-c", "128", "--temp", "0", "--json"]
    plain = spec_cli("run", *common)
    spec = spec_cli("speculative-simple", *common, "-md", str(tiny_other_vocab_path), "--draft-max", "8",
                    "--draft-p-min", "0")
    assert spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    assert out["content"] == json.loads(plain.stdout)["content"] and out["drafters"][0]["n_acc_tokens"] > 0


def test_cli_refuses_a_pair_that_shares_too_little(tiny_model_path, tmp_path):
    alien = write_tiny_gguf(tmp_path / "alien.gguf", seed=0, vocab_changes={"rename_tokens": range(N_VOCAB)})
    r = spec_cli("speculative-simple", "-m", str(tiny_model_path), "-md", str(alien), "-p", "hi", "-n", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "too few" in r.stderr and "0 of its 304 most common tokens (0.0 %" in r.stderr
