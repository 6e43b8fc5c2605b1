"""loadgen's statistics, SLO goodput, sweep verdicts and A/B comparison, on synthetic per-request records with
hand-computed expectations (times are binary fractions of a second so that they are exact)."""

import pytest

from loadgen.compare import compare_runs, config_changes, diff, pair_runs
from loadgen.config import SLO, Load
from loadgen.records import RequestRecord
from loadgen.results import Report, RunResult
from loadgen.stats import distribution, meets_slo, percentile, summarize
from loadgen.sweep import sweep_result


def record(index, start, ttft, e2e, n_out, chunks, ok=True, error="", prompt_tokens=10):
    return RequestRecord(
        index=index,
        session=index,
        turn=0,
        scheduled=start,
        start=start,
        ttft=ttft,
        e2e=e2e,
        chunk_times=chunks,
        prompt_tokens=prompt_tokens,
        output_tokens=n_out,
        max_tokens=n_out,
        ok=ok,
        error=error,
        status=200 if ok else 500,
    )


# r3's server reported 9 tokens in 3 chunks (several tokens per chunk): TPOT uses the 9, ITL the 3 chunks.
RECORDS = [
    record(0, 0.0, 0.25, 1.25, 5, [0.25, 0.5, 0.75, 1.0, 1.25]),  # TPOT 1.0/4 = 0.25
    record(1, 0.5, 0.5, 1.5, 3, [0.5, 1.0, 1.5]),  # TPOT 1.0/2 = 0.5
    record(2, 1.0, 0.125, 0.125, 1, [0.125]),  # one token: no TPOT, no ITL
    record(3, 1.5, 1.0, 3.0, 9, [1.0, 2.0, 3.0]),  # TPOT 2.0/8 = 0.25; ends at 4.5
    record(4, 2.0, 0.25, 0.5, 0, [0.25], ok=False, error="HTTP 500: boom"),
]


def test_percentile_is_linear_interpolation():
    values = [40.0, 10.0, 30.0, 20.0]  # sorted: 10 20 30 40, h = 3q/100
    assert percentile(values, 0) == 10.0
    assert percentile(values, 50) == 25.0
    assert percentile(values, 25) == 17.5  # h = 0.75
    assert percentile(values, 90) == pytest.approx(37.0, abs=1e-12)  # h = 2.7
    assert percentile(values, 100) == 40.0
    assert percentile([7.0], 99) == 7.0


def test_tpot_and_itl_of_one_record():
    assert RECORDS[0].tpot() == 0.25 and RECORDS[1].tpot() == 0.5 and RECORDS[3].tpot() == 0.25
    assert RECORDS[2].tpot() is None and RECORDS[4].tpot() is None  # one token; failed
    assert RECORDS[0].inter_token_latencies() == [0.25] * 4
    assert RECORDS[3].inter_token_latencies() == [1.0, 1.0]


def test_summary_exact():
    s = summarize(RECORDS)
    assert (s.num_requests, s.num_ok, s.num_errors, s.error_rate) == (5, 4, 1, 0.2)
    assert s.duration_s == 4.5  # first start 0.0 .. last end 1.5 + 3.0
    assert s.request_throughput == 4 / 4.5
    assert (s.prompt_tokens, s.output_tokens) == (40, 18)
    assert s.output_throughput == 18 / 4.5 and s.total_token_throughput == 58 / 4.5
    assert s.errors == {"HTTP 500: boom": 1}
    approx = lambda x: pytest.approx(x, rel=1e-12)  # noqa: E731
    # TTFT ms 250 500 125 1000 -> sorted 125 250 500 1000
    assert (s.ttft_ms.count, s.ttft_ms.mean, s.ttft_ms.median, s.ttft_ms.max) == (4, 468.75, 375.0, 1000.0)
    assert (s.ttft_ms.p90, s.ttft_ms.p99) == (approx(850.0), approx(985.0))
    # TPOT ms 250 500 250 -> 250 250 500
    assert (s.tpot_ms.count, s.tpot_ms.mean, s.tpot_ms.median) == (3, approx(1000 / 3), 250.0)
    assert (s.tpot_ms.p90, s.tpot_ms.p99) == (approx(450.0), approx(495.0))
    # ITL ms: 4 x 250, 2 x 500, 2 x 1000 (the failed request's chunks are not counted)
    assert (s.itl_ms.count, s.itl_ms.mean, s.itl_ms.median, s.itl_ms.p90, s.itl_ms.p99) == (8, 500, 375, 1000, 1000)
    # E2E ms 1250 1500 125 3000 -> 125 1250 1500 3000
    assert (s.e2e_ms.count, s.e2e_ms.mean, s.e2e_ms.median) == (4, 1468.75, 1375.0)
    assert (s.e2e_ms.p90, s.e2e_ms.p99) == (approx(2550.0), approx(2955.0))
    assert s.slo is None and s.goodput is None and s.slo_attainment is None


def test_goodput_counts_requests_meeting_every_bound():
    slo = SLO(ttft_ms=500, tpot_ms=300)
    # r0 meets both; r1 TPOT 500 > 300; r2 one token: TPOT not checked; r3 TTFT 1000 > 500; r4 failed.
    assert [meets_slo(r, slo) for r in RECORDS] == [True, False, True, False, False]
    s = summarize(RECORDS, slo)
    assert (s.slo_met, s.slo_attainment, s.goodput) == (2, 0.4, 2 / 4.5)
    assert [meets_slo(r, SLO(e2e_ms=1250)) for r in RECORDS] == [True, False, True, False, False]
    assert [meets_slo(r, SLO(ttft_ms=1000)) for r in RECORDS] == [True, True, True, True, False]


def test_empty_and_all_failed_runs():
    s = summarize([])
    assert (s.num_requests, s.duration_s, s.request_throughput, s.ttft_ms, s.error_rate) == (0, 0.0, 0.0, None, 0.0)
    s = summarize([RECORDS[4]], SLO(ttft_ms=1))
    assert (s.num_ok, s.error_rate, s.ttft_ms, s.slo_met, s.goodput) == (0, 1.0, None, 0, 0.0)
    assert distribution([]) is None


DEFAULT_SLO = SLO(ttft_ms=100)


def run_with(load, attainment=None, throughput=1.0, ttft_mean=100.0, errors=0, slo=DEFAULT_SLO):
    s = summarize(RECORDS[:4], slo)
    s.slo_attainment, s.request_throughput, s.ttft_ms.mean, s.num_errors = attainment, throughput, ttft_mean, errors
    return RunResult(load=load, summary=s, server=None, records=[], started_at=0.0)


def test_sweep_reports_the_highest_load_meeting_the_slo():
    runs = [run_with(Load("rate", v), a) for v, a in ((1, 1.0), (2, 0.95), (4, 0.5), (8, 0.9), (16, 0.2))]
    result = sweep_result("rate", runs, attainment=0.9)
    assert result.meets_slo == [True, True, False, True, False]
    assert (result.best, result.best_index, result.values) == (8, 3, [1, 2, 4, 8, 16])
    assert sweep_result("rate", runs, attainment=0.99).best == 1
    assert sweep_result("rate", runs[2:3], attainment=0.9).best_index is None
    # rate=inf (None) is the highest load of all
    inf = sweep_result("rate", [run_with(Load("rate", 4), 1.0), run_with(Load("rate", None), 1.0)], 0.9)
    assert (inf.best, inf.best_index) == (None, 1)


def test_sweep_without_slo_requires_no_errors():
    runs = [run_with(Load("concurrency", c), errors=e, slo=None) for c, e in ((1, 0), (4, 0), (16, 2))]
    result = sweep_result("concurrency", runs, attainment=0.9)
    assert result.meets_slo == [True, True, False] and result.best == 4
    assert result.criterion == "no failed requests (no --slo given)"


def test_metric_diff_verdicts():
    d = diff("throughput", 2.0, 3.0, "higher")
    assert (d.delta, d.relative, d.verdict) == (1.0, 0.5, "better")
    d = diff("ttft", 100.0, 150.0, "lower")
    assert (d.delta, d.relative, d.verdict) == (50.0, 0.5, "worse")
    assert diff("ttft", 100.0, 100.5, "lower").verdict == "~"  # 0.5 % is noise
    assert diff("kv", 0.25, 0.5, None).verdict == ""
    assert diff("errors", 0.0, 0.0, "lower").verdict == "~"
    d = diff("errors", 0.0, 0.1, "lower")
    assert (d.relative, d.verdict) == (None, "worse")
    assert diff("goodput", None, 2.0, "higher").verdict == ""


def report_of(runs, **config):
    return Report(
        created="",
        url="http://a",
        model="m",
        endpoint="completions",
        workload="random",
        tokens_per_word=1.0,
        config=config,
        runs=runs,
    )


def test_compare_runs_and_pairing():
    a = run_with(Load("rate", 4), attainment=0.5, throughput=2.0, ttft_mean=100.0)
    b = run_with(Load("rate", 4), attainment=0.75, throughput=3.0, ttft_mean=80.0)
    by_name = {d.name: d for d in compare_runs(a, b)}
    assert by_name["request throughput (req/s)"].verdict == "better"
    assert by_name["TTFT mean (ms)"].delta == -20.0 and by_name["TTFT mean (ms)"].verdict == "better"
    assert by_name["SLO attainment"].relative == 0.5
    assert by_name["TPOT p90 (ms)"].verdict == "~"
    assert "server TTFT mean (ms)" not in by_name  # neither run has server metrics
    # single runs pair whatever their load; sweeps pair equal levels only
    assert pair_runs(report_of([a]), report_of([run_with(Load("rate", 8))]))[0][0] is a
    sweep_b = [run_with(Load("rate", 8)), b]
    assert pair_runs(report_of([a, run_with(Load("rate", 2))]), report_of(sweep_b)) == [(a, b)]
    changes = config_changes(report_of([a], seed=0, rate=4), report_of([b], seed=0, rate=8))
    assert changes == [("rate", 4, 8)]
