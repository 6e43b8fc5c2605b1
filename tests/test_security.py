"""Security: the API key guard on every /v1 route (several keys, or vLLM's VLLM_API_KEY), binding to localhost by
default, a random prefix-hash seed per process, and cache_salt isolation of prefix-cache sharing between tenants."""

import subprocess
import sys

import reliability_common
from reliability_common import make_llm_engine
from test_server import make_client, metric

from aserve.cli import build_parser
from aserve.entrypoints.openai.cli_args import api_keys

llm_engine = reliability_common.llm_engine  # a fixture, found by its name


async def test_api_key_guards_every_v1_route(llm_engine):
    """With --api-key, every /v1 route (whatever it is, present or future) answers 401 without the right bearer
    token; /health and /metrics stay open for probes and scrapers."""
    client = await make_client(llm_engine, api_key="sekrit")
    try:
        routes = [
            (r.method, r.resource.canonical)
            for r in client.app.router.routes()
            if r.resource is not None and r.resource.canonical.startswith("/v1") and r.method != "HEAD"
        ]
        assert {path for _, path in routes} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                resp = await client.request(method, path, json={}, headers=headers)
                assert resp.status == 401, (method, path, headers)
                assert (await resp.json())["error"]["code"] == "invalid_api_key"
        resp = await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert resp.status == 200
        assert (await client.get("/health")).status == 200 and (await client.get("/metrics")).status == 200
    finally:
        await client.close()


async def test_several_api_keys_and_vllms_variable(llm_engine, monkeypatch):
    """--api-key takes several keys (any opens /v1); without the flag $VLLM_API_KEY sets one, as in vLLM."""
    client = await make_client(llm_engine, api_key=["first", "second"])
    try:
        for key, status in (("first", 200), ("second", 200), ("firs", 401), ("first second", 401)):
            assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status == status
    finally:
        await client.close()
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys(build_parser().parse_args(["serve"])) == ["from-env"]
    assert api_keys(build_parser().parse_args(["serve", "--api-key", "a", "b"])) == ["a", "b"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert api_keys(build_parser().parse_args(["serve"])) is None


def test_serve_binds_localhost_by_default():
    ns = build_parser().parse_args(["serve"])
    assert ns.host == "127.0.0.1" and ns.api_key is None


def test_prefix_hash_seed_is_random_per_process():
    """The same tokens hash differently in two processes: block hashes cannot be predicted (or collided on purpose)
    from outside."""
    code = ("from aserve.core.block_pool import BlockHasher; h = []; BlockHasher(16).extend(h, list(range(32)));"
            "print(h[-1].hex())")  # fmt: skip
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)]  # fmt: skip
    assert len(runs[0]) == 32 and runs[0] != runs[1]


async def test_cache_salt_isolates_prefix_sharing(tiny_model):
    """Requests share prefix-cache blocks only with requests of the same cache_salt (tenant). A fresh engine: the
    shared one's hit counter also moves with other tests' leftover step statistics."""
    client = await make_client(make_llm_engine(tiny_model))
    prompt = list(range(10, 74))  # 4 full blocks

    async def hits_of(salt) -> float:
        before = metric(await (await client.get("/metrics")).text(), "aserve:prefix_cache_hits_total")
        body = {"prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200
        return metric(await (await client.get("/metrics")).text(), "aserve:prefix_cache_hits_total") - before

    try:
        assert await hits_of("tenant-a") == 0
        assert await hits_of("tenant-a") > 0  # same tenant: shared
        assert await hits_of("tenant-b") == 0  # another tenant: not shared
        assert await hits_of(None) == 0  # unsalted requests do not share with salted ones either
        assert await hits_of(None) > 0
    finally:
        await client.close()
