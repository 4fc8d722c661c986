"""Rich rendering shared by several commands (rich lives here and in cli/ only; the library returns plain data)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from spec_cli.model.catalog import ProgressCallback

# --- models -----------------------------------------------------------------------------------------------------


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:,.1f}"


@contextmanager
def pull_progress(console: Console | None = None) -> Iterator[ProgressCallback]:
    """A `progress(stage, done, total)` callback for `models.pull` / `resolve_model`: one rich bar per stage, on
    stderr so stdout stays clean. The bars start with the first report, so a cached model draws nothing."""
    from spec_cli.model.catalog import STAGE_ASSEMBLE

    bars: Progress | None = None
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int) -> None:
        nonlocal bars
        if bars is None:
            bars = Progress(TextColumn("{task.description:<12}"), BarColumn(), TaskProgressColumn(),
                            TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
                            console=console or Console(stderr=True))
            bars.start()
        if stage not in tasks:
            tasks[stage] = bars.add_task(stage, total=total, detail="")
        detail = f"{mib(done)}/{mib(total)} MiB" if stage == STAGE_ASSEMBLE else f"{done}/{total}"
        bars.update(tasks[stage], completed=done, total=total, detail=detail)

    try:
        yield update
    finally:
        if bars is not None:
            bars.stop()
