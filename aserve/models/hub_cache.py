"""Models and tokenizers named by their Hugging Face repo id (`org/name`), found in the local Hugging Face cache.

aserve never downloads: a repo id resolves to the snapshot that a download (huggingface-cli, vLLM, transformers) left
in the cache, in huggingface_hub's layout, as vLLM resolves it offline:

    <cache>/models--org--name/refs/main                 the commit the branch (or tag) names
    <cache>/models--org--name/snapshots/<commit>/...    the repo's files at that commit (links into blobs/)

The cache is --download-dir (vLLM's directory for its downloads, which is such a cache) if given, else
envs.HF_HUB_CACHE ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub)."""

from __future__ import annotations

import re

from aserve import envs

# huggingface_hub's repo ids: a name, or a namespace and a name (letters, digits, "-", "_", ".")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_repo_id(name: str) -> bool:
    return _REPO_ID.fullmatch(name) is not None and ".." not in name and not name.endswith(".gguf")


def cache_dir(download_dir: str | None = None) -> str:
    return download_dir or envs.HF_HUB_CACHE


def cached_snapshot(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> str | None:
    """The snapshot directory of `repo_id` at `revision` (a branch, tag or commit; None: main) in the cache, or None
    when the cache does not hold it. Reads the cache only: nothing goes over the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir(download_dir), local_files_only=True)
    except LocalEntryNotFoundError:
        return None


def not_cached(what: str, repo_id: str, revision: str | None, download_dir: str | None) -> str:
    """The error for a repo id the cache does not hold: where aserve looked, and how to put it there."""
    at = f" at revision {revision!r}" if revision else ""
    options = (f" --revision {revision}" if revision else "") + (f" --cache-dir {download_dir}" if download_dir else "")
    return (f"{what} {repo_id!r}{at} is not in the Hugging Face cache ({cache_dir(download_dir)}), and aserve does "
            f"not download models: run `huggingface-cli download {repo_id}{options}` on a machine with network "
            "access and copy its cache here (or point HF_HOME / HF_HUB_CACHE, or --download-dir, at a cache that "
            "holds it), or pass a local directory")  # fmt: skip
