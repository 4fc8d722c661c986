"""`--plot FILE.png`: draws a sweep with matplotlib (Agg backend, no display needed).

Panels: tokens/s against draft length, one line per (model, spec type), with each plain run as a dashed
horizontal line (`--draft-max auto` sits one step right of the longest fixed length, labelled auto); speed-up
against draft length with 1.0 marked; acceptance rate per draft position as grouped
bars (one group per series at its largest draft length); and, when verify-cost rows exist, cost(k)/cost(1)
against k next to the ideal flat line, which is the break-even mean acceptance length.
"""

from __future__ import annotations

from pathlib import Path

from spec_cli.errors import SpecCliError
from spec_cli.options import AUTO


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    """Speculative rows grouped per line: model, spec type, prompt set, temp (draft length varies along it)."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r["test"] != "spec" or r["spec_type"] == "none":
            continue
        draft = f" ({Path(r['model_draft']).stem})" if r["model_draft"] else ""
        label = f"{r['model_type']} {r['spec_type']}{draft} [{r['prompt_set']}" + (
            f", temp {r['temp']:g}]" if r["temp"] else "]")
        out.setdefault(label, []).append(r)
    return {k: sorted(v, key=lambda r: (r["draft_max"] == AUTO, 0 if r["draft_max"] == AUTO else r["draft_max"]))
            for k, v in out.items()}


def _draft_positions(series) -> tuple[dict, bool]:
    """x of each draft-max value and whether the axis is log2: numbers as they are, auto one step past the
    largest (twice it on a log axis)."""
    values = {r["draft_max"] for rs in series.values() for r in rs}
    numbers = sorted(v for v in values if v != AUTO)
    log = bool(numbers) and numbers[-1] / max(numbers[0], 1) >= 8
    x = {v: v for v in numbers}
    if AUTO in values:
        top = numbers[-1] if numbers else 1
        x[AUTO] = 2 * top if log else top + 1
    return x, log


def plot_rows(rows: list[dict], path: str | Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SpecCliError("--plot needs matplotlib (pip install 'spec-cli[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(rows)
    plain = [r for r in rows if r["test"] == "spec" and r["spec_type"] == "none"]
    verify = [r for r in rows if r["test"] == "verify"]
    if not series and not verify:
        raise SpecCliError("--plot needs a speculative sweep (--spec-type ...) or --verify-cost rows")
    panels = (["ts", "speedup", "acc"] if series else []) + (["verify"] if verify else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.8), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        {"ts": _tokens_per_second, "speedup": _speedup, "acc": _acceptance, "verify": _verify}[panel](
            ax, series, plain, verify)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise SpecCliError(f"cannot write {path}: {e}") from None
    finally:
        plt.close(fig)


def _tokens_per_second(ax, series, plain, _verify) -> None:
    x, _ = _draft_positions(series)
    for label, rs in series.items():
        ax.errorbar([x[r["draft_max"]] for r in rs], [r["avg_ts"] for r in rs], yerr=[r["stddev_ts"] for r in rs],
                    marker="o", capsize=3, label=label)
    for r in plain:
        ax.axhline(r["avg_ts"], linestyle="--", color="gray", linewidth=1)
        ax.annotate(f"plain {r['model_type']} {r['avg_ts']:.1f}", (0, r["avg_ts"]), xycoords=("axes fraction", "data"),
                    textcoords="offset points", xytext=(4, 3), fontsize=7, color="gray")
    ax.set(xlabel="draft max (tokens)", ylabel="generated tokens / s", title="generation speed")
    _draft_axis(ax, series)
    ax.legend(fontsize=7)


def _speedup(ax, series, _plain, _verify) -> None:
    x, _ = _draft_positions(series)
    for label, rs in series.items():
        pts = [(x[r["draft_max"]], r["speedup"]) for r in rs if r["speedup"] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(1.0, linestyle="--", color="gray", linewidth=1)
    ax.set(xlabel="draft max (tokens)", ylabel="speed-up vs plain", title="speed-up (same prompts, same run)")
    _draft_axis(ax, series)
    ax.legend(fontsize=7)


def _acceptance(ax, series, _plain, _verify) -> None:
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, (label, rs) in enumerate(series.items()):
        rates = rs[-1]["acc_per_pos"]  # the longest draft length of this series
        xs = [p + 1 + (i - (n - 1) / 2) * width for p in range(len(rates))]
        ax.bar(xs, rates, width=width, label=f"{label} dmax {rs[-1]['draft_max']}")
    ax.set(xlabel="draft position", ylabel="acceptance rate (per generated draft)", ylim=(0, 1.3),
           title="acceptance per position")
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.legend(fontsize=7, loc="upper right")  # above the bars: the axis reaches 1.3


def _verify(ax, _series, _plain, verify) -> None:
    groups: dict[str, list[dict]] = {}
    for r in verify:
        groups.setdefault(f"{r['model_type']} {r['device']} d{r['n_depth']}", []).append(r)
    for label, rs in groups.items():
        ax.plot([r["verify_k"] for r in rs], [r["cost_ratio"] for r in rs], marker="o", label=label)
    k_max = max(r["verify_k"] for r in verify)
    ax.plot([1, k_max], [1, 1], linestyle="--", color="gray", linewidth=1, label="ideal (free verification)")
    ax.plot([1, k_max], [1, k_max], linestyle=":", color="gray", linewidth=1, label="k sequential decodes")
    ax.set(xlabel="rows per forward (k = 1 + draft length)", ylabel="cost(k) / cost(1) = break-even acc. length",
           title="verify cost")
    ax.legend(fontsize=7)


def _draft_axis(ax, series) -> None:
    x, log = _draft_positions(series)
    if log:
        ax.set_xscale("log", base=2)
    ax.set_xticks(list(x.values()), [str(v) for v in x])
