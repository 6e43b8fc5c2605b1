"""`aserve bench serve|latency|throughput` as a vLLM user runs them: `bench serve` against a real `aserve serve` of the
tiny model, `bench latency` and `bench throughput` as subprocesses on the tiny model; the printed lines and the JSON
files must agree with each other and with what was asked for (exact token counts where EOS is ignored)."""

import json
import re
import shlex
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
from aserve_server import running_server

from aserve.cli import main


def aserve(command_line: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`aserve COMMAND_LINE` as a subprocess (the line split as a shell would)."""
    argv = [sys.executable, "-m", "aserve", *shlex.split(command_line)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def block_values(stdout: str) -> dict[str, str]:
    """The result block's 'Label:  value' lines, label -> value."""
    block = stdout[stdout.index("============ Serving Benchmark Result ============") :]
    return {m[1]: m[2] for m in re.finditer(r"^(.+?:)\s+(\S+)\s*$", block, re.M)}


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server("--model", tiny_model, "--enforce-eager", "--max-model-len", "512") as url:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            yield url, json.load(r)["data"][0]["id"]


def test_serve_random_completions_block_and_saved_json(server, tmp_path):
    url, model = server
    proc = aserve(
        f"bench serve --base-url {url} --num-prompts 5 --random-input-len 16 --random-output-len 6 --ignore-eos "
        "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result "
        f"--result-dir {tmp_path} --result-filename run.json --metadata run=ci --disable-tqdm --seed 3"
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = lines.index("============ Serving Benchmark Result ============")
    assert lines[-1] == "=" * 50
    sections = [line for line in lines[start + 1 :] if line.startswith("-")]
    assert sections == [
        "---------------Time to First Token----------------",
        "-----Time per Output Token (excl. 1st token)------",
        "---------------Inter-token Latency----------------",
        "----------------End-to-end Latency----------------",
    ]
    values = block_values(proc.stdout)
    # token-id prompts: exactly the tokens asked for; EOS ignored: exactly the output asked for
    assert (values["Successful requests:"], values["Failed requests:"]) == ("5", "0")
    assert (values["Total input tokens:"], values["Total generated tokens:"]) == ("80", "30")
    assert "Maximum request concurrency:" not in values and "Request rate configured (RPS):" not in values

    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["backend"] == saved["endpoint_type"] == "openai" and saved["label"] is None
    assert (saved["model_id"], saved["num_prompts"], saved["request_rate"], saved["max_concurrency"]) == (
        model,
        5,
        "inf",
        None,
    )
    assert saved["run"] == "ci" and re.fullmatch(r"\d{8}-\d{6}", saved["date"])
    assert (saved["completed"], saved["failed"]) == (5, 0)
    assert (saved["total_input_tokens"], saved["total_output_tokens"]) == (80, 30)
    duration = saved["duration"]
    assert saved["request_throughput"] * duration == pytest.approx(5)
    assert saved["output_throughput"] * duration == pytest.approx(30)
    assert saved["total_token_throughput"] * duration == pytest.approx(110)
    assert values["Benchmark duration (s):"] == f"{duration:.2f}"
    assert values["Total Token throughput (tok/s):"] == f"{saved['total_token_throughput']:.2f}"
    for metric, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        stats = [saved[f"{key}_{metric}_ms"] for key in ("mean", "median", "std", "p50", "p90", "p99")]
        assert all(v >= 0 for v in stats) and stats[1] == stats[3] <= stats[4] <= stats[5], metric
        assert values[f"Mean {name} (ms):"] == f"{stats[0]:.2f}"
        assert values[f"P99 {name} (ms):"] == f"{stats[5]:.2f}"
    assert saved["mean_ttft_ms"] < saved["mean_e2el_ms"]
    assert len(saved["latencies"]) == 5 and "ttfts" not in saved  # per-request lists only with --save-detailed


def test_serve_chat_at_a_rate_with_concurrency_cap(server, tmp_path):
    url, model = server
    proc = aserve(
        f"bench serve --base-url {url} --backend openai-chat --endpoint /v1/chat/completions --num-prompts 4 "
        "--input-len 10 --output-len 4 --random-range-ratio 0.5 --request-rate 40 --max-concurrency 2 "
        "--goodput e2el:60000 --num-warmups 1 --percentile-metrics ttft,client_queue_time "
        f"--save-result --save-detailed --result-dir {tmp_path} --disable-tqdm"
    )
    assert proc.returncode == 0, proc.stderr
    values = block_values(proc.stdout)
    assert values["Maximum request concurrency:"] == "2" and values["Request rate configured (RPS):"] == "40.00"
    assert "Mean Client Queue Time (ms):" in values and "Mean TPOT (ms):" not in values
    (path,) = tmp_path.iterdir()  # vLLM's file name: label, rate, concurrency, model, date
    assert re.fullmatch(rf"openai-chat-40\.0qps-concurrency2-{re.escape(model)}-\d{{8}}-\d{{6}}\.json", path.name)
    saved = json.loads(path.read_text())
    assert saved["completed"] == 4 and saved["max_concurrent_requests"] <= 2
    assert saved["request_goodput"] == saved["request_throughput"]  # every request well within 60 s
    assert all(2 <= n <= 6 for n in saved["output_lens"])  # 4 tokens, range ratio 0.5: [2, 6]
    assert sum(saved["output_lens"]) == saved["total_output_tokens"] == int(values["Total generated tokens:"])
    assert saved["total_input_tokens"] == sum(saved["input_lens"]) > 4 * 5  # chat template around the prompts
    assert len(saved["ttfts"]) == len(saved["itls"]) == 4 and saved["errors"] == [""] * 4
    assert len(saved["generated_texts"]) == 4 and all(saved["generated_texts"])  # the replies, as streamed


def test_serve_against_a_speculating_server_prints_its_acceptance(tiny_model, tmp_path):
    """A server drafting with the model itself (every draft accepted, greedy): vLLM's Speculative Decoding block
    from the server's counters over the measured run (the warm-up's drafts left out), in the JSON too."""
    draft = json.dumps({"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 3})
    args = ("--model", tiny_model, "--enforce-eager", "--max-model-len", "512", "--speculative-config", draft)
    with running_server(*args) as url:
        proc = aserve(
            f"bench serve --base-url {url} --num-prompts 3 --random-input-len 16 --random-output-len 13 --ignore-eos "
            f"--temperature 0 --num-warmups 1 --save-result --result-dir {tmp_path} --result-filename spec.json "
            "--disable-tqdm"
        )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    block = lines[lines.index("---------------Speculative Decoding---------------") :]
    assert block[-1] == "=" * 50 and block[6] == "Per-position acceptance (%):"
    saved = json.loads((tmp_path / "spec.json").read_text())
    values = block_values(proc.stdout)
    # 3 requests x 13 tokens: the first from the prefill, then 12 in steps of 4 (3 drafts + 1) -> 3 drafts each
    assert saved["total_output_tokens"] == 39
    assert (saved["spec_decode_num_drafts"], saved["spec_decode_draft_tokens"]) == (9, 27)
    assert saved["spec_decode_accepted_tokens"] == 27 and saved["spec_decode_acceptance_rate"] == 100.0
    assert saved["spec_decode_acceptance_length"] == 4.0
    assert saved["spec_decode_per_position_acceptance_rates"] == [1.0, 1.0, 1.0]
    assert values["Acceptance rate (%):"] == "100.00" and values["Drafts:"] == "9"
    assert [values[f"  Position {i}:"] for i in range(3)] == ["100.00"] * 3


def token_count(url: str, model: str, **body) -> int:
    """The server's own count (/tokenize) of a prompt or a chat's messages."""
    data = json.dumps({"model": model, **body}).encode()
    request = urllib.request.Request(f"{url}/tokenize", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.load(r)["count"]


def test_serve_custom_dataset_rendered_by_the_chat_template(server, tmp_path):
    url, model = server
    prompts = ["What is the capital of France?", "Tell me about rivers."]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    proc = aserve(
        f"bench serve --base-url {url} --dataset-name custom --dataset-path {dataset} --num-prompts 2 "
        "--custom-output-len 3 --ignore-eos --disable-tqdm"
    )
    assert proc.returncode == 0, proc.stderr
    # vLLM renders custom prompts with the chat template for /v1/completions
    rendered = sum(token_count(url, model, messages=[{"role": "user", "content": p}]) for p in prompts)
    values = block_values(proc.stdout)
    assert (values["Successful requests:"], values["Total generated tokens:"]) == ("2", "6")
    assert values["Total input tokens:"] == str(rendered)


def test_serve_sharegpt_file_asks_for_each_reply_length(server, tmp_path):
    url, model = server
    turns = [("Where do rivers go when they reach the sea?", "They slow down and drop their sand."),
             ("hi", "a conversation vLLM skips: its prompt is under 4 tokens"),
             ("How do bees find the best flowers near the hive?", "A forager dances to tell the others.")]  # fmt: skip
    conversations = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]} for q, a in turns]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(conversations + [{"conversations": [{"from": "human", "value": "one turn"}]}]))
    proc = aserve(
        f"bench serve --base-url {url} --dataset-name sharegpt --dataset-path {dataset} --num-prompts 2 "
        "--disable-shuffle --ignore-eos --disable-tqdm"
    )
    assert proc.returncode == 0, proc.stderr
    kept = [turns[0], turns[2]]
    values = block_values(proc.stdout)
    assert values["Successful requests:"] == "2"
    assert values["Total input tokens:"] == str(sum(token_count(url, model, prompt=q) for q, _ in kept))
    assert values["Total generated tokens:"] == str(sum(token_count(url, model, prompt=a) for _, a in kept))


def test_latency_prints_vllm_lines_and_json(tiny_model, tmp_path):
    out = tmp_path / "latency.json"
    proc = aserve(
        f"bench latency --model {tiny_model} --enforce-eager --input-len 8 --output-len 4 --batch-size 2 "
        f"--num-iters-warmup 1 --num-iters 3 --output-json {out}"
    )
    assert proc.returncode == 0, proc.stderr
    saved = json.loads(out.read_text())
    assert len(saved["latencies"]) == 3 and saved["avg_latency"] == pytest.approx(np.mean(saved["latencies"]))
    assert f"Avg latency: {saved['avg_latency']} seconds" in proc.stdout.splitlines()
    percentiles = re.findall(r"^(\d+)% percentile latency: (\S+) seconds$", proc.stdout, re.M)
    assert [p for p, _ in percentiles] == ["10", "25", "50", "75", "90", "99"] == list(saved["percentiles"])
    assert [float(v) for _, v in percentiles] == list(saved["percentiles"].values())
    assert sorted(saved["percentiles"].values()) == list(saved["percentiles"].values())
    assert min(saved["latencies"]) <= saved["percentiles"]["50"] <= max(saved["latencies"])


def test_throughput_prints_vllm_lines_and_json(tiny_model, tmp_path):
    out = tmp_path / "throughput.json"
    proc = aserve(
        f"bench throughput --model {tiny_model} --enforce-eager --input-len 10 --output-len 5 --num-prompts 7 "
        f"--output-json {out}"
    )
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"^Throughput: (\S+) requests/s, (\S+) total tokens/s, (\S+) output tokens/s$", proc.stdout, re.M)
    requests, total, output = map(float, m.groups())
    assert "Total num prompt tokens:  70" in proc.stdout and "Total num output tokens:  35" in proc.stdout
    assert total / requests == pytest.approx(15, rel=0.01) and output / requests == pytest.approx(5, rel=0.01)
    saved = json.loads(out.read_text())
    assert (saved["num_requests"], saved["total_num_tokens"]) == (7, 105)
    assert saved["requests_per_second"] * saved["elapsed_time"] == pytest.approx(7)
    assert f"{saved['requests_per_second']:.2f}" == m[1]


@pytest.mark.parametrize(
    "argv, named",
    [
        (["serve", "--ramp-up-strategy", "linear"], "--ramp-up-strategy"),
        (["serve", "--dataset-name", "sonnet"], "sonnet dataset"),
        (["serve", "--dataset-name", "sharegpt"], "--dataset-path"),
        (["serve", "--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai"),
        (["latency", "--lora-path", "adapter"], "--lora-path"),
        (["throughput", "--async-engine"], "--async-engine"),
        (["throughput", "--backend", "hf", "--input-len", "8"], "--backend hf"),
    ],
)
def test_refused_flags_name_themselves(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "error" in err
