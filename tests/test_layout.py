"""The package's layers: every import of spec_cli (module level or inside a function) points down the table below or
stays inside its own package, and the module graph has no cycle. A new module goes into the package of its layer."""

from __future__ import annotations

import ast
from pathlib import Path

import spec_cli

ROOT = Path(spec_cli.__file__).parent
# top-level name -> layer; a module imports only lower layers and its own package (peers do not import each other)
LAYERS = {
    "": 0, "errors": 0,  # spec_cli/__init__ (version, thread policy) and the error types
    "options": 1,  # every flag once: defaults, spellings, parsers
    "model": 2, "text": 2,  # GGUF -> logits; text <-> token ids
    "speculative": 3,  # drafters, chain, verify, planner
    "runtime": 4,  # engine, session, the step loop, lookup
    "bench": 5, "server": 5, "train": 5,  # the applications
    "cli": 6,
    "__main__": 7,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(name: str) -> set[str]:
    """The spec_cli modules `name` imports anywhere in its body (a `from package import module` counts as the
    module)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "spec_cli":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "spec_cli")
    return found - {name}


def package(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_has_a_layer():
    assert {package(m) for m in MODULES} <= set(LAYERS)


def test_imports_point_down_or_stay_in_their_package():
    wrong = [f"{m} -> {t}" for m in sorted(MODULES) for t in sorted(imports(m))
             if package(t) != package(m) and LAYERS[package(t)] >= LAYERS[package(m)]]
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_no_import_cycle():
    graph = {m: {t for t in imports(m) if t in MODULES} for m in MODULES}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(path: list[str]) -> list[str] | None:
        m = path[-1]
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(path + [t])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            assert (cycle := visit([m])) is None, " -> ".join(cycle)


def test_the_top_level_shows_the_layers():
    """The top of the package holds the layers' packages and the few modules everything shares, nothing else."""
    entries = sorted(p.name for p in ROOT.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, entries


def test_functions_are_under_60_lines():
    """A function of 60 lines or more has a seam to split it along."""
    long = [f"{m}.{node.name}: {node.end_lineno - node.lineno + 1} lines" for m, path in sorted(MODULES.items())
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 >= 60]
    assert not long, "\n".join(long)


def test_scripts_and_the_tests_import_the_package_before_torch():
    """spec_cli/__init__ sets OpenMP's wait policy, which OpenMP reads once, when torch loads it: a script that
    imports torch first runs with torch's threads spinning after every parallel op, against the kernels' pool (one
    3-row feature copy before each decode made a qwen2.5-coder-1.5b decode 18 % slower)."""
    late = []
    for path in [*sorted((ROOT.parent / "scripts").glob("*.py")), ROOT.parent / "tests" / "conftest.py"]:
        order = [alias.name.split(".")[0] if isinstance(node, ast.Import) else (node.module or "").split(".")[0]
                 for node in ast.parse(path.read_text(encoding="utf-8")).body
                 if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names]
        if "torch" in order and ("spec_cli" not in order or order.index("torch") < order.index("spec_cli")):
            late.append(path.name)
    assert not late, late
