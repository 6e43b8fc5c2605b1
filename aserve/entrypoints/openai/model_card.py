"""GET /v1/models' cards, in vLLM's shape: OpenAI's id, object, created and owned_by, and vLLM's root (where the
weights were read), parent (null: no adapters here), max_model_len and permission (one model_permission object with
vLLM's values; clients that list models through vLLM's schema read it)."""

from __future__ import annotations

import uuid

from aserve.entrypoints.openai.server_state import ServerState


def model_card(state: ServerState, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "aserve",
        "root": state.engine.config.model_dir,
        "parent": None,
        "max_model_len": state.engine.config.max_model_len,
        "permission": [_permission(state.created)],
    }


def _permission(created: int) -> dict:
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
