"""`--config FILE.yaml`: a command's flags read from a YAML file, as vLLM reads them. Each key is a flag's name
(dashes or underscores, no leading --):

    model: /models/qwen3-8b          # serve's positional model may be given as `model`
    max-model-len: 8192
    enable_prefix_caching: false     # a switch: true gives --flag, false --no-flag
    served-model-name: [a, b]        # a list: a flag's several values, or a JSON list where the flag takes one
    hf-overrides: {rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768}}

The file's flags go right after the command (and its positional model), so the command line's win where both give
one, as in vLLM. An unknown key, a value a flag cannot take, or a nested --config is an error naming the file."""

from __future__ import annotations

import argparse
import json

import yaml


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None,
                        help="read flags from a YAML file, keys named as the flags (the command line's "
                             "win)")  # fmt: skip


def expand_config(argv: list[str], commands: dict[str, argparse.ArgumentParser]) -> list[str]:
    """`argv` (a command and its arguments) with --config FILE replaced by the file's flags."""
    at = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ValueError("--config may be given once")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 == len(argv):
            raise ValueError("--config needs a YAML file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    else:
        path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1 :]
    parser = commands.get(rest[0]) if rest else None
    if parser is None or "--config" not in parser._option_string_actions:
        raise ValueError(f"--config goes after a command that takes it: {', '.join(sorted(_takers(commands)))}")
    positional = any(not a.option_strings for a in parser._actions)
    start = 2 if positional and len(rest) > 1 and not rest[1].startswith("-") else 1
    return rest[:start] + config_flags(path, parser) + rest[start:]


def _takers(commands: dict[str, argparse.ArgumentParser]) -> list[str]:
    return [name for name, parser in commands.items() if "--config" in parser._option_string_actions]


def config_flags(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The YAML file's keys and values as command-line arguments of `parser`."""
    if not path.endswith((".yaml", ".yml")):
        raise ValueError(f"--config {path}: the file must be YAML (.yaml or .yml), as vLLM reads it")
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not YAML: {e}") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: the file must map flag names to values")
    actions = parser._option_string_actions
    args = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag in ("--config", "--help"):
            raise ValueError(f"--config {path}: {key!r} is not a flag of `aserve {parser.prog.split()[-1]}`")
        if value is None:  # null: the flag's default
            continue
        if action.nargs == 0:  # a switch
            args += _switch(path, key, flag, value, action, actions)
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            args += [flag, *map(str, value)]
        elif isinstance(value, (dict, list, bool)):
            args += [flag, json.dumps(value)]
        else:
            args += [flag, str(value)]
    return args


def _switch(path: str, key, flag: str, value, action: argparse.Action, actions: dict) -> list[str]:
    if not isinstance(value, bool):
        raise ValueError(f"--config {path}: {key!r} is a switch: true or false, got {value!r}")
    if value:
        return [flag]
    if "--no-" + flag[2:] in actions:
        return ["--no-" + flag[2:]]
    if not action.default:  # false: what the flag is unless given
        return []
    raise ValueError(f"--config {path}: {key!r} cannot be turned off")
