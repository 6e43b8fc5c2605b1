"""What the OpenAI server costs over the offline engine on the same workload, in one command:

    python bench/online_vs_offline.py [--model M] [--load-format dummy] [--dtype D] [--streams 64] [--requests 256]
        [--input-len 256] [--output-len 128] [--max-num-seqs 256] [--max-num-batched-tokens N]
        [--long-prefill-token-threshold N] [--max-decode-slowdown R] [--profile] [--passes N] [--interleave]
        [--offline-from JSON]
        [--json PATH] [--server-arg '...']

Offline: `LLM.generate` of --requests random token-id prompts (seeded; ids in [100, vocab_size - 100)), max_tokens
--output-len with EOS ignored, temperature 0, after a warm-up of the whole batch at max_tokens 4 (other prompts of
the same length). It runs in a process of its own (this script with --offline-only), so its memory is freed before
the server starts.
Online: `aserve serve` with the same engine flags and the same KV cache size, and an aiohttp client in this process:
--streams workers pull the same prompts, each streaming POST /v1/completions; a warm-up pass (other prompts,
max_tokens 4) first. Per request: TTFT (send -> first chunk carrying a token), TPOT ((e2e - TTFT) / (n_out - 1)),
and every gap between token-carrying chunks (ITL). Output tokens come from the usage chunk. Both engines report
when every request had its first token (offline: the last step that gave one; online: the last first chunk), which
with every request sent at once splits a run into its prompts' phase and its decoding, and the decoding phase's
time per step (offline: between the ends of its steps; online: between a stream's chunks). The gaps are also split
by whether prompts were computed during them (offline: the step gave a request its first token; online: another
request's first chunk came during the gap), with each kind's share.
--profile samples the server with py-spy during the (first) timed online pass and prints where its threads spend time.
--passes N times N online passes on one server, each with its own prompts, and reports the median one;
--interleave (where one machine holds both engines, e.g. CPU) also runs an offline pass on each pass's prompts right
before it, while the server idles, and reports each pair's ratio and their median (a shared machine's speed drifts
over minutes; a pair's two halves see about the same machine); --offline-from reuses the offline part of an earlier
run's --json (same workload flags) instead of running it.

The client shares the machine with the server: its CPU use during the timed pass is reported (client_cpu_frac, of
one core); near 1.0 the client, not the server, bounds the online numbers. --server-arg passes flags to the server
only (repeatable; shell-split).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import itertools
import json
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from reliability_health import pct  # noqa: E402  (bench/ is on the path of its scripts)

RESULT_MARK = "OFFLINE_RESULT "


def make_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size - 100) for _ in range(input_len)] for _ in range(num)]


def ms_stats(values: list[float]) -> dict:
    out = {"count": len(values)}
    if values:
        out.update(p50_ms=round(pct(values, 50) * 1e3, 2), p99_ms=round(pct(values, 99) * 1e3, 2),
                   mean_ms=round(statistics.fmean(values) * 1e3, 2))  # fmt: skip
    return out


def engine_kwargs(ns: argparse.Namespace) -> dict:
    kw = dict(dtype=ns.dtype, load_format=ns.load_format, max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
              enforce_eager=ns.enforce_eager)  # fmt: skip
    if ns.kv_cache_memory_gb is not None:
        kw["kv_cache_memory_gb"] = ns.kv_cache_memory_gb
    for name in ("long_prefill_token_threshold", "max_num_batched_tokens", "max_decode_slowdown"):
        if getattr(ns, name):
            kw[name] = getattr(ns, name)
    return kw


# -- offline ----------------------------------------------------------------------------------------------------


def offline(ns: argparse.Namespace) -> dict:
    from aserve import LLM, SamplingParams

    llm = LLM(ns.model, **engine_kwargs(ns))
    vocab = llm.engine.config.vocab_size
    as_inputs = lambda ps: [{"prompt_token_ids": p} for p in ps]  # noqa: E731
    warm = make_prompts(ns.requests, ns.input_len, vocab, ns.seed + 1)
    llm.generate(as_inputs(warm), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.engine.reset_prefix_cache()
    prompts = as_inputs(make_prompts(ns.requests, ns.input_len, vocab, ns.seed))
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    stats = llm.engine.stats
    steps0, tokens0 = stats.steps_total, stats.scheduled_tokens_total
    marks, tpot, itl = [], [], []  # (when each step ended, did it give first tokens); the engine's own latencies
    itl_by_kind = ([], [])  # the engine's inter-token latencies in steps that gave no first token / gave some

    def seen(step, _) -> None:
        marks.append((time.perf_counter(), bool(step.time_to_first_token)))
        tpot.extend(step.time_per_output_token)
        itl.extend(step.inter_token_latency)
        itl_by_kind[bool(step.time_to_first_token)].extend(step.inter_token_latency)

    stats.add_listener(seen)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    firsts = [at for at, first in marks if first]
    steps = {"steps": stats.steps_total - steps0, "step_tokens": stats.scheduled_tokens_total - tokens0,
             "tpot": ms_stats(tpot), "itl": ms_stats(itl), "itl_decode_only": ms_stats(itl_by_kind[0]),
             "itl_with_first_tokens": ms_stats(itl_by_kind[1])}  # fmt: skip
    if firsts:
        # The decoding phase's steps: those after the last one that gave a request its first token.
        late = [at for at, _ in marks if at > firsts[-1]]
        gaps = [b - a for a, b in itertools.pairwise(late)]
        steps.update(first_tokens_s=round(firsts[-1] - t0, 3), decode_step=ms_stats(gaps))
    core = llm.engine.core
    return {"vocab_size": vocab, "device": str(llm.engine.config.device), "output_tokens": n_out,
            "wall_s": round(elapsed, 3), "output_tok_s": round(n_out / elapsed, 1),
            "kv_cache_bytes": core.num_kv_blocks * core.runner.kv_bytes_per_block, **steps}  # fmt: skip


def run_offline_child(argv: list[str], log_path: str) -> dict:
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--offline-only"],
                              stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT_MARK)), None)
    if proc.returncode != 0 or line is None:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"offline run failed ({proc.returncode}):\n{proc.stdout[-1000:]}\n{tail}")
    return json.loads(line[len(RESULT_MARK) :])


# -- online -----------------------------------------------------------------------------------------------------


async def stream_one(session, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    stamps, n_out = [], None  # when each chunk carrying tokens arrived
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:500]}")
        async for line in resp.content:  # one SSE line at a time, as it arrives
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            # Token chunks are not decoded (the client must keep up with the server): only the usage chunk
            # (no choices) and errors are.
            if b'"choices":[]' in payload or b'"error"' in payload:
                obj = json.loads(payload)
                if "error" in obj:
                    raise RuntimeError(f"stream error: {obj['error']}")
                n_out = obj["usage"]["completion_tokens"]
                continue
            stamps.append(time.perf_counter())
    end = time.perf_counter()
    if not stamps or n_out is None:
        raise RuntimeError("stream ended without a token or without usage")
    ttft, e2e = stamps[0] - t0, end - t0
    tpot = (e2e - ttft) / (n_out - 1) if n_out > 1 else None
    return {"ttft": ttft, "e2e": e2e, "tpot": tpot, "stamps": stamps, "n_out": n_out}


STEP_METRIC = ("iteration_tokens_total",)


async def server_counts(session, url: str) -> dict[str, float]:
    """Engine steps, the tokens they computed, and streams paused by flow control so far, from /metrics."""
    from loadgen.server_metrics import MetricsSnapshot, parse_prometheus

    async with session.get(f"{url}/metrics") as resp:
        snapshot = MetricsSnapshot(parse_prometheus(await resp.text()))
    return {"steps": snapshot.total(STEP_METRIC, "_count"), "step_tokens": snapshot.total(STEP_METRIC, "_sum"),
            "stream_pauses": snapshot.total(("http_stream_pauses_total",))}  # fmt: skip


async def run_pass(url: str, prompts: list[list[int]], max_tokens: int, streams: int) -> tuple[list[dict], float, dict]:
    """-> (per-request results, wall seconds, the engine's steps, the tokens they computed and the streams paused
    over the pass, and when the last request got its first token)."""
    import aiohttp

    results: list[dict] = []
    todo = iter(prompts)

    async def worker(session):
        for prompt in todo:  # one event loop: the workers share the iterator safely
            results.append(await stream_one(session, url, prompt, max_tokens))

    connector = aiohttp.TCPConnector(limit=streams)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        before = await server_counts(session, url)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(streams)))
        elapsed = time.perf_counter() - t0
        after = await server_counts(session, url)
    counts = {k: int(after[k] - before[k]) for k in after}
    # The decoding phase: the gaps between a stream's chunks after every request had its first token.
    last_first = max(r["stamps"][0] for r in results)
    late = [b - a for r in results for a, b in itertools.pairwise(r["stamps"]) if a >= last_first]
    plain, with_firsts = split_gaps(results)
    gaps = {"itl_decode_only": ms_stats(plain), "itl_with_first_tokens": ms_stats(with_firsts)}
    return results, elapsed, {**counts, "first_tokens_s": round(last_first - t0, 3), "decode_step": ms_stats(late),
                              **gaps}  # fmt: skip


def split_gaps(results: list[dict], slack_s: float = 0.002) -> tuple[list[float], list[float]]:
    """A pass's gaps between a stream's chunks: (those over which no other request got its first token, those over
    which one did, or did within slack_s after: one step's chunks reach the streams a little apart)."""
    firsts = sorted(r["stamps"][0] for r in results)
    out: tuple[list[float], list[float]] = ([], [])
    for r in results:
        for a, b in itertools.pairwise(r["stamps"]):
            i = bisect.bisect_right(firsts, a)
            out[i < len(firsts) and firsts[i] <= b + slack_s].append(b - a)
    return out


def start_profiler(pid: int, out_dir: str, duration_s: int):
    if shutil.which("py-spy") is None:
        print("py-spy is not installed: no profile (pip install py-spy)", flush=True)
        return None
    raw, log = os.path.join(out_dir, "pyspy.txt"), open(os.path.join(out_dir, "pyspy.log"), "w")
    cmd = ["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "-o", raw, "--duration",
           str(duration_s), "--nonblocking", "--threads"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    time.sleep(0.5)  # attached before the pass begins
    return proc, raw


def stop_profiler(profiler) -> str | None:
    """Ends the sampling (SIGINT: py-spy writes what it has) -> the raw file, or None."""
    proc, raw = profiler
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if not os.path.exists(raw):
        with open(os.path.join(os.path.dirname(raw), "pyspy.log")) as f:
            print(f"py-spy wrote no samples:\n{f.read()[-1500:]}", flush=True)
        return None
    return raw


_FRAME = re.compile(r"^(.*) \((.*?):\d+\)$")


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    return f"{m.group(2)}:{m.group(1)}" if m else frame


def aggregate_profile(raw: str, top: int = 15) -> dict:
    """py-spy's raw folded stacks ('thread (tid): name;frame;...;leaf count' per line) -> samples by thread, the
    main thread's leaf frames, and aserve's own file:function entries by inclusive count."""
    threads, leaf_main = collections.Counter(), collections.Counter()
    own_all, own_main = collections.Counter(), collections.Counter()
    with open(raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n, frames = int(count), stack.split(";")
            thread = frames[0].partition(": ")[2] or frames[0]
            names = [_name(x) for x in frames[1:]]
            threads[thread] += n
            main = thread == "MainThread"
            if main and names:
                leaf_main[names[-1]] += n
            for entry in {x for x in names if x.startswith("aserve/")}:
                own_all[entry] += n
                if main:
                    own_main[entry] += n
    return {"samples_by_thread": dict(threads.most_common()), "main_leaf": leaf_main.most_common(top),
            "own_inclusive": [(k, v, own_main[k]) for k, v in own_all.most_common(top)]}  # fmt: skip


def print_profile(prof: dict) -> None:
    by_thread = prof["samples_by_thread"]
    main_total = max(by_thread.get("MainThread", 0), 1)
    print(f"\npy-spy samples by thread over the {prof['pass_s']:.1f} s pass (200/s, so ~{200 * prof['pass_s']:.0f} for "
          "a thread always on CPU; waits, the GIL's included, are not sampled): "
          + ", ".join(f"{k} {v}" for k, v in list(by_thread.items())[:8]))  # fmt: skip
    print("\n| main thread leaf frame | samples | % of main |\n|---|---|---|")
    for name, n in prof["main_leaf"]:
        print(f"| {name} | {n} | {100 * n / main_total:.1f} |")
    print("\n| aserve file:function (inclusive) | all threads | main thread |\n|---|---|---|")
    for name, n, n_main in prof["own_inclusive"]:
        print(f"| {name} | {n} | {n_main} |")


def online(ns: argparse.Namespace, off: dict, tmp: str) -> dict:
    from aserve_server import start_server, stop_server

    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    # The offline engine's KV cache size, exactly (bytes / 2^30 is exact in a float, and repr round-trips).
    kv_gb = ns.kv_cache_memory_gb if ns.kv_cache_memory_gb is not None else off["kv_cache_bytes"] / (1 << 30)
    flags = (["--model", ns.model] if ns.model else []) + ["--no-debug-invariants"]
    for name, value in {**engine_kwargs(ns), "kv_cache_memory_gb": kv_gb}.items():
        flag, text = "--" + name.replace("_", "-"), value if isinstance(value, str) else repr(value)  # exact floats
        flags += ([flag] if value else []) if isinstance(value, bool) else [flag, text]
    flags += [x for arg in ns.server_arg for x in shlex.split(arg)]
    log_path = os.path.join(tmp, "server.log")
    try:
        proc, url = start_server(*flags, timeout=900, log_path=log_path)
    except Exception:
        print(f"server flags: {flags}", file=sys.stderr)
        raise
    try:
        vocab = off["vocab_size"]
        warm = make_prompts(ns.requests, ns.input_len, vocab, ns.seed + 1)
        run(run_pass(url, warm, 4, ns.streams))
        passes, paired = [], []  # paired: the offline rate right before each pass (--interleave)
        for i in range(ns.passes):
            # Each pass its own prompts (no prefix-cache hits across passes); the first is the offline engine's.
            seed = ns.seed + 1000 * i
            prompts = make_prompts(ns.requests, ns.input_len, vocab, seed)
            if ns.interleave:
                argv = [*sys.argv[1:], "--seed", str(seed)]
                paired.append(run_offline_child(argv, os.path.join(tmp, f"offline{i}.log"))["output_tok_s"])
            profiler = None
            if ns.profile and i == 0:
                profiler = start_profiler(proc.pid, tmp, int(max(60, 20 * off["wall_s"] + 60)))
            cpu0 = time.process_time()
            results, elapsed, steps = run(run_pass(url, prompts, ns.output_len, ns.streams))
            client_cpu = time.process_time() - cpu0
            raw = stop_profiler(profiler) if profiler else None
            n_out = sum(r["n_out"] for r in results)
            passes.append((n_out / elapsed, results, elapsed, client_cpu, raw, steps))
            if ns.passes > 1 or paired:
                pair = f", offline just before {paired[-1]:.1f}: {n_out / elapsed / paired[-1]:.3f}" if paired else ""
                print(f"  pass {i + 1}: {n_out / elapsed:.1f} tok/s ({elapsed:.2f} s){pair}", flush=True)
    except Exception:
        with open(log_path) as f:
            print(f"server log (tail):\n{f.read()[-3000:]}", file=sys.stderr)
        raise
    finally:
        stop_server(proc)
    # The table reports the median pass; every pass's rate is listed.
    rates = [x[0] for x in passes]
    _, results, elapsed, client_cpu, _, steps = sorted(passes, key=lambda x: x[0])[(len(passes) - 1) // 2]
    raw = passes[0][4]
    n_out = sum(r["n_out"] for r in results)
    chunks = sum(len(r["stamps"]) for r in results)
    out = {"output_tokens": n_out, "wall_s": round(elapsed, 3), "output_tok_s": round(n_out / elapsed, 1),
           "ttft": ms_stats([r["ttft"] for r in results]),
           "tpot": ms_stats([r["tpot"] for r in results if r["tpot"] is not None]),
           "itl": ms_stats([b - a for r in results for a, b in itertools.pairwise(r["stamps"])]),
           "e2e": ms_stats([r["e2e"] for r in results]),
           "tokens_per_chunk": round(n_out / max(chunks, 1), 3), "client_cpu_frac": round(client_cpu / elapsed, 3),
           "kv_cache_memory_gb": kv_gb, "pass_tok_s": [round(x, 1) for x in rates], **steps}  # fmt: skip
    if paired:
        out["paired_offline_tok_s"] = paired
        out["paired_ratios"] = [round(r / o, 4) for r, o in zip(rates, paired)]
        out["paired_median"] = statistics.median(out["paired_ratios"])
    if raw is not None:
        out["profile"] = {"pass_s": round(elapsed, 3), **aggregate_profile(raw)}
    return out


# -- report -----------------------------------------------------------------------------------------------------


def print_table(off: dict, on: dict, ns: argparse.Namespace) -> None:
    def fmt(stats: dict, key: str) -> str:
        return f"{stats[key]:.2f}" if key in stats else "-"

    def gap_stats(result: dict, key: str) -> str:
        kinds = [result.get(k, {}).get("count", 0) for k in ("itl_decode_only", "itl_with_first_tokens")]
        stats = result.get(key, {})
        share = f" ({stats['count'] / sum(kinds):.1%})" if stats.get("count") else ""
        return f"{fmt(stats, 'p50_ms')} / {fmt(stats, 'p99_ms')}{share}"

    rows = [
        ("offline output tok/s", f"{off['output_tok_s']:.1f}", f"{off['wall_s']:.2f} s, {off['output_tokens']} tokens"),
        ("online output tok/s", f"{on['output_tok_s']:.1f}", f"{on['wall_s']:.2f} s, {on['output_tokens']} tokens"),
        ("online / offline", f"{on['output_tok_s'] / off['output_tok_s']:.3f}",
         f"batch: offline up to {min(ns.requests, ns.max_num_seqs)}, online up to {min(ns.streams, ns.max_num_seqs)}"),
        ("online / offline, each pass", " ".join(f"{x / off['output_tok_s']:.3f}" for x in on["pass_tok_s"]), ""),
    ]  # fmt: skip
    if "paired_ratios" in on:
        rows.append(("each pass / the offline pass just before it", " ".join(f"{r:.3f}" for r in on["paired_ratios"]),
                     f"median {on['paired_median']:.3f}"))  # fmt: skip
    rows += [
        ("TTFT p50 / p99 (ms)", f"{fmt(on['ttft'], 'p50_ms')} / {fmt(on['ttft'], 'p99_ms')}", ""),
        ("TPOT p50 / p99 (ms)", f"{fmt(on['tpot'], 'p50_ms')} / {fmt(on['tpot'], 'p99_ms')}",
         f"offline engine {fmt(off.get('tpot', {}), 'p50_ms')} / {fmt(off.get('tpot', {}), 'p99_ms')}"),
        ("ITL p50 / p99 (ms)", f"{fmt(on['itl'], 'p50_ms')} / {fmt(on['itl'], 'p99_ms')}",
         f"{on['tokens_per_chunk']} tokens per chunk; offline engine {fmt(off.get('itl', {}), 'p50_ms')} / "
         f"{fmt(off.get('itl', {}), 'p99_ms')}"),
        ("ITL p50 / p99 (ms) over steps without / with first tokens, offline engine",
         f"{gap_stats(off, 'itl_decode_only')}, {gap_stats(off, 'itl_with_first_tokens')}",
         "with: a step that also computed prompts (a share of the gaps)"),
        ("the same, online", f"{gap_stats(on, 'itl_decode_only')}, {gap_stats(on, 'itl_with_first_tokens')}",
         "with: another request's first token came during the gap"),
        ("client CPU (of one core)", f"{on['client_cpu_frac']:.2f}", "near 1: the client bounds the online run"),
        ("engine steps, offline / online", f"{off.get('steps', '-')} / {on['steps']}",
         f"tokens per step {off.get('step_tokens', 0) / max(off.get('steps', 0), 1):.1f} / "
         f"{on['step_tokens'] / max(on['steps'], 1):.1f}"),
        ("streams paused (flow control)", str(on["stream_pauses"]), "the client fell a step behind reading"),
        ("every request's first token by (s), offline / online", f"{off.get('first_tokens_s', '-')} / "
         f"{on['first_tokens_s']}", "with every request sent at once: the prompts' phase; the rest is decoding"),
        ("decoding phase: ms per step p50 / p99, offline / online",
         f"{fmt(off.get('decode_step', {}), 'p50_ms')} / {fmt(off.get('decode_step', {}), 'p99_ms')}, "
         f"{fmt(on['decode_step'], 'p50_ms')} / {fmt(on['decode_step'], 'p99_ms')}",
         "after every first token: offline between steps' ends, online between a stream's chunks"),
    ]  # fmt: skip
    print("\n| metric | value | note |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--load-format", default="auto", help="auto | dummy")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=64, help="concurrent client streams (online)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    kv_help = "both engines' KV budget (default: the offline engine's own; the server gets the same)"
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, help=kv_help)
    p.add_argument("--enforce-eager", action="store_true", help="both engines: no CUDA graphs / CPU compile")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="both engines: the most tokens in one step (0: the engine's default)")  # fmt: skip
    p.add_argument("--max-decode-slowdown", type=float, default=0.0,
                   help="both engines: cap prompt tokens beside decodes (0: off)")  # fmt: skip
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="both engines: at most this many prompt tokens of a request per step (0: no cap)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="sample the server with py-spy during the timed pass")
    p.add_argument("--passes", type=int, default=1, help="timed online passes on one server (the median reported)")
    p.add_argument("--interleave", action="store_true", help="an offline pass before each online pass (paired)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--offline-from", default=None, help="take the offline result from this earlier --json file")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra server flags, shell-split (repeatable); a lone flag as --server-arg=--flag",
    )
    p.add_argument("--offline-only", action="store_true", help="run the offline part only; print it as JSON")
    ns = p.parse_args()
    if ns.input_len + ns.output_len > ns.max_model_len:
        p.error("--input-len + --output-len must fit in --max-model-len")
    if ns.offline_only:
        print(RESULT_MARK + json.dumps(offline(ns)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        print(f"offline: {ns.requests} requests x {ns.input_len} in / {ns.output_len} out ...", flush=True)
        if ns.offline_from:
            with open(ns.offline_from) as f:
                off = json.load(f)["offline"]
        else:
            off = run_offline_child(sys.argv[1:], os.path.join(tmp, "offline.log"))
        print(f"  {off['output_tok_s']} tok/s ({off['wall_s']} s) on {off['device']}", flush=True)
        print(f"online: the same through `aserve serve`, {ns.streams} streams ...", flush=True)
        on = online(ns, off, tmp)
        print(f"  {on['output_tok_s']} tok/s ({on['wall_s']} s)", flush=True)
    if "profile" in on:
        print_profile(on["profile"])
    result = {"config": {k: v for k, v in vars(ns).items() if k not in ("offline_only", "json")},
              "offline": off, "online": on,
              "online_over_offline": round(on["output_tok_s"] / off["output_tok_s"], 4)}  # fmt: skip
    if "paired_ratios" in on:
        result["online_over_offline_paired"] = on["paired_median"]
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)
    print_table(off, on, ns)


if __name__ == "__main__":
    main()
