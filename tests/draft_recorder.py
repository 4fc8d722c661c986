"""Records what a session's last drafter drafts, for tests that compare every draft with a reference."""

from __future__ import annotations


def record_drafts(session) -> list[tuple[list[int], int, list[int]]]:
    """Wrap the chain's last drafter's draft(): every call's (prompt, id_last, drafted tokens), appended as they
    come to the list returned."""
    drafter = session.chain.drafters[-1]
    calls, inner = [], drafter.draft

    def draft(params):
        inner(params)
        calls.extend((list(p.prompt), p.id_last, list(p.result)) for p in params if p.result)

    drafter.draft = draft
    return calls
