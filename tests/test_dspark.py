"""draft-dspark: DFlash drafters with DSpark's Markov (and confidence) head in llama.cpp's layout, written with gguf's
writer (tests/tiny_dflash.py plus markov_w1 / markov_w2 / conf_proj): every draft is the reference block's rows
biased by a Markov chain computed here from the file's weights (anchor-first and not, stopped by the confidence
under --draft-p-min), one forward per draft; greedy output equals plain; the type comes from the file; bad
combinations are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spec_cli.errors import UsageError
from spec_cli.runtime.draft_files import draft_kind
from tests.draft_recorder import record_drafts
from tests.test_dflash import make_session, plain_outputs, target_path  # noqa: F401 (fixtures)
from tests.test_eagle3 import PROMPTS, run_all, target_features
from tests.tiny_dflash import (
    MASK,
    H,
    reference_block,
    reference_fuse,
    write_tiny_dflash,
)

RANK = 32


def write_tiny_dspark(path, target, anchor_first: bool | None = True, confidence: bool = True, seed: int = 5,
                      n_draft: int | None = 150, scale: float = 0.5):
    """A random DSpark drafter (anchor_first None: no dflash.sample_from_anchor key) and its Markov weights
    (w1 [V, R], w2 [rows, R], conf [1, H + R] and its bias, the w2 scale)."""
    rng = np.random.default_rng(seed + 100)
    V, rows = 307, n_draft or 307
    markov = {"markov_w1.weight": rng.standard_normal((V, RANK)).astype(np.float32),
              "markov_w2.weight": (3.0 * rng.standard_normal((rows, RANK)) / np.sqrt(RANK)).astype(np.float32),
              "markov_w2.scale": np.array([scale], dtype=np.float32)}
    if confidence:
        markov["conf_proj.weight"] = (rng.standard_normal((1, H + RANK)) / np.sqrt(H + RANK)).astype(np.float32)
        markov["conf_proj.bias"] = np.array([0.3], dtype=np.float32)
    keys = {} if anchor_first is None else {"dflash.sample_from_anchor": anchor_first}
    tiny = write_tiny_dflash(path, target, seed=seed, n_draft=n_draft, extra_keys=keys, extra_tensors=markov)
    return tiny, {k: torch.tensor(v) for k, v in markov.items()}


def reference_draft(tiny, markov, lm, prompt, id_last, n, anchor_first, p_min=0.0) -> list[int]:
    """The reference block's rows, each biased by scale * w2 @ w1[the greedy token before it], read greedily up to
    the first whose confidence sigmoid(conf . [normed row; w1[prev]] + b) is below p_min."""
    first = 0 if anchor_first else 1
    g = reference_fuse(tiny, target_features(lm, tiny.layers, prompt))
    normed, logits = reference_block(tiny, g, [id_last] + [MASK] * (n - 1 + first))
    rows = torch.tensor(tiny.d2t) if tiny.d2t is not None else torch.arange(logits.shape[1])
    prev, drafts = id_last, []
    for i in range(first, first + n):
        e = markov["markov_w1.weight"][prev]
        col = logits[i].clone()
        col[rows] += markov["markov_w2.scale"][0] * (markov["markov_w2.weight"] @ e)
        if p_min > 0:
            w, b = markov["conf_proj.weight"][0], markov["conf_proj.bias"][0]
            conf = torch.sigmoid(w @ torch.cat((normed[i], e)) + b)
            if conf < p_min:
                break
        prev = int(col.argmax())
        drafts.append(prev)
    return drafts


@pytest.mark.parametrize("anchor_first", [True, False, None], ids=["anchor-first", "bonus-anchor", "key-absent"])
@pytest.mark.parametrize("n_seq", [1, 4])
def test_every_draft_is_the_markov_biased_reference_block(target_path, plain_outputs, tmp_path,  # noqa: F811
                                                          anchor_first, n_seq):
    tiny, markov = write_tiny_dspark(tmp_path / "dspark.gguf", target_path, anchor_first)
    assert draft_kind(tiny.path) == "draft-dspark"
    session = make_session(target_path, tiny.path, "draft-dspark", n_seq=n_seq, verify="match", draft_max=8)
    drafter = session.chain.drafters[-1]
    assert drafter.n_max == (8 if anchor_first is not False else 7)  # block_size 8: all of it anchor-first
    calls = record_drafts(session)
    n_decode = drafter.ctx.n_decode
    assert run_all(session, PROMPTS[:n_seq]) == plain_outputs[:n_seq]
    assert calls and max(len(d) for _, _, d in calls) == drafter.n_max
    assert drafter.ctx.n_decode - n_decode == session.chain.stats["draft-dspark"].n_call_draft  # one forward a call
    lm = session.engine.target
    first = anchor_first is not False
    assert all(drafted == reference_draft(tiny, markov, lm, prompt, id_last, len(drafted), first)
               for prompt, id_last, drafted in calls)


def test_the_confidence_head_stops_the_draft_under_p_min(target_path, tmp_path):  # noqa: F811
    tiny, markov = write_tiny_dspark(tmp_path / "dspark.gguf", target_path, n_draft=None)
    session = make_session(target_path, tiny.path, "draft-dspark", verify="match", draft_max=8)
    drafter = session.chain.drafters[-1]
    drafter.params.draft_p_min = 0.55
    calls, draft = [], drafter.draft

    def recorded(params):  # (prompt, id_last, block length, draft) of every call
        draft(params)
        calls.extend((list(p.prompt), p.id_last, min(p.n_max, drafter.n_max), list(p.result)) for p in params)

    drafter.draft = recorded
    for prompt in PROMPTS[:2]:
        run_all(session, [prompt])
    assert any(len(d) < n for _, _, n, d in calls) and any(len(d) == n for _, _, n, d in calls)
    lm = session.engine.target
    assert all(drafted == reference_draft(tiny, markov, lm, prompt, id_last, n, True, p_min=0.55)
               for prompt, id_last, n, drafted in calls)


def test_bad_dspark_combinations_are_clear_errors(target_path, tmp_path):  # noqa: F811
    no_conf, _ = write_tiny_dspark(tmp_path / "noconf.gguf", target_path, confidence=False)
    with pytest.raises(UsageError, match="no confidence head"):
        make_session(target_path, no_conf.path, "draft-dspark", draft_p_min=0.5)
    assert make_session(target_path, no_conf.path, "draft-dspark").chain.names == ["draft-dspark"]  # p-min 0
    plain = write_tiny_dflash(tmp_path / "plain.gguf", target_path)
    with pytest.raises(UsageError, match="is a DFlash draft .* not a DSpark draft"):
        make_session(target_path, plain.path, "draft-dspark")
    with pytest.raises(UsageError, match="is a DSpark draft .* not a DFlash draft"):
        make_session(target_path, no_conf.path, "draft-dflash")
    with pytest.raises(UsageError, match="needs a DSpark draft"):
        make_session(target_path, None, "draft-dspark")
