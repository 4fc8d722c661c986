"""Output formats of llama-bench (md, csv, json, jsonl, sql), over result rows as dicts (`Result.to_dict()`).

md: llama-bench's table (model, size, params, backend, then ngl off the CPU, threads on the CPU, every engine
parameter whose values differ from its default, test, t/s) with two changes: every row says its device and dtype,
and speculative and verify-cost rows get tables of their own, since their columns differ. csv: a header, then
every value double-quoted. json: an array of objects with typed values plus `samples_ns` and `samples_ts`;
jsonl: one object per line. sql: CREATE TABLE then one INSERT per row. csv and sql use one column set for all
rows (the union), empty / NULL where a field does not apply.
"""

from __future__ import annotations

import json

from spec_cli.bench import (
    BOOL_FIELDS,
    FLOAT_FIELDS,
    INT_FIELDS,
    LIST_FIELDS,
    NGRAM_FIELDS,
    SWEPT_CASE_FIELDS,
    columns,
    row_label,
)
from spec_cli.bench.params import default_values

SQL_TABLE = "llama_bench"  # llama-bench's, so that queries written for its tables read ours
# md: parameter -> (display name, width: negative = left-aligned); defaults decide which columns show
_MD_PARAMS = {"n_gpu_layers": ("ngl", 3), "n_threads": ("threads", 7), "n_batch": ("n_batch", 7),
              "n_ubatch": ("n_ubatch", 8), "flash_attn": ("fa", 3), "devices": ("devices", -8),
              "model_draft": ("model_draft", -12), "n_gpu_layers_draft": ("ngld", 4), "devices_draft": ("devd", -6),
              "draft_vocab": ("draft_vocab", 11),
              "spec_verify": ("spec_verify", -12), "spec_select": ("spec_select", -12),
              "spec_mtp_rollback": ("mtp_rollback", -12), "compile": ("compile", -7),
              "compile_s": ("compile s", 9)}
_DEFAULTS = default_values()


def format_rows(rows: list[dict], fmt: str) -> str:
    return {"md": format_md, "csv": format_csv, "json": format_json, "jsonl": format_jsonl,
            "sql": format_sql, "none": lambda _: ""}[fmt](rows)


# --- md ----------------------------------------------------------------------------------------------------

def format_md(rows: list[dict]) -> str:
    sections = []
    for kinds, table in ((("pp", "tg", "pg"), _random_table), (("verify",), _verify_table), (("spec",), _spec_table)):
        mine = [r for r in rows if r["test"] in kinds]
        if mine:
            sections.append(_md_table(*table(mine)))
    if not rows:
        return ""
    r = rows[0]
    footer = f"build: {r['build_commit']} ({r['build_version']}), torch {r['torch_version']}\n"
    return "\n".join(sections) + "\n" + footer


def _md_table(cols: list[tuple[str, int]], cells: list[list[str]]) -> str:
    # a column is at least as wide as its longest cell (a long chain name), so the pipes stay aligned
    cols = [(name, (1 if w > 0 else -1) * max(abs(w), len(name), *(len(str(c[i])) for c in cells)))
            for i, (name, w) in enumerate(cols)]

    def line(values):
        return "|" + "".join(f" {v:>{w}} |" if w > 0 else f" {v:<{-w}} |" for v, (_, w) in zip(values, cols)) + "\n"

    rule = "|" + "".join(f" {'-' * (abs(w) - 1)}{':' if w > 0 else '-'} |" for _, w in cols) + "\n"
    return line([name for name, _ in cols]) + rule + "".join(line(c) for c in cells)


def _shown(rows: list[dict], field: str) -> bool:
    """llama-bench shows a parameter when it has several values or a non-default one (empty = not applicable)."""
    values = {json.dumps(r[field]) for r in rows if r.get(field) is not None}
    return bool(values) and (len(values) > 1 or values != {json.dumps(_DEFAULTS.get(field))})


def _engine_cols(rows: list[dict]) -> list[str]:
    cpu = all(r["backends"] == "CPU" for r in rows)
    out = [] if cpu else ["n_gpu_layers"]
    if cpu or len({r["n_threads"] for r in rows}) > 1:
        out.append("n_threads")
    out += [f for f in ("n_batch", "n_ubatch", "flash_attn", "compile", "devices") if _shown(rows, f)]
    return out + (["compile_s"] if any(r.get("compile_s") for r in rows) else [])  # seconds spent compiling


def _model_cells(r: dict) -> list[str]:
    size = r["model_size"] / 1024**2
    size_s = f"{size:.2f} MiB" if size < 1024 else f"{size / 1024:.2f} GiB"
    params = r["model_n_params"]
    params_s = f"{params / 1e6:.2f} M" if params < 1e9 else f"{params / 1e9:.2f} B"
    return [r["model_type"], size_s, params_s, r["backends"], r["device"], r["dtype"]]


_MODEL_COLS = [("model", -30), ("size", 10), ("params", 10), ("backend", -7), ("device", -6), ("dtype", -5)]


def _pm(mean: float, sd: float) -> str:
    return f"{mean:.2f} ± {sd:.2f}"


def _random_table(rows: list[dict]):
    extra = _engine_cols(rows)
    cols = _MODEL_COLS + [_MD_PARAMS[f] for f in extra] + [("test", 15), ("t/s", 20)]
    cells = [_model_cells(r) + [str(r[f]) for f in extra] + [row_label(r), _pm(r["avg_ts"], r["stddev_ts"])]
             for r in rows]
    return cols, cells


def _verify_table(rows: list[dict]):
    extra = _engine_cols(rows)
    cols = ([("model", -30), ("backend", -7), ("device", -6), ("dtype", -5)] + [_MD_PARAMS[f] for f in extra]
            + [("test", 15), ("ms/forward", 16), ("rows/s", 20), ("cost(k)/cost(1)", 15), ("break-even len", 14),
               ("break-even acc", 14)])
    cells = []
    for r in rows:
        acc = r["break_even_acc"]
        cells.append([r["model_type"], r["backends"], r["device"], r["dtype"]] + [str(r[f]) for f in extra] + [
            row_label(r), _pm(r["avg_ns"] / 1e6, r["stddev_ns"] / 1e6), _pm(r["avg_ts"], r["stddev_ts"]),
            f"{r['cost_ratio']:.2f}", f"{r['break_even_len']:.2f}", "-" if acc is None else f"{acc:.2f}"])
    return cols, cells


def _spec_table(rows: list[dict]):
    extra = _engine_cols(rows)
    speculative = [r for r in rows if r["spec_type"] != "none"]  # drafting settings mean nothing on plain rows
    fixed = ("spec_type", "draft_max")  # columns on every speculative table
    optional = [f for f in ("temp", "warm") if _shown(rows, f)] + [
        f for f in SWEPT_CASE_FIELDS + NGRAM_FIELDS if f not in fixed and _shown(speculative, f)]
    cols = ([("model", -30), ("backend", -7), ("device", -6), ("dtype", -5)] + [_MD_PARAMS[f] for f in extra]
            + [("test", -16), ("spec_type", -24)] + [_MD_PARAMS.get(f, (f, max(len(f), 6))) for f in optional]
            + [("draft_max", 9), ("acc %", 6), ("acc len", 7), ("acc/pos", -24), ("t/s", 20), ("speedup", 7)])
    cells = []
    for r in rows:
        plain = r["spec_type"] == "none"
        pos = " ".join(f"{a:.2f}" for a in r["acc_per_pos"][:4]) + (" …" if len(r["acc_per_pos"]) > 4 else "")
        cells.append(
            [r["model_type"], r["backends"], r["device"], r["dtype"]] + [str(r[f]) for f in extra]
            + [row_label(r), r["spec_type"]] + [_md_value(r, f, plain) for f in optional]
            + ["-" if plain else str(r["draft_max"]), "-" if plain else f"{r['acceptance']:.1f}",
               "-" if plain else f"{r['mean_acc_len']:.2f}", "-" if plain else pos, _pm(r["avg_ts"], r["stddev_ts"]),
               "-" if r["speedup"] is None else f"{r['speedup']:.2f}"])
    return cols, cells


def _md_value(r: dict, f: str, plain: bool) -> str:
    v = r.get(f)
    if v is None or (plain and f not in ("temp", "warm")):
        return "-"
    if f == "model_draft":
        return v.rsplit("/", 1)[-1] or "-"
    return str(int(v)) if isinstance(v, bool) else str(v)


# --- csv / json / jsonl / sql --------------------------------------------------------------------------------

def _text(field: str, value) -> str:
    """A value as llama-bench prints it in csv/sql: bools 0/1, floats with 6 decimals, lists '/'-joined."""
    if value is None:
        return ""
    if field in LIST_FIELDS:
        return "/".join(f"{v:.6f}" for v in value)
    if isinstance(value, bool):
        return str(int(value))
    if field in FLOAT_FIELDS and not isinstance(value, str):  # draft_p_min may be auto
        return f"{value:.6f}"
    return str(value)


def format_csv(rows: list[dict]) -> str:
    cols = columns(rows)
    lines = [",".join(cols)]
    for r in rows:
        lines.append(",".join('"' + _text(c, r.get(c)).replace('"', '""') + '"' for c in cols))
    return "\n".join(lines) + "\n"


def format_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2, ensure_ascii=False) + "\n"


def format_jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def _sql_type(field: str) -> str:
    if field in INT_FIELDS or field in BOOL_FIELDS:
        return "INTEGER"
    return "REAL" if field in FLOAT_FIELDS else "TEXT"


def format_sql(rows: list[dict]) -> str:
    cols = columns(rows)
    out = [f"CREATE TABLE IF NOT EXISTS {SQL_TABLE} (\n"]
    out += [f"  {c} {_sql_type(c)}{',' if i < len(cols) - 1 else ''}\n" for i, c in enumerate(cols)]
    out.append(");\n\n")
    for r in rows:
        values = ", ".join("NULL" if r.get(c) is None else "'" + _text(c, r[c]).replace("'", "''") + "'" for c in cols)
        out.append(f"INSERT INTO {SQL_TABLE} ({', '.join(cols)}) VALUES ({values});\n")
    return "".join(out)
