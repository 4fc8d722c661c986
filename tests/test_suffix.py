"""suffix (SuffixDecoding): continuation frequencies along the matched path, the draft length from the match length
(max_spec_factor, max_depth), min_token_prob, the best-scoring match, earlier requests' outputs shared by every
sequence within a token budget, those outputs in a slot file's state; and through the installed `spec-cli`: lossless,
its flags checked."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from spec_cli.errors import StateError
from spec_cli.speculative.base import DraftParams, SpecParams
from spec_cli.speculative.suffix import SuffixDrafter, TokenStore

SCRIPT = Path(sys.executable).with_name("spec-cli")  # the installed console script
# "1 2 3" three times: followed by "4 5 6", "4 5 7" and "4 8"; the last two after "9 1 2 3", like the pattern
HISTORY = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 5, 7, 9, 1, 2, 3, 4, 8, 9, 1, 2]
ID_LAST = 3
N_CTX_SEQ = 1024  # each sequence's context: more than any history here


def make(n_seq=1, **settings):
    return SuffixDrafter(SpecParams(**{f"suffix_{k}": v for k, v in settings.items()}), n_seq, N_CTX_SEQ)


def draft(drafter, history, id_last, seq=0, n_max=16):
    p = DraftParams(seq=seq, n_max=n_max, pos0=len(history), id_last=id_last, prompt=history)
    drafter.draft([p])
    return p.result


# Over the three occurrences of "1 2 3" (matches of up to 3 tokens) the path is 4 (3/3), 5 (2/3), then 6 and 7 tie at
# 1/3 (the most recent, 7, is taken): a draft of at most 3 tokens (factor 1), score 1 + 2/3 + 1/3 = 2.
# Over the two occurrences of "9 1 2 3" (4 tokens) it is 4 (2/2), then 5 and 8 tie at 1/2 (8, the more recent),
# then 9 and 1 at 1/2 (one occurrence left): 4 tokens, score 2.5, the best.
CASES = [
    (dict(), [4, 8, 9, 1], "the longer match scores 2.5 over 2"),
    (dict(min_token_prob=0.6), [4, 5], "stops below 0.6: the 3-token match's 4 5 (1 + 2/3) beats 4 (1)"),
    (dict(max_spec_factor=0.5), [4, 8], "half the match length: 4 5 6 of 3 tokens gives 1 token, of 4 gives 2"),
    (dict(max_depth=5), [4, 5], "pattern + draft within 5 tokens: a match of 3 may draft 2, of 4 only 1"),
]


@pytest.mark.parametrize("settings,expected,why", CASES, ids=[c[-1] for c in CASES])
def test_the_draft_follows_the_most_frequent_path_of_the_best_match(settings, expected, why):
    drafter = make(**settings)
    drafter.begin(0, HISTORY)
    assert draft(drafter, HISTORY, ID_LAST) == expected


def test_the_draft_is_capped_per_call():
    drafter = make()
    drafter.begin(0, HISTORY)
    # within 2 tokens the 3-token match's 4 5 (1 + 2/3) beats the 4-token match's 4 8 (1 + 1/2)
    assert draft(drafter, HISTORY, ID_LAST, n_max=2) == [4, 5]


def test_the_pattern_itself_is_no_occurrence():
    """The only earlier "1 2 3" continues "1 2 3" (through id_last), with probability 1: the pattern's own place at
    the end, which continues nowhere, does not halve it (a 0.6 threshold would stop it)."""
    drafter = make(min_token_prob=0.6)
    drafter.begin(0, [1, 2])
    assert draft(drafter, [1, 2, 3, 1, 2], 3) == [1, 2, 3]
    assert draft(drafter, [1, 2, 3, 1, 2, 3, 1, 2], 5) == []  # nothing ever followed 5


def test_the_output_grows_with_the_committed_history():
    drafter = make()
    drafter.begin(0, [7, 8])
    assert draft(drafter, [7, 8], 9) == []
    assert draft(drafter, [7, 8, 9, 10, 11, 7, 8], 9) == [10, 11, 7]  # "7 8 9" matched: 3 tokens


def test_earlier_outputs_draft_for_every_sequence_and_request():
    drafter = make(n_seq=2)
    drafter.begin(0, [10, 11, 12])
    drafter.end(0, [20, 21, 22, 23, 24])  # the output of a finished request
    drafter.begin(1, [30])
    assert draft(drafter, [30, 20, 21], 22, seq=1) == [23, 24]  # the output ended after 24
    drafter.begin(0, [40])  # a new request on the first slot too
    assert draft(drafter, [40, 21], 22, seq=0) == [23, 24]


def test_the_requests_own_text_wins_ties_with_earlier_outputs():
    drafter = make()
    drafter.end(0, [1, 2, 3, 50])
    drafter.begin(0, [1, 2, 3, 60, 1, 2])
    assert draft(drafter, [1, 2, 3, 60, 1, 2], 3) == [60, 1, 2]  # both score 1 per token; its own text is longer


def test_no_earlier_outputs_with_a_zero_budget():
    drafter = make(cache_tokens=0)
    drafter.end(0, [20, 21, 22, 23, 24])
    drafter.begin(0, [30])
    assert draft(drafter, [30, 20, 21], 22) == []


def test_the_oldest_outputs_are_dropped_past_the_budget():
    store = TokenStore(budget=8)
    store.add([1, 2, 3, 4, 5])
    store.add([6, 7, 8])
    assert store.n_tokens == 8
    store.add([9, 10])  # 10 > 8: the first output goes
    assert store.n_tokens == 5 and store.buf.tolist() == [6, 7, 8, -1, 9, 10, -1]
    store.add(list(range(100, 120)))  # longer than the budget: its last 8 tokens, alone
    assert store.buf.tolist() == list(range(112, 120)) + [-1]
    drafter = make(cache_tokens=8)
    drafter.end(0, [1, 2, 3, 4, 5])
    drafter.end(0, [6, 7, 8, 9])
    drafter.begin(0, [0])
    assert draft(drafter, [0, 1, 2], 3) == [] and draft(drafter, [0, 6, 7], 8) == [9]


def test_a_match_may_be_the_whole_pattern():
    """A request's first draft: its one-token prompt and id_last matched in an earlier output, two tokens, so a draft
    of two (the factor 1)."""
    drafter = make()
    drafter.end(0, [1, 2, 3, 4])
    drafter.begin(0, [1])
    assert draft(drafter, [1], 2) == [3, 4]


def test_a_restored_store_joins_a_running_one_as_its_oldest():
    """A slot file's earlier outputs: restored into a fresh drafter they are the store as it was; into a running one,
    those it lacks go before its own, and the budget drops them first."""
    saved = make(cache_tokens=8)
    saved.end(0, [1, 2, 3])
    saved.end(0, [4, 5])
    state = saved.save_state(0)
    fresh = make(cache_tokens=8)
    for lengths in ([3, 1], [3, 3], [6, -1], [0, 5]):  # lengths that do not split the 5 tokens
        with pytest.raises(StateError, match="does not split"):
            fresh.restore_state(0, {**state, "output_lengths": np.array(lengths)}, n_vocab=100)
    with pytest.raises(StateError, match="outside"):
        fresh.restore_state(0, state, n_vocab=5)  # token 5 is no token of a 5-token vocabulary
    fresh.restore_state(0, state, n_vocab=100)
    assert fresh.save_state(0)["outputs"].tolist() == [1, 2, 3, 4, 5]
    # [4, 5] is held already; [1, 2, 3] joins within 16 tokens, not within 8
    for budget, expected in ((16, [1, 2, 3, -1, 4, 5, -1, 6, 7, 8, 9, -1]), (8, [4, 5, -1, 6, 7, 8, 9, -1])):
        running = make(cache_tokens=budget)
        running.end(0, [4, 5])
        running.end(0, [6, 7, 8, 9])
        running.restore_state(0, state, n_vocab=100)
        assert running.outputs.buf.tolist() == expected


def spec_cli_json(command, model, *flags):
    r = subprocess.run([str(SCRIPT), command, "-m", str(model), "-p", "one two three one two three one two",
                        "-n", "40", "--temp", "0", "--json", "-c", "256", *flags], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("draft_max", ["6", "auto"])
def test_cli_suffix_is_lossless_and_drafts(tiny_model_path, draft_max):
    plain = spec_cli_json("run", tiny_model_path)
    out = spec_cli_json("speculative-simple", tiny_model_path, "--spec-type", "suffix", "--draft-max", draft_max,
                        "--spec-suffix-min-token-prob", "0.05")
    assert out["content"] == plain["content"]
    stats = {s["name"]: s for s in out["drafters"]}["suffix"]
    assert stats["n_proposed"] > 0, "no draft: the test proves nothing"
    if draft_max != "auto":  # auto verifies them where its timing of this machine says they pay (test_adaptive.py)
        assert stats["n_acc_tokens"] > 0, "nothing accepted: the test proves nothing"


@pytest.mark.parametrize("flag,value", [("--spec-suffix-min-token-prob", "1.5"), ("--spec-suffix-max-depth", "1"),
                                        ("--spec-suffix-cache-tokens", "-1"), ("--spec-suffix-max-spec-factor", "x")])
def test_cli_refuses_bad_suffix_settings(tiny_model_path, flag, value):
    r = subprocess.run([str(SCRIPT), "speculative-simple", "-m", str(tiny_model_path), "-p", "x", "--spec-type",
                        "suffix", flag, value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and flag in r.stderr and "Traceback" not in r.stderr
