"""Slot files: one sequence of a session saved to a file and restored, in this process or another one, so that it
continues exactly as it would have: the target's KV cache, the tokens it holds and every drafter's state of it (the
draft model's KV, the MTP / EAGLE-3 head's rows and features, a DFlash drafter's injected keys and values, the n-gram
tables). llama-server's /slots/{id}?action=save|restore, whose restore loses the draft context (llama.cpp #28619).
The adaptive planner keeps nothing per sequence (its estimates are the machine's and the drafters', shared by every
sequence), so nothing of it is saved.

The format is numpy's .npz (a zip of .npy arrays), read without pickle and with every member stored, not compressed
(a member cannot inflate past the file's own bytes). Members:
  header                 UTF-8 JSON: magic, version, the model files (name and size), the drafter types, the KV
                         dtype, the context of a slot and the number of tokens
  tokens                 [n] what the sequence's KV cache holds, position by position
  target/...             the target cache (Context.seq_state)
  drafters/<type>/...    each drafter's state (Drafter.save_state)
A file that is no such zip, lacks a member, or comes from another model, drafter chain, KV dtype or version is a
StateError naming what differs; a restore that fails leaves the sequence empty.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

from spec_cli.errors import SpecCliError, StateError
from spec_cli.model.state_arrays import State, entry, ints, prefixed, token_ids, within
from spec_cli.runtime.session import Session

MAGIC = "spec-cli slot"
VERSION = 1


def identity(session: Session) -> dict:
    """What a slot file must have been saved by: the same model files, drafter chain and KV dtype."""
    engine = session.engine
    return {"model": _file_id(engine.target.gguf.path),
            "model_draft": _file_id(engine.draft_file) if engine.draft_file and session.chain else None,
            "types": session.types, "kv_dtype": str(engine.ctx.kv[0][0].dtype).removeprefix("torch.")}


def _file_id(path: Path) -> dict:
    return {"name": path.name, "size": path.stat().st_size}


def save_slot(session: Session, seq: int, tokens: list[int], path: Path) -> int:
    """Write sequence `seq` (whose KV cache holds `tokens`) to `path`, replacing it at once (written beside it
    first); returns the bytes written."""
    ctx = session.engine.ctx
    if ctx.lengths[seq] != len(tokens):
        raise SpecCliError(f"sequence {seq} holds {ctx.lengths[seq]} positions, not the {len(tokens)} tokens given")
    header = {"magic": MAGIC, "version": VERSION, **identity(session), "n_ctx_slot": ctx.n_ctx_seq,
              "n_tokens": len(tokens)}
    arrays = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), "tokens": ints(tokens),
              **prefixed("target/", ctx.seq_state(seq))}
    if session.chain is not None:
        arrays.update(prefixed("drafters/", session.chain.save_state(seq)))
    part = path.with_name(f".{path.name}.{os.getpid()}.part")  # no client names a file with a leading dot
    part.unlink(missing_ok=True)  # left by a crash
    try:
        with open(part, "xb") as f:  # x: never through a link someone left at that name
            np.savez(f, **arrays)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path.stat().st_size


def restore_slot(session: Session, seq: int, f: BinaryIO) -> list[int]:
    """Sequence `seq` from an open slot file; returns the tokens its KV cache now holds. StateError (the sequence
    then empty) for a file that does not fit this session."""
    arrays = read_arrays(f)
    check_header(arrays, session)
    ctx, chain = session.engine.ctx, session.chain
    try:
        tokens = token_ids(arrays, "tokens", ctx.config.n_vocab).tolist()
        ctx.restore_seq(seq, within(arrays, "target/"))
        if ctx.lengths[seq] != len(tokens):
            raise StateError(f"the target cache holds {ctx.lengths[seq]} positions, 'tokens' {len(tokens)}")
        if chain is not None:
            chain.restore_state(seq, within(arrays, "drafters/"), ctx.config.n_vocab)
    except StateError:
        erase_slot(session, seq)
        raise
    return tokens


def erase_slot(session: Session, seq: int) -> None:
    """Empty sequence `seq`: the target's cells and what every drafter holds of it."""
    session.engine.ctx.seq_rm(seq, 0)
    if session.chain is not None:
        session.chain.forget(seq)


def read_arrays(f: BinaryIO) -> State:
    """Every member of an .npz whose members are all stored (StateError for anything else)."""
    try:
        with zipfile.ZipFile(f) as z:
            packed = [i.filename for i in z.infolist() if i.compress_type != zipfile.ZIP_STORED]
        if packed:
            raise StateError(f"its member {packed[0]} is compressed (slot files store their arrays as they are)")
        f.seek(0)
        with np.load(f, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except StateError:
        raise
    except Exception as e:  # noqa: BLE001 - zipfile and numpy raise a dozen types for a damaged file
        raise StateError(f"not a slot file: {type(e).__name__}: {e}") from None


def check_header(arrays: State, session: Session) -> None:
    """The header's magic, version and identity against this session's (StateError naming the difference)."""
    try:
        header = json.loads(entry(arrays, "header", "u").tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateError(f"not a slot file: its header is no JSON ({e})") from None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise StateError("not a slot file of spec-cli (no header with its magic)")
    if header.get("version") != VERSION:
        raise StateError(f"a slot file of version {header.get('version')}; this spec-cli reads version {VERSION}")
    for key, ours in identity(session).items():
        if header.get(key) != ours:
            raise StateError(f"saved with {key} {_shown(header.get(key))}; this server has {_shown(ours)}")
    n_ctx = session.engine.ctx.n_ctx_seq
    if not isinstance(header.get("n_tokens"), int) or header["n_tokens"] >= n_ctx:
        raise StateError(f"holds {header.get('n_tokens')} tokens; a slot of this server holds {n_ctx - 1}")


def _shown(value) -> str:
    if isinstance(value, dict) and "name" in value:
        return f"{value['name']} ({value.get('size')} bytes)"
    return json.dumps(value)
