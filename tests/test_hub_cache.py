"""Models named by Hugging Face repo id, read from the local Hugging Face cache (never downloaded): `LLM("org/name")`,
`aserve serve org/name`, --revision, --tokenizer org/name and --download-dir, against a cache laid out as
huggingface_hub writes it, under a temporary HF_HOME."""

import os
import shutil

import pytest
import torch
from aserve_server import running_server
from test_serve_flags import call
from tiny_models import make_tiny_model

from aserve import LLM, EngineArgs, LLMEngine, SamplingParams
from aserve.cli import main as cli_main

MAIN, V2 = "a" * 40, "b" * 40  # the commits refs/main and refs/v2 name
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def add_snapshot(cache: str, repo_id: str, ref: str, commit: str, source: str) -> None:
    """`source`'s files as huggingface_hub caches them: blobs, a snapshot of links to them, a ref naming it."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    for name in os.listdir(source):
        blob = os.path.join(repo, "blobs", f"{commit[:8]}-{name}")
        shutil.copyfile(os.path.join(source, name), blob)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", ref), "w") as f:
        f.write(commit)


@pytest.fixture(scope="module")
def hf_home(tiny_model, tmp_path_factory):
    """An HF_HOME whose cache holds tiny-org/tiny (main: the tiny model; v2: other weights) and tiny-org/tok (the
    tokenizer alone)."""
    home = str(tmp_path_factory.mktemp("hf_home"))
    cache = os.path.join(home, "hub")
    other = make_tiny_model(str(tmp_path_factory.mktemp("other") / "gqa"), "gqa", seed=1)
    add_snapshot(cache, "tiny-org/tiny", "main", MAIN, tiny_model)
    add_snapshot(cache, "tiny-org/tiny", "v2", V2, other)
    tokenizer_only = str(tmp_path_factory.mktemp("tok"))
    for name in os.listdir(tiny_model):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tiny_model, name), tokenizer_only)
    add_snapshot(cache, "tiny-org/tok", "main", MAIN, tokenizer_only)
    return home


def engine_kwargs():
    return {"dtype": torch.float32, "enforce_eager": True, "max_model_len": 128}


def greedy_ids(llm) -> list[int]:
    return list(llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_repo_ids_resolve_from_the_local_cache(hf_home, tiny_model, monkeypatch):
    monkeypatch.setenv("HF_HOME", hf_home)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    local = LLM(tiny_model, **engine_kwargs())
    cached = LLM("tiny-org/tiny", tokenizer="tiny-org/tok", **engine_kwargs())
    assert cached.engine.config.served_model_name == "tiny-org/tiny"  # vLLM serves a repo id under its name
    assert cached.engine.config.model_dir.endswith(os.path.join("snapshots", MAIN))
    assert greedy_ids(cached) == greedy_ids(local)
    # --revision: another ref of the same repo (EngineArgs, as `aserve serve --revision v2` builds them)
    other = LLMEngine(EngineArgs(model="tiny-org/tiny", revision="v2", **engine_kwargs()))
    assert other.config.model_dir.endswith(os.path.join("snapshots", V2))
    offline = LLM("tiny-org/tiny", revision="v2", tokenizer="tiny-org/tok", tokenizer_revision="main",
                  **engine_kwargs())  # fmt: skip
    assert offline.engine.config.model_dir == other.config.model_dir
    # --download-dir: vLLM's cache directory, looked in instead of HF_HOME's
    monkeypatch.setenv("HF_HOME", "/nonexistent")
    elsewhere = LLM("tiny-org/tiny", download_dir=os.path.join(hf_home, "hub"), **engine_kwargs())
    assert greedy_ids(elsewhere) == greedy_ids(local)


@pytest.mark.parametrize("args, message", [
    ({"model": "tiny-org/missing"}, "model 'tiny-org/missing' is not in the Hugging Face cache"),
    ({"model": "tiny-org/tiny", "revision": "v3"}, "at revision 'v3' is not in the Hugging Face cache"),
    ({"model": "tiny-org/tiny", "tokenizer": "tiny-org/none"}, "tokenizer 'tiny-org/none' is not in the"),
])  # fmt: skip
def test_what_the_cache_lacks_is_refused_with_how_to_get_it(hf_home, monkeypatch, args, message):
    monkeypatch.setenv("HF_HOME", hf_home)
    with pytest.raises(ValueError, match=message) as e:
        LLMEngine(EngineArgs(**args, **engine_kwargs()))
    assert "aserve does not download models" in str(e.value) and "huggingface-cli download" in str(e.value)
    assert os.path.join(hf_home, "hub") in str(e.value)


def test_a_revision_of_a_local_directory_is_refused(tiny_model, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", tiny_model, "--revision", "main"])
    assert e.value.code == 2 and "names a commit, branch or tag of a Hugging Face repo id" in capsys.readouterr().err


def test_serve_a_repo_id(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", hf_home)
    flags = ["tiny-org/tiny", "--revision", "v2", "--tokenizer", "tiny-org/tok", "--dtype", "float32",
             "--enforce-eager", "--max-model-len", "128"]  # fmt: skip
    with running_server(*flags) as url:
        status, _, models = call(url, "/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == ["tiny-org/tiny"]
        status, _, out = call(url, "/v1/completions", {"model": "tiny-org/tiny", "prompt": [5, 6, 7], "max_tokens": 2})
        assert status == 200 and out["usage"]["completion_tokens"] == 2
