"""What `spec-cli bench` shows on stderr while it runs (bench/runner.py `Progress`)."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

from spec_cli.bench import Result
from spec_cli.bench.params import Instance
from spec_cli.bench.runner import Progress


class BenchReport(Progress):
    """The grid's size before anything loads (always), then a live bar over the timed runs on a terminal;
    elsewhere (CI logs) one line per test with --progress, like llama-bench's; loads and samples with -v."""

    def __init__(self, err: Console, repetitions: int, lines: bool, verbose: bool,
                 stream: Callable[[list[dict]], None] | None = None):
        self.err, self.repetitions, self.verbose, self.stream = err, repetitions, verbose, stream
        self.done: list[dict] = []  # the finished tests' rows, in case the run stops before the end
        self.lines = lines and not err.is_terminal
        self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=True,
                                disable=not err.is_terminal)
        self.task = None
        self.n_tests = 0

    def start(self, tests: list[Instance], n_runs: int) -> None:
        self.n_tests = len(tests)
        self.task = self.bar.add_task("bench", total=n_runs)
        r = self.repetitions
        spec = " (a speculative run is one prompt of its set)" if any(i.test.kind == "spec" for i in tests) else ""
        self._print(f"bench: {len(tests)} tests, {r} repetition{'s' * (r != 1)} each: {n_runs} timed runs{spec}")

    def test(self, i: int, name: str) -> None:
        self.bar.update(self.task, description=f"bench {i + 1}/{self.n_tests} {name}")
        if self.lines:
            self._print(f"bench {i + 1}/{self.n_tests}: {name}")

    def runs_done(self, n: int = 1) -> None:
        self.bar.advance(self.task, n)

    def log(self, line: str) -> None:
        if self.verbose:
            self._print(line)

    def finished(self, rows: list[Result]) -> None:
        done = [r.to_dict() for r in rows]
        self.done += done
        if self.stream:
            self.stream(done)

    def _print(self, line: str) -> None:
        self.err.print(line, markup=False, highlight=False, soft_wrap=True)
