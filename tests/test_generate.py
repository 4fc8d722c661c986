"""The shared step loop: speculation is lossless (greedy output == plain greedy output, token for token) for
every drafter and chain, one and four sequences at once; statistics stay consistent; stops are per token."""

from __future__ import annotations

import pytest

from spec_cli.errors import SpecCliError
from spec_cli.model.sampling import SamplingParams
from spec_cli.options import default
from spec_cli.runtime.engine import EngineOptions
from spec_cli.runtime.generate import SpecOverrides, generate
from spec_cli.runtime.session import open_session
from spec_cli.speculative import draft_model
from spec_cli.speculative.base import SpecParams

GREEDY = SamplingParams(temp=0.0)
# a prompt that repeats itself, so n-gram drafters find matches; token ids of the tiny vocabulary
PROMPTS = [
    [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42],
    [60, 61, 62, 60, 61, 62, 60, 61, 62, 60, 61],
    [70, 71, 72, 73, 74, 70, 71, 72, 73],
    [80, 81, 82, 83, 80, 81, 82, 83, 80, 81],
]
N_PREDICT = 40
# small n-gram sizes so the drafters fire on short tiny-model outputs
SMALL = dict(ngram_simple_size_n=2, ngram_simple_size_m=8, ngram_map_k_size_n=2, ngram_map_k_size_m=8,
             ngram_map_k4v_size_n=2, ngram_map_k4v_size_m=8, ngram_mod_n_match=3, ngram_mod_n_min=1, ngram_mod_n_max=8)

CHAINS = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix", "draft-simple",
          "ngram-mod,draft-simple", "ngram-simple,ngram-cache,draft-simple", "suffix,draft-simple"]


def make_session(model, spec_types: str = "", draft=None, n_seq: int = 1, draft_max: int = 6,
                 n_ubatch: int = default("ubatch_size"), **spec):
    params = SpecParams(types=[t for t in spec_types.split(",") if t], draft_max=draft_max, draft_p_min=0.0,
                        **{**SMALL, **spec})
    opts = EngineOptions(model=str(model), model_draft=str(draft) if draft else None, n_ctx=256 * n_seq,
                         n_seq=n_seq, device="cpu", n_ubatch=n_ubatch, spec=params)
    return open_session(opts)


def run(session, prompt, n=N_PREDICT, **kw):
    """Generate from a clean cache; returns (emitted tokens, sequence)."""
    session.reset()
    emitted: list[int] = []
    seq = generate(session.generator(), prompt, kw.pop("sampling", GREEDY), n,
                   on_emit=lambda e: emitted.extend(e.tokens), **kw)
    return emitted, seq


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_path):
    session = make_session(tiny_model_path)
    return [run(session, prompt)[0] for prompt in PROMPTS]


def assert_greedy_equals_plain(session, plain_outputs) -> None:
    """Every prompt's greedy output equals plain decoding, and some draft was accepted (else it proves nothing)."""
    drafted = accepted = 0
    for prompt, expected in zip(PROMPTS, plain_outputs):
        out, seq = run(session, prompt)
        assert out == expected
        drafted += seq.n_drafted
        accepted += seq.n_accepted
    assert drafted > 0 and accepted > 0, "the drafters never produced an accepted draft: the test proves nothing"


@pytest.mark.parametrize("chain", CHAINS)
def test_greedy_speculation_equals_plain_one_sequence(tiny_model_path, tiny_draft_path, plain_outputs, chain):
    assert_greedy_equals_plain(make_session(tiny_model_path, chain, draft=tiny_draft_path), plain_outputs)


GAIN_CHAINS = ["ngram-simple,ngram-map-k,ngram-mod,ngram-cache,suffix", "ngram-simple,ngram-cache,draft-simple"]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "auto"])
@pytest.mark.parametrize("chain", GAIN_CHAINS)
def test_gain_selection_equals_plain_and_picks_among_proposals(tiny_model_path, tiny_draft_path, plain_outputs,
                                                               chain, adaptive):
    """--spec-select gain: every n-gram drafter proposes, one proposal per step is verified; the output stays plain
    greedy's, and (at a fixed draft length, where every drafter is asked every step) some n-gram drafter proposed
    drafts that another's beat (proposed > verified)."""
    session = make_session(tiny_model_path, chain, draft=tiny_draft_path, select="gain", adaptive=adaptive)
    assert_greedy_equals_plain(session, plain_outputs)
    stats = session.chain.stats.values()
    assert all(st.n_proposed >= st.n_gen_drafts for st in stats)
    if not adaptive:
        assert any(st.n_proposed > st.n_gen_drafts for st in stats if st.name != "draft-simple")


@pytest.mark.parametrize("chain", ["ngram-mod", "suffix", "draft-simple", "ngram-simple,ngram-cache,draft-simple"])
@pytest.mark.parametrize("defer_max", [draft_model.DEFER_MAX, 0])  # 0: the draft model catches up in process()
@pytest.mark.parametrize("select", ["priority", "gain"])
def test_greedy_speculation_equals_plain_four_sequences(tiny_model_path, tiny_draft_path, plain_outputs, chain,
                                                        defer_max, select, monkeypatch):
    monkeypatch.setattr(draft_model, "DEFER_MAX", defer_max)
    session = make_session(tiny_model_path, chain, draft=tiny_draft_path, n_seq=4, select=select)
    gen = session.generator()
    outs: dict[int, list[int]] = {seq: [] for seq in range(len(PROMPTS))}
    for seq, prompt in enumerate(PROMPTS):
        outs[seq].extend(gen.start(seq, prompt, GREEDY, N_PREDICT).tokens)
    seqs = dict(gen.active)
    while True:
        emitted = gen.step()
        if not emitted:
            break
        assert len({e.seq for e in emitted}) == len(emitted)
        for e in emitted:
            outs[e.seq].extend(e.tokens)
    assert [outs[seq] for seq in range(len(PROMPTS))] == plain_outputs
    assert sum(s.n_accepted for s in seqs.values()) > 0


@pytest.mark.parametrize("chain", ["", "ngram-mod", "draft-simple", "ngram-simple,ngram-cache,draft-simple"])
def test_prompts_admitted_into_the_steps_ride_beside_the_others_and_keep_greedy_output(tiny_model_path,
                                                                                       tiny_draft_path,
                                                                                       plain_outputs, chain):
    """The server's continuous batching: a prompt admitted while other sequences generate is decoded a few rows per
    step (the ubatch's room beside the verify rows), its first token emitted by the step that decodes its last
    row; meanwhile the others go on generating, and every output is what the sequence gives alone."""
    session = make_session(tiny_model_path, chain, draft=tiny_draft_path, n_seq=4, n_ubatch=12)
    gen = session.generator()
    outs: dict[int, list[int]] = {seq: [] for seq in range(len(PROMPTS))}
    steps_beside_a_prompt = 0
    step = 0
    while step == 0 or gen.active or gen.prompts:
        if step % 3 == 0 and step // 3 < len(PROMPTS):  # a new prompt every third step
            gen.admit(step // 3, PROMPTS[step // 3], GREEDY, N_PREDICT)
        generating = {seq for seq, s in gen.active.items() if not s.done}
        emitted = gen.step()
        steps_beside_a_prompt += bool(gen.prompts) and any(e.seq in generating for e in emitted)
        for e in emitted:
            outs[e.seq].extend(e.tokens)
            if e.done:
                gen.finish(e.seq)
        step += 1
    assert [outs[seq] for seq in range(len(PROMPTS))] == plain_outputs
    assert steps_beside_a_prompt > 0
    with pytest.raises(SpecCliError, match="admitted"):  # `start` prefills alone
        gen.admit(0, PROMPTS[0], GREEDY, N_PREDICT)
        gen.start(1, PROMPTS[1], GREEDY, N_PREDICT)


@pytest.mark.parametrize("defer_max", [draft_model.DEFER_MAX, 0])
def test_self_draft_accepts_everything(tiny_model_path, plain_outputs, defer_max, monkeypatch):
    """The target as its own draft model: any wrong row in the draft cache would show as a rejected draft."""
    monkeypatch.setattr(draft_model, "DEFER_MAX", defer_max)
    session = make_session(tiny_model_path, "draft-simple", draft=tiny_model_path)
    out, seq = run(session, PROMPTS[0])
    assert out == plain_outputs[0]
    assert seq.n_accepted == seq.n_drafted > 0
    assert session.chain.stats["draft-simple"].acc_rate_per_pos[0] == 1.0


def test_a_small_draft_vocabulary_keeps_greedy_output_and_drafts_every_token_it_was_shown(tiny_model_path,
                                                                                            plain_outputs):
    """The target as its own draft model, drafting among 4 common tokens plus those it was shown: the output is plain
    greedy's, and each draft follows the target's tokens up to the first one the draft vocabulary did not hold, so
    columns map to the right ids and a token shown to the draft model is draftable from then on."""
    session = make_session(tiny_model_path, "draft-simple", draft=tiny_model_path, draft_vocab=4)
    drafter = session.chain.drafters[0]
    drafts: list[tuple[int, list[int], set[int]]] = []
    draft = drafter.draft

    def recorded(params):
        draft(params)
        drafts.extend((p.pos0, list(p.result), set(drafter.vocab.known)) for p in params)

    drafter.draft = recorded
    cut = 0
    for prompt, expected in zip(PROMPTS, plain_outputs):
        drafts.clear()
        out, seq = run(session, prompt)
        assert out == expected and seq.n_accepted > 0
        tokens = prompt + out
        for pos0, result, known in drafts:
            target = tokens[pos0 + 1: pos0 + 1 + len(result)]
            n = next((i for i, (a, b) in enumerate(zip(result, target)) if a != b), len(target))
            if n < len(target):
                assert target[n] not in known
                cut += 1
    assert cut > 0, "no draft met an unknown token: the vocabulary was not restricted"


def test_a_short_lag_is_decoded_with_the_seed_row_and_a_long_one_caught_up_apart(tiny_model_path):
    """The rows every step adds (accepted tokens) go into draft()'s seed batch, priced as drafting; only a cache
    more than CATCH_UP_MIN rows behind is caught up apart (catch_up, unpriced)."""
    from spec_cli.model.context import Context
    from spec_cli.model.loader import load_model
    from spec_cli.speculative.base import DraftParams

    ctx = Context(load_model(tiny_model_path, device="cpu"), n_ctx=256)
    drafter = draft_model.DraftModelDrafter(ctx, SpecParams(draft_max=2, draft_p_min=0.0), 1)
    sizes: list[int] = []
    decode = ctx.decode
    ctx.decode = lambda batch, **kw: (sizes.append(len(batch)), decode(batch, **kw))[1]
    prompt = list(range(40, 70))
    first = DraftParams(seq=0, n_max=2, pos0=len(prompt), id_last=5, prompt=prompt)
    drafter.catch_up([first])
    assert sizes == [len(prompt) - 1]  # 30 rows behind: all but the last committed row, apart
    sizes.clear()
    drafter.draft([first])
    assert sizes[0] == 2  # the last committed row and the seed row
    later = prompt + [5, 6, 7]
    second = DraftParams(seq=0, n_max=2, pos0=len(later), id_last=8, prompt=later)
    sizes.clear()
    drafter.catch_up([second])
    assert sizes == []  # 3 rows behind: left to draft()
    drafter.draft([second])
    assert 2 <= sizes[0] <= 4  # those rows and the seed row, one decode


def test_process_catches_up_settled_rows_only(tiny_model_path, monkeypatch):
    """`process` catching a draft cache up (more than DEFER_MAX rows behind) stops at a target batch's first row with
    logits: a prompt's rows are all settled, a verify batch's rows after id_last hold another drafter's tokens the
    target may still reject."""
    from spec_cli.model.batch import Batch
    from spec_cli.model.context import Context
    from spec_cli.model.loader import load_model

    monkeypatch.setattr(draft_model, "DEFER_MAX", 0)
    ctx = Context(load_model(tiny_model_path, device="cpu"), n_ctx=256)
    drafter = draft_model.DraftModelDrafter(ctx, SpecParams(draft_max=2, draft_p_min=0.0), 1)
    prompt = list(range(40, 70))
    batch = Batch()
    for i, t in enumerate(prompt):
        batch.add(t, i, 0, i == len(prompt) - 1)
    drafter.process(batch)
    assert ctx.lengths[0] == len(prompt)
    verify = Batch()
    for i, t in enumerate([5, 6, 7, 8]):  # id_last and a 3-token draft
        verify.add(t, len(prompt) + i, 0, True)
    drafter.process(verify)
    assert ctx.lengths[0] == len(prompt) + 1


def test_an_idle_draft_model_is_not_prefilled_and_restarts_from_a_window(tiny_model_path, monkeypatch):
    """A sequence not asked for drafts stops being prefilled; asked again far behind, its draft cache restarts from
    the last RESTART_WINDOW committed tokens, and drafting goes on from there at shifted draft positions."""
    from spec_cli.model.batch import Batch
    from spec_cli.model.context import Context
    from spec_cli.model.loader import load_model
    from spec_cli.speculative.base import DraftParams

    monkeypatch.setattr(draft_model, "RESTART_WINDOW", 8)
    ctx = Context(load_model(tiny_model_path, device="cpu"), n_ctx=256)
    drafter = draft_model.DraftModelDrafter(ctx, SpecParams(draft_max=3, draft_p_min=0.0), 1)
    tokens = [40 + i % 50 for i in range(150)]
    drafter.begin(0, [])
    for pos in range(len(tokens)):  # one target decode per token, the drafter never asked
        batch = Batch()
        batch.add(tokens[pos], pos, 0, True)
        drafter.process(batch)
    assert ctx.lengths[0] <= draft_model.DEFER_MAX + draft_model.IDLE_STEPS  # prefilled only while not yet idle
    p = DraftParams(seq=0, n_max=3, pos0=len(tokens), id_last=7, prompt=tokens)
    drafter.catch_up([p])
    drafter.draft([p])
    assert drafter.offset[0] == len(tokens) - 8
    assert drafter.cached[0][:9] == tokens[-8:] + [7] and len(p.result) == 3
    assert ctx.lengths[0] == 8 + 1 + 2  # the window, the seed row, the draft tokens decoded to draft the next


def test_a_draft_model_idle_in_the_last_request_mirrors_the_next_prompt_as_part_of_it(tiny_model_path):
    """The prompt reaches a drafter through `process`, before `begin`: a sequence idle since the last request (the
    adaptive planner did not ask this drafter there) has its new prompt mirrored by `begin`, as part of the prompt's
    processing, not by the first step's `process`, in the generation's time (0.87x of plain for draft-simple under
    --draft-max auto where it never drafted: every prompt after the first prefilled in a step)."""
    from spec_cli.model.batch import Batch
    from spec_cli.model.context import Context
    from spec_cli.model.loader import load_model

    ctx = Context(load_model(tiny_model_path, device="cpu"), n_ctx=256)
    drafter = draft_model.DraftModelDrafter(ctx, SpecParams(draft_max=3, draft_p_min=0.0), 1)
    first = [40 + i % 50 for i in range(60)]
    drafter.begin(0, [])
    for pos, token in enumerate(first):  # a request whose steps never asked the drafter
        batch = Batch()
        batch.add(token, pos, 0, True)
        drafter.process(batch)
    assert drafter.idle[0] > draft_model.IDLE_STEPS
    prompt = [60 + i % 30 for i in range(50)]
    batch = Batch()
    for pos, token in enumerate(prompt):
        batch.add(token, pos, 0, pos == len(prompt) - 1)
    drafter.process(batch)
    drafter.begin(0, prompt)
    assert ctx.lengths[0] == len(prompt) and drafter.cached[0] == prompt


def test_draft_catch_ups_longer_than_n_batch_are_split(tiny_model_path, plain_outputs):
    """Prompt chunks of 8 rows: every draft-cache catch-up (prompt + deferred rows) spans several decodes."""
    params = SpecParams(types=["draft-simple"], draft_max=6, draft_p_min=0.0)
    session = open_session(EngineOptions(model=str(tiny_model_path), model_draft=str(tiny_model_path), n_ctx=256,
                                         n_batch=8, n_ubatch=8, device="cpu", spec=params))
    out, seq = run(session, PROMPTS[0])
    assert out == plain_outputs[0] and seq.n_accepted == seq.n_drafted > 0


def test_an_idle_draft_model_catches_up_in_batches(tiny_model_path, plain_outputs, monkeypatch):
    """A draft model the chain does not ask (here per-request types; the adaptive planner does the same) decodes the
    target's tokens DEFER_MAX positions at a time, not once per step; asked again, it drafts from an exact cache."""
    monkeypatch.setattr(draft_model, "DEFER_MAX", 8)
    session = make_session(tiny_model_path, "ngram-simple,draft-simple", draft=tiny_model_path)
    session.reset()
    ctx = session.chain.drafters[-1].ctx
    decoded_rows = []
    decode = ctx.decode
    monkeypatch.setattr(ctx, "decode", lambda batch, **kw: decoded_rows.append(len(batch)) or decode(batch, **kw))
    gen = session.generator()
    out = gen.start(0, PROMPTS[0], GREEDY, N_PREDICT, SpecOverrides(types={"ngram-simple"})).tokens
    s = gen.active[0]
    while s.n_generated < N_PREDICT // 2:
        out += [t for e in gen.step() for t in e.tokens]
    assert gen.timings.n_steps >= 8 and len(decoded_rows) <= 1 + s.n_past // 8
    assert all(n > 8 for n in decoded_rows)  # whole catch-ups only, no per-step mirroring
    s.spec.types = None  # draft-simple may draft again
    while not s.done:
        out += [t for e in gen.step() for t in e.tokens]
    assert out == plain_outputs[0]
    stats = session.chain.stats["draft-simple"]
    assert stats.n_gen_tokens > 0 and stats.n_acc_tokens == stats.n_gen_tokens


def test_statistics_are_consistent(tiny_model_path, tiny_draft_path):
    session = make_session(tiny_model_path, "ngram-simple,ngram-mod,draft-simple", draft=tiny_draft_path)
    seqs = [run(session, p)[1] for p in PROMPTS]
    for st in session.chain.stats.values():
        assert st.n_acc_tokens <= st.n_gen_tokens
        assert sum(st.n_acc_tokens_per_pos) == st.n_acc_tokens
        assert st.n_acc_drafts <= st.n_gen_drafts == st.n_call_accept
        if st.n_call_accept:
            assert st.mean_acc_len == pytest.approx(1 + st.n_acc_tokens / st.n_call_accept)
        assert all(0.0 <= r <= 1.0 for r in st.acc_rate_per_pos)
    assert sum(st.n_acc_tokens for st in session.chain.stats.values()) == sum(s.n_accepted for s in seqs)
    assert sum(st.n_gen_tokens for st in session.chain.stats.values()) == sum(s.n_drafted for s in seqs)


def test_per_sequence_overrides(tiny_model_path, plain_outputs):
    session = make_session(tiny_model_path, "ngram-simple,ngram-mod")
    out, seq = run(session, PROMPTS[0], spec=SpecOverrides(enabled=False))
    assert out == plain_outputs[0] and seq.n_drafted == 0
    out, seq = run(session, PROMPTS[0], spec=SpecOverrides(n_max=1))
    assert out == plain_outputs[0] and seq.n_drafted > 0
    assert all(len(st.n_gen_tokens_per_pos) <= 1 for st in session.chain.stats.values())
    before = session.chain.stats["ngram-simple"].n_gen_drafts
    out, seq = run(session, PROMPTS[0], spec=SpecOverrides(types={"ngram-mod"}))
    assert out == plain_outputs[0]
    assert session.chain.stats["ngram-simple"].n_gen_drafts == before


@pytest.mark.parametrize("n", [1, 2, 7])
def test_n_predict_is_exact_even_inside_an_accepted_run(tiny_model_path, plain_outputs, n):
    session = make_session(tiny_model_path, "ngram-simple")
    out, seq = run(session, PROMPTS[0], n)
    assert out == plain_outputs[0][:n]
    assert seq.n_generated == n and seq.finish_reason == "length"


def test_end_of_generation_token_stops_and_is_not_emitted(tiny_model_path, plain_outputs):
    session = make_session(tiny_model_path, "ngram-simple")
    stop = plain_outputs[0][5]
    session.engine.tokenizer.eog_ids = frozenset({stop})
    out, seq = run(session, PROMPTS[0])
    assert out == plain_outputs[0][: plain_outputs[0].index(stop)]
    assert seq.finish_reason == "stop"


def test_context_end_finishes_with_length(tiny_model_path):
    session = make_session(tiny_model_path, "ngram-simple")
    session.engine.ctx.n_ctx_seq = 30  # a small context
    out, seq = run(session, PROMPTS[0], -1)
    assert seq.finish_reason == "length" and len(PROMPTS[0]) + len(out) == 31


def test_prompt_longer_than_context_is_a_clear_error(tiny_model_path):
    from spec_cli.errors import SpecCliError

    session = make_session(tiny_model_path)
    with pytest.raises(SpecCliError, match="prompt is too long"):
        generate(session.generator(), list(range(5, 300)), GREEDY, 4)
