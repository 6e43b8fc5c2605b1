"""`loadgen [run] ...` benchmarks a server; `loadgen compare A.json B.json` diffs two runs; `loadgen report RUN.json`
re-renders a saved run (console table, HTML, PNGs)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from loadgen.bench import LoadgenError, run_benchmark
from loadgen.compare import format_comparison
from loadgen.console import format_report
from loadgen.html_report import write_report
from loadgen.options import build_parser, config_from_args
from loadgen.results import load_report, save_report


def _fail(message: str, code: int = 2) -> None:
    print(f"loadgen: error: {message}", file=sys.stderr)
    sys.exit(code)


def run_main(argv: list[str]) -> None:
    ns = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(ns)
    except ValueError as e:
        _fail(str(e))
    try:
        report = asyncio.run(run_benchmark(cfg, log=lambda m: print(m, file=sys.stderr, flush=True)))
    except (LoadgenError, ValueError) as e:
        _fail(str(e), code=1)
    except KeyboardInterrupt:
        _fail("interrupted", code=130)
    print(format_report(report), flush=True)
    if ns.out:
        save_report(report, ns.out)
        print(f"results: {ns.out}", file=sys.stderr)
    html_path = ns.html or (os.path.splitext(ns.out)[0] + ".html" if ns.out else None)
    if html_path or ns.plots_dir:
        write_report(report, html_path, ns.plots_dir)
        if html_path:
            print(f"report: {html_path}", file=sys.stderr)
    if all(run.summary.num_ok == 0 for run in report.runs):  # a broken setup should fail a script or CI job
        _fail("no request succeeded", code=1)


def compare_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(
        prog="loadgen compare",
        description="Metric-by-metric difference of two runs (B - A); a sweep pairs equal load levels.",
    )
    p.add_argument("a", help="results JSON of run A (the baseline)")
    p.add_argument("b", help="results JSON of run B")
    ns = p.parse_args(argv)
    try:
        a, b = load_report(ns.a), load_report(ns.b)
    except (OSError, ValueError) as e:
        _fail(str(e))
    name = os.path.basename
    print(format_comparison(a, b, name(ns.a), name(ns.b)))


def report_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="loadgen report", description="Re-render a saved run.")
    p.add_argument("results", help="results JSON written by --out")
    p.add_argument("--html", default=None, help="write the HTML report here")
    p.add_argument("--plots-dir", default=None, help="write the PNG plots into this directory")
    ns = p.parse_args(argv)
    try:
        report = load_report(ns.results)
    except (OSError, ValueError) as e:
        _fail(str(e))
    print(format_report(report))
    if ns.html or ns.plots_dir:
        write_report(report, ns.html, ns.plots_dir)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else ""
    if command == "compare":
        compare_main(argv[1:])
    elif command == "report":
        report_main(argv[1:])
    else:
        run_main(argv[1:] if command == "run" else argv)


if __name__ == "__main__":
    main()
