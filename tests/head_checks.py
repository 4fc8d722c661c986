"""What the tests of the trained draft heads with files of their own (EAGLE-3, DFlash) check alike: a training run
next to an untrained one, that it learned, that it accepts more at run time, a bench sweep and a server with slots and
per-request types drafting with it."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import httpx
import numpy as np
from gguf import GGUFReader, quants

from spec_cli.model.loader import load_model
from spec_cli.model.sampling import SamplingParams
from spec_cli.runtime.generate import generate
from spec_cli.text.tokenizer import Tokenizer
from spec_cli.train.eagle3_data import request_prompts
from spec_cli.train.requests import all_requests
from tests.server_harness import LiveServer, greedy_reference
from tests.server_harness import make_session as server_session
from tests.test_generate_sampling import exact_two_token_distribution

GREEDY = SamplingParams(temp=0.0, ignore_eos=True)


def trained_and_untrained(train, target_path, d, cfg):
    """(the trained file's path, its TrainResult, the training losses, the untrained file's path) of `train(loaded,
    out, cfg, progress)` on the tiny target."""
    lm = load_model(target_path, device="cpu", dtype="f32")
    losses = []
    result = train(lm, d / "trained.gguf", cfg, lambda p: losses.append(p.info["loss"]) if p.stage == "train" else None)
    untrained = train(lm, d / "untrained.gguf", replace(cfg, steps=0))
    return result.out_path, result, losses, untrained.out_path


def training_prompts(target_path, n: int) -> list[list[int]]:
    tok = Tokenizer.from_metadata(load_model(target_path, device="cpu").gguf.metadata)
    return request_prompts(tok, [r for r in all_requests() if not r.held_out][:n], 16)


def assert_it_learned(result, losses: list[float], steps: int) -> None:
    """The loss fell, the held-out acceptance rose, and the checkpoint is there."""
    assert len(losses) == steps and np.mean(losses[-20:]) < 0.6 * np.mean(losses[:20])
    assert result.acc_after > result.acc_before + 0.05 and result.mean_len_after > result.mean_len_before
    assert result.out_path.with_suffix(".ckpt.pt").exists()


def n_accepted(make_session, target_path, path, draft_max: int = 3) -> int:
    """Draft tokens accepted over four training prompts, 24 tokens each, drafting with the file at `path`."""
    session = make_session(target_path, path, draft_max=draft_max)
    return sum(generate(session.generator(), p, GREEDY, 24).n_accepted for p in training_prompts(target_path, 4))


def bench_sweep(spec_cli, target, md, kind: str, d, prompt: str, *flags: str) -> None:
    """`bench` with -md over `kind` alone and chained with ngram-mod, two draft lengths: every test runs and drafts."""
    prompts = d / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt": prompt}) + "\n")
    run = spec_cli("bench", "-m", str(target), "-md", str(md), "--spec-type", f"{kind};ngram-mod,{kind}", "--prompts",
                   str(prompts), "-n", "16", "-r", "1", "-t", "1", "-dev", "cpu", "--no-warmup", "-o", "jsonl", *flags)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    spec = [r for r in rows if r.get("spec_type") not in (None, "none")]
    assert {r["spec_type"] for r in spec} == {kind, f"ngram-mod,{kind}"} and len(spec) == 4
    assert all(r["model_draft"] for r in spec) and any(r["n_drafted"] > 0 for r in spec)


def server_types(target, md, kind: str, prompt: str) -> None:
    """A server of two slots chaining ngram-mod and `kind`: every request's output is plain greedy's, whichever
    types it asks for."""
    prompts = [prompt, "abc abc abc abc abc", "Hello world Hello world Hello world"]
    ref = greedy_reference(target, prompts, 16)
    session = server_session(target, n_seq=2, spec_types=f"ngram-mod,{kind}", draft=md, draft_max=3)
    with LiveServer(session) as srv:
        for text in prompts:
            for types in (None, [kind], []):
                body = {"prompt": text, "n_predict": 16, "temperature": 0, "return_tokens": True}
                if types is not None:
                    body["speculative"] = {"types": types}
                out = httpx.post(srv.url + "/completion", json=body, timeout=120).json()
                assert out["tokens"] == ref[text], (text, types)
                assert out["generation_settings"]["speculative.types"] == (
                    ["ngram-mod", kind] if types is None else types)
    assert session.chain.stats[kind].n_gen_tokens > 0


def assert_rejection_keeps_the_distribution(session, prompt: list[int]) -> None:
    """Rejection sampling with `session`'s drafter (verify="rejection"): the first two tokens sampled over 600 seeds
    follow plain sampling's joint distribution (total variation < 0.12), and some drafts are accepted, some not."""
    params = dict(temp=1.5, top_k=3, top_p=1.0, min_p=0.0)  # flat: several pairs likely, drafts often rejected
    exact = exact_two_token_distribution(session, prompt, SamplingParams(**params))
    n, counts, accepted, drafted = 600, Counter(), 0, 0
    for seed in range(n):
        seq = generate(session.generator(), prompt, SamplingParams(seed=seed, ignore_eos=True, **params), 4)
        counts[tuple(seq.tokens[len(prompt) : len(prompt) + 2])] += 1
        accepted, drafted = accepted + seq.n_accepted, drafted + seq.n_drafted
    tv = 0.5 * sum(abs(counts[k] / n - exact.get(k, 0.0)) for k in set(exact) | set(counts))
    assert tv < 0.12, f"total variation {tv:.3f}"
    assert drafted > 0 and 0 < accepted < drafted


class GGUFContents:
    """A GGUF file read with gguf's reader: its fields' values and its tensors as float32 arrays in numpy's order
    (dequantized), the form the Hugging Face references of the head tests compute with."""

    def __init__(self, path) -> None:
        reader = GGUFReader(str(path))
        self.fields = reader.fields
        self.tensors = {x.name: x for x in reader.tensors}

    def value(self, key: str):
        return self.fields[key].contents()

    def array(self, name: str) -> np.ndarray:
        x = self.tensors[name]
        data = quants.dequantize(x.data, x.tensor_type) if x.tensor_type.name not in ("F32", "F16") else x.data
        return np.asarray(data, dtype=np.float32).reshape([int(v) for v in reversed(x.shape)])
