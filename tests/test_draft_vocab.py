"""draft-simple's draft vocabulary (`--draft-vocab`): which tokens it holds, and that its logits are the full output's
columns bit for bit (drafting with it: tests/test_generate.py)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from spec_cli.model.loader import load_model
from spec_cli.speculative import draft_vocab
from spec_cli.speculative.draft_vocab import DraftVocab
from spec_cli.text.tokenizer import common_tokens
from tests.tiny_gguf import write_tiny_gguf


def test_common_tokens_rank_bpe_by_id_and_spm_by_score_and_keep_every_special():
    types = [3, 1, 1, 1, 1, 6, 4, 5]  # control, 4 normal, byte, user-defined, unused
    bpe = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": list("abcdefgh"),
           "tokenizer.ggml.token_type": types}
    assert common_tokens(bpe, 2) == [0, 1, 2, 5, 6]
    spm = {**bpe, "tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": [0, -4, -1, -3, -2, 0, 0, 0]}
    assert common_tokens(spm, 2) == [0, 2, 4, 5, 6]
    assert common_tokens(bpe, 0) == [0, 5, 6]


@pytest.fixture(scope="module", params=[T.F32, T.Q8_0], ids=["f32", "q8_0"])
def tiny_loaded(request, tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("vocab") / "tiny.gguf", arch="llama", seed=3, qtype=request.param)
    return load_model(path, device="cpu")


def test_draft_logits_are_the_full_logits_columns_of_their_ids(tiny_loaded, monkeypatch):
    model = tiny_loaded.model
    hidden = torch.randn(3, tiny_loaded.config.n_embd, generator=torch.Generator().manual_seed(0))
    full = model.logits(hidden)
    vocab = DraftVocab(tiny_loaded, 16)
    assert vocab.ids.tolist() == common_tokens(tiny_loaded.gguf.metadata, 16)

    def check() -> None:
        ids = vocab.ids.tolist()
        assert len(set(ids)) == len(ids)
        assert torch.equal(vocab.logits(hidden), full[:, vocab.ids])

    check()
    n_fixed = len(vocab.ids)
    vocab.see([200, 201, 200, 5])  # 5 is among the common ids already
    check()
    assert vocab.ids.tolist()[n_fixed:] == [200, 201]
    monkeypatch.setattr(draft_vocab, "MERGE_AT", 3)
    vocab.see([250, 202])  # four seen tokens > MERGE_AT: they join the fixed rows
    check()
    assert vocab._seen is None and {200, 201, 202, 250} <= set(vocab.ids.tolist())
    fresh = DraftVocab(tiny_loaded, 16)  # another drafter of the model: the common rows are built once, and a merge
    assert fresh._fixed is DraftVocab(tiny_loaded, 16)._fixed  # elsewhere left them as they were
    assert fresh.ids.tolist() == common_tokens(tiny_loaded.gguf.metadata, 16)
