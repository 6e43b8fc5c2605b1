"""vLLM's series that dashboards and scripts read, checked with real requests through a tiny model: the per-request
n and longest-sample histograms, vLLM's buckets, waiting requests by reason and corrupted requests on /metrics; and
the offline `LLM.get_metrics()` (Counter, Gauge, Histogram, Vector objects) agreeing with what generate() returned."""

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_server import metric

from aserve import LLM, EngineArgs, LLMEngine, SamplingParams
from aserve.core.metrics import PrometheusMetrics
from aserve.engine.async_engine import AsyncEngine
from aserve.entrypoints.openai.server import SERVER_OPTIONS, build_app
from aserve.metrics_reader import Counter, Gauge, Histogram, Vector


def bucket(text: str, name: str, le: str) -> float:
    return metric(text, f'{name}_bucket{{le="{le}",model_name="tiny"}}')


async def test_request_params_n_and_longest_sample_over_http(tiny_model):
    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=256,
                                  served_model_name="tiny"))  # fmt: skip
    client = TestClient(TestServer(build_app(AsyncEngine(engine), "tiny", None), **SERVER_OPTIONS))
    await client.start_server()
    try:
        for body in ({"prompt": "Hello there", "max_tokens": 4, "ignore_eos": True},
                     {"prompt": "Once upon a time", "max_tokens": 7, "n": 3, "ignore_eos": True,
                      "temperature": 1.0, "seed": 1}):  # fmt: skip
            resp = await client.post("/v1/completions", json=body)
            assert resp.status == 200, await resp.text()
        text = await (await client.get("/metrics")).text()
    finally:
        await client.close()
    # once per request: n=1 lands in the first bucket, n=3 in le="5" (vLLM's buckets 1, 2, 5, 10, 20)
    n = "aserve:request_params_n"
    assert [bucket(text, n, le) for le in ("1.0", "2.0", "5.0", "10.0", "20.0", "+Inf")] == [1, 1, 2, 2, 2, 2]
    assert metric(text, f"{n}_count") == 2 and metric(text, f"{n}_sum") == 4
    longest = "aserve:request_max_num_generation_tokens"
    assert metric(text, f"{longest}_count") == 2 and metric(text, f"{longest}_sum") == 4 + 7
    assert bucket(text, longest, "5.0") == 1 and bucket(text, longest, "10.0") == 2
    # per sequence (each of the 3 samples), max_tokens in 1-2-5 buckets up to max_model_len (256)
    max_tokens = "aserve:request_params_max_tokens"
    assert metric(text, f"{max_tokens}_count") == 4 and metric(text, f"{max_tokens}_sum") == 4 + 3 * 7
    assert bucket(text, max_tokens, "5.0") == 1 and bucket(text, max_tokens, "10.0") == 4
    assert bucket(text, max_tokens, "200.0") == 4 and f'{max_tokens}_bucket{{le="500.0"' not in text
    assert metric(text, "aserve:request_generation_tokens_sum") == 4 + 3 * 7
    # vLLM's request-latency and inter-token buckets
    assert 'aserve:e2e_request_latency_seconds_bucket{le="0.3",' in text
    assert 'aserve:request_queue_time_seconds_bucket{le="7680.0",' in text
    assert 'aserve:inter_token_latency_seconds_bucket{le="0.01",' in text
    assert 'aserve:inter_token_latency_seconds_bucket{le="0.005",' not in text
    assert metric(text, "aserve:corrupted_requests_total") == 0
    for reason in ("capacity", "deferred"):
        assert metric(text, f'aserve:num_requests_waiting_by_reason{{model_name="tiny",reason="{reason}"}}') == 0


def test_waiting_by_reason_counts_paused_requests_as_deferred(tiny_model):
    engine = LLMEngine(EngineArgs(model=tiny_model, dtype="float32", enforce_eager=True, max_num_seqs=1))
    metrics = PrometheusMetrics("tiny")
    engine.stats.add_listener(metrics)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for request_id in ("a", "b", "c"):
        engine.add_request(request_id, "Hello", params)
    engine.set_paused("c", True)  # its client stopped reading: it waits, but not for room in the batch
    engine.step()  # "a" runs (one sequence slot); "b" waits for the slot
    text = metrics.render().decode()
    assert metric(text, "aserve:num_requests_running") == 1 and metric(text, "aserve:num_requests_waiting") == 2
    by_reason = {reason: metric(text, f'aserve:num_requests_waiting_by_reason{{model_name="tiny",reason="{reason}"}}')
                 for reason in ("capacity", "deferred")}  # fmt: skip
    assert by_reason == {"capacity": 1, "deferred": 1}


def by_name(metrics, name: str, kind: type):
    found = [m for m in metrics if m.name == name]
    assert len(found) == 1 and isinstance(found[0], kind), found
    return found[0]


def test_offline_get_metrics_counts_what_generate_returned(tiny_model):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=256, disable_log_stats=False)
    params = [SamplingParams(max_tokens=5, ignore_eos=True), SamplingParams(max_tokens=3, n=2, seed=0),
              SamplingParams(max_tokens=12, ignore_eos=True)]  # fmt: skip
    outputs = llm.generate(["Hello", "The sky is", "One two three"], params, use_tqdm=False)
    samples = [c for out in outputs for c in out.outputs]
    metrics = llm.get_metrics()
    assert {m.name.split(":")[0] for m in metrics} == {"aserve"}
    name = llm.engine.config.served_model_name  # on every series but cache_config_info (labelled by its settings)
    assert all(m.labels["model_name"] == name for m in metrics if m.name != "aserve:cache_config_info")
    generated = sum(len(c.token_ids) for c in samples)
    assert by_name(metrics, "aserve:generation_tokens", Counter).value == generated
    prompt_tokens = sum(len(out.prompt_token_ids) * len(out.outputs) for out in outputs)
    assert by_name(metrics, "aserve:prompt_tokens", Counter).value == prompt_tokens
    finished = {m.labels["finished_reason"]: m.value for m in metrics if m.name == "aserve:request_success"}
    assert sum(finished.values()) == len(samples) == 4
    assert finished["length"] == sum(c.finish_reason == "length" for c in samples)
    lengths = by_name(metrics, "aserve:request_generation_tokens", Histogram)
    assert (lengths.count, lengths.sum) == (4, generated) and lengths.buckets["+Inf"] == 4
    assert list(lengths.buckets) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"]
    assert lengths.buckets["5.0"] == sum(len(c.token_ids) <= 5 for c in samples)
    n = by_name(metrics, "aserve:request_params_n", Histogram)
    assert (n.count, n.sum, n.buckets["1.0"], n.buckets["2.0"]) == (3, 4, 2, 3)
    longest = by_name(metrics, "aserve:request_max_num_generation_tokens", Histogram)
    assert longest.sum == 5 + max(len(c.token_ids) for c in outputs[1].outputs) + 12
    assert by_name(metrics, "aserve:num_requests_running", Gauge).value == 0
    assert by_name(metrics, "aserve:cache_config_info", Gauge).labels["block_size"] == "16"
    assert by_name(metrics, "aserve:e2e_request_latency_seconds", Histogram).count == 4
    # counters keep counting across calls
    llm.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert by_name(llm.get_metrics(), "aserve:generation_tokens", Counter).value == generated + 2


def test_offline_get_metrics_spec_decode_vector(tiny_model):
    self_draft = {"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 3}
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True, disable_log_stats=False, speculative_config=self_draft)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate({"prompt_token_ids": [5, 6, 7, 8] * 4}, greedy, use_tqdm=False)
    metrics = llm.get_metrics()
    by_position = by_name(metrics, "aserve:spec_decode_num_accepted_tokens_per_pos", Vector)
    accepted = by_name(metrics, "aserve:spec_decode_num_accepted_tokens", Counter).value
    # the target drafting for itself: every draft is accepted, at every position
    assert len(by_position.values) == 3 and all(v > 0 for v in by_position.values)
    assert sum(by_position.values) == accepted == by_name(metrics, "aserve:spec_decode_num_draft_tokens", Counter).value


def test_get_metrics_needs_stats_logging(tiny_model):
    llm = LLM(tiny_model, dtype="float32", enforce_eager=True)  # disable_log_stats=True by default, as in vLLM
    with pytest.raises(AssertionError, match="disable_log_stats=False"):
        llm.get_metrics()
