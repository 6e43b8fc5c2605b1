"""vLLM's `vllm bench` flags that `aserve bench` does not implement and that would change what is measured: they are
parsed (so that a vLLM command line fails on them by name, not as an unknown argument) and refused."""

from __future__ import annotations

import argparse


class _Refuse(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        # parser.exit, not parser.error: the message alone, without a screen of usage above it
        parser.exit(
            2, f"{parser.prog}: error: {option_string} is not supported by `{parser.prog}`: {self.help_reason}\n"
        )


def add_refused_args(parser: argparse.ArgumentParser, reasons: dict[str, str]) -> None:
    """One hidden flag per entry: giving it (with any values) is an error naming it and the reason."""
    for flag, reason in reasons.items():
        action = parser.add_argument(flag, nargs="*", action=_Refuse, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        action.help_reason = reason
