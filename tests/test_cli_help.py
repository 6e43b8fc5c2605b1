"""`aserve serve --help`, `aserve quantize --help`, `aserve run-batch --help` and `aserve bench serve|latency|throughput
--help`: every flag shown has help text that states its default."""

import argparse
import re

import pytest

from aserve.cli import build_parser


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


@pytest.mark.parametrize("command", ["serve", "quantize", "run-batch", "bench serve", "bench latency",
                                     "bench throughput"])  # fmt: skip
def test_every_flag_shows_its_default(command):
    sub = build_parser()
    for name in command.split():
        sub = subcommand(sub, name)
    text = sub.format_help()
    entries = re.split(r"\n  (?=-)", text.split("options:", 1)[1])[1:]
    flags = {a.option_strings[-1] for a in sub._actions
             if a.option_strings and a.dest != "help" and a.help is not argparse.SUPPRESS}  # fmt: skip
    described = {}
    for entry in entries:
        names = [t.rstrip(",") for t in entry.split("  ", 1)[0].split() if t.startswith("-")]
        described[names[-1]] = " ".join(entry.split())
    missing = sorted(f for f in flags if f not in described or "default" not in described[f].lower())
    assert len(flags) > 10 and not missing, missing
