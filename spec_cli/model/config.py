"""ModelConfig: the hyperparameters of one GGUF model, read from its `{arch}.*` metadata.

One Transformer covers every supported architecture; the differences are flags here (llama.cpp's
`llm_arch` switch in src/llama-model.cpp, reduced to what these families need).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from spec_cli.errors import SpecCliError
from spec_cli.model.gguf_file import GGUFFile

# llama.cpp rope types: NORM rotates adjacent pairs (x0, x1); NEOX rotates (x_i, x_{i + d/2}).
ARCH_ROPE_TYPE = {"llama": "norm", "mistral": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox"}
SUPPORTED_ARCHS = tuple(ARCH_ROPE_TYPE)


@dataclass
class ModelConfig:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_type: str  # "norm" | "neox"
    rope_dim: int
    rope_base: float
    rope_base_swa: float  # rope base of sliding-window layers (gemma3 uses 10k there)
    rope_scale: float  # linear position scaling factor (1 = none)
    attn_scale: float  # multiplies q.k
    sliding_window: int  # 0 = no sliding-window layers
    swa_layers: list[bool] = field(default_factory=list)  # per layer: uses the sliding window
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (qwen3, gemma3)
    post_norms: bool = False  # gemma3: norms after attention and after the FFN, before the residual add
    embed_scale: float = 1.0  # gemma: embeddings multiplied by sqrt(n_embd)
    ffn_act: str = "silu"  # "silu" | "gelu_tanh"  (gated: act(gate) * up)
    tied_output: bool = False
    n_nextn: int = 0  # trailing NextN/MTP blocks (not part of the main stack)

    @property
    def n_layer_main(self) -> int:
        return self.n_layer - self.n_nextn

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "ModelConfig":
        arch = gf.architecture
        if arch not in SUPPORTED_ARCHS:
            raise SpecCliError(f"unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHS)})")

        def key(name: str, default=None):
            value = gf.get(f"{arch}.{name}", default)
            if value is None:
                raise SpecCliError(f"{gf.path.name}: metadata key {arch}.{name} is missing")
            return value

        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        n_head_kv = key("attention.head_count_kv", n_head)
        if isinstance(n_head_kv, list):
            raise SpecCliError(f"{gf.path.name}: per-layer head_count_kv is not supported")
        head_dim = int(gf.get(f"{arch}.attention.key_length", n_embd // n_head))
        n_layer = int(key("block_count"))
        tensors = gf.tensors
        if "token_embd.weight" not in tensors:
            raise SpecCliError(f"{gf.path.name}: no token_embd.weight tensor")
        n_vocab = tensors["token_embd.weight"].shape[0]
        sliding_window = int(gf.get(f"{arch}.attention.sliding_window", 0) or 0)
        swa_layers = [False] * n_layer
        if arch == "gemma3" and sliding_window:
            swa_layers = [il % 6 < 5 for il in range(n_layer)]  # llama.cpp: set_swa_pattern(6), every 6th is global
        scaling = gf.get(f"{arch}.rope.scaling.type", "none")
        rope_scale = float(gf.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0
        gemma = arch == "gemma3"
        return cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=int(key("feed_forward_length")),
            n_head=n_head,
            n_head_kv=int(n_head_kv),
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=int(gf.get(f"{arch}.context_length", 4096)),
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_type=ARCH_ROPE_TYPE[arch],
            rope_dim=int(gf.get(f"{arch}.rope.dimension_count", head_dim)),
            rope_base=float(gf.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_base_swa=10000.0 if gemma else float(gf.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scale=rope_scale,
            attn_scale=1.0 / math.sqrt(head_dim),
            sliding_window=sliding_window,
            swa_layers=swa_layers,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            post_norms="blk.0.post_attention_norm.weight" in tensors,
            embed_scale=math.sqrt(n_embd) if gemma else 1.0,
            ffn_act="gelu_tanh" if gemma else "silu",
            tied_output="output.weight" not in tensors,
            n_nextn=int(gf.get(f"{arch}.nextn_predict_layers", 0) or 0),
        )
