"""draft-train --type dflash on a tiny target: the loss falls and the held-out acceptance rises; the written file is
llama.cpp's dflash layout (read back here with gguf's reader into the Hugging Face layout, the reference of
tests/tiny_dflash.py computes its drafts); the training forward of a block is the run-time drafter's; the trained
drafter accepts more than the untrained one at run time and stays lossless (greedy, alone and chained, one and four
sequences; rejection sampling keeps the target's distribution at T > 0 with its draft vocabulary)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader

from spec_cli.model.batch import Batch
from spec_cli.model.dflash_file import load_dflash_head
from spec_cli.model.dflash_head import DFlashContext
from spec_cli.model.loader import load_model
from spec_cli.model.sampling import SamplingParams
from spec_cli.train.dflash import (
    DFlashTrainConfig,
    block_labels,
    block_states,
    default_layers,
    train,
)
from spec_cli.train.eagle3_data import UNKNOWN, Windows, draft_row_index
from spec_cli.train.loop import settled_lengths
from tests.draft_recorder import record_drafts
from tests.head_checks import (
    GGUFContents,
    assert_it_learned,
    assert_rejection_keeps_the_distribution,
    n_accepted,
    trained_and_untrained,
    training_prompts,
)
from tests.test_dflash import make_session, reference_draft, run_all
from tests.test_eagle3 import target_features
from tests.tiny_dflash import LAYER_NAMES, TinyDFlash
from tests.tiny_gguf import write_tiny_gguf

GREEDY = SamplingParams(temp=0.0, ignore_eos=True)
CFG = DFlashTrainConfig(steps=200, lr=3e-3, seq_len=32, batch=4, data_tokens=32 * 96, gen_tokens=32 * 64,
                        eval_tokens=32 * 8, draft_vocab=150, checkpoint_every=50, block_size=4, draft_layers=2,
                        anchors=8)


def test_block_rows_follow_the_targets_path_and_stop_where_the_text_leaves_it():
    # the target would have written 8 after [5, 6, 7]; the text goes on with 9: a block anchored at 6 sees neither,
    # so its rows are the target's 7 and 8, and nothing of what the target chose after the text's 9
    tokens = torch.tensor([[5, 6, 7, 9, 10, 11, 12, 13]])
    top1 = torch.tensor([[6, 7, 8, 10, 11, 12, 13, UNKNOWN]])
    w = Windows(tokens, torch.zeros(1, 8, 1, 1), torch.zeros(1, 8, 1), top1)
    rows_of = draft_row_index(list(range(16)), 16)
    labels = block_labels(w, torch.tensor([[1, 3, 6]]), 5, rows_of)
    assert labels.tolist() == [[[7, 8, -1, -1], [10, 11, 12, 13], [13, -1, -1, -1]]]


def test_the_estimate_counts_the_blocks_its_labels_settle():
    labelled = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]]).bool()
    hits = torch.tensor([[True, False, False, False],  # rejected at a labelled row: 1
                         [True, True, False, False],  # rejected past the labels: unsettled
                         [True, True, True, True],  # all accepted: 4
                         [False, True, True, True],  # rejected first: 0
                         [True, True, True, True]])  # a hit where nothing is known is no acceptance: unsettled
    assert settled_lengths(hits, labelled).tolist() == [1, 4, 0]


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("train") / "target.gguf", arch="llama", seed=11, n_layer=4)


@pytest.fixture(scope="module")
def trained(target_path, tmp_path_factory):
    """(the trained drafter's path, its TrainResult, the training losses, the untrained drafter's path)."""
    return trained_and_untrained(train, target_path, tmp_path_factory.mktemp("drafters"), CFG)


def test_training_lowers_the_loss_and_raises_the_held_out_acceptance(trained):
    _, result, losses, _ = trained
    assert_it_learned(result, losses, CFG.steps)


def test_the_trained_drafter_accepts_more_than_the_untrained_one(target_path, trained):
    path, _, _, untrained = trained
    assert n_accepted(make_session, target_path, path) > n_accepted(make_session, target_path, untrained) + 4


def read_back(path, target_path) -> TinyDFlash:
    """The written file read with gguf's reader into the Hugging Face layout the reference computes with."""
    head, target = GGUFContents(path), GGUFContents(target_path)
    arr, value = head.array, head.value

    n_layer = value("dflash.block_count")
    hf = {"fc": arr("fc.weight"), "hidden_norm": arr("enc.output_norm.weight"), "norm": arr("output_norm.weight"),
          "lm_head": arr("output.weight"),
          **{f"layers.{i}.{key}": arr(f"blk.{i}.{name}.weight") for i in range(n_layer)
             for name, key in LAYER_NAMES.items()}}
    return TinyDFlash(path, tuple(int(v) for v in value("dflash.target_layers")), value("dflash.block_size"), hf,
                      n_layer, head.tensors["d2t"].data.tolist(), target.array("token_embd.weight"),
                      target.array("output.weight"))


def test_the_file_is_llama_cpps_layout_and_drafts_as_its_reference(target_path, trained):
    path, _, _, _ = trained
    reader = GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == "dflash"
    assert tuple(int(v) for v in reader.fields["dflash.target_layers"].contents()) == default_layers(4)
    assert reader.fields["dflash.block_size"].contents() == CFG.block_size
    assert reader.fields["tokenizer.ggml.mask_token_id"].contents() == 306  # the vocabulary's last id
    assert "token_embd.weight" not in {t.name for t in reader.tensors}  # the target's
    d2t = next(t for t in reader.tensors if t.name == "d2t")
    assert d2t.tensor_type.name == "I64" and list(d2t.data) == sorted(d2t.data) and len(d2t.data) == CFG.draft_vocab
    tiny = read_back(path, target_path)
    session = make_session(target_path, path, n_seq=2, verify="match")
    calls = record_drafts(session)
    gen = session.generator()
    for seq, p in enumerate(training_prompts(target_path, 2)):
        gen.start(seq, p, GREEDY, 24)
    while gen.step():
        pass
    assert session.chain.stats["draft-dflash"].n_acc_tokens > 0
    assert calls and all(drafted == reference_draft(tiny, session.engine.target, prompt, id_last, len(drafted), 306)
                         for prompt, id_last, drafted in calls)


def test_the_training_block_forward_is_the_run_time_block(target_path, trained):
    """block_states for anchor a (context < a, its own block) computes what the drafter's context computes for the
    block at a after the features of positions < a were injected."""
    lm = load_model(target_path, device="cpu", dtype="f32")
    head = load_dflash_head(trained[0], lm)
    tokens = training_prompts(target_path, 1)[0] + [40, 41, 42, 43, 44, 45]
    g = head.fuse(target_features(lm, head.target_layers, tokens))
    anchors = torch.tensor([[3, len(tokens) - 4, 7]])
    with torch.no_grad():
        states = block_states(head, g[None], torch.tensor([tokens]), anchors)[0]
    for i, a in enumerate(anchors[0].tolist()):
        ctx = DFlashContext(head, 64)
        ctx.inject([0] * a, list(range(a)), g[:a])
        block = [tokens[a]] + [head.layout.mask_token] * (CFG.block_size - 1)
        out = ctx.decode(Batch(block, list(range(a, a + len(block))), [0] * len(block), [False] * len(block)),
                         hidden=True)
        torch.testing.assert_close(states[i], out.hidden, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chain", ["draft-dflash", "ngram-mod,draft-dflash"])
@pytest.mark.parametrize("n_seq", [1, 4])
def test_greedy_speculation_with_the_trained_drafter_equals_plain(target_path, trained, chain, n_seq):
    prompts = training_prompts(target_path, n_seq)
    session = make_session(target_path, trained[0], chain, n_seq=n_seq)
    assert run_all(session, prompts) == run_all(make_session(target_path, None, "", n_seq=n_seq), prompts)
    assert session.chain.stats["draft-dflash"].n_acc_tokens > 0


def test_rejection_sampling_keeps_the_target_distribution(target_path, trained):
    """q = the block row's distribution over its draft vocabulary mapped to target ids (0 elsewhere)."""
    session = make_session(target_path, trained[0], verify="rejection", draft_max=3)
    assert_rejection_keeps_the_distribution(session, training_prompts(target_path, 1)[0])
