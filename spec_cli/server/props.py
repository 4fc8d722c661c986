"""GET /props: llama-server's server properties (default generation settings, slot count, model, chat template, build)
plus what a speculative server is asked about: the drafter types it loaded and its draft settings, each slot's
drafter state and draft counters (llama.cpp #28119), a draft model's vocabulary bridge where its vocabulary is not the
target's (its shared tokens and the draft tokens mapped or not since the server started), and the bytes of weights and
KV cache of every model and head (runtime/memory.py, measured once the server is up: they do not change while it
runs) with the suffix drafter's token store as it is now. No prompt or output is shown (that is /slots', behind
--slots).
"""

from __future__ import annotations

from spec_cli import __version__
from spec_cli.runtime.memory import with_stores
from spec_cli.runtime.session import Session
from spec_cli.server import protocol as P
from spec_cli.server.scheduler import Scheduler
from spec_cli.server.settings import ServerSettings
from spec_cli.speculative.draft_model import DraftModelDrafter
from spec_cli.text.chat import resolve_template


def props(scheduler: Scheduler, settings: ServerSettings, model_id: str, memory: dict) -> dict:
    session, engine = scheduler.session, scheduler.engine
    tok, spec, loaded = engine.tokenizer, session.spec, session.types
    params = P.generation_settings(P.GenerationFields(), settings.sampling, settings.n_predict, None, spec, loaded)
    template = resolve_template(settings.chat_template) if settings.chat_template else tok.chat_template
    return {
        "default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": scheduler.n_ctx_slot, "speculative": params["speculative"],
            "is_processing": False, "params": params, "prompt": "",
            "next_token": {"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0,
                           "stopping_word": ""}},
        "total_slots": len(scheduler.slots),
        "model_alias": model_id,
        "model_path": str(engine.target.gguf.path),
        "modalities": {"vision": False, "audio": False},
        "endpoint_slots": settings.slots,
        "endpoint_props": False,  # read-only: no POST /props
        "endpoint_metrics": settings.metrics,
        "chat_template": template or "",
        "bos_token": _piece(tok, tok.bos_id),
        "eos_token": _piece(tok, tok.eos_id),
        "build_info": f"spec-cli {__version__}",
        "is_sleeping": False,
        "speculative": {
            "types": loaded, "n_max": spec.draft_max, "n_max_auto": spec.adaptive, "n_min": spec.draft_min,
            "p_min": spec.draft_p_min, "verify": spec.verify, "select": spec.select,
            "model_draft": str(engine.draft_file) if engine.draft_file is not None and loaded else None,
            **draft_vocabulary(session)},
        "slots": [slot_props(scheduler, i) for i in range(len(scheduler.slots))],
        "memory": with_stores(memory, session.drafters),
    }


def draft_vocabulary(session: Session) -> dict:
    """{"draft_vocabulary": ...} for a draft model whose vocabulary is not the target's (vocab_bridge.py): the
    bridge's figures and the draft tokens that had a counterpart (n_mapped) or had none and ended their draft
    (n_unmapped), pooled over the slots since the server started; {} for one vocabulary."""
    bridge = session.engine.draft_bridge
    if bridge is None:
        return {}
    st = session.stats.get(DraftModelDrafter.name)
    n_mapped, n_unmapped = (st.n_mapped, st.n_unmapped) if st is not None else (0, 0)
    return {"draft_vocabulary": {**bridge.figures(), "n_mapped": n_mapped, "n_unmapped": n_unmapped}}


def slot_props(scheduler: Scheduler, seq: int) -> dict:
    """One slot's state: its KV cells, its draft counters since the server started, what each drafter holds of it."""
    slot, chain = scheduler.slots[seq], scheduler.session.chain
    return {"id": seq, "is_processing": slot.task is not None, "n_ctx": scheduler.n_ctx_slot,
            "n_past": scheduler.engine.ctx.lengths[seq],
            "speculative": {"n_drafted": slot.n_drafted, "n_accepted": slot.n_accepted,
                            "drafters": chain.slot_info(seq) if chain is not None else {}}}


def _piece(tok, token_id: int | None) -> str:
    return tok.token_to_piece(token_id).decode("utf-8", "replace") if token_id is not None else ""
