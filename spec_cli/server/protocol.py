"""Wire format of the server: request models (validated, with bounds) and response bodies.

Mirrors llama-server's `server_task.cpp` params parsing and `server_task_result_*::to_json*` (native `/completion`
and the OpenAI-compatible `/v1/completions`, `/v1/chat/completions`), and OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` with llama.cpp's error types and `code` = the HTTP status.

The OpenAI routes reject unknown fields (a typo or an unsupported feature such as `tools` is a 400, never
silently ignored); the native `/completion` ignores them like llama.cpp. Types are strict everywhere: "5" is
not an integer and "yes" is not a boolean. The request's `speculative` field is this project's per-request
speculation control: `false` disables it, an object overrides n_max / n_min / p_min / types.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from spec_cli.errors import UsageError
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import FLOAT32_MAX, OPTIONS
from spec_cli.runtime.generate import SpecOverrides
from spec_cli.server.task import Completion
from spec_cli.speculative.base import SpecParams

MAX_DRAFT = 256  # bound on per-request draft lengths
MAX_STOPS = 16


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.type, self.param)


def error_body(status: int, message: str, type: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": status}}


# --- requests ------------------------------------------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], body: bytes) -> M:
    """JSON body -> request model; any problem becomes a 400 naming the offending field."""
    try:
        text = body.decode("utf-8")  # strict: json.loads would let UTF-8-encoded surrogates through
        data = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"invalid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "invalid JSON: nested too deeply") from None
    except ValueError:  # the one other failure of json.loads: int() refuses that many digits
        raise ApiError(400, f"invalid JSON: an integer has more than {sys.get_int_max_str_digits()} digits") from None
    if _SURROGATE_ESCAPE.search(text):
        _reject_lone_surrogates(data)
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        # a union field reports one error per member: the deepest one is about what the client meant
        err = max(e.errors(), key=lambda er: len(er["loc"]))
        loc = ".".join(str(x) for x in err["loc"] if not (isinstance(x, str) and x in _UNION_TAGS))
        raise ApiError(400, f"{loc or 'body'}: {err['msg']}", param=loc or None) from None


# JSON spells a character outside the BMP as two \u escapes (a UTF-16 surrogate pair); one alone is valid JSON
# but no Unicode text: it cannot be tokenized or sent back as UTF-8 (llama.cpp's JSON parser refuses it too)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _reject_lone_surrogates(data) -> None:
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"invalid JSON: lone UTF-16 surrogate \\u{ord(e.object[e.start]):04x} in a string "
                       "(a \\uD800-\\uDFFF escape must be half of a pair)") from None


# pydantic names the union member it tried in an error's location; the field path without them is clearer
_UNION_TAGS = {"str", "int", "bool", "float", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]",
               "SpeculativeFields"}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _bounded(name: str, **narrower) -> Any:
    """A request field that stands for a flag (None = the server's value): the flag's bounds, or narrower ones."""
    return Field(None, **{**OPTIONS[name].bounds(), **narrower})


class SpeculativeFields(Strict):
    n_max: int | None = Field(None, ge=0, le=MAX_DRAFT)
    n_min: int | None = _bounded("draft_min", le=MAX_DRAFT)
    p_min: float | None = _bounded("draft_p_min")
    types: list[str] | None = Field(None, max_length=16)


class GenerationFields(Strict):
    """Sampling, stop, cache and speculation fields every completion route accepts (None = server default)."""

    temperature: float | None = _bounded("temp", ge=0.0)  # narrower than --temp's (<= 0: greedy)
    top_k: int | None = _bounded("top_k")
    top_p: float | None = _bounded("top_p")
    min_p: float | None = _bounded("min_p")
    repeat_penalty: float | None = _bounded("repeat_penalty")
    repeat_last_n: int | None = _bounded("repeat_last_n")
    presence_penalty: float | None = _bounded("presence_penalty", ge=-2.0, le=2.0)  # OpenAI's range
    frequency_penalty: float | None = _bounded("frequency_penalty", ge=-2.0, le=2.0)
    seed: int | None = _bounded("seed")
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    cache_prompt: bool = True
    id_slot: int = Field(-1, ge=-1)
    speculative: bool | SpeculativeFields | None = None

    @field_validator("temperature", "repeat_penalty")
    @classmethod
    def _in_float32(cls, value: float | None) -> float | None:
        """A temperature or repeat penalty past float32's range is inf in the sampler: its probabilities turn NaN,
        and the request silently decodes greedily."""
        if value is not None and value > FLOAT32_MAX:
            raise ValueError(f"{value:g} is more than {FLOAT32_MAX:.4g}, the largest float32 (the sampler's numbers)")
        return value

    def to_sampling(self, defaults: SamplingParams) -> SamplingParams:
        """The server's sampling flags, overridden by the fields this request set."""
        params = SamplingParams(**vars(defaults))
        for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
                     "frequency_penalty", "seed", "ignore_eos"):
            value = getattr(self, name)
            if value is not None:
                setattr(params, "temp" if name == "temperature" else name, value)
        try:
            params.validate()
        except UsageError as e:
            raise ApiError(400, str(e)) from None
        return params

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"at most {MAX_STOPS} stop strings", param="stop")
        return stops

    def to_spec(self, server: SpecParams, loaded: list[str]) -> SpecOverrides | None:
        """Per-request speculation control, checked against what the server loaded (None = server settings)."""
        spec = self.speculative
        if spec is None or spec is True:
            return None
        if spec is False:
            return SpecOverrides(enabled=False)
        types = None
        if spec.types is not None:
            try:
                types = set(OPTIONS["spec_type"].value(spec.types, "speculative.types"))
            except UsageError as e:
                raise ApiError(400, str(e), param="speculative.types") from None
            missing = sorted(types - set(loaded))
            if missing:
                raise ApiError(400, f"speculative.types {missing} not loaded by this server "
                               f"(loaded: {loaded or 'none'})", param="speculative.types")
        elif not loaded:
            raise ApiError(400, "this server was started without speculative decoding (--spec-type / -md)",
                           param="speculative")
        n_max = spec.n_max if spec.n_max is not None else server.draft_max
        n_min = spec.n_min if spec.n_min is not None else server.draft_min
        if n_min > n_max:
            raise ApiError(400, f"speculative.n_min ({n_min}) is larger than speculative.n_max ({n_max})",
                           param="speculative.n_min")
        return SpecOverrides(enabled=bool(types is None or types), n_max=spec.n_max, n_min=spec.n_min,
                             p_min=spec.p_min, types=types)


class NativeCompletionRequest(GenerationFields):
    """llama-server `/completion`: unknown fields are ignored, as llama.cpp does."""

    model_config = ConfigDict(extra="ignore")
    prompt: str | list[int]
    n_predict: int | None = Field(None, ge=-1)
    return_tokens: bool = False
    n_probs: int = Field(0, ge=0)


class StreamOptions(Strict):
    include_usage: bool = False


class OpenAIFields(GenerationFields):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=-1)
    n: int = Field(1, ge=1, le=1)
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(OpenAIFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            return p[0]
        return p


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=-1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)


class TokenizeRequest(Strict):
    model_config = ConfigDict(extra="ignore")
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


class SlotFileRequest(Strict):
    """POST /slots/{id}?action=save|restore (llama-server's; other fields are ignored, as there)."""

    model_config = ConfigDict(extra="ignore")
    filename: str = Field(max_length=255)


def check_tokens(tokens: list[int], n_vocab: int, param: str) -> list[int]:
    bad = next((t for t in tokens if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} out of range [0, {n_vocab})", param=param)
    return tokens


def generation_settings(req: GenerationFields, sampling: SamplingParams, n_predict: int, spec: SpecOverrides | None,
                        server: SpecParams, loaded: list[str]) -> dict:
    """llama.cpp's `generation_settings` / slot `params`, with the effective per-request speculation settings."""
    enabled = bool(loaded) and (spec is None or spec.enabled)
    spec = spec or SpecOverrides()
    types = sorted(spec.types, key=loaded.index) if spec.types is not None else list(loaded)
    return {
        "n_predict": n_predict, "seed": sampling.seed, "temperature": sampling.temp, "top_k": sampling.top_k,
        "top_p": sampling.top_p, "min_p": sampling.min_p, "repeat_last_n": sampling.repeat_last_n,
        "repeat_penalty": sampling.repeat_penalty, "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty, "ignore_eos": sampling.ignore_eos, "stop": req.stops(),
        "stream": req.stream, "cache_prompt": req.cache_prompt, "n_probs": 0,
        "speculative": enabled,
        "speculative.n_max": spec.n_max if spec.n_max is not None else server.draft_max,
        "speculative.n_min": spec.n_min if spec.n_min is not None else server.draft_min,
        "speculative.p_min": spec.p_min if spec.p_min is not None else server.draft_p_min,
        "speculative.types": types if enabled else [],
    }


# --- responses -----------------------------------------------------------------------------------------------------

def usage(c: Completion) -> dict:
    return {"prompt_tokens": c.n_prompt, "completion_tokens": c.n_predicted,
            "total_tokens": c.n_prompt + c.n_predicted,
            "prompt_tokens_details": {"cached_tokens": c.n_cached}}


def native_chunk(text: str, tokens: list[int], with_tokens: bool) -> dict:
    """A streamed `/completion` piece; the slot id comes with the final object."""
    return {"index": 0, "content": text, "tokens": tokens if with_tokens else [], "stop": False, "id_slot": -1}


def native_final(c: Completion, model: str, prompt: str, streamed: bool, with_tokens: bool) -> dict:
    """The last `/completion` object: the whole answer (streaming: nothing more, the pieces carried it) plus
    settings and timings."""
    return {
        "index": 0, "content": "" if streamed else c.text, "tokens": c.tokens if with_tokens and not streamed else [],
        "id_slot": c.id_slot,
        "stop": True, "model": model, "tokens_predicted": c.n_predicted, "tokens_evaluated": c.n_prompt,
        "generation_settings": c.settings, "prompt": prompt, "has_new_line": "\n" in c.text, "truncated": False,
        "stop_type": c.stop_type, "stopping_word": c.stopping_word, "tokens_cached": c.n_cached,
        "timings": c.timings(),
    }


def completion_body(cid: str, created: int, model: str, choice: dict, final: Completion | None = None,
                    chunk: bool = False, chat: bool = False, with_usage: bool = True) -> dict:
    """An OpenAI completion / chat completion object or stream chunk; the final one carries usage and timings."""
    obj = ("chat.completion" if chat else "text_completion") + (".chunk" if chunk and chat else "")
    body = {"id": cid, "object": obj, "created": created, "model": model, "system_fingerprint": "spec-cli",
            "choices": [choice]}
    if final is not None:
        if with_usage:
            body["usage"] = usage(final)
        body["timings"] = final.timings()
        body["generation_settings"] = final.settings
    return body


def text_choice(text: str, finish_reason: str | None) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chat_choice(text: str, finish_reason: str | None) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chat_delta(delta: dict, finish_reason: str | None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def prometheus(metrics: list[tuple[str, str, str, object]]) -> str:
    """Prometheus text format; a value is a number or a list of (labels dict, number)."""
    lines = []
    for name, kind, help_text, value in metrics:
        full = f"llamacpp:{name}"
        lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
        samples = value if isinstance(value, list) else [({}, value)]
        for labels, v in samples:
            tag = ",".join(f'{k}="{val}"' for k, val in labels.items())
            lines.append(f"{full}{{{tag}}} {v}" if tag else f"{full} {v}")
    return "\n".join(lines) + "\n"
