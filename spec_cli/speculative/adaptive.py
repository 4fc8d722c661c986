"""Adaptive draft length (`--draft-max auto`): each step verifies the draft length that maximizes expected tokens per
second, from the target's measured verify-cost curve and the running acceptance per draft position of the drafter
that produced the draft.

Why: speculation only pays when verifying k draft tokens costs little more than decoding one. On CPUs the cost of a
forward grows with its rows (bench/verify_cost.py: the int4 kernel tiles 4 rows, f32 roughly doubles at 2 rows), and
acceptance changes with the text (a copied block vs free writing), so no fixed --draft-max is right everywhere.

The math. Let a_i = P(draft token i accepted | tokens 1..i-1 accepted), the conditional acceptance at position i.
Token j is committed iff tokens 1..j are all accepted, so a draft of k tokens commits on average, counting the
target's own token,
    E(k) = 1 + sum_{j=1..k} g_j,   g_j = prod_{i<=j} a_i   (the marginal gain of the j-th token).
g_j never grows with j (a_i <= 1), so E is concave. One step over G sequences with drafts of k_s tokens takes
    time = cost(G + sum_s k_s) + sum_s c_s * k_s
where cost(rows) is the verify side of a step (on the CPU kernels the rows go as they come; elsewhere the verify
batch is padded to the longest draft, context.py laying it out as [G, T]: cost(G * (1 + max_s k_s))) and c_s the
seconds per token of the drafter that drafted sequence s (a model's forward per token for draft-simple and
draft-mtp, ~0 for the n-gram drafters). The planner maximizes  sum_s E_s(k_s) / time  twice per
step: before drafting, to cap what each drafter may draft (drafting time still to be spent counts, and how far its
drafts reach: a draft model stops below --draft-p-min, `_uniform_length`); after drafting,
to choose how much of each draft to verify, where the drafting time is already spent: a fixed term of the
denominator, so a draft that was paid for is not thrown away for nothing. Maximizing a step's own rate is right
where the tokens a cut leaves are drafted again at the next step (an n-gram drafter's copied block goes on, a draft
model drafts on): they cost a step then, not nothing.

What the estimates see. Position i is tried only when a draft of at least i tokens was verified and its first
i - 1 were accepted, so the plan decides what it learns: a position it stops verifying (one rejection there, or a
prior borrowed from a weaker position before it) would keep its estimate for good, and the plan short. Under match
verification (greedy, and every n-gram draft) a draft token is accepted exactly when it equals the token the
target commits at its position, so the step loop also scores what was not verified against the committed tokens
(runtime/generate.py): the first token a cut removed from a draft whose verified tokens were all accepted (against
the target's own next token), and the drafts of n-gram drafters planned at 0, asked apart (`Planner.shadowing`).
An n-gram drafter's asking costs nothing (Drafter.cheap), so its cap is either 0 or the whole draft, cut after
drafting: pricing its lookup per drafted token, on every ask, capped ngram-mod at a few tokens where its copied
blocks were accepted whole (issue 46: 0.87x of --draft-max 16 on code edits).
"""

from __future__ import annotations

import itertools
import math
import operator

from spec_cli.options import DRAFT_MAX
from spec_cli.speculative.confidence import ConfidenceModel, DraftGate, calibrated_gains
from spec_cli.speculative.verify_costs import COST_EMA, CostModel

# Upper bound of an adaptive draft (unless the drafter's own cap is lower, e.g. draft-mtp's 3): the default fixed
# --draft-max (options.draft_bound), and past 16 rows the CPU verify cost grows about linearly, so longer drafts
# rarely pay.
AUTO_DRAFT_MAX = DRAFT_MAX

ACCEPT_DECAY = 0.9  # per observation: memory of ~10 drafts, so the estimate follows the text as it changes
PRIOR_ACCEPT = 0.5  # prior a_1 of a drafter never seen; position i > 1 starts from the estimate at i - 1
PRIOR_WEIGHT = 1.0  # the prior of a_1 counts as one observation, forgotten like the others
# A deeper position's prior, borrowed from the position before it, is a guess about another position: it counts as
# DEPTH_PRIOR_WEIGHT observations. At 0.5 like a_1's, two accepted drafts of 1 and 2 tokens made ngram-cache's next
# draft, all 8 tokens of it, look 70 % likely to go through, and it was rejected at its first token (chat, summarize
# and a code edit of qwen2.5-coder-1.5b). Replayed over the built-in prompt sets' greedy outputs (1.5b and 0.5b) with
# the measured cost curve: worst prompt 0.937x -> 0.989x of plain, code-edit within +-2 % (ngram-cache +5-9 %).
DEPTH_PRIOR_WEIGHT = 4.0
# Exploration: a model drafter planned at 0 tokens gets a 1-token probe (its estimate only changes when it drafts),
# the gap to the next probe doubling from its shortest gap up to PROBE_GAP_MAX steps, starting over when the drafter
# is worth asking again. The shortest gap is PROBE_GAP_MIN steps, or longer for a dear probe: a probe's whole price
# (the catch-up of an idle draft cache, its token, the extra verify row) is held to PROBE_BUDGET of the time of the
# steps between probes. So a useless draft model costs a few percent at most, and one that starts to fit the text is
# found again. An n-gram drafter (free to ask) is shadowed instead (Planner._free_cap): its drafts are scored against
# the committed tokens, never verified, its asking held to PROBE_BUDGET.
PROBE_GAP_MIN = 16
# A model drafter's first probe comes this many steps into a request, while its cache still holds the prompt it
# mirrored at prompt time (draft_model.IDLE_STEPS): one draft token and one verify row. Waiting for the gap its
# prompt prefill priced (the next probes' price: an idle cache restarts from a window) meant no probe at all within
# a 128-token request, and draft-simple, 99 % right on code edits, never drafted in a fresh process (1.01x of plain).
FIRST_PROBE_AFTER = 1
PROBE_GAP_MAX = 256
# A model drafter planned at 0 before JUDGED_DRAFTS of its drafts were judged by the target is planned from priors
# and from asks that p-min stopped, which say how seldom it drafts, not how well: it is probed at every step instead
# (one token, its cache still warm), up to JUDGED_PROBES times. Before, draft-simple (the 0.5b for the 1.5b) on chat
# had its first two asks stopped by p-min at the start of an answer, fell to 0 on the prior a_1 = 0.5, and its next
# probe was 256 steps away: never asked in a request, where draft-max 4 runs at 1.16x of plain (88 % accepted).
JUDGED_DRAFTS = 3
# Three judged drafts are little evidence: smollm2 drafting for qwen2.5-coder-0.5b on code edits (~0.7 of its first
# tokens accepted, 0.35 of a target forward per draft token) had its first drafts accepted 3 of 3, 0 of 6 and 0 of 2,
# fell to 0, and its next probe was ~170 steps away: 308 steps for the set against 142 at --draft-max 4. So a drafter
# that falls to 0 stays unjudged, probed at every step (its cache kept in step), while its long-run estimates raised
# by Z_UPPER standard errors still plan it above 0 (`UpperAcceptance`): a wrong one is done after a probe or two, a
# right one comes back. Replayed (`scripts/replay_plans.py --draft-clock curve --curves FILE`, 2026-11-29, two curve
# files): that set 1.04 -> 1.26x of plain (draft-max 4 1.16x), chained with ngram-mod 1.58-1.60 -> 1.68-1.70x
# (1.50-1.52x), writing 1.11 -> 1.14x; the 1.5b's chat 1.07 -> 1.11x; elsewhere within the replay's noise (1-2 %).
Z_UPPER = 1.0
JUDGED_PROBES = 16
PROBE_BUDGET = 0.01
# A drafter whose asking costs time (a model's forwards) is asked only where its expected tokens per second beat plain
# decoding's by this fraction: the cost and acceptance estimates move by a few percent from step to step on a shared
# CPU, and one planned at break-even pays for every draft that p-min stops or the target rejects. With 2-row verifies
# at 1.1-1.2 one-row forwards, draft-simple on free writing (96 % of its drafts accepted, half of its asks stopped by
# p-min) was planned at 0.98-1.05x and ran at 0.97x of plain. A free drafter (n-gram) has nothing to lose by asking.
ASK_MARGIN = 0.05
# A dropped model drafter is not observed, so its ~10-ask estimates stay where they were when it fell to 0, which is
# where they dipped: draft-simple (the 0.5b for the 1.5b) on chat was dropped at a reach of 0.30 against its run's
# 0.44 (at 0.44 the plan gives 1.23x of plain, as draft-max 4 measures) and not asked for the rest of the run, new
# requests included (0.91x of draft-max 4). The same observations also feed estimates with a memory of ~20 asks
# (LONG_RUN_DECAY): a model drafter is dropped only when both plan it at 0, and at a request's first step, when its
# draft cache holds the prompt mirrored at `begin` (no restart to pay), a dropped drafter either says pays comes
# back. Replayed on saved curves (`scripts/replay_plans.py --draft-clock curve --curves`), against returns alone with
# a memory of ~50 asks: the 0.5b with smollm2 on code edits 0.86 -> 0.99x of draft-max 4, the 1.5b's chat 0.94 ->
# 0.97x of draft-max 8, writing 0.96 -> 0.97-0.98x of plain; the 0.5b's chat 0.96 -> 0.91x.
LONG_RUN_DECAY = 0.95
# Both memories dip together where the text is hard for a while (the 0.5b drafting for the 1.5b on chat: dropped at a
# reach of 0.25 against the run's 0.48), and stay there while it is dropped, so the next requests ran draftless too
# (35 % of the chat set's steps). A third set of estimates, with a memory of ~100 asks (POOLED_DECAY; its reach an
# unbiased mean, not an EMA from 1.0), brings a dropped drafter back at a request's first step where the requests so
# far say it pays. Replayed on four saved curve files: the 1.5b's chat 1.027 -> 1.043x of plain on one (draft-max 4
# 1.069x), chained 1.029 -> 1.042x; elsewhere the same plans.
POOLED_DECAY = 0.99
MEMORIES = ("recent", "long_run", "pooled")  # the planner's estimates, shortest memory first
# A token-by-token model drafter may draft GATED_EXTRA tokens past the length its positional estimates plan: its
# gate (confidence.DraftGate) stops the draft where the next token stops paying, and a position past the cap is
# never drafted, so never judged again. With the floor of p-min gone (options.DRAFT_P_MIN), unsure tokens rejected
# at position 3 capped the 0.5b drafting for the 1.5b at 2 tokens on code edits for the rest of the set, where its
# sure drafts run on. Replayed on four saved curve files (`--draft-max auto`, 2026-11-28): code edits 1.514 ->
# 1.623x and 1.596 -> 1.631x of plain on the 1.5b (draft-max 4: 1.58-1.59x), 1.377 -> 1.423x on the 0.5b with
# smollm2; the 1.5b's chat 1.285 -> 1.256x and 1.280 -> 1.269x (draft-max 4: 1.06x); elsewhere within 2 points.
# Twice the planned length instead: chat 1.22-1.23x.
GATED_EXTRA = 1


class AcceptanceModel:
    """Per drafter name, the conditional acceptance a_i per draft position, an exponentially decayed average with a
    weak prior:  a_i = (hits_i + w_i * prior_i) / (trials_i + w_i)  where hits and trials decay by `decay` at
    each observation of position i, and so does the prior's weight w_i (PRIOR_WEIGHT at first for a_1,
    DEPTH_PRIOR_WEIGHT for the others): the prior only matters until a position has been seen a few times, and a
    drafter that is always right gets a_i -> 1.
    prior_1 = PRIOR_ACCEPT, prior_i = a_{i-1}: positions rarely verified borrow from the one before."""

    def __init__(self, n_max: int = AUTO_DRAFT_MAX, decay: float = ACCEPT_DECAY) -> None:
        self.n_max = n_max
        self.decay = decay
        self.counts: dict[str, list[list[float]]] = {}  # name -> per position [hits, trials, prior weight]
        self._gains: dict[str, list[float]] = {}  # cache of gains(), dropped by observe()

    def observe(self, name: str, n_drafted: int, n_accepted: int) -> None:
        """A verified draft: positions 1..n_accepted were accepted, position n_accepted + 1 (if drafted) rejected;
        later positions were never tried (their condition failed), so they learn nothing."""
        counts = self.counts.setdefault(name, self._unseen())
        for i in range(min(n_accepted + 1, n_drafted, self.n_max)):
            c = counts[i]
            c[0] = self.decay * c[0] + (i < n_accepted)
            c[1] = self.decay * c[1] + 1.0
            c[2] *= self.decay
        self._gains.pop(name, None)

    def adopt(self, name: str, other: AcceptanceModel) -> None:
        """Take `other`'s estimates for `name` (its rates, the same), their hits, trials and prior weights scaled
        by (1 - self.decay) / (1 - other.decay): a shorter memory taking a longer one's counts weighs them up (x10
        for the ~10-ask estimates taking the ~100-ask ones), so what many asks saw is not undone by the next few.
        Scaled down instead, to the weight this memory's own observations have, a drafter brought back at a
        request's first step was dropped again at the answer's first uncertain tokens (replayed, the 0.5b with
        smollm2 drafting on chat: 1.171 -> 1.158x of plain; elsewhere within 0.6 %)."""
        scale = (1 - self.decay) / (1 - other.decay)
        self.counts[name] = [[x * scale for x in c] for c in other.counts.get(name) or other._unseen()]
        self._gains.pop(name, None)

    def rates(self, name: str, z: float = 0.0) -> list[float]:
        """a_1..a_n_max; with z > 0 each raised by z standard errors of its decayed counts (capped at 1)."""
        out, prior = [], PRIOR_ACCEPT
        for hits, trials, weight in self.counts.get(name) or self._unseen():
            prior = (hits + weight * prior) / (trials + weight)
            out.append(min(1.0, prior + z * math.sqrt(prior * (1 - prior) / (trials + weight))))
        return out

    def _unseen(self) -> list[list[float]]:
        return [[0.0, 0.0, PRIOR_WEIGHT if i == 0 else DEPTH_PRIOR_WEIGHT] for i in range(self.n_max)]

    def gains(self, name: str, z: float = 0.0) -> list[float]:
        """g_1..g_n_max: g_j = prod_{i<=j} a_i, the expected tokens the j-th draft token adds (from rates raised by
        z standard errors where z > 0, not cached)."""
        if z:
            return list(itertools.accumulate(self.rates(name, z), operator.mul))
        cached = self._gains.get(name)
        if cached is None:
            cached = self._gains[name] = list(itertools.accumulate(self.rates(name), operator.mul))
        return cached


class UpperAcceptance:
    """What a drafter's acceptance may be, as far as `model`'s evidence tells: its a_i raised by Z_UPPER standard
    errors (`AcceptanceModel.rates`)."""

    def __init__(self, model: AcceptanceModel) -> None:
        self.model = model

    def gains(self, name: str) -> list[float]:
        return self.model.gains(name, Z_UPPER)


def expected_tokens(gains: list[float], k: int) -> float:
    """E(k) = 1 + g_1 + ... + g_k: tokens committed by a step verifying k draft tokens."""
    return 1.0 + sum(gains[:k])


class DraftCost:
    """A drafter's seconds per draft forward: EMA of the time of its draft calls over EMA of the forwards they ran
    (`forwards`: a draft stopped below --draft-p-min ran one past its last token, and a call that drafted nothing
    ran its seed row, so a drafter that often fails looks as expensive as the time it wastes). The first call is
    not priced: it pays one-time costs (48 ms instead of 21 for one 0.5b draft token), and as the first price, which
    the EMA only slowly forgets, it kept a 98 %-accepted draft model from ever drafting again."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.forwards = 0.0
        self.warm = False

    def observe(self, seconds: float, n_forwards: int) -> None:
        if not self.warm:
            self.warm = True
            return
        n = max(n_forwards, 1)
        if self.forwards == 0.0:
            self.seconds, self.forwards = seconds, float(n)
        else:
            self.seconds += COST_EMA * (seconds - self.seconds)
            self.forwards += COST_EMA * (n - self.forwards)

    @property
    def per_forward(self) -> float:
        return self.seconds / self.forwards if self.forwards else 0.0  # unknown until its first call: optimistic


def forwards(n_drafted: int, most: int) -> int:
    """Forwards of a token-by-token draft call that drafted n_drafted tokens of at most `most`: the seed row's, then
    one per drafted token but the last, or but none where a token below --draft-p-min ended the draft."""
    return min(n_drafted + 1, max(most, 1))


class Planner:
    """Chooses, per step, how many tokens each drafter may draft (`drafting_caps`, before drafting) and how many
    of each sequence's draft to verify (`plan`, after drafting); learns from `observe_*`. One per drafter chain
    (its acceptance and draft costs are the chain's drafters'); the cost model is the engine's, shared."""

    def __init__(self, costs: CostModel, n_max: int = AUTO_DRAFT_MAX, ragged: bool = False) -> None:
        self.costs = costs
        self.n_max = n_max
        self.ragged = ragged  # the target's verify step costs its rows, not G x (1 + the longest draft) (Context)
        self.acceptance = AcceptanceModel(n_max)
        self.long_run = AcceptanceModel(n_max, LONG_RUN_DECAY)  # the same, with a longer memory (LONG_RUN_DECAY)
        self.draft_costs: dict[str, DraftCost] = {}
        # per drafter, r_j: the decayed fraction of asks whose draft reached position j, where the cap allowed it
        # (a draft model stops below --draft-p-min: at once on a third to a half of its asks on chat)
        self.reach: dict[str, list[float]] = {}
        self.long_run_reach: dict[str, list[float]] = {}  # the same, with a longer memory
        self.pooled = AcceptanceModel(n_max, POOLED_DECAY)  # the same, with a memory across requests
        self.pooled_reach: dict[str, list[list[float]]] = {}  # per position: [asks that reached it, asks], decayed
        self.confidence = ConfidenceModel()  # a token-by-token model drafter's acceptance per confidence
        self.ask_rates: dict[str, float] = {}  # per model drafter, this step's planned rate (`drafting_caps`)
        self.step = 0
        self.request_step = -1  # the first step of the newest request
        self.next_probe: dict[str, int] = {}
        self.probe_gap: dict[str, int] = {}
        self.probing: set[str] = set()  # drafters granted a probe this step
        self.shadowing: set[str] = set()  # free drafters to ask this step only to score their drafts
        # drafters planned at 0: asked again only when a probe's outcome says so (a draft model idle for a while
        # restarts its cache from a window, a price the estimate that tips it back over 0 does not see)
        self.dropped: set[str] = set()
        self.probes_granted: set[str] = set()  # drafters granted a probe at the last step
        self.probe_catch_up: dict[str, float] = {}  # seconds the last probe of a drafter caught up
        self.mirroring_price: dict[str, float] = {}  # its dearest mirroring (a prompt's): priced until measured
        self.unasked: set[str] = set()  # model drafters not asked yet: their first ask finds the prompt in cache
        self.n_verified: dict[str, int] = {}  # drafts of a drafter the target has judged (verified or scored)
        self.unjudged_probes: dict[str, int] = {}  # probes granted while it had fewer than JUDGED_DRAFTS of them
        # drafters whose draft is one forward whatever its length (draft-dflash's block): their drafting is priced
        # per call, shared by the sequences of the step, so only the verify cost and acceptance choose the length
        self.per_call: frozenset[str] = frozenset()

    # --- planning -------------------------------------------------------------------------------------------

    def drafting_caps(self, names: list[str], n_seq: int, free: frozenset[str] = frozenset()) -> dict[str, int]:
        """Per drafter, the most tokens worth drafting this step: the best length if all n_seq sequences drafted
        with it (an upper estimate of what `plan` will keep), or 1 when its probe is due; 0 = do not ask it.
        A `free` drafter (an n-gram lookup: asking costs nothing) is capped by `_free_cap` instead."""
        self.step += 1
        probed = self.probes_granted
        self.probing.clear()
        self.shadowing = set()
        caps = {}
        for name in names:
            if name in free:
                caps[name] = self._free_cap(name, n_seq)
                continue
            if name not in self.next_probe:
                self.next_probe[name] = self.step + FIRST_PROBE_AFTER
                self.unasked.add(name)
            k, self.ask_rates[name] = self._uniform_plan(name, n_seq)  # the rate: the gate's this step (`gate`)
            if self.step == self.request_step:  # its cache holds the prompt `begin` mirrored: no restart to pay
                k = (k or self._start_over_length(name, n_seq, "long_run")
                     or self._start_over_length(name, n_seq, "pooled"))
            elif k > 0 and name in self.dropped and name not in probed:
                k = 0  # fallen to 0: only a probe's evidence brings it back, not a drift of the cost estimates
            elif k == 0 and name not in self.dropped:  # a dip of the recent estimates alone does not drop it
                k = self._uniform_length(name, n_seq, "long_run")
            if k > 0:  # worth asking: should it fall back to 0, its probes start over at the shortest gap
                self.dropped.discard(name)
                self._schedule_probe(name, self._probe_gap_min(name))
                if name not in self.per_call:
                    k = min(self.n_max, k + GATED_EXTRA)  # its gate stops the draft where it stops paying
            else:
                in_step = name not in self.dropped or name in probed  # asked at the last step: its cache is warm
                self.dropped.add(name)
                if self._unjudged(name, n_seq, in_step):
                    self.probing.add(name)  # at the price of one token: its cache is still warm
                    self.unjudged_probes[name] = self.unjudged_probes.get(name, 0) + 1
                elif self.step >= self.next_probe[name]:
                    self.probing.add(name)
                    self._spend_probe(name)  # paid for by the asking
                k = 1 if name in self.probing else 0
            caps[name] = k
        self.probes_granted = set(self.probing)
        return caps

    def _start_over_length(self, name: str, n_seq: int, memory: str) -> int:
        """The length the estimates of a longer `memory` (MEMORIES: `long_run`, `pooled`) plan for a model drafter
        the shorter ones plan at 0; where it is not 0, every shorter memory starts over from its estimates."""
        k = self._uniform_length(name, n_seq, memory)
        if k > 0:
            model, reach = self._estimates(name, memory)
            shorter = ((self.acceptance, self.reach), (self.long_run, self.long_run_reach))
            for shorter_model, shorter_reach in shorter[: MEMORIES.index(memory)]:
                shorter_model.adopt(name, model)
                if reach is not None:
                    shorter_reach[name] = list(reach)
        return k

    def _estimates(self, name: str, memory: str) -> tuple[AcceptanceModel | UpperAcceptance, list[float] | None]:
        """The acceptance model and the observed reach (None before the first ask) of one of MEMORIES, or of
        "upper": the long-run estimates raised by their uncertainty (`UpperAcceptance`)."""
        if memory == "pooled":
            return self.pooled, self._pooled_reach(name)
        if memory in ("long_run", "upper"):
            model = self.long_run if memory == "long_run" else UpperAcceptance(self.long_run)
            return model, self.long_run_reach.get(name)
        return self.acceptance, self.reach.get(name)

    def _pooled_reach(self, name: str) -> list[float] | None:
        """r_1..r_n_max of the pooled memory: the decayed fraction of asks that reached each position."""
        counts = self.pooled_reach.get(name)
        return [reached / asked if asked else 1.0 for reached, asked in counts] if counts else None

    def _free_cap(self, name: str, n_seq: int) -> int:
        """A free drafter's cap: n_max where its drafts pay for their verify rows (a draft costs the same at any
        length; `plan` cuts it, seeing it), else 0, and when due it is shadowed (`shadowing`): asked apart, its
        draft scored against the tokens the step commits (`observe_shadow`), never verified. A shadow stays due
        step after step until the drafter has a draft to score (one that finds nothing teaches nothing), then
        comes back at the gap that holds its asking within PROBE_BUDGET (every step or two for an n-gram lookup).
        Between shadows it is not asked: in a chain its draft would take the step from the drafters after it.
        Verified 1-token probes at doubling gaps were this evidence before: a drafter wrong on its first drafts of
        a request (ngram-cache's cold cache on chat) came back only after ~100 steps, or missed a copied block
        that began between probes."""
        if self._draft_pays(name, n_seq):
            self.next_probe[name] = self.step + 1  # should it fall to 0, its first shadow is due at once
            return self.n_max
        if self.step >= self.next_probe.get(name, 0):
            self.shadowing.add(name)
        return 0

    def plan(self, drafts: list[tuple[str | None, int]], drafting_s: float,
             confidences: list[list[float]] | None = None) -> list[int]:
        """Per sequence of the step (winning drafter or None, draft length): the tokens to verify, each <= its
        draft, the drafting (`drafting_s`) being spent already. A draft with its tokens' `confidences` (a model
        drafter's) is valued by their calibrated acceptance, the others by the drafter's per position. Greedy
        path: from no drafts, add one token at a time where it gives the best throughput until every draft is
        used up, and keep the best point of the path; that ignores local dips of a stepped cost curve. For one
        sequence the path covers every length; for several, the order by marginal gain is the optimal one for
        concave gains when the cost only depends on the rows."""
        confidences = confidences or [[] for _ in drafts]
        gains = [self._draft_gains(name, n, conf) for (name, n), conf in zip(drafts, confidences)]
        n_seq = len(drafts)
        lengths = [0] * n_seq
        expected, longest, total = float(n_seq), 0, 0
        best, best_lengths = expected / (self.costs(n_seq) + drafting_s), list(lengths)
        while True:
            pick, pick_rate = -1, -1.0
            for s, g in enumerate(gains):
                k = lengths[s]
                if k < len(g):
                    rows = n_seq + total + 1 if self.ragged else n_seq * (1 + max(longest, k + 1))
                    rate = (expected + g[k]) / (self.costs(rows) + drafting_s)
                    if rate > pick_rate:
                        pick, pick_rate = s, rate
            if pick < 0:
                break
            expected += gains[pick][lengths[pick]]
            lengths[pick] += 1
            longest, total = max(longest, lengths[pick]), total + 1
            if pick_rate > best:
                best, best_lengths = pick_rate, list(lengths)
        return self._with_probes(drafts, best_lengths)

    def _draft_gains(self, name: str | None, n: int, confidence: list[float]) -> list[float]:
        """g_1..g_n of a draft of n tokens: by the calibrated acceptance of its tokens' confidences where it has
        them, else by the drafter's acceptance per position."""
        if not name:
            return []
        if len(confidence) < n:
            return self.acceptance.gains(name)[:n]
        return calibrated_gains(self.confidence.rates(name), confidence[:n])

    def gate(self, name: str, n_seq: int) -> DraftGate:
        """Where a token-by-token model drafter's drafts stop paying this step (confidence.DraftGate), in tokens at
        the rate its asking is planned to run at (`_uniform_length`'s best, plain decoding's when it plans 0): a
        token pays where its expected gain over that rate's time for its verify row (and the next draft forward)
        raises the step's rate."""
        rate = self.ask_rates.get(name) or self._uniform_plan(name, n_seq)[1]
        at = [self.costs(n_seq * j) for j in range(1, self.n_max + 2)]  # at[j - 1] = cost(n_seq j)
        row = tuple(rate * (at[j] - at[j - 1]) / n_seq for j in range(1, self.n_max + 1))
        return DraftGate(self.confidence.rates(name), row, self.confidence.mean(name), rate * self._draft_cost(name))

    def _draft_pays(self, name: str, n_seq: int) -> bool:
        """Whether a free drafter's draft, whenever it has one, pays for its verify rows at some length:
        E(k) / cost(n_seq (1 + k)) > 1 / cost(n_seq) per sequence. How seldom it drafts does not enter: an ask that
        finds nothing costs nothing. Weighed by the fraction y of asks that gave a draft, as a paid drafter's reach
        is (`_uniform_length`), where y cancels only on paper, the rate tied with plain decoding's in floating point
        once y had decayed below 1e-16 (some 350 asks without a draft; a server's planner lives across requests):
        ngram-mod, at a copied block after 417 draftless steps of free writing (the writing set at -n 128), was
        shadowed and its first 16-token draft, accepted whole, scored instead of verified."""
        gains, plain = self.acceptance.gains(name), self.costs(n_seq)
        return any(expected_tokens(gains, k) * plain > self.costs(n_seq * (1 + k)) for k in range(1, self.n_max + 1))

    def _uniform_length(self, name: str, n_seq: int, memory: str = "recent") -> int:
        return self._uniform_plan(name, n_seq, memory)[0]

    def _uniform_plan(self, name: str, n_seq: int, memory: str = "recent") -> tuple[int, float]:
        """(k, its rate; plain decoding's where k is 0): argmax_k of the tokens per second if every sequence asked
        drafter `name`, whose asking costs time, for k tokens, where its draft reaches position j with probability
        r_j (`reach`: a draft model stops below --draft-p-min or its gate, and then gives none, but its seed row was
        paid for):
            (1 + sum_{j<=k} r_j g_j) / (verify(k) / n_seq + ask(k)),
            verify(k) = cost(n_seq) + sum_{j<=k} r_j (cost(n_seq (1 + j)) - cost(n_seq j)),
        0 unless that beats plain decoding by ASK_MARGIN. ask(k), the drafting time per sequence, is f times the
        expected forwards 1 + r_1 + ... + r_{k-1} for a model drafter (f: its seconds per forward) and f / n_seq for
        a per-call (block) drafter (f: its seconds per call, shared by the step's sequences). Priced as if every
        draft had k tokens, draft-simple's asks stopped by p-min looked k times dearer than they were and its shorter
        drafts as long: on chat (half its asks stopped, 88 % of its tokens accepted; 1.16x of plain at draft-max 4)
        it was never asked. A free drafter (an n-gram lookup) is judged by `_draft_pays` instead: its lookups take
        0.02-0.2 ms against a 0.5b forward's 14.5, but priced per token, their EMA (one call preempted for 7-30 ms
        on a busy machine included) counted k times on every ask against a gain that comes with 1 ask in r_1:
        ngram-mod, drafting on 7 % of code-edit steps, was capped at a few tokens or dropped.
        `memory`: which estimates it plans on (`_estimates`; MEMORIES' longer ones in `_start_over_length`)."""
        model, observed_reach = self._estimates(name, memory)
        gains, reach = model.gains(name), self._reach(observed_reach)
        plain, f = self.costs(n_seq), self._draft_cost(name)
        best_k, best = 0, (1.0 + ASK_MARGIN) / (plain / n_seq)
        expected, verify, n_forwards = 1.0, plain, 1.0
        for k in range(1, self.n_max + 1):
            expected += reach[k - 1] * gains[k - 1]
            verify += reach[k - 1] * (self.costs(n_seq * (1 + k)) - self.costs(n_seq * k))
            n_forwards += reach[k - 2] if k > 1 else 0.0
            asking = f / n_seq if name in self.per_call else f * n_forwards
            rate = expected / (verify / n_seq + asking)
            if rate > best:
                best_k, best = k, rate
        return best_k, best if best_k else n_seq / plain

    def _reach(self, observed_reach: list[float] | None) -> list[float]:
        """r_1..r_n_max, never growing with j; a position no cap has allowed yet takes the one before's."""
        out, r = [], 1.0
        for observed in observed_reach or [1.0] * self.n_max:
            r = min(r, observed)
            out.append(r)
        return out

    def _with_probes(self, drafts: list[tuple[str | None, int]], lengths: list[int]) -> list[int]:
        """A drafter granted a probe verifies one token of its first draft the plan would have dropped."""
        for s, (name, n) in enumerate(drafts):
            if name in self.probing and lengths[s] == 0 and n > 0:
                lengths[s] = 1
                self.probing.discard(name)
        return lengths

    def _unjudged(self, name: str, n_seq: int, in_step: bool) -> bool:
        """Whether a model drafter planned at 0 is not judged yet, and may be probed at once (up to JUDGED_PROBES
        times): fewer than JUDGED_DRAFTS of its drafts judged by the target, or, while it is `in_step` (asked at
        the last step, so a probe costs one token, no restart), too few for its estimates to tell (raised by their
        uncertainty, they still plan it above 0)."""
        if self.unjudged_probes.get(name, 0) >= JUDGED_PROBES:
            return False
        if self.n_verified.get(name, 0) < JUDGED_DRAFTS:
            return True
        return in_step and self._uniform_length(name, n_seq, "upper") > 0

    def _spend_probe(self, name: str) -> None:
        """The next probe after the doubled gap, or longer where the last probe showed a dearer price than the gap
        was planned for."""
        self._schedule_probe(name, max(self.probe_gap.get(name, 0), self._probe_gap_min(name)))

    def _schedule_probe(self, name: str, gap: int) -> None:
        """The next probe of `name` `gap` steps from now, the one after it at twice the gap (up to PROBE_GAP_MAX)."""
        self.next_probe[name] = self.step + gap
        self.probe_gap[name] = min(2 * gap, PROBE_GAP_MAX)

    def _probe_gap_min(self, name: str) -> int:
        """The fewest steps between probes that keep a probe's price within PROBE_BUDGET of the steps' time, at
        least PROBE_GAP_MIN: a draft model's probe (with the catch-up of its idle cache) costs forwards."""
        if not self.costs.calibrated:
            return PROBE_GAP_MIN
        catch_up = self.probe_catch_up.get(name, self.mirroring_price.get(name, 0.0))
        price = catch_up + self._draft_cost(name) + self.costs(2) - self.costs(1)
        return min(max(PROBE_GAP_MIN, math.ceil(price / (PROBE_BUDGET * self.costs(1)))), PROBE_GAP_MAX)

    def _draft_cost(self, name: str) -> float:
        cost = self.draft_costs.get(name)
        return cost.per_forward if cost else 0.0

    # --- learning -------------------------------------------------------------------------------------------

    def observe_drafting(self, name: str, seconds: float, drafts: list[tuple[int, int]]) -> None:
        """One draft call of drafter `name` took `seconds` and drafted, per sequence asked, (tokens, the most it
        could draft): what it costs per forward (a per-call drafter's price is the call's) and how far its drafts
        reach."""
        n_forwards = 1 if name in self.per_call else sum(forwards(n, most) for n, most in drafts)
        self.draft_costs.setdefault(name, DraftCost()).observe(seconds, n_forwards)
        short = self.reach.setdefault(name, [1.0] * self.n_max)
        long_run = self.long_run_reach.setdefault(name, [1.0] * self.n_max)
        pooled = self.pooled_reach.setdefault(name, [[0.0, 0.0] for _ in range(self.n_max)])
        for j in range(self.n_max):
            allowed = [n > j for n, most in drafts if most > j]
            pooled[j][0] = POOLED_DECAY * pooled[j][0] + sum(allowed)
            pooled[j][1] = POOLED_DECAY * pooled[j][1] + len(allowed)
            if allowed:
                for r, decay in ((short, ACCEPT_DECAY), (long_run, LONG_RUN_DECAY)):
                    r[j] += (1 - decay) * (sum(allowed) / len(allowed) - r[j])

    def observe_catch_up(self, name: str, seconds: float) -> None:
        """Drafter `name` spent `seconds` bringing its cache up to date before drafting (its `catch_up`): a probe's
        catch-up prices the next probes, except the first ask's (the early first probe's): its cache still held the
        prompt, but a later probe restarts an idle cache (pricing those by the first's ~0 s brought a 32-row restart
        into every chat request: 0.97x of plain)."""
        first = name in self.unasked
        self.unasked.discard(name)
        if name in self.probing and not first:
            self.probe_catch_up[name] = seconds

    def observe_mirroring(self, name: str, seconds: float) -> None:
        """Drafter `name` spent `seconds` mirroring the target (its `process` of a target decode, its `begin` of a
        request). The dearest, a prompt's (a draft model's prefill of it in `process`, an MTP head's prompt rows in
        `begin`: about a probe's restart window), stands in for a probe's catch-up until a probe is measured, so the
        probes after the first (which comes while the cache holds the prompt) are not scheduled as if they were
        free."""
        self.mirroring_price[name] = max(self.mirroring_price.get(name, 0.0), seconds)

    def begin_request(self) -> None:
        """A request begins: the next step is its first."""
        self.request_step = self.step + 1

    def observe_accept(self, name: str, n_drafted: int, n_accepted: int, confidence: list[float] = ()) -> None:
        """The target judged n_drafted tokens of `name`'s draft (with their confidences, a model drafter's) and
        accepted the first n_accepted."""
        if len(confidence) >= n_drafted:
            self.confidence.observe(name, list(confidence[:n_drafted]), n_accepted)
        self.acceptance.observe(name, n_drafted, n_accepted)
        self.long_run.observe(name, n_drafted, n_accepted)
        self.pooled.observe(name, n_drafted, n_accepted)
        if n_drafted:
            self.n_verified[name] = self.n_verified.get(name, 0) + 1

    def observe_shadow(self, name: str, n_scored: int, n_matched: int) -> None:
        """A shadowed drafter's draft, scored against the tokens the step committed: its first n_matched tokens
        equal them, out of n_scored compared (the draft or the committed tokens, whichever is shorter). Its next
        shadow comes when its asking has cost no more than PROBE_BUDGET of the steps between."""
        self.acceptance.observe(name, n_scored, n_matched)
        self.long_run.observe(name, n_scored, n_matched)
        self.pooled.observe(name, n_scored, n_matched)
        cost = self.draft_costs.get(name)
        asking = cost.seconds if cost else 0.0
        gap = math.ceil(asking / (PROBE_BUDGET * self.costs(1))) if self.costs.calibrated else PROBE_GAP_MIN
        self.next_probe[name] = self.step + min(max(gap, 1), PROBE_GAP_MAX)

    def observe_step(self, rows: int, seconds: float) -> None:
        """The verify side of a step whose target forward computed `rows` rows took `seconds`."""
        self.costs.observe(rows, seconds)

