"""Bench printers against golden output for fixed results: md (llama-bench's table, non-default columns only,
speculative and verify-cost tables), csv (all quoted), json / jsonl (typed values with samples), sql."""

from __future__ import annotations

import json

from spec_cli.bench import Result, printers
from spec_cli.bench.printers import format_csv, format_json, format_jsonl, format_md, format_rows, format_sql

BUILD = dict(build_commit="abc1234", build_version="0.1.0", torch_version="2.13.0", cpu_info="Test CPU",
             gpu_info="", backends="CPU", device="cpu", dtype="f32")
MODEL = dict(model_filename="/models/qwen.gguf", model_type="qwen2 0.5B Q4_K_M", model_size=491400064,
             model_n_params=494032768)


def row(test, n_prompt, n_gen, samples, n_depth=0, tokens=None, **engine):
    e = dict(n_batch=2048, n_ubatch=512, n_threads=2, n_gpu_layers=-1, flash_attn=-1, devices="auto")
    e.update(engine)
    ts_tokens = tokens if tokens is not None else n_prompt + n_gen
    return Result(**BUILD, **MODEL, **e, test=test, n_prompt=n_prompt, n_gen=n_gen, n_depth=n_depth,
                  test_time="2026-01-02T03:04:05Z", samples_ns=list(samples),
                  samples_ts=[1e9 * ts_tokens / ns for ns in samples])


def spec_row(spec_type, draft_max, samples, speedup, **kw):
    r = row("spec", 300, 64, samples, tokens=120)
    r.spec = dict(prompt_set="code-edit", n_prompts=2, temp=0.0, spec_type=spec_type,
                  model_draft=kw.get("model_draft", ""), draft_max=draft_max, draft_min=0, draft_p_min="auto",
                  spec_verify="auto", warm=False, n_drafted=kw.get("drafted", 0), n_accepted=kw.get("accepted", 0),
                  n_steps=40, acceptance=kw.get("acc", 0.0), mean_acc_len=kw.get("length", 0.0), tokens_per_step=3.0,
                  acc_per_pos=kw.get("pos", []), prompt_ns=1000, draft_ms=1.5, verify_ms=2.5, speedup=speedup)
    return r


def verify_row(k, ns, ratio, acc):
    r = row("verify", 0, 0, [ns, ns], n_depth=512, tokens=k)
    r.verify = dict(verify_k=k, cost_ratio=ratio, break_even_len=ratio, break_even_acc=acc)
    return r


PP = row("pp", 512, 0, [4_000_000_000, 4_096_000_000])  # 128 and 125 t/s
TG = row("tg", 0, 128, [8_000_000_000, 6_400_000_000], n_depth=512)  # 16 and 20 t/s


def dicts(*rows):
    return [r.to_dict() for r in rows]


def test_md_llama_bench_table():
    assert format_md(dicts(PP, TG)) == (
        "| model                          |       size |     params | backend | device | dtype | threads |"
        "            test |                  t/s |\n"
        "| ------------------------------ | ---------: | ---------: | ------- | ------ | ----- | ------: |"
        " --------------: | -------------------: |\n"
        "| qwen2 0.5B Q4_K_M              | 468.64 MiB |   494.03 M | CPU     | cpu    | f32   |       2 |"
        "           pp512 |        126.50 ± 2.12 |\n"
        "| qwen2 0.5B Q4_K_M              | 468.64 MiB |   494.03 M | CPU     | cpu    | f32   |       2 |"
        "    tg128 @ d512 |         18.00 ± 2.83 |\n"
        "\n"
        "build: abc1234 (0.1.0), torch 2.13.0\n")


def test_md_shows_only_non_default_parameters():
    a = row("pp", 64, 0, [1_000_000_000], n_batch=512, flash_attn=1, n_gpu_layers=99)
    a.backends, a.device, a.dtype = "CUDA", "cuda:0", "bf16"
    b = row("pp", 64, 0, [500_000_000], n_batch=2048, flash_attn=1, n_gpu_layers=99)
    b.backends, b.device, b.dtype = "CUDA", "cuda:0", "bf16"
    header, rule, first, second = format_md(dicts(a, b)).splitlines()[:4]
    # off the CPU: ngl shown, threads hidden (single value); n_batch varies; fa is non-default; ubatch is not
    assert [c.strip() for c in header.split("|")[1:-1]] == [
        "model", "size", "params", "backend", "device", "dtype", "ngl", "n_batch", "fa", "test", "t/s"]
    assert first.split("|")[4:12] == [" CUDA    ", " cuda:0 ", " bf16  ", "  99 ", "     512 ", "   1 ",
                                      "            pp64 ", "         64.00 ± 0.00 "]
    assert "2048" in second and "128.00 ± 0.00" in second


def test_md_speculative_and_verify_tables():
    plain = spec_row("none", 0, [10e9, 10e9], 1.0)
    mod = spec_row("ngram-mod", 8, [4e9, 6e9], 2.0, drafted=100, accepted=80, acc=80.0, length=3.0,
                   pos=[0.9, 0.8, 0.7, 0.6, 0.5])
    v = [verify_row(1, 50e6, 1.0, 0.0), verify_row(4, 100e6, 2.0, 0.5436890126920764),
         verify_row(8, 450e6, 9.0, None)]
    assert format_md(dicts(plain, mod, *v)) == (
        "| model                          | backend | device | dtype | threads |            test |       ms/forward |"
        "               rows/s | cost(k)/cost(1) | break-even len | break-even acc |\n"
        "| ------------------------------ | ------- | ------ | ----- | ------: | --------------: | ---------------: |"
        " -------------------: | --------------: | -------------: | -------------: |\n"
        "| qwen2 0.5B Q4_K_M              | CPU     | cpu    | f32   |       2 |       k1 @ d512 |     50.00 ± 0.00 |"
        "         20.00 ± 0.00 |            1.00 |           1.00 |           0.00 |\n"
        "| qwen2 0.5B Q4_K_M              | CPU     | cpu    | f32   |       2 |       k4 @ d512 |    100.00 ± 0.00 |"
        "         40.00 ± 0.00 |            2.00 |           2.00 |           0.54 |\n"
        "| qwen2 0.5B Q4_K_M              | CPU     | cpu    | f32   |       2 |       k8 @ d512 |    450.00 ± 0.00 |"
        "         17.78 ± 0.00 |            9.00 |           9.00 |              - |\n"
        "\n"
        "| model                          | backend | device | dtype | threads | test             | spec_type"
        "                | draft_max |  acc % | acc len | acc/pos                  |                  t/s | speedup |\n"
        "| ------------------------------ | ------- | ------ | ----- | ------: | ---------------- | ---------"
        "--------------- | --------: | -----: | ------: | ------------------------ | -------------------: | ------: |\n"
        "| qwen2 0.5B Q4_K_M              | CPU     | cpu    | f32   |       2 | code-edit n64    | none     "
        "                |         - |      - |       - | -                        |         12.00 ± 0.00 |    1.00 |\n"
        "| qwen2 0.5B Q4_K_M              | CPU     | cpu    | f32   |       2 | code-edit n64    | ngram-mod"
        "                |         8 |   80.0 |    3.00 | 0.90 0.80 0.70 0.60 …    |         25.00 ± 7.07 |    2.00 |\n"
        "\n"
        "build: abc1234 (0.1.0), torch 2.13.0\n")


def test_md_spec_table_adds_swept_drafting_columns():
    a = spec_row("none", 0, [10e9], 1.0)
    b = spec_row("draft-simple", 4, [5e9], 2.0, model_draft="/m/small.gguf")
    c = spec_row("draft-simple", 4, [5e9], 2.0, model_draft="/m/small.gguf")
    c.spec["draft_p_min"] = 0.5
    header = format_md(dicts(a, b, c)).splitlines()[0]
    cols = [h.strip() for h in header.split("|")[1:-1]]
    assert cols[cols.index("spec_type") + 1: cols.index("draft_max")] == ["model_draft", "draft_p_min"]
    cells = [[x.strip() for x in line.split("|")[1:-1]] for line in format_md(dicts(a, b, c)).splitlines()[2:5]]
    assert [r[cols.index("model_draft")] for r in cells] == ["-", "small.gguf", "small.gguf"]
    assert [r[cols.index("draft_p_min")] for r in cells] == ["-", "auto", "0.5"]


def test_csv_quotes_every_value():
    assert format_csv(dicts(PP)) == (
        "build_commit,build_version,torch_version,cpu_info,gpu_info,backends,device,dtype,model_filename,model_type,"
        "model_size,model_n_params,n_batch,n_ubatch,n_threads,n_gpu_layers,flash_attn,compile,devices,test,n_prompt,"
        "n_gen,n_depth,test_time,avg_ns,stddev_ns,avg_ts,stddev_ts,compile_s\n"
        '"abc1234","0.1.0","2.13.0","Test CPU","","CPU","cpu","f32","/models/qwen.gguf","qwen2 0.5B Q4_K_M",'
        '"491400064","494032768","2048","512","2","-1","-1","auto","auto","pp","512","0","0",'
        '"2026-01-02T03:04:05Z","4048000000","67882250","126.500000","2.121320","0.000000"\n')
    quoted = row("pp", 1, 0, [1_000_000_000])
    quoted.cpu_info = 'CPU "fast", 2 cores'
    assert '"CPU ""fast"", 2 cores"' in format_csv(dicts(quoted))


def test_csv_mixed_kinds_share_one_column_set():
    mod = spec_row("ngram-mod", 8, [4e9, 6e9], 2.0, pos=[0.5, 0.25])
    lines = format_csv(dicts(PP, mod, verify_row(2, 60e6, 1.2, 0.2))).splitlines()
    header = lines[0].split(",")
    assert "acc_per_pos" in header and "verify_k" in header
    assert all(line.count('","') == len(header) - 1 for line in lines[1:])
    values = dict(zip(header, (v.strip('"') for v in lines[2].split('","'))))
    assert values["acc_per_pos"] == "0.500000/0.250000" and values["warm"] == "0" and values["verify_k"] == ""


def test_json_and_jsonl_carry_typed_values_and_samples():
    mod = spec_row("ngram-mod", 8, [4e9, 6e9], 2.0, pos=[0.5])
    expected = dicts(PP, mod)
    assert json.loads(format_json(expected)) == expected
    assert [json.loads(line) for line in format_jsonl(expected).splitlines()] == expected
    first = json.loads(format_jsonl(dicts(PP)).splitlines()[0])
    assert first["samples_ns"] == [4000000000, 4096000000] and first["samples_ts"] == [128.0, 125.0]
    assert first["avg_ns"] == 4048000000 and first["avg_ts"] == 126.5
    assert list(first)[-2:] == ["samples_ns", "samples_ts"]
    spec = json.loads(format_json(dicts(mod)))[0]
    assert spec["warm"] is False and spec["acc_per_pos"] == [0.5] and "verify_k" not in spec
    assert format_jsonl(dicts(PP)) == json.dumps(dicts(PP)[0], ensure_ascii=False) + "\n"


def test_sql():
    sql = format_sql(dicts(PP))
    head, insert = sql.split(");\n\n")
    assert head.splitlines()[:3] == ["CREATE TABLE IF NOT EXISTS llama_bench (", "  build_commit TEXT,",
                                     "  build_version TEXT,"]
    assert "  model_size INTEGER,\n" in head and "  avg_ts REAL,\n" in head and head.endswith("  stddev_ts REAL,\n  compile_s REAL\n")
    assert insert == (
        "INSERT INTO llama_bench (build_commit, build_version, torch_version, cpu_info, gpu_info, backends, device, "
        "dtype, model_filename, model_type, model_size, model_n_params, n_batch, n_ubatch, n_threads, n_gpu_layers, "
        "flash_attn, compile, devices, test, n_prompt, n_gen, n_depth, test_time, avg_ns, stddev_ns, avg_ts, stddev_ts, "
        "compile_s) VALUES "
        "('abc1234', '0.1.0', '2.13.0', 'Test CPU', '', 'CPU', 'cpu', 'f32', '/models/qwen.gguf', "
        "'qwen2 0.5B Q4_K_M', '491400064', '494032768', '2048', '512', '2', '-1', '-1', 'auto', 'auto', 'pp', '512', "
        "'0', '0', '2026-01-02T03:04:05Z', '4048000000', '67882250', '126.500000', '2.121320', '0.000000');\n")
    odd = row("pp", 1, 0, [1_000_000_000])
    odd.cpu_info = "it's"
    assert "'it''s'" in format_sql(dicts(odd))
    assert "NULL" in format_sql(dicts(verify_row(8, 450e6, 9.0, None)))


def test_none_format_and_empty_results():
    assert format_rows(dicts(PP), "none") == ""
    assert format_md([]) == ""


def test_md_columns_widen_to_their_longest_cell():
    """A chain name longer than its column (ngram-simple,ngram-mod,ngram-cache) keeps the table's pipes aligned."""
    table = printers._md_table([("spec_type", -8), ("t/s", 5)], [["ngram-simple,ngram-mod,ngram-cache", "1.0"],
                                                               ["none", "22.5"]])
    lines = table.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert [line.index("|", 1) for line in lines] == [lines[0].index("|", 1)] * len(lines)
