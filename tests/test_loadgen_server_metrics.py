"""loadgen's reading of Prometheus /metrics: parsing, vLLM's names, model filtering and exact deltas."""

from loadgen.server_metrics import GaugeSample, MetricsSnapshot, parse_prometheus, server_delta

VLLM_BEFORE = """\
# HELP vllm:num_preemptions_total Cumulative number of preemptions.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="llama"} 3.0
vllm:prompt_tokens_total{engine="0",model_name="llama"} 1000.0
vllm:generation_tokens_total{engine="0",model_name="llama"} 500.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="llama"} 4.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="llama"} 6.0
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="llama"} 800.0
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="llama"} 200.0
vllm:gpu_cache_usage_perc{engine="0",model_name="llama"} 0.1
vllm:num_requests_running{engine="0",model_name="llama"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama"} 1.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 10.0
vllm:time_to_first_token_seconds_created{engine="0",model_name="llama"} 1.7e+09
vllm:spec_decode_num_drafts_total{engine="0",model_name="llama"} 100.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="llama"} 300.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="llama"} 150.0
"""

VLLM_AFTER = """\
vllm:num_preemptions_total{engine="0",model_name="llama"} 5.0
vllm:prompt_tokens_total{engine="0",model_name="llama"} 1800.0
vllm:generation_tokens_total{engine="0",model_name="llama"} 900.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="llama"} 6.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="llama"} 6.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="llama"} 1.0
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="llama"} 1600.0
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="llama"} 600.0
vllm:gpu_cache_usage_perc{engine="0",model_name="llama"} 0.0
vllm:num_requests_running{engine="0",model_name="llama"} 0.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama"} 2.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 14.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="llama"} 200.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="llama"} 600.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="llama"} 390.0
"""


def test_parse_prometheus_lines():
    text = (
        '# HELP x y\nplain 1\nwith_labels{a="1",b="q\\"uote, {brace}"} 2.5 1700000000\n'
        'inf_value{le="+Inf"} +Inf\nbroken{ 1\nnot_a_number{} abc\n\n'
    )
    samples = parse_prometheus(text)
    assert samples[:2] == [("plain", {}, 1.0), ("with_labels", {"a": "1", "b": 'q"uote, {brace}'}, 2.5)]
    assert samples[2] == ("inf_value", {"le": "+Inf"}, float("inf")) and len(samples) == 3


def test_vllm_deltas_with_spec_decode():
    before = MetricsSnapshot(parse_prometheus(VLLM_BEFORE), model="llama")
    after = MetricsSnapshot(parse_prometheus(VLLM_AFTER), model="llama")
    samples = [GaugeSample(0.0, 0.1, 2.0, None), GaugeSample(0.5, 0.75, 9.0, None), GaugeSample(1.0, 0.0, 0.0, None)]
    s = server_delta(before, after, samples)
    assert (s.preemptions, s.prompt_tokens, s.generation_tokens) == (2.0, 800.0, 400.0)
    assert s.finished == {"stop": 2.0, "abort": 1.0}  # length did not change
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.prefix_cache_hit_rate) == (800.0, 400.0, 0.5)
    assert s.ttft_mean_ms == 250.0  # (2.5 - 1.5) s / (14 - 10) requests
    assert (s.spec_decode_drafts, s.spec_decode_draft_tokens, s.spec_decode_accepted_tokens) == (100, 300, 240)
    assert s.spec_decode_acceptance_rate == 0.8 and s.spec_decode_mean_acceptance_length == 3.4
    assert (s.peak_kv_usage, s.peak_running, s.peak_waiting) == (0.75, 9.0, None)
    assert s.itl_mean_ms is None and s.queue_time_mean_ms is None  # not exported


def test_other_models_are_ignored_and_unlabelled_series_kept():
    text = (
        'aserve:num_preemptions_total{model_name="a"} 1\naserve:num_preemptions_total{model_name="b"} 10\n'
        "aserve:kv_cache_usage_perc 0.5\n"
    )
    assert MetricsSnapshot(parse_prometheus(text), model="a").total(("num_preemptions_total",)) == 1.0
    assert MetricsSnapshot(parse_prometheus(text), model="a").total(("kv_cache_usage_perc",)) == 0.5
    # a --model the server does not label: every series counts
    assert MetricsSnapshot(parse_prometheus(text), model="c").total(("num_preemptions_total",)) == 11.0
    assert MetricsSnapshot(parse_prometheus(text)).total(("missing_total",)) is None
