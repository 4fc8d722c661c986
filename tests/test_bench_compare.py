"""Stored-baseline comparison: rows matched by parameters (not position or path), medians compared, a regression
needs the percentage threshold, sample ranges apart and enough samples for that to mean something; the report
warns that it is unpaired; missing and new rows are reported, not failed."""

from __future__ import annotations

import json

import pytest

from spec_cli.bench.compare import (
    UNPAIRED,
    compare,
    comparison_verdict,
    enough_samples,
    format_comparison,
    has_regression,
    load_results,
    row_key,
)
from spec_cli.errors import SpecCliError


def row(test="tg", n_gen=128, samples_ts=(100.0, 100.0, 100.0), path="/a/models/qwen.gguf", **extra):
    r = {"model_filename": path, "backends": "CPU", "dtype": "f32", "n_batch": 2048, "n_ubatch": 512,
         "n_threads": 2, "n_gpu_layers": -1, "flash_attn": -1, "test": test, "n_prompt": 0, "n_gen": n_gen,
         "n_depth": 0, "samples_ts": list(samples_ts), "samples_ns": [1] * len(samples_ts)}
    r.update(extra)
    return r


def statuses(result):
    return [(r.name, r.status) for r in result]


def test_equal_runs_pass():
    base = [row(), row(test="pp", n_gen=0, n_prompt=512)]
    result = compare([dict(r) for r in base], base, 5.0)
    assert [r.status for r in result] == ["ok", "ok"] and not has_regression(result)
    assert all(r.ratio == 1.0 for r in result)


def test_clear_slowdown_fails():
    result = compare([row(samples_ts=(80.0, 81.0, 79.0))], [row(samples_ts=(100.0, 101.0, 99.0))], 5.0)
    assert [r.status for r in result] == ["regression"] and has_regression(result)
    assert result[0].ratio == pytest.approx(0.8) and result[0].apart
    assert comparison_verdict(result, 5.0).startswith("FAIL: 1 row(s)")
    assert format_comparison(result).startswith(UNPAIRED)


def test_slowdown_within_threshold_passes():
    result = compare([row(samples_ts=(97.0, 97.0))], [row(samples_ts=(100.0, 100.0))], 5.0)
    assert [r.status for r in result] == ["ok"]


def test_slowdown_within_noise_passes():
    # medians 100 -> 85 (15 % slower) but the samples scatter by +-10 in each run: the ranges overlap
    now, then = (75.0, 85.0, 95.0), (90.0, 100.0, 110.0)
    result = compare([row(samples_ts=now)], [row(samples_ts=then)], 5.0)
    assert result[0].status == "ok" and result[0].apart is False
    # the same medians with tight samples is a regression
    assert compare([row(samples_ts=(84.0, 85.0, 86.0))], [row(samples_ts=(99.0, 100.0, 101.0))], 5.0)[0].status == (
        "regression")


def test_one_slow_baseline_sample_keeps_the_ranges_together():
    # the medians are 25 % apart and beyond the half-ranges (20 + 0), but a baseline sample was as slow as now's
    result = compare([row(samples_ts=(75.0, 75.0, 75.0))], [row(samples_ts=(100.0, 100.0, 60.0))], 5.0)
    assert result[0].status == "ok" and result[0].apart is False


def test_too_few_samples_never_fail():
    # all now below all then by chance: 1 in C(m + n, m) for one distribution; 3 and 3 is the least at 5 %
    assert [enough_samples(m, n) for m, n in ((1, 1), (2, 2), (2, 4), (3, 3), (1, 19), (5, 5))] == [
        False, False, False, True, True, True]
    result = compare([row(samples_ts=(50.0, 50.0))], [row(samples_ts=(100.0, 100.0))], 5.0)
    assert result[0].status == "few samples" and not has_regression(result)
    assert "use -r 3 or more" in comparison_verdict(result, 5.0)


def test_median_ignores_one_disturbed_repetition():
    result = compare([row(samples_ts=(100.0, 100.0, 20.0))], [row(samples_ts=(100.0, 100.0, 100.0))], 5.0)
    assert result[0].status == "ok" and result[0].ratio == 1.0


def test_faster_is_never_a_regression():
    assert compare([row(samples_ts=(200.0,))], [row(samples_ts=(100.0,))], 0.0)[0].status == "ok"


def test_missing_and_new_rows_are_reported_not_failed():
    base = [row(n_gen=128), row(n_gen=64)]
    now = [row(n_gen=128), row(n_gen=32)]
    result = compare(now, base, 5.0)
    assert [r.status for r in result] == ["ok", "new", "missing"] and not has_regression(result)
    assert "tg32" in result[1].name and "tg64" in result[2].name
    assert comparison_verdict(result, 5.0) == "ok: no row slower than 5% with the sample ranges apart"
    lines = format_comparison(result).splitlines()[2:5]
    assert len({len(line) - len(r.status) for line, r in zip(lines, result)}) == 1  # '-' cells keep the alignment


def test_rows_match_by_parameters_not_position_or_directory():
    base = [row(n_gen=64, samples_ts=(50.0,)), row(n_gen=128, samples_ts=(100.0,))]
    now = [row(n_gen=128, samples_ts=(100.0,), path="/other/place/qwen.gguf"), row(n_gen=64, samples_ts=(50.0,))]
    assert [r.status for r in compare(now, base, 1.0)] == ["ok", "ok"]
    assert row_key(row(dtype="bf16")) != row_key(row())
    assert row_key(row(path="/x/other.gguf")) != row_key(row())


def test_speculative_rows_are_keyed_by_their_settings():
    spec = dict(prompt_set="code-edit", temp=0.0, spec_type="ngram-mod", model_draft="", draft_max=8, draft_min=0,
                draft_p_min=0.75, spec_verify="auto", warm=False)
    longer = {**spec, "draft_max": 16}
    base = [row(test="spec", samples_ts=(30.0,) * 3, **spec), row(test="spec", samples_ts=(10.0,) * 3, **longer)]
    now = [row(test="spec", samples_ts=(30.0,) * 3, **spec), row(test="spec", samples_ts=(5.0,) * 3, **longer)]
    result = compare(now, base, 10.0)
    assert [r.status for r in result] == ["ok", "regression"]
    assert "ngram-mod dmax16" in result[1].name


def test_load_json_and_jsonl(tmp_path):
    rows = [row(), row(n_gen=64)]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_results(tmp_path / "a.json") == rows == load_results(tmp_path / "b.jsonl")


@pytest.mark.parametrize("content", ["not json", '[{"no": "fields"}]', "{\"test\": 1}\n{"])
def test_bad_baseline_is_a_one_line_error(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SpecCliError):
        load_results(path)
    with pytest.raises(SpecCliError):
        load_results(tmp_path / "absent.json")
