"""Greedy outputs of a -tp N target as one JSON line, in a process of its own (a tensor-parallel group is one per
process): `python -m tests.tp_driver MODEL DRAFT|- CHAIN|- N_SEQ TP` (tests/test_tensor_parallel.py)."""

from __future__ import annotations

import json
import sys

from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.session import open_session
from spec_cli.speculative.base import SpecParams

# prompts that repeat themselves, so n-gram drafters find matches (token ids of the tiny vocabulary)
PROMPTS = [
    [60, 61, 62, 60, 61, 62, 60, 61, 62, 60, 61],
    [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42],
    [70, 71, 72, 73, 74, 70, 71, 72, 73],
    [80, 81, 82, 83, 80, 81, 82, 83, 80, 81],
]
N_PREDICT = 32


def greedy_outputs(model: str, draft: str | None, chain: str, n_seq: int, tp: int) -> dict:
    """Every sequence's tokens, twice (the second round after a reset: clear() on every shard), and how many draft
    tokens were accepted (rejected ones were rolled back with seq_rm)."""
    spec = SpecParams(types=[t for t in chain.split(",") if t], draft_max=6, draft_p_min=0.0,
                      ngram_simple_size_n=2, ngram_simple_size_m=8)
    session = open_session(EngineOptions(model=model, model_draft=draft, n_ctx=256 * n_seq, n_seq=n_seq,
                                         device="cpu", spec=spec, tensor_parallel=tp))
    rounds, accepted = [], 0
    for _ in range(2):
        session.reset()
        gen = session.generator()
        outs = {seq: list(gen.start(seq, prompt, SamplingParams(temp=0.0), N_PREDICT).tokens)
                for seq, prompt in enumerate(PROMPTS[:n_seq])}
        seqs = dict(gen.active)
        while emitted := gen.step():
            for e in emitted:
                outs[e.seq].extend(e.tokens)
        rounds.append([outs[seq] for seq in range(n_seq)])
        accepted += sum(s.n_accepted for s in seqs.values())
    return {"rounds": rounds, "accepted": accepted}


if __name__ == "__main__":
    model, draft, chain, n_seq, tp = sys.argv[1:]
    print(json.dumps(greedy_outputs(model, None if draft == "-" else draft, "" if chain == "-" else chain,
                                    int(n_seq), int(tp))))
