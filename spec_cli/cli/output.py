"""Rich tables for the end of a run (stderr), and llama.cpp-style text lines (`--log-format text`)."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from spec_cli.speculative.stats import DrafterStats

stderr = Console(stderr=True)
MIB = 1 << 20


def print_json(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


def run_table(d: dict) -> Table:
    t = Table(title="run", title_justify="left", show_header=True, header_style="bold")
    for col in ("", "tokens", "ms", "tok/s"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("load", "", f"{d['load_ms']:.0f}", "")
    t.add_row("prompt", str(d["prompt_n"]), f"{d['prompt_ms']:.1f}", f"{d['prompt_per_second']:.2f}")
    t.add_row("generation", str(d["predicted_n"]), f"{d['predicted_ms']:.1f}", f"{d['predicted_per_second']:.2f}")
    return t


def memory_table(memory: dict) -> Table:
    """Bytes of weights and KV cache per model and head, and of the suffix drafter's token store where one is loaded
    (runtime/memory.py), in MiB."""
    t = Table(title="memory", title_justify="left", header_style="bold")
    kinds = _memory_kinds(memory)
    for col in ("", "device", *(f"{label} MiB" for label in kinds.values())):
        t.add_column(col, justify="right" if col.endswith("MiB") else "left")
    for name, part in memory.items():
        t.add_row(name, "+".join(part.get("devices", [])), *(f"{part[kind] / MIB:.1f}" for kind in kinds))
    return t


def memory_lines(memory: dict) -> str:
    """The memory figures as llama.cpp-style lines (`--log-format text`)."""
    kinds = _memory_kinds(memory)
    return "".join(f"memory: {name:<11} " + ", ".join(f"{label} = {part[kind] / MIB:9.2f} MiB"
                                                       for kind, label in kinds.items()) + "\n"
                   for name, part in memory.items())


def _memory_kinds(memory: dict) -> dict[str, str]:
    """The figures shown and their labels: the token store's only where the suffix drafter is loaded."""
    from spec_cli.runtime.memory import KINDS, SUFFIX_PART  # torch loads in a command that runs, not at --help

    return {kind: label for kind, label in KINDS.items() if kind != "store" or SUFFIX_PART in memory}


def speculation_table(d: dict) -> Table:
    """Field / value rows: readable at any terminal width (and in logs, where rich assumes 80 columns)."""
    t = Table(title="speculation", title_justify="left", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value", justify="right")
    split = d["time_split_ms"]
    for field, value in (
        ("n_draft", d["n_draft"]), ("n_predict", d["predicted_n"]), ("n_drafted", d["n_drafted"]),
        ("n_accept", d["n_accept"]), ("accept %", f"{d['accept']:.3f}"), ("verify steps", d["n_steps"]),
        ("mean acceptance length", f"{d['mean_acc_len']:.2f}"),
        ("time draft / verify / accept ms", f"{split['draft']:.1f} / {split['verify']:.1f} / {split['accept']:.1f}"),
    ):
        t.add_row(field, str(value))
    return t


def drafter_table(drafters: list[dict]) -> Table:
    """One column per drafter, llama.cpp's counters as rows."""
    t = Table(title="drafters", title_justify="left", header_style="bold")
    t.add_column("")
    for s in drafters:
        t.add_column(s["name"], justify="right")
    rows = {
        "calls begin/draft/accept": lambda s: f"{s['n_call_begin']}/{s['n_call_draft']}/{s['n_call_accept']}",
        "proposed / verified drafts": lambda s: f"{s['n_proposed']} / {s['n_gen_drafts']}",
        "acc drafts": lambda s: s["n_acc_drafts"],
        "gen tokens": lambda s: s["n_gen_tokens"],
        "acc tokens": lambda s: s["n_acc_tokens"],
        "mean draft length": lambda s: f"{s['mean_draft_len']:.2f}",
        "acceptance %": lambda s: f"{100 * s['acceptance']:.1f}",
        "mean acceptance length": lambda s: f"{s['mean_acc_len']:.2f}",
        "acc rate/pos": lambda s: " ".join(f"{r:.2f}" for r in s["acc_rate_per_pos"][:6])
        + (" …" if len(s["acc_rate_per_pos"]) > 6 else ""),
        "begin/draft/accept ms": lambda s: f"{s['t_begin_us'] / 1e3:.1f}/{s['t_draft_us'] / 1e3:.1f}/"
        f"{s['t_accept_us'] / 1e3:.1f}",
    }
    if any(s["n_mapped"] or s["n_unmapped"] for s in drafters):  # a draft model with another vocabulary
        rows["mapped tokens"] = lambda s: f"{s['n_mapped']}/{s['n_mapped'] + s['n_unmapped']}"
    for label, value in rows.items():
        t.add_row(label, *(str(value(s)) for s in drafters))
    return t


def print_summary(d: dict) -> None:
    stderr.print()
    stderr.print(run_table(d))
    stderr.print(memory_table(d["memory"]))
    if "n_drafted" in d:
        stderr.print(speculation_table(d))
        stderr.print(drafter_table(d["drafters"]))


def print_text_log(d: dict) -> None:
    """llama-speculative-simple's end-of-run lines."""
    stats = ""
    if "n_drafted" in d:
        stats = (f"n_draft   = {d['n_draft']}\nn_predict = {d['predicted_n']}\nn_drafted = {d['n_drafted']}\n"
                 f"n_accept  = {d['n_accept']}\naccept    = {d['accept']:.3f}%\n\ndraft:\n\n")
        for s in d["drafters"]:
            st = DrafterStats(**{k: v for k, v in s.items() if k in DrafterStats.__dataclass_fields__})
            stats += st.format_line() + "\n"
    _text_log(d, stats)


def print_lookup_text_log(d: dict) -> None:
    """llama-lookup's end-of-run lines."""
    _text_log(d, f"n_draft      = {d['n_draft']}\nn_predict    = {d['n_predict']}\nn_drafted    = {d['n_drafted']}\n"
                 f"t_draft_flat = {d['t_draft_flat_ms']:.2f} ms\n"
                 f"t_draft      = {d['t_draft_ms']:.2f} ms, {d['t_draft_us_per_token']:.2f} us per token, "
                 f"{d['draft_tokens_per_second']:.2f} tokens per second\n"
                 f"n_accept     = {d['n_accept']}\naccept       = {d['accept']:.3f}%\n")


def _text_log(d: dict, stats: str) -> None:
    """The speeds, a tool's own statistics, the target's load time: llama.cpp's examples end this way."""
    w = sys.stderr.write
    w("\n")
    w(f"encoded {d['prompt_n']:4d} tokens in {d['prompt_ms'] / 1e3:8.3f} seconds, speed: {d['prompt_per_second']:8.3f} t/s\n")
    w(f"decoded {d['predicted_n']:4d} tokens in {d['predicted_ms'] / 1e3:8.3f} seconds, "
      f"speed: {d['predicted_per_second']:8.3f} t/s\n\n")
    w(stats)
    w(f"\ntarget:\n\nload time = {d['load_ms']:10.2f} ms\n")
    if "memory" in d:
        w("\n" + memory_lines(d["memory"]))
