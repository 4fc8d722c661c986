"""Every option of every command that takes a value which can be malformed gets one through the installed `spec-cli`
script: exit code 2, and an error that names the flag, before anything loads (`-m` names a file that does not exist:
loading first would make it exit 1 with "model file not found").

The cases come from the commands themselves (the options `with_options` gave each one, spec_cli/options.py), so a
new option is covered as soon as a command takes it; the malformed value is chosen by the kind of option (MALFORMED).
An option shared by several commands (the same `Opt`) is given to the first command that takes it, once. Options a
command declares inline must take any text or be switches (`test_inline_options_take_any_text`): a value that can be
malformed belongs in options.py, where its parser is.

The invocations run a few at a time in one fixture (each process pays the torch import), the tests then check each."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import typing
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest
from typer.models import OptionInfo

from spec_cli.cli import app
from spec_cli.options import Opt, api_key, nonempty, parallel, shown

SCRIPT = Path(sys.executable).with_name("spec-cli")
MISSING_MODEL = "no-such-model.gguf"
# the malformed value by kind of option, in the order they are tried: a bounded number just outside its bounds
# (`outside`), a parser's word no parser accepts (or what the parser in SPECIAL refuses), a whole number that is not
# one, a float that is not finite; text without a parser and switches cannot be malformed
MALFORMED = {"bounded": "outside", "parsed": "bogus", "int": "1.5", "float": "nan"}
SPECIAL = {nonempty: "", parallel: "0", api_key: " key "}
FREE_TEXT = (str, Optional[str], bool, list[str], Optional[list[str]], Path)


def outside(o: Opt) -> str:
    """A value just outside the option's bounds: below the lower one, else above the upper one."""
    value = (o.ge - 1 if o.ge is not None else o.gt if o.gt is not None else o.le + 1 if o.le is not None else o.lt)
    return shown(int(value) if o.annotation in (int, Optional[int]) else float(value))


def malformed(o: Opt) -> str | None:
    if o.bounds():
        return outside(o)
    if o.parse is not None:
        return SPECIAL.get(o.parse, MALFORMED["parsed"])
    if o.annotation in (int, Optional[int]):
        return MALFORMED["int"]
    if o.annotation is float:
        return MALFORMED["float"]
    return None


def commands() -> dict[str, typing.Callable]:
    """Every command's function, by its name on the command line (`models list` for a sub-command)."""
    out = {c.name: c.callback for c in app.registered_commands}
    for group in app.registered_groups:
        out.update({f"{group.name} {c.name}": c.callback for c in group.typer_instance.registered_commands})
    return out


def required(fn, tmp: Path) -> list[str]:
    """The command's required options (files to read or write), with a path that need not exist."""
    out = []
    for name, p in inspect.signature(fn).parameters.items():
        if isinstance(p.default, OptionInfo) and p.default.default is ...:
            out += [p.default.param_decls[0], str(tmp / name)]
    return out


def cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """'command flag' -> (arguments, the flag the error must name)."""
    out, seen = {}, set()
    for command, fn in commands().items():
        options = getattr(fn, "options", {})
        for o in options.values():
            value = malformed(o)
            if value is None or id(o) in seen:
                continue
            seen.add(id(o))
            flag = max(o.flags, key=len)  # the long spelling takes `=value`, which a value like -1 needs
            model = ["-m", str(tmp / MISSING_MODEL)] if "model" in options else []
            out[f"{command} {o.flags[0]}"] = ([*command.split(), *model, *required(fn, tmp), f"{flag}={value}"],
                                              o.flags[0])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, str]]:
    assert SCRIPT.exists(), f"{SCRIPT} is missing: pip install -e '.[test]'"
    tmp = tmp_path_factory.mktemp("flag-values")
    env = {**os.environ, "SPEC_CLI_CACHE": str(tmp / "cache"), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    env.pop("SPEC_CLI_DEBUG", None)

    def invoke(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env,
                              stdin=subprocess.DEVNULL)

    todo = cases(tmp)
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip(todo, pool.map(invoke, (args for args, _ in todo.values()))))
    return {name: (done[name], flag) for name, (_, flag) in todo.items()}


@pytest.mark.parametrize("name", list(cases(Path("."))))
def test_a_malformed_value_is_a_usage_error_naming_its_flag(results, name):
    proc, flag = results[name]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    # ours: "error: -c must be >= 0 (got -1)"; typer's, for a number that is none: "Invalid value for '-c' / ..."
    named = re.compile(rf"^error: {re.escape(flag)} must be |Invalid value for '{re.escape(flag)}'")
    assert any(named.search(line) for line in proc.stderr.splitlines()), proc.stderr


def test_every_kind_of_option_is_covered():
    """The table above reaches every kind: a bounded number, a parser, an unbounded whole number and float; and the
    commands that take values have cases (models has no option that can be malformed)."""
    names = list(cases(Path(".")))
    assert {name.split(" -")[0] for name in names} >= {"run", "speculative-simple", "lookup-stats", "bench", "server",
                                                       "mtp-train"}
    assert {"run -c", "run --temp", "run --draft-max", "bench -p", "bench --spec-type", "server --api-key",
            "mtp-train -s"} <= set(names)


@pytest.mark.parametrize("command", list(commands()))
def test_inline_options_take_any_text(command):
    """An option a command declares itself (not from options.py) takes text (a path, a name) or is a switch."""
    fn = commands()[command]
    hints = typing.get_type_hints(fn)
    inline = {name: hints[name] for name in inspect.signature(fn).parameters if name not in getattr(fn, "options", {})}
    assert all(t in FREE_TEXT for t in inline.values()), inline
