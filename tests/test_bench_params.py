"""Bench parameters: llama-bench's value syntax (lists, repeats, +step and *mult ranges) and the instance order
(Cartesian product, model outermost, depth innermost, tests pp -> tg -> pg; speculative cases after the plain run)."""

from __future__ import annotations

import pytest

from spec_cli.bench.params import BenchParams, chain_types, from_flags, instances, spec_chains
from spec_cli.errors import UsageError
from spec_cli.model.catalog import load_registry
from spec_cli.options import BENCH_OPTIONS, read_flags, spec_types


def swept(name: str, *values: str) -> list:
    """A sweep's flag given `values`, as bench reads it."""
    return BENCH_OPTIONS[name].values(list(values))


def params(flags: dict) -> BenchParams:
    """Bench's parameters from its flags as typed."""
    return from_flags(read_flags(BENCH_OPTIONS, flags))


@pytest.mark.parametrize("text,expected", [
    ("5", [5]),
    ("0", [0]),
    ("1-4", [1, 2, 3, 4]),
    ("3-3", [3]),
    ("1-32+4", [1, 5, 9, 13, 17, 21, 25, 29]),  # 33 overshoots: last is included only when reached exactly
    ("0-8+4", [0, 4, 8]),
    ("1-64*2", [1, 2, 4, 8, 16, 32, 64]),
    ("1-16*2", [1, 2, 4, 8, 16]),
    ("1-10*3", [1, 3, 9]),
    ("2-5*2", [2, 4]),
    ("1,2,4", [1, 2, 4]),
    ("8,1-3", [8, 1, 2, 3]),  # order as written, no sorting
    ("4,4", [4, 4]),
])
def test_parse_values(text, expected):
    assert swept("n_prompt", text) == expected


@pytest.mark.parametrize("text", ["4-1", "1-8*1", "0-8*2", "1-8+0", "a", "1-", "", "-3", "1-8/2", "1.5", "1,,2"])
def test_parse_values_rejects(text):
    with pytest.raises(UsageError, match="-p must be"):
        swept("n_prompt", text)


def test_repeated_flags_concatenate_and_defaults_apply():
    assert swept("n_prompt", "1,2", "4-6") == [1, 2, 4, 5, 6]
    assert BENCH_OPTIONS["n_prompt"].values(None) is None and params({}).n_prompt == [512]
    assert swept("n_gpu_layers", "-1,0-2", "all,auto,8-16*2") == [-1, 0, 1, 2, -1, -1, 8, 16]
    assert params({}).n_gpu_layers_draft == [-1]
    with pytest.raises(UsageError, match="-ngld"):
        swept("n_gpu_layers_draft", "-3")
    with pytest.raises(UsageError, match="-p"):
        swept("n_prompt", "-1")


def test_pairs_flash_attn_and_spec_chains():
    assert swept("n_pg", "512,128", "1,2") == [(512, 128), (1, 2)]
    with pytest.raises(UsageError, match="-pg must be PP,TG"):
        swept("n_pg", "512")
    assert swept("flash_attn", "on,off", "auto") == [1, 0, -1]
    with pytest.raises(UsageError, match="-fa"):
        swept("flash_attn", "maybe")
    with pytest.raises(UsageError, match="--spec-type"):
        swept("spec_type", "ngram-nope")


def test_spec_type_string_is_one_chain_as_in_every_command():
    # `--spec-type ngram-mod,mtp` is the chain ngram-mod then mtp in run/server/speculative-simple: in bench too
    assert swept("spec_type", "ngram-mod,mtp") == [",".join(spec_types("ngram-mod,mtp"))] == ["ngram-mod,draft-mtp"]
    assert chain_types(params({"spec_type": ["ngram-mod,mtp"]}).spec_type[0]) == ["ngram-mod", "draft-mtp"]
    # sweep values: ';' or the flag repeated; llama.cpp's priority order in each chain, aliases resolved, none and
    # repeats dropped
    chains = swept("spec_type", "draft,ngram-mod;ngram-simple", "none;ngram-simple", "ngram-mod,draft")
    assert spec_chains(chains) == ["ngram-mod,draft-simple", "ngram-simple"]
    with pytest.raises(UsageError, match="joined with ','"):  # the old '+' syntax says what replaced it
        swept("spec_type", "ngram-mod+draft-simple")


def _shape(inst):
    return (inst.model, inst.n_batch, inst.n_threads, inst.test.kind, inst.test.n_prompt, inst.test.n_gen,
            inst.test.n_depth)


def test_instance_order_is_llama_bench_nesting():
    p = BenchParams(model=["a", "b"], n_prompt=[8, 16], n_gen=[4], n_pg=[(2, 3)], n_depth=[0, 32], n_batch=[64, 128],
                    n_threads=[1, 2])
    got = [_shape(i) for i in instances(p)]
    per_depth = lambda d: [("pp", 8, 0, d), ("pp", 16, 0, d), ("tg", 0, 4, d), ("pg", 2, 3, d)]  # noqa: E731
    expected = [(m, b, t, *test) for m in "ab" for b in (64, 128) for t in (1, 2) for d in (0, 32)
                for test in per_depth(d)]
    assert got == expected
    assert len(got) == 2 * 2 * 2 * 2 * 4
    # the first four rows written out, so the nesting is checked literally too
    assert got[:5] == [("a", 64, 1, "pp", 8, 0, 0), ("a", 64, 1, "pp", 16, 0, 0), ("a", 64, 1, "tg", 0, 4, 0),
                       ("a", 64, 1, "pg", 2, 3, 0), ("a", 64, 1, "pp", 8, 0, 32)]


def test_engine_fields_nest_in_llama_bench_order():
    p = BenchParams(model=["m"], dtype=["f32", "bf16"], n_gpu_layers=[0, 99], n_ubatch=[256, 512], flash_attn=[0, 1],
                    n_prompt=[8], n_gen=[0])
    got = [(i.dtype, i.n_gpu_layers, i.n_ubatch, i.flash_attn) for i in instances(p)]
    assert got[:4] == [("f32", 0, 256, 0), ("f32", 0, 256, 1), ("f32", 0, 512, 0), ("f32", 0, 512, 1)]
    assert got[4] == ("f32", 99, 256, 0) and got[8] == ("bf16", 0, 256, 0)
    assert len(set(got)) == len(got) == 16


def test_zero_lengths_make_no_test():
    p = BenchParams(n_prompt=[0, 8], n_gen=[0], n_pg=[(0, 0)])
    assert [(i.test.kind, i.test.n_prompt) for i in instances(p)] == [("pp", 8)]


def test_verify_cost_test_per_depth():
    p = BenchParams(n_depth=[0, 64], random_tests=False, verify_cost=8)
    assert [(i.test.kind, i.test.n_depth, i.test.verify_k) for i in instances(p)] == [("verify", 0, 8),
                                                                                      ("verify", 64, 8)]


def test_speculative_cases_follow_their_plain_run():
    p = BenchParams(model=["m"], random_tests=False, spec_type=["ngram-simple", "draft-simple"],
                    model_draft=["d1", "d2"], draft_max=[2, 4], prompt_sets=["qa", "chat"], n_gen=[16])
    tests = [i.test for i in instances(p)]
    for set_name in ("qa", "chat"):
        mine = [t for t in tests if t.prompt_set == set_name]
        assert mine[0].spec_type == "none"  # plain first: the speed-up reference
        got = [(t.spec_type, t.model_draft, t.draft_max) for t in mine[1:]]
        # ngram-simple does not use the draft model: one run per draft length, not one per draft model
        assert got == [("ngram-simple", "", 2), ("ngram-simple", "", 4), ("draft-simple", "d1", 2),
                       ("draft-simple", "d1", 4), ("draft-simple", "d2", 2), ("draft-simple", "d2", 4)]
    assert [t.prompt_set for t in tests].index("chat") == 7


def test_chain_selection_is_a_sweep_axis():
    p = params({"spec_type": ["ngram-simple,ngram-cache"], "spec_select": ["priority,gain"], "n_gen": ["8"]})
    assert [i.test.spec_select for i in instances(p)] == ["priority", "priority", "gain"]  # the plain run first


def test_mtp_rollback_is_a_sweep_axis_of_chains_with_draft_mtp_only():
    p = params({"spec_type": ["ngram-simple", "draft-mtp"], "spec_mtp_rollback": ["partial,reeval"],
                    "n_gen": ["8"]})
    got = [(i.test.spec_type, i.test.spec_mtp_rollback) for i in instances(p)][1:]
    assert got == [("ngram-simple", "partial"), ("draft-mtp", "partial"), ("draft-mtp", "reeval")]


def test_suffix_settings_are_sweep_axes_of_chains_with_suffix_only():
    p = params({"spec_type": ["ngram-mod;suffix"], "suffix_max_depth": ["16,32"],
                "suffix_min_token_prob": ["0.1,0.3"], "n_gen": ["8"]})
    got = [(i.test.spec_type, dict(i.test.ngram).get("suffix_max_depth"),
            dict(i.test.ngram).get("suffix_min_token_prob")) for i in instances(p)][1:]
    assert got == [("ngram-mod", None, None), ("suffix", 16, 0.1), ("suffix", 16, 0.3), ("suffix", 32, 0.1),
                   ("suffix", 32, 0.3)]


def test_p_min_sweeps_numbers_and_auto():
    p = params({"spec_type": ["draft-simple"], "model_draft": ["small.gguf"], "draft_p_min": ["0.75,auto"],
                "n_gen": ["8"]})
    assert [i.test.draft_p_min for i in instances(p)][1:] == [0.75, "auto"]


def test_synthetic_acceptance_adds_a_test_per_rate():
    p = params({"spec_type": ["ngram-mod"], "spec_accept": ["0.9,0.50/0.2", "0.9"], "draft_max": ["4,auto"],
                "n_gen": ["8"]})
    got = [(i.test.spec_type, i.test.spec_accept, i.test.draft_max) for i in instances(p)][1:]
    assert got == [("ngram-mod", None, 4), ("ngram-mod", None, "auto"), ("synthetic", "0.9", 4),
                   ("synthetic", "0.9", "auto"), ("synthetic", "0.5/0.2", 4), ("synthetic", "0.5/0.2", "auto")]


def test_from_flags_selects_test_kinds(tmp_path):
    plain = params({})
    assert plain.random_tests and not plain.speculative and plain.n_prompt == [512] and plain.n_gen == [128]
    sweep = params({"spec_type": ["ngram-mod"], "n_gen": ["32"]})
    # in a sweep -n is the length per prompt, not a tg test; the default prompt set is code-edit
    assert not sweep.random_tests and sweep.n_gen == [32] and sweep.prompt_sets == ["code-edit"]
    assert params({"spec_type": ["ngram-mod"], "n_prompt": ["64"]}).random_tests
    assert not params({"verify_cost": 4}).random_tests
    assert params({"verify_cost": 4, "n_gen": ["8"]}).random_tests
    md = params({"model_draft": ["small.gguf"]})
    assert md.spec_type == ["draft-simple"]  # -md alone sweeps draft-simple
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"id": 1, "prompt": "x"}\n')
    assert params({"prompt_set": ["qa"], "prompts": [str(mine)]}).prompt_sets == ["qa", str(mine)]


@pytest.mark.parametrize("flags,message", [
    ({"n_batch": ["0"]}, "-b must be >= 1"),
    ({"draft_p_min": ["1.5"]}, "p-min"),
    ({"spec_verify": ["sometimes"]}, "spec-verify"),
    ({"spec_select": ["best"]}, "spec-select"),
    ({"spec_mtp_rollback": ["some"]}, "spec-mtp-rollback"),
    ({"spec_type": ["ngram-mod"], "n_gen": ["0"]}, "-n"),
    ({"temp": ["hot"]}, "--temp"),
])
def test_invalid_parameters_are_usage_errors(flags, message):
    with pytest.raises(UsageError, match=message):
        instances(params(flags))


def test_draft_simple_without_md_drafts_with_the_models_listed_draft(tiny_model_path):
    registry = load_registry()
    listed = registry.get(registry.default_model).draft
    tests = [i.test for i in instances(params({"spec_type": ["draft-simple"]}))]  # the default model
    assert [t.model_draft for t in tests if t.spec_type == "draft-simple"] == [listed]
    with pytest.raises(UsageError, match="draft model"):  # a GGUF path lists no draft
        instances(params({"spec_type": ["ngram-mod;draft-simple"], "model": [str(tiny_model_path)]}))
