"""Tokenizer built from GGUF metadata: byte-level BPE (`gpt2`) and SentencePiece BPE (`llama`) vocabularies.

Mirrors llama.cpp's `src/llama-vocab.cpp` (llama_vocab::impl::load, tokenize, tokenizer_st_partition, token_to_piece,
llm_tokenizer_bpe_session, llm_tokenizer_spm_session) and the pre-tokenizer split of `src/unicode.cpp`
(unicode_regex_split). Pure Python on purpose: the merge loops are llama.cpp's own (a priority queue over adjacent
symbol pairs), so the ids match llama.cpp's rather than HF tokenizers' where the two disagree.
"""

from __future__ import annotations

import codecs
import heapq
import warnings
from collections.abc import Mapping
from functools import cached_property

from spec_cli.errors import SpecCliError
from spec_cli.text.chat import render_chat, resolve_template
from spec_cli.text.pretokenize import BYTE_TO_CHAR, CHAR_TO_BYTE, PRE_TYPES, pre_patterns, pre_tokenize

# llama_token_attr bits; GGUF token_type -> attr as llama.cpp maps it.
UNKNOWN, UNUSED, NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 2, 4, 8, 16, 32
_ATTR_OF_TYPE = {0: 0, 1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

# Token texts llama.cpp recognizes when metadata names no id (llama_vocab::impl::load, "auto-detect special tokens").
_DETECT = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
                "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
                "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
                "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>",
              "[e~[")
# (texts that, all among the EOG tokens, take `dropped` out of them and give it back `attr`): llama.cpp's fixes for
# harmony, solar-open, gemma4 and plamo, whose vocabularies use those texts as ordinary tokens
_EOG_EXCLUSIONS = ((("<|return|>", "<|call|>"), "<|end|>", USER_DEFINED),
                   (("<|calls|>", "<|flush|>"), "<|end|>", USER_DEFINED),
                   (("<|tool_response>",), "</s>", NORMAL), (("<|plamo:eos|>",), "</s>", NORMAL))


class Tokenizer:
    """A GGUF vocabulary: encode text to ids and ids to bytes exactly as llama.cpp does."""

    def __init__(self, meta: Mapping):
        model, tokens = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.tokens")
        if not model or not tokens:
            raise SpecCliError("model has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        n = len(tokens)
        if model == "gpt2":
            self.vocab_type, defaults, self.add_space_prefix = "bpe", (11, 11, None), False
            pre = meta.get("tokenizer.ggml.pre")
            if not pre:
                warnings.warn("GGUF has no tokenizer.ggml.pre: using the 'default' pre-tokenizer (quality may degrade)")
                pre = "default"
            self._patterns = pre_patterns(pre)
            _, self._ignore_merges, self.add_bos = PRE_TYPES[pre]
            merges = meta.get("tokenizer.ggml.merges")
            if not merges:
                raise SpecCliError("BPE tokenizer has no tokenizer.ggml.merges")
            # A rank keyed by "left right": byte-level symbols never contain a space, so this is the same pair lookup
            # as llama.cpp's find_bpe_rank; reversed so a repeated merge keeps its first (lowest) rank.
            self._ranks = dict(zip(reversed(merges), range(len(merges) - 1, -1, -1)))
            self._word_cache: dict[str, list[int]] = {}
        elif model == "llama":
            self.vocab_type, defaults, self.add_bos, self.add_space_prefix = "spm", (1, 2, 0), True, True
            self._scores = meta.get("tokenizer.ggml.scores") or [0.0] * n
        else:
            raise SpecCliError(f"unsupported tokenizer model '{model}' (supported: gpt2, llama)")
        self.add_eos = False
        self._tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._token_to_id = {t: i for i, t in enumerate(self._tokens)}
        if len(self._token_to_id) != n:
            raise SpecCliError("duplicate token in vocabulary")
        types = meta.get("tokenizer.ggml.token_type") or [1] * n
        self._attrs = [_ATTR_OF_TYPE.get(t, 0) for t in types]

        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", self.add_space_prefix))
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", self.add_bos))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", self.add_eos))
        self.bos_id = self._special_id(meta, "bos_token_id", defaults[0])
        self.eos_id = self._special_id(meta, "eos_token_id", defaults[1])
        self.unk_id = self._special_id(meta, "unknown_token_id", defaults[2])
        for flag, tid, name in ((self.add_bos, self.bos_id, "bos"), (self.add_eos, self.eos_id, "eos")):
            if flag and tid is None:
                raise SpecCliError(f"tokenizer.ggml.add_{name}_token is true but the model has no {name} token")
        detected = {kind: self._detect(meta, kind) for kind in _DETECT}
        self.eot_id, self.eom_id = detected["eot"], detected["eom"]
        self.eog_ids = self._eog_set(detected)
        self.chat_template: str | None = meta.get("tokenizer.chat_template")

        by_length = sorted((i for i, a in enumerate(self._attrs) if a & (CONTROL | USER_DEFINED | UNKNOWN)),
                           key=lambda i: -len(self._tokens[i].encode()))
        self._specials = [(self._tokens[i], i) for i in by_length]  # parse_special=True: longest first
        self._user_defined = [(t, i) for t, i in self._specials if not self._attrs[i] & (CONTROL | UNKNOWN)]
        self._pieces: dict[int, bytes] = {}

    @classmethod
    def from_metadata(cls, meta: Mapping) -> Tokenizer:
        return cls(meta)

    # --- construction helpers -----------------------------------------------------------------------------------

    def _special_id(self, meta: Mapping, key: str, default: int | None) -> int | None:
        n = len(self._tokens)
        if default is not None and default >= n:
            default = None
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is None:
            return default
        if 0 <= value < n:
            return int(value)
        warnings.warn(f"bad special token tokenizer.ggml.{key} = {value}, using default {default}")
        return default

    def _detect(self, meta: Mapping, kind: str) -> int | None:
        """Metadata id if present, else the first token whose text llama.cpp associates with `kind`."""
        tid = self._special_id(meta, f"{kind}_token_id", None)
        if tid is not None:
            return tid
        for text in _DETECT[kind]:
            tid = self._token_to_id.get(text)
            if tid is not None:
                self._attrs[tid] |= CONTROL  # llama.cpp forces control-looking tokens to be control
                return tid
        return None

    def _eog_set(self, detected: dict[str, int | None]) -> frozenset[int]:
        eog = {detected[k] for k in ("fim_pad", "fim_rep", "fim_sep")}
        for text in _EOG_TEXTS:
            tid = self._token_to_id.get(text)
            if tid is not None:
                self._attrs[tid] |= CONTROL
                eog.add(tid)
        eog |= {self.eos_id, self.eot_id, self.eom_id}
        eog.discard(None)
        texts = {self._tokens[i] for i in eog}
        for required, dropped, attr in _EOG_EXCLUSIONS:
            if dropped in texts and all(t in texts for t in required):
                eog.discard(self._token_to_id[dropped])
                self._attrs[self._token_to_id[dropped]] = attr
        return frozenset(eog)

    # --- properties ---------------------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The raw vocabulary string (byte-level or "▁" escaped), as stored in the GGUF."""
        return self._tokens[token_id]

    def token_attr(self, token_id: int) -> int:
        """The token's llama_token_attr bits (NORMAL, CONTROL, BYTE, ...)."""
        return self._attrs[token_id]

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    # --- encode -------------------------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """llama_tokenize: special-token partition, then BPE/SPM on each text fragment, BOS/EOS per metadata."""
        fragments = self._partition(text, parse_special) if text else []
        out = [self.bos_id] if add_special and self.add_bos else []
        prev_special = True  # SPM: a space prefix goes at the start and after each special token
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif self.vocab_type == "bpe":
                out.extend(self._encode_bpe(frag))
            else:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._encode_spm(frag.replace(" ", "\u2581")))
                prev_special = False
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def min_tokens(self, text: str) -> int:
        """A lower bound on the length of `encode(text)` (any flags), from the text's length alone: no token stands
        for more text bytes than the vocabulary's longest, and only bytes BPE has no token for go without one. 0
        where the vocabulary gives no bound. Lets the server refuse a prompt that cannot fit a context before
        spending seconds tokenizing it."""
        max_bytes, dropped = self._token_bound
        if not max_bytes:
            return 0
        n = len(text.encode("utf-8", "replace").translate(None, dropped))  # encode's own bytes: "?" for a surrogate
        if self.vocab_type == "spm":
            n -= 2 * text.count("\u2581")  # a literal "▁" (3 bytes) is matched as the 1-byte space it stands for
        return -(-n // max_bytes)

    @cached_property
    def _token_bound(self) -> tuple[int, bytes]:
        """(the most text bytes one token stands for, the bytes encode drops) for min_tokens; (0, b"") when a merge
        makes a symbol that is no token (BPE would then fall back to single bytes, some of them dropped)."""
        if self.vocab_type == "bpe":
            if not all(pair.replace(" ", "") in self._token_to_id for pair in self._ranks):
                return 0, b""
            dropped = bytes(b for b, c in enumerate(BYTE_TO_CHAR) if c not in self._token_to_id)
            merged = max(len(t) for t in self._tokens)  # one byte-level symbol is one byte
        else:
            dropped = b""  # SPM falls back to byte tokens, and fails if one is missing
            merged = max(len(t.replace("\u2581", " ").encode()) for t in self._tokens)
        special = max((len(t.encode()) for t, _ in self._specials), default=0)  # cut out of the text verbatim
        return max(merged, special), dropped

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """tokenizer_st_partition: cut special tokens out of the text, longest token first over the whole text.

        User-defined tokens are always cut; control and unknown ones only with parse_special."""
        fragments: list[str | int] = [text]
        for piece, tid in self._specials if parse_special else self._user_defined:
            if piece not in text:  # cheap filter: absent from the text means absent from every fragment
                continue
            cut: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or piece not in frag:
                    cut.append(frag)
                    continue
                for k, part in enumerate(frag.split(piece)):
                    if k:
                        cut.append(tid)
                    if part:
                        cut.append(part)
            fragments = cut
        return fragments

    def _encode_bpe(self, text: str) -> list[int]:
        out: list[int] = []
        for word in pre_tokenize(text, self._patterns):
            ids = self._word_cache.get(word)
            if ids is None:
                ids = self._bpe_word("".join(BYTE_TO_CHAR[b] for b in word.encode("utf-8", "replace")))
                if len(self._word_cache) > 100_000:  # bound memory on huge inputs
                    self._word_cache.clear()
                self._word_cache[word] = ids
            out.extend(ids)
        return out

    def _bpe_word(self, word: str) -> list[int]:
        """llm_tokenizer_bpe_session: merge the lowest-ranked adjacent pair (leftmost on ties) until none is left."""
        if self._ignore_merges and word in self._token_to_id:
            return [self._token_to_id[word]]
        ranks = self._ranks
        syms = merge_pairs(list(word), lambda left, right: ranks.get(left + " " + right))
        out = []
        for sym in syms:
            if not sym:
                continue
            tid = self._token_to_id.get(sym)
            if tid is not None:
                out.append(tid)
            else:  # llama.cpp falls back to single-byte tokens and silently drops what it cannot find
                out.extend(self._token_to_id[chr(b)] for b in sym.encode() if b < 0x80 and chr(b) in self._token_to_id)
        return out

    def _encode_spm(self, text: str) -> list[int]:
        """llm_tokenizer_spm_session: merge the highest-scored adjacent pair that is a token (leftmost on ties).

        llama.cpp's resegment() can only meet a final symbol that is not a token when it is a single character
        (merges always form tokens), so byte fallback covers it."""
        token_to_id, scores = self._token_to_id, self._scores

        def priority(left: str, right: str) -> float | None:
            tid = token_to_id.get(left + right)
            return None if tid is None else -scores[tid]

        syms = merge_pairs(list(text), priority)
        out = []
        for sym in syms:
            if not sym:
                continue
            tid = self._token_to_id.get(sym)
            out.extend([tid] if tid is not None else (self._byte_token(b) for b in sym.encode("utf-8", "replace")))
        return out

    def _byte_token(self, byte: int) -> int:
        tid = self._token_to_id.get(f"<0x{byte:02X}>", self._token_to_id.get(chr(byte)) if byte < 0x80 else None)
        if tid is None:
            raise SpecCliError(f"vocabulary has no byte token for 0x{byte:02X}")
        return tid

    # --- decode -------------------------------------------------------------------------------------------------

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """llama_token_to_piece: the token's bytes; control/unknown tokens render their text only if `special`."""
        if not 0 <= token_id < len(self._tokens):
            raise SpecCliError(f"token id {token_id} out of range [0, {len(self._tokens)})")
        attr = self._attrs[token_id]
        if attr & (CONTROL | UNKNOWN) and not special:
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._piece(token_id, attr)
        return piece

    def _piece(self, token_id: int, attr: int) -> bytes:
        text = self._tokens[token_id]
        if attr & (CONTROL | UNKNOWN | USER_DEFINED):
            return text.encode()
        if attr & NORMAL:
            if self.vocab_type == "spm":
                return text.replace("\u2581", " ").encode()
            # a character outside the byte map passes through as UTF-8 (llama.cpp writes "[UNK_BYTE_0x..]" instead)
            return b"".join(bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE else c.encode() for c in text)
        if attr & BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined tokens render as nothing

    def decode(self, ids: list[int], special: bool = True) -> str:
        """llama_detokenize without its space clean-up: the pieces joined, less the space prefix SPM encoding added."""
        pieces = [self.token_to_piece(i, special) for i in ids]
        if pieces and self.add_space_prefix and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def stream(self, special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, special)

    # --- chat ---------------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template_override: str | None = None) -> str:
        """Render the model's chat template (or a builtin name / jinja source given instead)."""
        source = resolve_template(template_override) if template_override else self.chat_template
        if not source:
            raise SpecCliError("model has no chat template; pass --chat-template")
        bos = self._tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self._tokens[self.eos_id] if self.eos_id is not None else ""
        text = render_chat(source, messages, add_generation_prompt, bos_token=bos, eos_token=eos)
        # common/chat.cpp: tokenizing adds BOS/EOS itself, so drop the ones the template wrote
        if self.add_bos and bos and text.startswith(bos):
            text = text[len(bos):]
        if self.add_eos and eos and text.endswith(eos):
            text = text[:-len(eos)]
        return text


class StreamDecoder:
    """Token ids in, text out: holds back the bytes of a UTF-8 character split across tokens until it completes."""

    def __init__(self, tokenizer: Tokenizer, special: bool = True):
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_to_piece(token_id, self._special))

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def merge_pairs(syms: list[str], priority) -> list[str]:
    """The merge loop of llama.cpp's BPE and SPM tokenizers: repeatedly merge the adjacent pair with the lowest
    `priority(left, right)` (None = never merge; leftmost on ties) until none is left. Returns the symbols, merged
    ones emptied ("")."""
    nxt = [*range(1, len(syms)), -1]
    prv = list(range(-1, len(syms) - 1))
    queue: list[tuple] = []  # (priority, left, right, merged text)

    def add_pair(left: int, right: int) -> None:
        if left >= 0 and right >= 0:
            key = priority(syms[left], syms[right])
            if key is not None:
                heapq.heappush(queue, (key, left, right, syms[left] + syms[right]))

    for i in range(len(syms) - 1):
        add_pair(i, i + 1)
    while queue:
        _, left, right, text = heapq.heappop(queue)
        if not syms[left] or not syms[right] or syms[left] + syms[right] != text:
            continue  # outdated: one side was merged since this pair was queued
        syms[left], syms[right] = text, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        add_pair(prv[left], left)
        add_pair(left, nxt[left])
    return syms


def common_tokens(meta: Mapping, n: int) -> list[int]:
    """The n ordinary tokens a GGUF vocabulary ranks most common, plus its control, user-defined and byte tokens (end
    of turn, template markers, byte fallbacks), ascending: a draft vocabulary's fixed part. BPE ids are in merge
    order (an earlier merge joined a more frequent pair); SentencePiece scores are log-frequencies."""
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(meta.get("tokenizer.ggml.tokens") or ())
    attrs = [_ATTR_OF_TYPE.get(t, 0) for t in types]
    ordinary = [i for i, a in enumerate(attrs) if a == NORMAL]
    if meta.get("tokenizer.ggml.model") == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(attrs)
        ordinary.sort(key=lambda i: -scores[i])
    special = [i for i, a in enumerate(attrs) if a & (CONTROL | USER_DEFINED | BYTE | UNKNOWN)]
    return sorted(set(ordinary[:n]) | set(special))
