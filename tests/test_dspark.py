"""draft-dspark: DFlash drafters with DSpark's Markov (and confidence) head in llama.cpp's layout, written with gguf's
writer (tests/tiny_dflash.py plus markov_w1 / markov_w2 / conf_proj): every draft is the reference block's rows
biased by a Markov chain computed here from the file's weights (anchor-first and not, stopped by the confidence
under --draft-p-min), one forward per draft; greedy output equals plain, alone and chained with ngram-mod, with
and without a cached prompt prefix; the type comes from the file; bad combinations are clear errors."""

from __future__ import annotations

import pytest
import torch

from spec_cli.errors import UsageError
from spec_cli.runtime.draft_files import draft_kind
from tests.draft_recorder import record_drafts
from tests.test_dflash import make_session, plain_outputs, target_path  # noqa: F401 (fixtures)
from tests.test_eagle3 import PROMPTS, run_all, target_features
from tests.tiny_dflash import MASK, reference_block, reference_fuse, write_tiny_dflash, write_tiny_dspark


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


@pytest.mark.parametrize("n_seq", [1, 4])
def test_chained_with_ngram_mod_and_a_cached_prefix_it_equals_plain(target_path, plain_outputs, tmp_path,  # noqa: F811
                                                                     n_seq):
    """ngram-mod,draft-dspark for one and four sequences; then a request reusing the first's prompt prefix from the
    KV cache (the server's prompt cache): the drafter's cache is cut where the prefix ends."""
    tiny, _ = write_tiny_dspark(tmp_path / "dspark.gguf", target_path)
    session = make_session(target_path, tiny.path, "ngram-mod,draft-dspark", n_seq=n_seq, draft_max=8)
    assert run_all(session, PROMPTS[:n_seq]) == plain_outputs[:n_seq]
    plain = make_session(target_path, None, "")
    second = PROMPTS[0][:6] + PROMPTS[2]
    assert run_all(plain, [PROMPTS[0]]) == plain_outputs[:1]
    assert run_all(session, [second], n_cached=6) == run_all(plain, [second], n_cached=6)
    assert session.chain.stats["draft-dspark"].n_gen_tokens > 0
