"""POST /slots/{id}?action=save|restore|erase: llama-server's slot actions, on the slot files of --slot-save-path.

save     writes the slot's sequence (target KV, tokens, every drafter's state: runtime/slot_file.py) to the file named
         by the body's `filename`: {"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}
restore  reads it back into the slot, whose next request reuses it as a cached prompt prefix and continues as the
         saved slot would have: {"id_slot", "filename", "n_restored", "n_read", "timings": {"restore_ms"}}
erase    empties the slot (its target cells and the drafters' state of it): {"id_slot", "n_erased"}

A file name is letters, digits, '.', '_' and '-', starting with a letter or digit: no separator, no '..', nothing
outside the directory (400 otherwise); a restore does not follow a symbolic link, and a save writes a new file and
renames it over the name (never through a link left there). The slot must be idle (409 while it serves a request).
A file that is not a slot file of this server's models and drafters is a 400 naming why; a missing one a 404; a
drafter that cannot save its state (a plugin's without save_state) a 501. The work runs on the engine thread between
two generation steps (Scheduler.call); while it reads or writes a file the other slots wait.
"""

from __future__ import annotations

import os
import re
import stat
import time
from functools import partial
from pathlib import Path

from spec_cli.errors import SpecCliError, StateError
from spec_cli.runtime.slot_file import erase_slot, restore_slot, save_slot
from spec_cli.server import protocol as P
from spec_cli.server.scheduler import Scheduler, Slot
from spec_cli.speculative.base import StateUnsupported

ACTIONS = ("save", "restore", "erase")
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


async def slot_action(scheduler: Scheduler, directory: Path | None, id_slot: str, action: str | None,
                      body: bytes) -> dict:
    """The route: checks what the request asks, then runs the action on the engine thread."""
    if directory is None:
        raise P.ApiError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                         "not_supported_error")
    if not id_slot.isdigit() or int(id_slot) >= len(scheduler.slots):
        raise P.ApiError(400, f"Invalid slot ID {id_slot!r}: this server has slots 0 to {len(scheduler.slots) - 1}")
    if action not in ACTIONS:
        raise P.ApiError(400, f"Invalid action {action!r}: ?action= save, restore or erase", param="action")
    seq, name = int(id_slot), None
    if action == "erase":
        work = partial(erase, scheduler, seq)
    else:
        name = P.parse_request(P.SlotFileRequest, body).filename
        if not FILE_NAME.fullmatch(name):
            raise P.ApiError(400, f"Invalid filename {name!r}: a slot file is named by letters, digits, '.', '_' and "
                             "'-', starting with a letter or digit (no directories)", param="filename")
        work = partial(save if action == "save" else restore, scheduler, seq, directory / name)
    try:
        return await scheduler.call(work)
    except StateUnsupported as e:
        raise P.ApiError(501, str(e), "not_supported_error") from None
    except StateError as e:
        raise P.ApiError(400, f"slot file {name}: {e}", param="filename") from None
    except SpecCliError as e:  # shutting down, or a cache that cannot be saved (-tp)
        status, kind = (503, "unavailable_error") if scheduler.closed else (400, "invalid_request_error")
        raise P.ApiError(status, str(e), kind) from None


# --- on the engine thread -------------------------------------------------------------------------------------------


def idle_slot(scheduler: Scheduler, seq: int) -> Slot:
    slot = scheduler.slots[seq]
    if slot.task is not None:
        raise P.ApiError(409, f"slot {seq} is busy with a request: save, restore or erase it once it is idle",
                         "conflict_error")
    return slot


def save(scheduler: Scheduler, seq: int, path: Path) -> dict:
    slot, session = idle_slot(scheduler, seq), scheduler.session
    t0 = time.perf_counter()
    if session.engine.ctx.lengths[seq] != len(slot.cached):  # a request failed or was cut short: nothing reusable
        erase_slot(session, seq)
        slot.cached = []
    try:
        n_written = save_slot(session, seq, slot.cached, path)
    except IsADirectoryError:
        raise P.ApiError(400, f"{path.name} is a directory in --slot-save-path", param="filename") from None
    except OSError as e:
        raise P.ApiError(500, f"cannot write {path.name}: {e.strerror}", "server_error") from None
    return {"id_slot": seq, "filename": path.name, "n_saved": len(slot.cached), "n_written": n_written,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}


def restore(scheduler: Scheduler, seq: int, path: Path) -> dict:
    slot, session = idle_slot(scheduler, seq), scheduler.session
    t0 = time.perf_counter()
    with open_file(path) as f:
        n_read = os.fstat(f.fileno()).st_size
        try:
            tokens = restore_slot(session, seq, f)
        except StateError:
            del slot.cached[session.engine.ctx.lengths[seq]:]  # emptied when the restore had begun
            raise
    slot.cached = tokens
    return {"id_slot": seq, "filename": path.name, "n_restored": len(tokens), "n_read": n_read,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}


def erase(scheduler: Scheduler, seq: int) -> dict:
    slot = idle_slot(scheduler, seq)
    n_erased = len(slot.cached)
    erase_slot(scheduler.session, seq)
    slot.cached = []
    return {"id_slot": seq, "n_erased": n_erased}


def open_file(path: Path):
    """A slot file opened for reading: a regular file, not through a symbolic link (the ApiError otherwise)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise P.ApiError(404, f"no slot file {path.name} in --slot-save-path", "not_found_error",
                         param="filename") from None
    except OSError as e:  # ELOOP: a symbolic link
        raise P.ApiError(400, f"cannot open {path.name}: {'a symbolic link' if os.path.islink(path) else e.strerror}",
                         param="filename") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise P.ApiError(400, f"{path.name} is not a regular file", param="filename")
    return os.fdopen(fd, "rb")
