"""CUDA graphs of the decode/verify step, captured explicitly (`torch.cuda.CUDAGraph`), one per padded shape.

Why explicit: under torch.compile's mode="reduce-overhead" every step went through dynamo's, AOTAutograd's and
cudagraph trees' Python wrappers around the replay, and the embedding, masks, rope gathers, final norm and output
head ran outside the graph, kernel by kernel (docs/cuda.md: on an H200 the host's side of a step was the
cost). Here one replay runs the whole step, as vLLM and SGLang capture theirs: embedding, masks and rope from the
step's indices, the compiled decoder blocks (compiled.CompiledStep, inductor's kernels), the final norm and the
output head, into static outputs. The host writes one int64 index buffer, replays, and gathers its rows.

Shapes: G sequences x T rows padded to compiled.ROW_BUCKETS, the key range to compiled.kv_bucket; one graph per
(G, T, key range, logits or not) captured at its first use (warmup runs on a side stream compile the blocks, then
the capture), all in one memory pool; the outputs are per (G, T) buffers outside it. A graph reads and writes
fixed addresses: every index of the step comes through the buffer, the KV cache is the context's (never
reallocated) and the rope tables it gathers from are kept alive by the graph's owner.

Padded rows write their keys and values to the cell right after their sequence's last row of the step: every
real row of the step comes before it (no real row attends it) and the sequence's next row overwrites it. A step
that fills a sequence's context writes them to the spare cell the KV cache keeps past each context (Context), so
every step of a bucket's shape replays its graph (a graphless step cost 7x a replay on an H100).
"""

from __future__ import annotations

import torch

from spec_cli.model.transformer import rope_table

WARMUP = 2  # runs before a capture: the first compiles the blocks for the shape, the second runs as captured


class StepGraphs:
    """The CUDA graphs of one context's steps. `capture=False` runs the same step from the same buffers without a
    graph, on any device (how the CPU tests check the layout)."""

    def __init__(self, ctx, capture: bool = True):
        self.ctx = ctx
        self.capture = capture
        self.buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}  # (G, T) -> [G * T, n_vocab] float32
        # (G, T, taps) -> [G * T, len(taps), D]: the target features of the context's taps (Context.set_taps)
        self.features: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
        self.graphs: dict[tuple[int, int, int, bool, tuple[int, ...]], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # rope tables the graphs read

    def run(self, G: int, T: int, n_kv: int, tokens: list[int], positions: list[int], seqs: list[int],
            ends: dict[int, int], order: list[int], flagged: list[int],
            with_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One step of G x T padded rows (`tokens`, `positions`: flat [G * T]; `seqs`: the cache sequence of each
        group; `ends`: each sequence's length after the step) -> hidden states of the rows `order` (flat indices,
        batch order) [n, D], the logits of the rows `flagged` [m, n_vocab] when `with_logits`, and the rows' target
        features [n, len(taps), D] when the context has taps (the graph of a shape is per set of taps)."""
        GT, taps = G * T, self.ctx.taps
        real = set(order)
        write_seq = [seqs[f // T] for f in range(GT)]
        write_pos = [positions[f] if f in real else ends[write_seq[f]] for f in range(GT)]
        values = (tokens + positions + write_seq + write_pos + seqs + order + [0] * (GT - len(order))
                  + flagged + [0] * (GT - len(flagged)))
        with torch.inference_mode():
            idx, _, hidden = self._buffers(G, T)
            logits = self._logits(G, T) if with_logits else None
            features = self._features(G, T, taps) if taps else None
            idx.copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
            key = (G, T, n_kv, with_logits, taps)
            if not self.capture:
                self._step(key)
            else:
                graph = self.graphs.get(key)
                if graph is None:
                    graph = self.graphs[key] = self._capture(key)
                graph.replay()
            at = 4 * GT + G  # order, then flagged
            rows = idx[at : at + len(order)]
            return (hidden[rows], logits[idx[at + GT : at + GT + len(flagged)]] if with_logits else None,
                    features[rows] if taps else None)

    def _buffers(self, G: int, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(G, T) -> the index buffer [6 G T + G] int64 (tokens, positions, write sequences, write positions,
        sequences, row order, flagged rows), every row's flat index [G T] (all are written), hidden out [G T, D]."""
        bufs = self.buffers.get((G, T))
        if bufs is None:
            GT, device = G * T, self.ctx.model.layer_devices[0]
            bufs = self.buffers[(G, T)] = (
                torch.zeros(6 * GT + G, dtype=torch.long, device=device),
                torch.arange(GT, device=device),
                torch.zeros(GT, self.ctx.config.n_embd, dtype=self.ctx.model.dtype, device=device),
            )
        return bufs

    def _logits(self, G: int, T: int) -> torch.Tensor:
        out = self.logits.get((G, T))
        if out is None:
            device = self.ctx.model.output_device
            out = self.logits[(G, T)] = torch.zeros(G * T, self.ctx.config.n_vocab, device=device)
        return out

    def _features(self, G: int, T: int, taps: tuple[int, ...]) -> torch.Tensor:
        out = self.features.get((G, T, taps))
        if out is None:
            n_embd, device = self.ctx.config.n_embd, self.ctx.model.layer_devices[0]
            out = self.features[(G, T, taps)] = torch.zeros(G * T, len(taps), n_embd, dtype=self.ctx.model.dtype,
                                                            device=device)
        return out

    def _step(self, key: tuple[int, int, int, bool, tuple[int, ...]]) -> None:
        """The step a graph captures: from the index buffer to the hidden (logits, features) outputs."""
        G, T, n_kv, with_logits, taps = key
        ctx, GT = self.ctx, G * T
        idx, all_rows, hidden = self._buffers(G, T)
        tokens, positions, write_seq, write_pos, seqs = idx[: 4 * GT + G].split([GT, GT, GT, GT, G])
        plan = ctx.forward_plan(positions.view(G, T), all_rows, write_seq, write_pos, seqs, n_kv)
        h, feats = ctx.model.forward_tapped(tokens.view(G, T), plan, ctx.kv, taps, step=ctx.step)
        h = h.reshape(GT, -1)
        hidden.copy_(h)
        if taps:
            self._features(G, T, taps).copy_(feats.reshape(GT, len(taps), -1))
        if with_logits:
            self._logits(G, T).copy_(ctx.model.logits(h))

    def _capture(self, key: tuple[int, int, int, bool, tuple[int, ...]]) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (as torch's CUDA-graph docs ask), then capture. The warmup runs are this
        step's own: they write the same keys and values the replay writes again."""
        device = self.ctx.model.layer_devices[0]
        cfg = self.ctx.config
        # grown to the context before capture, so the step reads these very tables; kept alive with the graph (a
        # context with a longer one may grow the shared table later)
        tables = [rope_table(cfg.rope_dim, base, cfg.rope_scale, self.ctx.n_ctx_seq, device)
                  for base in {cfg.rope_base, cfg.rope_base_swa}]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self._step(key)
        torch.cuda.current_stream(device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(key)
        self.kept.extend(t for t in tables if all(t is not k for k in self.kept))
        return graph
