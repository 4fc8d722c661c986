"""A deliberately altered spec-cli "build", for the regression gate's tests and its detection measurement
(scripts/gate_trials.sh): `python tests/altered_build.py bench ...` runs spec-cli with one change, chosen by
environment variables (none set: spec-cli unchanged):

- ALTERED_BUILD_SLOWDOWN=F (F >= 1): every model forward (Context.decode) takes F times as long: after each, a sleep
  of (F - 1) times its own duration. Proportional, so the build stays F times slower whatever the machine's speed
  at the moment.
- ALTERED_BUILD_CHANGE=text: every forward's logits favour one token by +100 (ALTERED_BUILD_TOKEN, default 97, the
  byte 'a' of byte-level vocabularies): greedy output changes, plain and speculative alike.
- ALTERED_BUILD_CHANGE=acceptance: greedy verification keeps one accepted draft token fewer per step (it becomes
  the step's own token instead): the output stays the same, the acceptance counters drop.

When the gate spawns the current build again (`paired.current_command`), it runs this script with the same
environment, so a paired run of this script against the real spec-cli compares the altered build with the real one.
"""

from __future__ import annotations

import os
import time

from spec_cli.model.context import Context


def _slow(factor: float) -> None:
    decode = Context.decode

    def slowed(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = decode(self, *args, **kwargs)
        time.sleep((factor - 1) * (time.perf_counter() - t0))
        return out

    Context.decode = slowed


def _favour_token(token: int) -> None:
    decode = Context.decode

    def biased(self, *args, **kwargs):
        out = decode(self, *args, **kwargs)
        out.logits[:, token] += 100.0
        return out

    Context.decode = biased


def _accept_one_fewer() -> None:
    from spec_cli.runtime import generate

    verify = generate.verify_match

    def fewer(sampler, logits, draft):
        emitted = verify(sampler, logits, draft)
        return emitted[:-1] if len(emitted) > 1 else emitted  # the last accepted draft token becomes the step's own

    generate.verify_match = fewer


def main() -> None:
    factor = float(os.environ.get("ALTERED_BUILD_SLOWDOWN", "1"))
    if factor > 1:
        _slow(factor)
    change = os.environ.get("ALTERED_BUILD_CHANGE", "")
    if change == "text":
        _favour_token(int(os.environ.get("ALTERED_BUILD_TOKEN", "97")))
    elif change == "acceptance":
        _accept_one_fewer()
    elif change:
        raise SystemExit(f"ALTERED_BUILD_CHANGE must be text or acceptance, not '{change}'")
    from spec_cli.cli import main as spec_cli_main

    spec_cli_main()


if __name__ == "__main__":
    main()
