"""`--config FILE.yaml` (vLLM's): a command's flags from a YAML file, the command line's winning; what a file cannot
say is an error naming it. (tests/test_serve_options.py starts a server from one.)"""

import pytest

from aserve.cli import build_parser, dashed, engine_args_from, subcommands
from aserve.cli import main as cli_main
from aserve.entrypoints.config_file import expand_config

CONFIG = """
model: /models/a
max_model_len: 4k
enable-prefix-caching: false
trust_remote_code: true
enable-lora: false
served-model-name: [first, second]
allowed-origins: [http://a.example]
hf-overrides: {rope_scaling: {rope_type: yarn, factor: 4.0}}
gpu-memory-utilization: 0.5
seed: null
port: 9000
"""


def parse(argv):
    parser = build_parser()
    return parser.parse_args(expand_config(dashed(argv), subcommands(parser)))


def test_flags_from_the_file_under_the_command_line(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    ns = parse(["serve", "--config", str(config), "--port", "9001", "--max_model_len=512"])
    args = engine_args_from(ns)
    assert (ns.port, args.max_model_len, args.model) == (9001, 512, "/models/a")  # the command line wins
    assert args.enable_prefix_caching is False and args.trust_remote_code is True and args.enable_lora is False
    assert ns.served_model_name == ["first", "second"] and ns.allowed_origins == ["http://a.example"]
    assert args.hf_overrides == {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert args.gpu_memory_utilization == 0.5 and args.seed == 0  # null: the default
    # a positional model stays first, and wins over the file's
    assert parse(["serve", "/models/b", f"--config={config}"]).model_tag == "/models/b"
    batch_config = tmp_path / "batch.yml"
    batch_config.write_text("model: /models/a\nmax-num-seqs: 8\nresponse_role: bot\n")
    batch = parse(["run-batch", "--config", str(batch_config), "-i", "in.jsonl", "-o", "out.jsonl"])
    assert (engine_args_from(batch).max_num_seqs, batch.response_role, batch.input_file) == (8, "bot", "in.jsonl")


@pytest.mark.parametrize("text, name, message", [
    ("max-model-len: 512\nno-such-flag: 1\n", "c.yaml", "'no-such-flag' is not a flag of `aserve serve`"),
    ("enforce-eager: 1\n", "c.yaml", "'enforce-eager' is a switch: true or false"),
    ("config: other.yaml\n", "c.yaml", "'config' is not a flag"),
    ("- a\n- b\n", "c.yaml", "must map flag names to values"),
    ("a: [\n", "c.yaml", "not YAML"),
    ("port: 1\n", "c.json", "must be YAML (.yaml or .yml)"),
])  # fmt: skip
def test_what_a_file_cannot_say(tmp_path, capsys, text, name, message):
    config = tmp_path / name
    config.write_text(text)
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--config", str(config)])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_config_needs_a_file_and_a_command(capsys, tmp_path):
    for argv, message in ((["serve", "--config"], "needs a YAML file"),
                          (["chat", "--config", "x.yaml"], "goes after a command that takes it: run-batch, serve"),
                          (["serve", "--config", str(tmp_path / "none.yaml")], "No such file")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            cli_main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
