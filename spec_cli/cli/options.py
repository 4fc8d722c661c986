"""The flags (spec_cli/options.py) as typer options.

`@with_options(MODEL, SAMPLING, SPEC)` appends the groups' typer options to a command's own parameters and hands
the command their values as one dict (`opts`), each parsed and checked by its option (`Opt.value`) before the
command runs (a bench sweep's strings by `Opt.values`); cli/settings.py and bench/params.py turn them into the
engine's dataclasses. So every command spells `-m`, `--temp` or `--spec-type` the same way with the same help, and
reads the same value from it.

Nothing here (nor in the command modules, which import the engine inside their commands) loads torch: a bad value,
a missing flag or --help answers in a fraction of a second, and the engine's modules load (seconds) only for a
command that runs.
"""

from __future__ import annotations

import functools
import gc
import inspect
from typing import Optional

import typer

from spec_cli.options import Opt, read_flags, shown


def with_options(*groups):
    """Append the groups' options to the decorated command; it receives their values, parsed and checked, as
    `opts: dict` (and, where it has a `given` parameter, the same values as typer read them, before parsing: what
    a command passes on to another build). `wrapper.options`: the options by parameter name."""

    def decorate(fn):
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.name not in ("opts", "given")]
        options = {o.name: o for _, opts in groups for o in opts}

        @functools.wraps(fn)
        def wrapper(**kwargs):
            mine = {k: kwargs.pop(k) for k in list(kwargs) if k in sig.parameters}
            if "given" in sig.parameters:
                mine["given"] = dict(kwargs)
            opts = read_flags(options, kwargs)  # a bad value stops the command here, before the engine loads
            load_engine()
            return fn(**mine, opts=opts)

        wrapper.__signature__ = sig.replace(parameters=own + [_parameter(panel, o) for panel, opts in groups
                                                              for o in opts])
        wrapper.options = options
        return wrapper

    return decorate


def _parameter(panel: str, o: Opt) -> inspect.Parameter:
    """An option as the keyword parameter typer reads its flag from."""
    annotation, value, help, metavar = o.annotation, o.default, o.help, o.metavar
    if o.sweep:  # a sweep takes the strings as typed (ranges, comma lists: `Opt.values`) and says its default
        annotation, value, metavar = Optional[list[str]], None, "LIST"
        if o.default is not None:
            help = f"{o.help} (default: {shown(o.default)})"
    option = typer.Option(value, *o.flags, help=help, rich_help_panel=panel, show_default=True, metavar=metavar)
    return inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option)


def load_engine() -> None:
    """Import the engine's modules (torch and spec-cli's kernels: seconds), where a command starts to run. Their
    objects live as long as the process: frozen out of the collector's full passes, which took ~2 % of a
    qwen2.5-coder-1.5b decode under perf."""
    import spec_cli.runtime.session  # noqa: F401  (the engine, the step loop and the drafters)

    gc.freeze()
