"""`aserve bench serve|latency|throughput`: vLLM's `vllm bench` subcommands, with vLLM's flag names and output.

    aserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --random-input-len 512 --request-rate 8
    aserve bench latency --model M --input-len 32 --output-len 128 --batch-size 8
    aserve bench throughput --model M --input-len 256 --output-len 128 --num-prompts 500

`serve` measures a running server through loadgen's client (loadgen/); `latency` and `throughput` build an LLM from
`aserve serve`'s engine flags and time LLM.generate."""

from __future__ import annotations

import argparse
import sys

from aserve.entrypoints.bench.errors import BenchmarkError
from aserve.entrypoints.bench.latency import add_latency_args, run_latency
from aserve.entrypoints.bench.serve import run_serve
from aserve.entrypoints.bench.serve_args import add_serve_args
from aserve.entrypoints.bench.throughput import add_throughput_args, run_throughput
from aserve.entrypoints.engine_cli_args import HelpWithDefaults

_COMMANDS = {
    "serve": ("benchmark a running server's online serving (vLLM's bench serve)", add_serve_args, run_serve),
    "latency": ("time one batch of requests end to end, offline (vLLM's bench latency)", add_latency_args, run_latency),
    "throughput": (
        "offline throughput of a set of requests (vLLM's bench throughput)",
        add_throughput_args,
        run_throughput,
    ),
}


def add_bench_parser(sub) -> None:
    """`aserve bench` and its subcommands, under `aserve`'s subparsers."""
    bench = sub.add_parser("bench", help="vLLM's benchmarks: bench serve, bench latency, bench throughput")
    commands = bench.add_subparsers(dest="bench_command", required=True)
    for name, (what, add_args, _) in _COMMANDS.items():
        add_args(commands.add_parser(name, help=what, description=what, formatter_class=HelpWithDefaults))


def run_bench(ns: argparse.Namespace) -> None:
    """Runs the subcommand; a mistake in the flags exits with status 2, a benchmark that could not run or measured
    nothing with 1."""
    try:
        _COMMANDS[ns.bench_command][2](ns)
    except ValueError as e:
        print(f"aserve bench {ns.bench_command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except BenchmarkError as e:
        print(f"aserve bench {ns.bench_command}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
