"""loadgen's workloads, length distributions, arrival processes and command-line parsing: exact and seeded."""

import itertools
import json

import numpy as np
import pytest

from loadgen.arrivals import arrival_offsets
from loadgen.config import SLO, Load, RunConfig
from loadgen.options import build_parser, config_from_args, parse_slo, parse_sweep
from loadgen.workloads import PromptMaker, make_workload, parse_length
from loadgen.workloads.corpus import VOCABULARY, WORDS
from loadgen.workloads.lengths import LengthDist


def take(workload, n, seed=0):
    return list(itertools.islice(workload.sessions(np.random.default_rng(seed)), n))


def test_parse_length():
    assert parse_length("128") == LengthDist("fixed", 128)
    assert parse_length(" 64:512 ") == LengthDist("uniform", 64, 512)
    assert parse_length("lognormal:256:0.5") == LengthDist("lognormal", 256.0, 0.5)
    for bad in ("0", "5:3", "abc", "lognormal:256", "1:2:3", "-4", ""):
        with pytest.raises(ValueError, match="bad length"):
            parse_length(bad)


def test_length_samples():
    rng = np.random.default_rng(0)
    assert LengthDist("fixed", 7).sample(rng, 3) == [7, 7, 7]
    uniform = LengthDist("uniform", 3, 5).sample(rng, 2000)
    assert set(uniform) == {3, 4, 5}  # both ends included
    lognormal = LengthDist("lognormal", 200, 0.5).sample(np.random.default_rng(1), 20001)
    assert min(lognormal) >= 1 and max(lognormal) <= 2000
    assert abs(np.median(lognormal) - 200) <= 6  # the median is the parameter (seeded: not flaky)


def test_arrivals():
    constant = list(itertools.islice(arrival_offsets("constant", 4.0, np.random.default_rng(0)), 5))
    assert constant == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert list(itertools.islice(arrival_offsets("poisson", None, np.random.default_rng(0)), 3)) == [0, 0, 0]
    poisson = list(itertools.islice(arrival_offsets("poisson", 10.0, np.random.default_rng(3)), 20001))
    assert poisson == list(itertools.islice(arrival_offsets("poisson", 10.0, np.random.default_rng(3)), 20001))
    gaps = np.diff(poisson)
    assert abs(gaps.mean() - 0.1) < 0.003 and abs(gaps.std() / gaps.mean() - 1.0) < 0.03  # exponential: CV 1
    bursty = np.diff(list(itertools.islice(arrival_offsets("gamma", 10.0, np.random.default_rng(3), 0.25), 20001)))
    assert abs(bursty.mean() - 0.1) < 0.005 and abs(bursty.std() / bursty.mean() - 2.0) < 0.1  # CV 1/sqrt(0.25)
    with pytest.raises(ValueError, match="unknown arrival"):
        next(arrival_offsets("uniform", 1.0, np.random.default_rng(0)))


def test_random_workload_ids_and_text():
    cfg = RunConfig(prompt_format="ids", input_len="16:32", output_len="8", vocab_size=100)
    sessions = take(make_workload(cfg), 50)
    assert all(len(s.turns) == 1 and not s.multi_turn for s in sessions)
    specs = [s.turns[0] for s in sessions]
    assert all(16 <= len(x.prompt) <= 32 and x.prompt_tokens == len(x.prompt) for x in specs)
    assert all(0 <= t < 100 for x in specs for t in x.prompt) and {x.max_tokens for x in specs} == {8}
    text = take(make_workload(RunConfig(input_len="40", output_len="4"), tokens_per_word=2.0), 3)
    assert [len(s.turns[0].prompt.split()) for s in text] == [20, 20, 20]  # 40 tokens at 2 tokens per word
    assert all(w in VOCABULARY for s in text for w in s.turns[0].prompt.split())


def test_same_seed_same_requests():
    cfg = RunConfig(workload="shared-prefix", prefix_len=8, input_len="4:9", output_len="lognormal:16:0.3")
    assert take(make_workload(cfg), 20, seed=5) == take(make_workload(cfg), 20, seed=5)
    assert take(make_workload(cfg), 20, seed=5) != take(make_workload(cfg), 20, seed=6)


def test_shared_prefix_workload():
    cfg = RunConfig(
        workload="shared-prefix", prompt_format="ids", num_prefixes=3, prefix_len=10, input_len="5", output_len="2"
    )
    specs = [s.turns[0] for s in take(make_workload(cfg), 60)]
    prefixes = {tuple(x.prompt[:10]) for x in specs}
    assert len(prefixes) == 3  # every request behind one of the K prefixes, all K used
    assert len({tuple(x.prompt[10:]) for x in specs}) == 60  # unique suffixes
    assert all(len(x.prompt) == 15 == x.prompt_tokens for x in specs)


def test_chat_workload_sessions():
    cfg = RunConfig(workload="chat", num_turns=3, input_len="6", output_len="5")
    (session,) = take(make_workload(cfg), 1)
    assert session.multi_turn and len(session.turns) == 3
    # estimated prompt tokens: the history (earlier messages and max_tokens replies) plus this message
    assert [t.prompt_tokens for t in session.turns] == [6, 17, 28]
    with pytest.raises(ValueError, match="text prompts"):
        make_workload(RunConfig(workload="chat", prompt_format="ids"))


def test_grounded_workload():
    specs = [s.turns[0] for s in take(make_workload(RunConfig(workload="grounded", input_len="30")), 30)]
    tasks = {x.prompt.split("\n")[0].split(",")[0].split(" ")[0] for x in specs}
    assert tasks == {"Repeat", "Copy", "The"}  # verbatim, replace a word, fix typos
    for x in specs:
        passage = x.prompt.split("Passage:\n", 1)[1].split()
        assert len(passage) == 30 and x.max_tokens == 16 + 38  # ceil(1.25 * 30) + 16
        if x.prompt.startswith("Repeat"):
            assert " ".join(passage) in " ".join(WORDS + WORDS)  # a window of the corpus (wrapping round)
    fixed = take(make_workload(RunConfig(workload="grounded", input_len="30", output_len="7")), 3)
    assert [s.turns[0].max_tokens for s in fixed] == [7, 7, 7]


def test_file_workload(tmp_path):
    path = tmp_path / "reqs.jsonl"
    path.write_text('{"prompt": "one two three", "max_tokens": 5}\n\n{"prompt": [1, 2, 3, 4]}\n')
    specs = [s.turns[0] for s in take(make_workload(RunConfig(workload="file", dataset=str(path), output_len="9")), 5)]
    assert [(x.prompt, x.max_tokens, x.prompt_tokens) for x in specs] == [
        ("one two three", 5, 3),
        ([1, 2, 3, 4], 9, 4),
        ("one two three", 5, 3),
        ([1, 2, 3, 4], 9, 4),
        ("one two three", 5, 3),
    ]
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"reqs.jsonl:2"):
        make_workload(RunConfig(workload="file", dataset=str(path)))


def test_prompt_maker_join():
    assert PromptMaker.join([1, 2], [3]) == [1, 2, 3] and PromptMaker.join("a", "b") == "a\n\nb"


def test_slo_and_sweep_flags():
    assert parse_slo("ttft_ms=500, tpot_ms=50") == SLO(ttft_ms=500, tpot_ms=50)
    assert parse_slo("e2e=2000") == SLO(e2e_ms=2000)
    for bad in ("ttft_ms", "itl_ms=3", "ttft_ms=fast", ""):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)
    assert parse_sweep("rate=1,2,inf") == ("rate", [1.0, 2.0, float("inf")])
    assert parse_sweep("concurrency=1,4") == ("concurrency", [1.0, 4.0])
    for bad in ("qps=1,2", "rate=", "rate=0,1", "concurrency=1.5", "rate=a"):
        with pytest.raises(ValueError, match="--sweep"):
            parse_sweep(bad)


def args(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_config_from_args():
    cfg = args(
        "--url",
        "http://h:1/v1/",
        "--rate",
        "4",
        "--burstiness",
        "0.5",
        "--slo",
        "ttft_ms=100",
        "--extra-body",
        '{"top_k": 5}',
        "--api-key",
        "sekrit",
    )
    assert (cfg.url, cfg.arrival, cfg.burstiness, cfg.rate, cfg.num_requests) == ("http://h:1", "gamma", 0.5, 4, 100)
    assert cfg.loads() == [Load("rate", 4.0)] and cfg.extra_body == {"top_k": 5}
    assert cfg.public()["api_key"] == "***" and json.dumps(cfg.public())
    sweep = args("--sweep", "concurrency=1,8", "--duration", "10")
    assert sweep.loads() == [Load("concurrency", 1), Load("concurrency", 8)] and sweep.num_requests is None
    assert args("--rate", "inf").loads() == [Load("rate", None)]
    assert args("--workload", "random").effective_ignore_eos and not args("--workload", "grounded").effective_ignore_eos
    assert not args("--no-ignore-eos").effective_ignore_eos
    errors = [
        (("--rate", "2", "--concurrency", "3"), "not both"),
        (("--prompt-format", "ids", "--endpoint", "chat"), "--endpoint completions"),
        (("--workload", "file"), "--dataset"),
        (("--sweep", "rate=1,2", "--rate", "3"), "give only one"),
        (("--sweep", "rate=1,2", "--concurrency", "3"), "drop --concurrency"),
        (("--input-len", "0"), "bad length"),
        (("--extra-body", "[1]"), "JSON object"),
        (("--url", "localhost:8000"), "http://"),
        (("--rate", "0"), "--rate must be > 0"),
        (("--duration", "5"), "needs --num-requests"),  # no rate: would send endlessly at t=0
        (("--duration", "5", "--sweep", "rate=1,inf"), "needs --num-requests"),
    ]
    for argv, message in errors:
        with pytest.raises(ValueError, match=message):
            args(*argv)
