"""`aserve serve --help`, `aserve quantize --help` and `aserve run-batch --help`: every flag has help text that states
its default."""

import re

import pytest

from aserve.cli import build_parser


@pytest.mark.parametrize("command", ["serve", "quantize", "run-batch"])
def test_every_flag_shows_its_default(command):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    text = sub.format_help()
    entries = re.split(r"\n  (?=-)", text.split("options:", 1)[1])[1:]
    flags = {a.option_strings[-1] for a in sub._actions if a.option_strings and a.dest != "help"}
    described = {}
    for entry in entries:
        names = [t.rstrip(",") for t in entry.split("  ", 1)[0].split() if t.startswith("-")]
        described[names[-1]] = " ".join(entry.split())
    missing = sorted(f for f in flags if f not in described or "default" not in described[f].lower())
    assert len(flags) > 10 and not missing, missing
