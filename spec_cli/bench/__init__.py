"""`spec-cli bench`: llama-bench's grid plus speculative sweeps, the verify-cost curve and a regression gate.

This module holds the one result record every part shares (runner writes it, printers / compare / plot read it as
plain dicts, so a json file from an earlier run reads back the same). Field order follows llama-bench's `test`
fields: build and hardware, where it ran, model, engine parameters, test shape, then the speculative and
verify-cost fields for those kinds, then results.

Layout: params (lists, ranges, instances), runner (timing), verify_cost (the k-row forward curve), printers
(md/csv/json/jsonl/sql), paired (the A/B gate against another build), compare (against a stored run), counters
(the exact counters both gates compare), plot (matplotlib).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

from spec_cli.options import DRAFTER_SETTINGS
from spec_cli.speculative.base import SpecParams

BUILD_FIELDS = ("build_commit", "build_version", "torch_version", "cpu_info", "gpu_info", "backends")
RUN_FIELDS = ("device", "dtype")
MODEL_FIELDS = ("model_filename", "model_type", "model_size", "model_n_params")
PARAM_FIELDS = ("n_batch", "n_ubatch", "n_threads", "n_gpu_layers", "flash_attn", "compile", "devices")
SHAPE_FIELDS = ("test", "n_prompt", "n_gen", "n_depth")
# the model-free drafters' own settings (SpecParams' ngram_* and suffix_* fields, the --spec-ngram-* and
# --spec-suffix-* flags), each read by the drafter it is named after: empty on rows whose chain lacks that drafter
NGRAM_FIELDS = tuple(f for f in SpecParams.__dataclass_fields__ if f.startswith(DRAFTER_SETTINGS))
_FLOAT_NGRAM_FIELDS = {f for f in NGRAM_FIELDS if SpecParams.__dataclass_fields__[f].type == "float"}
# a speculative test's parameters that bench sweeps for each prompt set and temperature (params.py), outermost first;
# the draft model's are read by draft-simple only; spec_accept (--spec-accept's rates) by the synthetic drafter's tests
# only (spec_type "synthetic", speculative/synthetic.py): a row with it measured synthetic acceptance
DRAFT_MODEL_FIELDS = ("model_draft", "n_gpu_layers_draft", "devices_draft", "draft_vocab")
SWEPT_CASE_FIELDS = ("spec_type", "spec_accept") + DRAFT_MODEL_FIELDS + (
    "draft_max", "draft_min", "draft_p_min", "spec_verify", "spec_select", "spec_mtp_rollback")
CASE_FIELDS = ("temp",) + SWEPT_CASE_FIELDS + NGRAM_FIELDS + ("warm",)
SPEC_FIELDS = ("prompt_set", "n_prompts") + CASE_FIELDS + (
    "n_drafted", "n_accepted", "n_steps", "n_tokens", "n_drafts", "acceptance", "mean_acc_len", "tokens_per_step",
    "forwards_per_token", "rows_per_token", "acc_per_pos", "text_hash", "prompt_ns", "draft_ms", "verify_ms",
    "speedup")
VERIFY_FIELDS = ("verify_k", "cost_ratio", "break_even_len", "break_even_acc")
RESULT_FIELDS = ("test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "compile_s")

# fields that identify a test across runs (compare matches rows on these)
KEY_FIELDS = (("model_filename", "backends", "dtype") + PARAM_FIELDS[:-1] + SHAPE_FIELDS + ("prompt_set",) + CASE_FIELDS
              + ("verify_k",))

INT_FIELDS = {"model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "n_gpu_layers", "flash_attn",
              "n_prompt", "n_gen", "n_depth", "n_prompts", "n_gpu_layers_draft", "draft_vocab", "draft_max", "draft_min",
              "n_drafted", "n_accepted", "n_steps", "n_tokens", "n_drafts", "prompt_ns", "verify_k", "avg_ns",
              "stddev_ns", *(set(NGRAM_FIELDS) - _FLOAT_NGRAM_FIELDS)}
FLOAT_FIELDS = {"temp", "draft_p_min", "acceptance", "mean_acc_len", "tokens_per_step", "forwards_per_token",
                "rows_per_token", "draft_ms", "verify_ms", "speedup", "cost_ratio", "break_even_len", "break_even_acc",
                "avg_ts", "stddev_ts", "compile_s", *_FLOAT_NGRAM_FIELDS}
BOOL_FIELDS = {"warm"}
LIST_FIELDS = {"acc_per_pos"}


@dataclass
class Result:
    """One row: a test of one instance with its samples (llama-bench's `test`)."""

    # build and hardware
    build_commit: str
    build_version: str
    torch_version: str
    cpu_info: str
    gpu_info: str
    backends: str  # CPU | CUDA
    # where it ran
    device: str  # resolved: cpu, cuda:0
    dtype: str  # resolved: f32, bf16, f16
    # model
    model_filename: str
    model_type: str  # "qwen2 1.5B Q4_K_M"
    model_size: int  # bytes of tensor data in the file
    model_n_params: int
    # engine parameters
    n_batch: int
    n_ubatch: int
    n_threads: int
    n_gpu_layers: int
    flash_attn: int  # -1 auto, 0 off, 1 on: recorded only (torch SDPA picks its kernel)
    devices: str  # as requested with -dev
    # test shape
    test: str  # pp | tg | pg | spec | verify
    n_prompt: int
    n_gen: int
    n_depth: int
    test_time: str  # ISO-8601 UTC, when the test started
    samples_ns: list[int] = field(default_factory=list)
    samples_ts: list[float] = field(default_factory=list)  # tokens (or verify rows) per second, per sample
    spec: dict | None = None  # SPEC_FIELDS for kind spec
    verify: dict | None = None  # VERIFY_FIELDS for kind verify
    compile: str = "auto"  # --compile (an engine parameter, after flash_attn in print order)
    compile_s: float = 0.0  # seconds this test's calls spent compiling (torch.compile; 0 when cached or eager)

    @property
    def avg_ns(self) -> int:
        return sample_stats(self.samples_ns, self.samples_ts)["avg_ns"]

    @property
    def stddev_ns(self) -> int:
        return sample_stats(self.samples_ns, self.samples_ts)["stddev_ns"]

    @property
    def avg_ts(self) -> float:
        return sample_stats(self.samples_ns, self.samples_ts)["avg_ts"]

    @property
    def stddev_ts(self) -> float:
        return sample_stats(self.samples_ns, self.samples_ts)["stddev_ts"]

    def to_dict(self) -> dict:
        """Fields in print order; the kind's extra fields only on rows of that kind."""
        d = asdict(self)
        spec, verify = d.pop("spec"), d.pop("verify")
        samples_ns, samples_ts = d.pop("samples_ns"), d.pop("samples_ts")
        head = BUILD_FIELDS + RUN_FIELDS + MODEL_FIELDS + PARAM_FIELDS + SHAPE_FIELDS
        out = {k: d[k] for k in head}
        out.update(spec or {})
        out.update(verify or {})
        out.update(test_time=self.test_time, avg_ns=self.avg_ns, stddev_ns=self.stddev_ns, avg_ts=self.avg_ts,
                   stddev_ts=self.stddev_ts, compile_s=round(d["compile_s"], 2), samples_ns=samples_ns,
                   samples_ts=samples_ts)
        return out


def sample_stats(samples_ns: list[int], samples_ts: list[float]) -> dict:
    """A row's avg_ns, stddev_ns, avg_ts, stddev_ts from its samples."""
    return {"avg_ns": int(statistics.fmean(samples_ns)) if samples_ns else 0,
            "stddev_ns": int(statistics.stdev(samples_ns)) if len(samples_ns) > 1 else 0,
            "avg_ts": statistics.fmean(samples_ts) if samples_ts else 0.0,
            "stddev_ts": statistics.stdev(samples_ts) if len(samples_ts) > 1 else 0.0}


def spec_rates(n_drafted: int, n_accepted: int, n_steps: int, n_tokens: int, n_drafts: int,
               n_acc_per_pos: list[int]) -> dict:
    """A speculative row's rates from its pooled counts (llama.cpp's definitions, speculative/stats.py): every
    draft is verified in one step, so the drafts are the verify steps that mean_acc_len divides by."""
    return {"acceptance": 100.0 * (n_accepted / n_drafted) if n_drafted else 0.0,
            "mean_acc_len": 1.0 + n_accepted / n_drafts if n_drafts else 0.0,
            "tokens_per_step": n_tokens / n_steps if n_steps else 0.0,
            # one target forward per step, of 1 + draft length rows
            "forwards_per_token": n_steps / n_tokens if n_tokens else 0.0,
            "rows_per_token": (n_steps + n_drafted) / n_tokens if n_tokens else 0.0,
            "acc_per_pos": [n / n_drafts for n in n_acc_per_pos] if n_drafts else []}


# what a speculative row and the plain row it is measured against share: engine parameters and workload
PLAIN_PAIR_FIELDS = ("model_filename", "device", "dtype", "n_batch", "n_ubatch", "n_threads", "n_gpu_layers",
                     "flash_attn", "n_gen", "prompt_set", "temp", "warm")


def plain_key(row: dict) -> tuple:
    """Equal for a spec row and the plain (spec_type none) row of the same model, settings and prompts."""
    return tuple(json.dumps(row.get(f)) for f in PLAIN_PAIR_FIELDS)


def columns(rows: list[dict]) -> list[str]:
    """The union of fields over rows, in print order (csv and sql need one column set; samples excluded)."""
    has_spec = any("spec_type" in r for r in rows)
    has_verify = any("verify_k" in r for r in rows)
    return list(BUILD_FIELDS + RUN_FIELDS + MODEL_FIELDS + PARAM_FIELDS + SHAPE_FIELDS
                + (SPEC_FIELDS if has_spec else ()) + (VERIFY_FIELDS if has_verify else ()) + RESULT_FIELDS)


def row_label(row: dict) -> str:
    """llama-bench's test column: pp512, tg128, pp512+tg128, ` @ d<depth>`; spec rows by prompt set, verify by k."""
    kind, n_prompt, n_gen, depth = row["test"], row["n_prompt"], row["n_gen"], row["n_depth"]
    if kind == "spec":
        base = f"{row['prompt_set']} n{n_gen}"
    elif kind == "verify":
        base = f"k{row['verify_k']}"
    elif n_gen == 0:
        base = f"pp{n_prompt}"
    elif n_prompt == 0:
        base = f"tg{n_gen}"
    else:
        base = f"pp{n_prompt}+tg{n_gen}"
    return base + (f" @ d{depth}" if depth > 0 else "")
