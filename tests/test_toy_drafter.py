"""A drafter type from outside spec-cli, written against the public interface only (`Drafter`, `register_drafter`).
SPEC_CLI_PLUGINS names this module, so the installed console script and the server register the toy type at startup:
its drafts must leave greedy output as the plain run's, and show in the statistics."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from spec_cli.speculative.base import Drafter, DraftParams
from spec_cli.speculative.registry import DrafterInputs, register_drafter


class RepeatLast(Drafter):
    """Proposes the last token again, --draft-max times: right on runs of one token, cheap to verify when wrong."""

    name = "toy-repeat"

    def __init__(self, inputs: DrafterInputs):
        self.n = inputs.params.draft_max

    def draft(self, params: list[DraftParams]) -> None:
        for p in params:
            if p.drafting:
                p.result = [p.id_last] * min(self.n, p.n_max)


register_drafter(RepeatLast.name, RepeatLast)

# --- the toy drafter through the command line and the server ------------------------------------------------------

SCRIPT = Path(sys.executable).with_name("spec-cli")
ROOT = Path(__file__).resolve().parents[1]
PROMPT = "abc abc abc abc abc"  # the tiny model continues it with a run of '(': the toy's drafts get accepted
GREEDY = ["-p", PROMPT, "-n", "24", "--temp", "0"]
TOY = ["--spec-type", "toy-repeat", "--draft-max", "4"]


def plugin_env(plugins: str = __name__) -> dict[str, str]:
    """The environment of a spec-cli process that loads `plugins`, importable from the repository root."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "SPEC_CLI_PLUGINS": plugins, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    env.pop("SPEC_CLI_DEBUG", None)
    return env


def spec_cli(*args: str, plugins: str = __name__) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=plugin_env(plugins),
                          stdin=subprocess.DEVNULL)


def test_speculative_simple_drafts_with_the_plugin_drafter(tiny_model_path):
    plain = spec_cli("run", "-m", str(tiny_model_path), *GREEDY, "--json")
    toy = spec_cli("speculative-simple", "-m", str(tiny_model_path), *GREEDY, *TOY, "--json")
    assert plain.returncode == 0, plain.stderr
    assert toy.returncode == 0, toy.stderr
    out = json.loads(toy.stdout)
    assert out["content"] == json.loads(plain.stdout)["content"]
    [stats] = out["drafters"]
    assert stats["name"] == "toy-repeat" and stats["n_gen_tokens"] > 0 and stats["n_acc_tokens"] > 0


def test_a_plugin_that_cannot_be_imported_is_a_usage_error():
    r = spec_cli("run", "--help", plugins="no_such_spec_plugin")
    assert r.returncode == 2, r.stderr
    assert "SPEC_CLI_PLUGINS" in r.stderr and "no_such_spec_plugin" in r.stderr and "Traceback" not in r.stderr


def test_the_server_drafts_with_the_plugin_drafter(tiny_model_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(SCRIPT), "server", "-m", str(tiny_model_path), "--port", str(port), "-np", "1", "-c", "256", *TOY]
    proc = subprocess.Popen(cmd, env=plugin_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url)
        request = {"prompt": PROMPT, "n_predict": 24, "temperature": 0}
        plain = httpx.post(url + "/completion", json={**request, "speculative": False}, timeout=60).json()
        toy = httpx.post(url + "/completion", json=request, timeout=60).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert toy["content"] == plain["content"]
    assert toy["generation_settings"]["speculative.types"] == ["toy-repeat"]
    assert toy["timings"]["draft_n"] > 0 and toy["timings"]["draft_n_accepted"] > 0


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)
