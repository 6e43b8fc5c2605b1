"""The /metrics series vLLM dashboards read about the KV cache and per-request decode speed: cache_config_info,
prompt tokens by source (computed or from the prefix cache), per-request prefill KV tokens computed and time per
output token, driven over HTTP with a tiny model."""

from aiohttp.test_utils import TestClient, TestServer
from test_server import metric

from aserve import EngineArgs, LLMEngine
from aserve.engine.async_engine import AsyncEngine
from aserve.entrypoints.openai.server import SERVER_OPTIONS, build_app


async def test_cache_and_decode_speed_series(tiny_model):
    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=256,
                                  num_gpu_blocks_override=40, served_model_name="tiny"))  # fmt: skip
    client = TestClient(TestServer(build_app(AsyncEngine(engine), "tiny", None), **SERVER_OPTIONS))
    await client.start_server()
    try:
        prompt = "The quick brown fox jumps over the lazy dog. " * 4  # 2+ blocks: the second request hits them
        for _ in range(2):
            resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "ignore_eos": True})
            assert resp.status == 200
        text = await (await client.get("/metrics")).text()
    finally:
        await client.close()
    info = next(line for line in text.splitlines() if line.startswith("aserve:cache_config_info{"))
    for label in ('block_size="16"', 'num_gpu_blocks="40"', 'cache_dtype="auto"', 'enable_prefix_caching="True"'):
        assert label in info
    prompt_tokens = metric(text, "aserve:prompt_tokens_total")
    cached = metric(text, "aserve:prompt_tokens_cached_total")
    assert cached >= 16 and cached == metric(text, "aserve:prefix_cache_hits_total")
    by_source = {source: metric(text, f'aserve:prompt_tokens_by_source_total{{model_name="tiny",source="{source}"}}')
                 for source in ("local_compute", "local_cache_hit")}  # fmt: skip
    assert by_source == {"local_compute": prompt_tokens - cached, "local_cache_hit": cached}
    assert metric(text, "aserve:request_prefill_kv_computed_tokens_count") == 2
    assert metric(text, "aserve:request_prefill_kv_computed_tokens_sum") == prompt_tokens - cached
    assert metric(text, "aserve:request_time_per_output_token_seconds_count") == 2
    assert metric(text, "aserve:request_time_per_output_token_seconds_sum") > 0
