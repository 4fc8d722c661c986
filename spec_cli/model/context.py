"""A model plus its static KV cache for n_seq sequences (llama.cpp's llama_context + llama_memory).

K/V per layer: [n_seq, kv_heads, n_ctx_seq, head_dim], written by position. Each sequence's cells are exactly
positions [0, length): a decode appends rows at positions length, length+1, ... and rollback (`seq_rm`) only
lowers the length, so the next write overwrites and attention never sees what was removed. n_ctx is split
evenly across sequences like llama-server's slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from spec_cli.errors import SpecCliError, StateError
from spec_cli.model.batch import Batch
from spec_cli.model.config import ModelConfig
from spec_cli.model.loader import LoadedModel
from spec_cli.model.state_arrays import State, array_of, copy_into, fits, scalar
from spec_cli.model.transformer import ForwardPlan, Transformer
from spec_cli.options import default


def kv_shape(cfg: ModelConfig, n_ctx: int, n_seq: int) -> tuple[int, int, int, int]:
    """One layer's K (or V) cache: [n_seq, kv_heads, n_ctx / n_seq + 1, head_dim]. The spare cell past each sequence's
    context is where a CUDA graph's padded rows write when a step fills the sequence (cuda_graphs.py); nothing
    attends it."""
    return n_seq, cfg.n_head_kv, n_ctx // n_seq + 1, cfg.head_dim


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The ubatches' rows in one tensor; one ubatch (every decode/verify step) as it is, not a copy (600 KB of
    logits per row on a 151936-token vocabulary)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass
class DecodeOutput:
    logits: torch.Tensor  # [n_rows_with_logits_flag, n_vocab] float32, in batch order
    hidden: torch.Tensor | None  # [n_rows, n_embd] pre-final-norm hidden state of every row, in batch order
    features: torch.Tensor | None = None  # [n_rows, len(taps), n_embd] the tapped layers' inputs (Context.taps)


class Context:
    def __init__(self, loaded: LoadedModel, n_ctx: int = default("ctx_size"), n_seq: int = 1,
                 n_batch: int = default("batch_size"), n_ubatch: int = default("ubatch_size"),
                 compile: str = "off"):  # --compile (options: auto), off here: contexts made outside the engine
        if n_seq < 1:
            raise SpecCliError("n_seq must be at least 1")
        if n_ctx < n_seq:
            raise SpecCliError(f"context of {n_ctx} tokens cannot hold {n_seq} sequences")
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.n_seq = n_seq
        self.n_ctx = n_ctx
        self.n_ctx_seq = n_ctx // n_seq
        self.n_batch = max(1, n_batch)
        self.n_ubatch = max(1, min(n_ubatch, self.n_batch))
        kv_dtype = self.model.dtype
        shape = kv_shape(self.config, n_ctx, n_seq)
        self.kv = [
            (torch.zeros(shape, dtype=kv_dtype, device=dev), torch.zeros(shape, dtype=kv_dtype, device=dev))
            for dev in self.model.layer_devices
        ]
        self.lengths = [0] * n_seq
        self.step = None  # compiled.CompiledStep with --compile: decode/verify shapes run compiled, padded to buckets
        self.graphs = None  # cuda_graphs.StepGraphs with --compile on CUDA: those steps replayed as CUDA graphs
        if compile != "off":
            self._init_compiled(compile)
        self.n_decode = 0  # number of decode calls (llama.cpp's n_eval/n_decode_total)
        # Target features on request (set_taps): the layers whose inputs every decode returns for every row, what
        # the last decode returned, and how many rows were captured in all (none unless a drafter asked)
        self.taps: tuple[int, ...] = ()
        self.last_features: torch.Tensor | None = None  # [n_rows, len(taps), n_embd] of the last decode
        self.n_tapped_rows = 0

    def _init_compiled(self, mode: str) -> None:
        from spec_cli.model import compiled

        if getattr(self.loaded, "shard", None) is not None:  # -tp: the followers' contexts are not compiled
            return
        name = self.loaded.gguf.path.stem
        if compiled.wanted(mode, self.model, name):
            on_cuda = any(d.type == "cuda" for d in self.model.layer_devices)
            self.step = compiled.CompiledStep(name, on_cuda)
            if on_cuda:
                from spec_cli.model.cuda_graphs import StepGraphs

                self.graphs = StepGraphs(self)

    @property
    def device(self) -> torch.device:
        return self.model.output_device

    @property
    def ragged(self) -> bool:
        """Whether a decode of several sequences runs their rows as they come, in one group (the CPU kernels take
        each row's sequence and position), rather than padded to [G, T]: its cost is then its rows (`step_rows`)."""
        return self.step is None and isinstance(self.model, Transformer) and self.model.runs_ragged(self.kv)

    def step_rows(self, batch: Batch) -> int:
        """The rows a decode of `batch` computes: its own where ragged, else G x the longest sequence's."""
        if self.ragged:
            return len(batch)
        counts: dict[int, int] = {}
        for seq in batch.seq_ids:
            counts[seq] = counts.get(seq, 0) + 1
        return len(counts) * max(counts.values())

    # --- memory (llama_memory_seq_*) --------------------------------------------------------------------

    def pos_max(self, seq: int) -> int:
        return self.lengths[seq] - 1

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        """Remove positions [p0, p1) (p1 < 0 = to the end). Only tail removal: the cache has no holes."""
        seqs = range(self.n_seq) if seq < 0 else [seq]
        p0 = max(p0, 0)
        for s in seqs:
            if p1 >= 0 and p1 < self.lengths[s]:
                if p0 >= p1:
                    continue
                raise SpecCliError("seq_rm of a middle range is not supported by the static KV cache")
            self.lengths[s] = min(self.lengths[s], p0)

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Copy positions [0, p1) of src into dst (prompt-prefix sharing); dst's tail is dropped."""
        if p0 != 0:
            raise SpecCliError("seq_cp copies prefixes only (p0 must be 0)")
        n = self.lengths[src] if p1 < 0 else min(p1, self.lengths[src])
        if src != dst:
            for k, v in self.kv:
                k[dst, :, :n] = k[src, :, :n]
                v[dst, :, :n] = v[src, :, :n]
        self.lengths[dst] = n

    def clear(self) -> None:
        self.lengths = [0] * self.n_seq

    # --- one sequence's cache as arrays (slot files) ------------------------------------------------------------

    def seq_state(self, seq: int) -> State:
        """Sequence `seq`'s cells: its length and, per layer i, `k{i}` / `v{i}` [kv_heads, length, head_dim]."""
        if self.loaded.shard is not None:
            raise SpecCliError("a -tp shard's cache lives on every rank: its sequences cannot be saved")
        n = self.lengths[seq]
        out = {"length": np.asarray(n)}
        for i, (k, v) in enumerate(self.kv):
            out[f"k{i}"], out[f"v{i}"] = array_of(k[seq, :, :n]), array_of(v[seq, :, :n])
        return out

    def restore_seq(self, seq: int, state: State) -> None:
        """Sequence `seq`'s cells from `seq_state`'s arrays, all checked before any is written (StateError)."""
        if self.loaded.shard is not None:
            raise SpecCliError("a -tp shard's cache lives on every rank: its sequences cannot be restored")
        n = scalar(state, "length", 0, self.n_ctx_seq - 1)
        pairs = [(t[seq, :, :n], state.get(f"{name}{i}"), f"{name}{i}")
                 for i, kv in enumerate(self.kv) for name, t in zip("kv", kv)]
        for dst, a, what in pairs:
            if a is None:
                raise StateError(f"'{what}' is missing")
            fits(dst, a, what)
        for dst, a, _ in pairs:
            copy_into(dst, a)
        self.lengths[seq] = n

    # --- target features on request --------------------------------------------------------------------------

    def set_taps(self, layers) -> None:
        """Capture the input of these layers (ids in [0, n_layer]; n_layer = the final pre-norm state) for every row
        of every decode from now on, in `DecodeOutput.features` and `last_features`; none (the default) captures
        and costs nothing."""
        n_layer = self.config.n_layer_main
        taps = tuple(sorted(set(layers)))
        if any(not 0 <= layer <= n_layer for layer in taps):
            raise SpecCliError(f"target layers {list(taps)} asked for: {self.loaded.gguf.path.name} has layers "
                               f"0..{n_layer - 1} (and {n_layer}: the final state)")
        self.taps = taps
        self.last_features = None

    def features_of(self, layers: tuple[int, ...]) -> torch.Tensor:
        """The last decode's features of `layers` (each tapped): [n_rows, len(layers), n_embd], batch order."""
        if self.last_features is None or any(layer not in self.taps for layer in layers):
            raise SpecCliError(f"the target's layers {list(layers)} were not captured (Context.set_taps)")
        if layers == self.taps:
            return self.last_features
        return self.last_features[:, [self.taps.index(layer) for layer in layers]]

    # --- decode ------------------------------------------------------------------------------------------

    def decode(self, batch: Batch, hidden: bool = False,
               head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DecodeOutput:
        """One forward over the batch (split into ubatches of n_ubatch rows). Hidden states of every row come
        back when `hidden` is set; the tapped layers' inputs (set_taps) whenever there are taps. `head` maps the
        flagged rows' pre-norm hidden states [n, D] to their logits instead of the model's output layer (a draft
        vocabulary's rows)."""
        if len(batch) == 0:
            raise SpecCliError("decode of an empty batch")
        if len(batch) > self.n_batch:
            raise SpecCliError(f"batch of {len(batch)} rows exceeds n_batch {self.n_batch}")
        self._check(batch)
        logits, hiddens, features = [], [], []
        for start in range(0, len(batch), self.n_ubatch):
            rows = range(start, min(start + self.n_ubatch, len(batch)))
            h, graph_logits, feats = self._decode_ubatch(batch, rows, head is None)  # [len(rows), D]
            flags = [i - start for i in rows if batch.logits[i]]
            if flags:
                logits.append(graph_logits if graph_logits is not None else (head or self.model.logits)(h[flags]))
            if hidden:
                hiddens.append(h)
            if feats is not None:
                features.append(feats)
        self.n_decode += 1
        if logits:
            out_logits = _joined(logits)
        else:
            out_logits = torch.empty(0, self.config.n_vocab, device=self.device)
        out = DecodeOutput(out_logits, _joined(hiddens) if hidden else None, _joined(features) if features else None)
        if self.taps:
            self.last_features = out.features
            self.n_tapped_rows += len(batch)
        return out

    def _check(self, batch: Batch) -> None:
        expected = list(self.lengths)
        for tok, pos, seq in zip(batch.tokens, batch.pos, batch.seq_ids):
            if not 0 <= seq < self.n_seq:
                raise SpecCliError(f"sequence id {seq} out of range [0, {self.n_seq})")
            if not 0 <= tok < self.config.n_vocab:
                raise SpecCliError(f"token id {tok} out of range [0, {self.config.n_vocab})")
            if pos != expected[seq]:
                raise SpecCliError(f"sequence {seq}: position {pos} given, {expected[seq]} expected (positions must be consecutive)")
            if pos >= self.n_ctx_seq:
                raise SpecCliError(f"sequence {seq}: context full ({self.n_ctx_seq} tokens per sequence)")
            expected[seq] += 1

    def _decode_ubatch(self, batch: Batch, rows: range,
                       with_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """-> hidden states of `rows` [n, D] in batch order, the flagged rows' logits where a CUDA graph computed
        them (`with_logits`: the model's own output head), else None (decode applies the head), and the rows'
        features [n, len(taps), D] (None without taps)."""
        # group rows per sequence, padded to T rows each: tokens/positions [G, T]
        groups: dict[int, list[int]] = {}
        for i in rows:
            groups.setdefault(batch.seq_ids[i], []).append(i)
        seqs = list(groups)
        G, T = len(seqs), max(len(r) for r in groups.values())
        step = self.step if self.step is not None and self.step.fits(G, T) and self.step.usable(self.model) else None
        if step is not None and not step.pads and max(self.lengths[s] + len(groups[s]) for s in seqs) < 2:
            step = None  # a sequence's first row alone: one key, a size torch would compile a graph of its own for
        pad = step is not None and step.pads
        ragged = step is None and G > 1 and self.ragged
        if pad:  # CUDA graphs: pad to the row buckets; padded groups read (never write) a real sequence
            from spec_cli.model.compiled import bucket

            G, T = bucket(G), bucket(T)
        if ragged:  # the rows as they come, one group: a verify step costs its rows, not G x the longest draft
            G, T = 1, len(rows)
        tokens, positions, flat_of_row, writes = _grid(batch, {None: list(rows)} if ragged else groups, G, T)
        write_rows, write_seq, write_pos = writes
        for seq in seqs:
            self.lengths[seq] += len(groups[seq])
        n_kv = max(self.lengths[s] for s in seqs)
        if pad:
            from spec_cli.model.compiled import kv_bucket

            n_kv = kv_bucket(n_kv, self.n_ctx_seq)
            seqs = seqs + [seqs[0]] * (G - len(seqs))
        order = [flat_of_row[i] for i in rows]
        if pad and self.graphs is not None:
            flagged = [flat_of_row[i] for i in rows if batch.logits[i]]
            return self.graphs.run(G, T, n_kv, tokens, positions, seqs, {s: self.lengths[s] for s in seqs}, order,
                                   flagged, with_logits and bool(flagged))
        # every index of the step in one host-to-device copy, issued before the forward (a copy after it would
        # wait for the GPU to finish the step before the output head could be queued)
        contiguous = step is None and seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # compiled: no slice
        parts = (tokens, positions, write_rows, write_seq, write_pos, [] if contiguous else seqs, order)
        packed = torch.tensor([v for part in parts for v in part], dtype=torch.long)
        packed = packed.to(self.model.layer_devices[0], non_blocking=True).split([len(p) for p in parts])
        tokens_t, pos_t, rows_t, seq_t, wpos_t, seqs_t, order_t = packed
        kv_seqs = slice(seqs[0], seqs[0] + len(seqs)) if contiguous else seqs_t
        if ragged:
            plan = ForwardPlan(pos_t.view(G, T), rows_t, seq_t, wpos_t, kv_seqs, n_kv, None, None, ragged=True)
        else:
            plan = self.forward_plan(pos_t.view(G, T), rows_t, seq_t, wpos_t, kv_seqs, n_kv)
        with torch.inference_mode():
            if step is None and not self.taps:  # every model's, the draft heads' runners included (never compiled)
                hidden, feats = self.model.forward_hidden(tokens_t.view(G, T), plan, self.kv), None  # [G, T, D]
            else:
                hidden, feats = self.model.forward_tapped(tokens_t.view(G, T), plan, self.kv, self.taps, step=step)
        order_t = order_t.to(hidden.device)
        if feats is not None:
            feats = feats.reshape(G * T, len(self.taps), -1)[order_t]
        return hidden.reshape(G * T, -1)[order_t], None, feats

    def forward_plan(self, pos: torch.Tensor, write_rows: torch.Tensor, write_seq: torch.Tensor,
                     write_pos: torch.Tensor, kv_seqs: slice | torch.Tensor, n_kv: int) -> ForwardPlan:
        """The plan of a step whose indices are on the device already (masks built there: no host sync)."""
        key_pos = torch.arange(n_kv, device=pos.device)
        causal = key_pos <= pos[..., None]  # [G, T, n_kv]; cells past a sequence's length are > any of its positions
        window = self.config.sliding_window
        swa = causal & (pos[..., None] - key_pos < window) if window and any(self.config.swa_layers) else None
        return ForwardPlan(
            positions=pos,
            write_rows=write_rows,
            write_seq=write_seq,
            write_pos=write_pos,
            kv_seqs=kv_seqs,
            n_kv=n_kv,
            mask_full=causal.unsqueeze(1),
            mask_swa=swa.unsqueeze(1) if swa is not None else None,
        )


def _grid(batch: Batch, groups: dict[int | None, list[int]], G: int, T: int):
    """The rows of `groups` (the batch rows of each group: a sequence's, or every row of a ragged step) laid out as
    [G, T], flat: -> (tokens, positions, the flat index of each batch row, (flat rows, sequences, positions) of the
    KV writes). Padded cells hold token 0 at position 0."""
    tokens, positions = [0] * (G * T), [0] * (G * T)
    flat_of_row: dict[int, int] = {}
    write_rows, write_seq, write_pos = [], [], []
    for g, rows in enumerate(groups.values()):
        for t, i in enumerate(rows):
            flat = flat_of_row[i] = g * T + t
            tokens[flat], positions[flat] = batch.tokens[i], batch.pos[i]
            write_rows.append(flat)
            write_seq.append(batch.seq_ids[i])
            write_pos.append(batch.pos[i])
    return tokens, positions, flat_of_row, (write_rows, write_seq, write_pos)
