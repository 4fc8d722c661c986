"""Speculation counters, kept by the chain around every drafter call (llama.cpp `common_speculative_impl`
counters and `common_speculative_print_stats`); pooled counts, never means of per-request ratios.

mean acceptance length = 1 + accepted / verify steps (the +1 is the target's own token per step);
acceptance rate at position i = drafts with >= i+1 accepted tokens / drafts generated;
mean draft length = tokens / drafts, as verified (with --draft-max auto: the planned lengths).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DrafterStats:
    name: str
    n_call_begin: int = 0
    n_call_draft: int = 0
    n_call_accept: int = 0  # verify steps that used this drafter's draft
    n_proposed: int = 0  # non-empty drafts it produced; some lose to another drafter's (--spec-select gain) or
    #                      were asked only to be scored (an n-gram drafter shadowed by --draft-max auto)
    n_gen_drafts: int = 0
    n_acc_drafts: int = 0  # drafts with at least one accepted token
    n_gen_tokens: int = 0
    n_acc_tokens: int = 0
    n_acc_tokens_per_pos: list[int] = field(default_factory=list)
    n_gen_tokens_per_pos: list[int] = field(default_factory=list)
    n_mapped: int = 0  # draft tokens of another vocabulary that had a counterpart in the target's (vocab_bridge.py)
    n_unmapped: int = 0  # ... that had none, each ending its draft
    t_begin_us: float = 0.0
    t_draft_us: float = 0.0
    t_accept_us: float = 0.0

    def observe_draft(self, n_tokens: int) -> None:
        self.n_gen_drafts += 1
        self.n_gen_tokens += n_tokens
        _grow(self.n_gen_tokens_per_pos, n_tokens)
        for i in range(n_tokens):
            self.n_gen_tokens_per_pos[i] += 1

    def observe_accept(self, n_accepted: int) -> None:
        self.n_call_accept += 1
        self.n_acc_tokens += n_accepted
        if n_accepted > 0:
            self.n_acc_drafts += 1
        _grow(self.n_acc_tokens_per_pos, n_accepted)
        for i in range(n_accepted):
            self.n_acc_tokens_per_pos[i] += 1

    def merge(self, other: "DrafterStats") -> None:
        for f in ("n_call_begin", "n_call_draft", "n_call_accept", "n_proposed", "n_gen_drafts", "n_acc_drafts",
                  "n_gen_tokens", "n_acc_tokens", "n_mapped", "n_unmapped", "t_begin_us", "t_draft_us", "t_accept_us"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for mine, theirs in ((self.n_acc_tokens_per_pos, other.n_acc_tokens_per_pos),
                             (self.n_gen_tokens_per_pos, other.n_gen_tokens_per_pos)):
            theirs = list(theirs)  # a copy: the server pools a chain's counters while its drafters go on counting
            _grow(mine, len(theirs))
            for i, v in enumerate(theirs):
                mine[i] += v

    @property
    def mean_acc_len(self) -> float:
        return 1.0 + self.n_acc_tokens / self.n_call_accept if self.n_call_accept else 0.0

    @property
    def mean_draft_len(self) -> float:
        return self.n_gen_tokens / self.n_gen_drafts if self.n_gen_drafts else 0.0

    @property
    def acceptance(self) -> float:
        return self.n_acc_tokens / self.n_gen_tokens if self.n_gen_tokens else 0.0

    @property
    def acc_rate_per_pos(self) -> list[float]:
        return [n / self.n_gen_drafts for n in self.n_acc_tokens_per_pos] if self.n_gen_drafts else []

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_acc_len=self.mean_acc_len, mean_draft_len=self.mean_draft_len, acceptance=self.acceptance,
                 acc_rate_per_pos=self.acc_rate_per_pos)
        return d

    def format_line(self, timing: bool = True) -> str:
        """llama.cpp's `statistics <type>: ...` line."""
        s = (f"statistics {self.name:>16}: #calls(b,g,a) = {self.n_call_begin:4d} {self.n_call_draft:6d} "
             f"{self.n_call_accept:6d}, #gen drafts = {self.n_gen_drafts:6d}, #acc drafts = {self.n_acc_drafts:5d}, "
             f"#gen tokens = {self.n_gen_tokens:6d}, #acc tokens = {self.n_acc_tokens:5d}")
        if self.n_call_accept > 0:
            rates = ", ".join(f"{r:.3f}" for r in self.acc_rate_per_pos)
            s += f", #mean acc len = {self.mean_acc_len:.2f}, #acc rate/pos = ({rates})"
        if self.n_mapped or self.n_unmapped:
            s += f", #mapped tokens = {self.n_mapped}/{self.n_mapped + self.n_unmapped}"
        if timing:
            s += f", dur(b,g,a) = {self.t_begin_us / 1e3:.3f}, {self.t_draft_us / 1e3:.3f}, {self.t_accept_us / 1e3:.3f} ms"
        return s


def _grow(counts: list[int], n: int) -> None:
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))
