"""The `spec-cli` command: registers one typer command per module and formats errors once (the `hf` pattern).

The command modules load torch and the engine only inside a command that runs (cli/options.py `with_options`), so
--help and a bad flag value answer in a fraction of a second."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping

import typer

from spec_cli.errors import SpecCliError, UsageError

PLUGINS_ENV = "SPEC_CLI_PLUGINS"

app = typer.Typer(
    name="spec-cli",
    help="Speculative decoding for GGUF models, shaped like llama.cpp's tools.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _register() -> None:
    from spec_cli.cli import bench, draft_train, lookup, models, run, server, speculative

    app.command("run")(run.run)
    app.command("bench")(bench.bench)
    app.command("speculative-simple")(speculative.speculative_simple)
    app.command("lookup")(lookup.lookup)
    app.command("lookup-create")(lookup.lookup_create)
    app.command("lookup-merge")(lookup.lookup_merge)
    app.command("lookup-stats")(lookup.lookup_stats)
    app.command("server")(server.server)
    app.command("draft-train")(draft_train.draft_train)
    app.command("mtp-train")(draft_train.mtp_train)
    app.add_typer(models.app, name="models")


_register()


def load_plugins(env: Mapping[str, str] = os.environ) -> None:
    """Import the modules SPEC_CLI_PLUGINS names (a comma list); each registers its drafter types at import
    (speculative/registry.py `register_drafter`)."""
    for module in filter(None, (m.strip() for m in env.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UsageError(f"{PLUGINS_ENV}: cannot import '{module}' ({e})") from None


def main() -> None:
    """Entry point: one-line errors with exit code 1 (runtime) or 2 (usage); SPEC_CLI_DEBUG=1 shows tracebacks."""
    debug = os.environ.get("SPEC_CLI_DEBUG") == "1"
    if "RANK" in os.environ:  # set by torchrun (parallel/comm.py), whose ranks > 0 serve rank 0's shards
        from spec_cli.model.parallel import tensor_parallel

        if tensor_parallel.followed_by_torchrun():
            tensor_parallel.torchrun_follower()
    try:
        load_plugins()  # drafter types of other packages, registered before --spec-type is read
        # without standalone mode click returns the code of a `typer.Exit` (and 130 for ^C) instead of exiting,
        # and a command's own return value (None) otherwise
        code = app(standalone_mode=False)
    except SpecCliError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except typer.TyperException as e:  # typer's own click: usage errors format themselves, exit code 2
        if hasattr(e, "show"):
            e.show()
        else:
            print(f"error: {e.format_message()}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:
        if debug:
            raise
        print(f"error: {type(e).__name__}: {e} (set SPEC_CLI_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
