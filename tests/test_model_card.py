"""GET /v1/models and /v1/models/{model} read with the official openai client: vLLM's card (root, parent,
max_model_len and a model_permission entry) beside OpenAI's id, object, created and owned_by."""

import pytest
from test_responses_api import MODEL, llm_engine, open_client  # noqa: F401  (llm_engine: the fixture)

openai = pytest.importorskip("openai")


async def test_models_carry_vllms_card_fields(llm_engine):  # noqa: F811
    http, client = await open_client(llm_engine)
    try:
        listed = (await client.models.list()).data
        assert [m.id for m in listed] == [MODEL]
        card = (await client.models.retrieve(MODEL)).model_dump()
        assert card == listed[0].model_dump() | {"permission": card["permission"]}  # each permission has its own id
        assert card["object"] == "model" and card["owned_by"] == "aserve" and card["parent"] is None
        assert card["root"] == llm_engine.config.model_dir and card["max_model_len"] == 256
        [permission] = card["permission"]
        assert permission["id"].startswith("modelperm-") and permission["object"] == "model_permission"
        assert permission["created"] == card["created"] and permission["organization"] == "*"
        assert permission["allow_sampling"] and permission["allow_logprobs"] and permission["allow_view"]
        assert not (permission["allow_create_engine"] or permission["allow_fine_tuning"] or permission["is_blocking"])
        assert permission["group"] is None and permission["allow_search_indices"] is False
        with pytest.raises(openai.NotFoundError) as err:
            await client.models.retrieve("no-such-model")
        assert err.value.body["code"] == "model_not_found"
    finally:
        await client.close()
        await http.close()
