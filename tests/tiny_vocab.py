"""A tiny byte-level BPE vocabulary (qwen2 pre-tokenizer, ChatML control tokens) as GGUF tokenizer metadata.

256 byte tokens make every UTF-8 text encodable; a few dozen English merges make the merge loop do real work.
"""

from __future__ import annotations

from spec_cli.text.chat import BUILTIN_TEMPLATES
from spec_cli.text.pretokenize import BYTE_TO_CHAR

# (left, right) in rank order; "Ġ" is the byte-level space, "Ċ" the newline
MERGES = [
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġt", "he"), ("r", "e"), ("a", "t"),
    ("e", "n"), ("Ġ", "s"), ("o", "r"), ("in", "g"), ("Ġ", "w"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ċ", "Ċ"), ("l", "l"),
    ("e", "s"), ("Ġ", "o"), ("Ġ", "c"), ("a", "n"), ("Ġ", "f"), ("Ġ", "i"), ("e", "d"), ("Ġ", "b"), ("o", "u"),
    ("Ġ", "h"), ("i", "s"), ("Ġ", "m"), ("Ġ", "p"), ("Ġ", "d"), ("a", "r"), ("i", "t"), ("Ġw", "or"), ("Ġwor", "l"),
    ("Ġworl", "d"), ("H", "e"), ("He", "ll"), ("Hell", "o"), ("d", "e"), ("de", "f"), ("Ġ", "="), ("Ġ", "re"),
    ("Ġre", "t"), ("u", "r"), ("Ġret", "ur"), ("Ġretur", "n"),
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_bpe_metadata() -> dict:
    """tokenizer.* GGUF keys of the tiny vocabulary: ids 0-255 are the bytes, then the merges, then the specials."""
    merged = [left + right for left, right in MERGES]
    tokens = BYTE_TO_CHAR + merged + SPECIAL_TOKENS
    assert len(set(tokens)) == len(tokens)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (256 + len(merged)) + [3] * len(SPECIAL_TOKENS),
        "tokenizer.ggml.merges": [f"{left} {right}" for left, right in MERGES],
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": BUILTIN_TEMPLATES["chatml"],
    }
