"""Which of aserve's source files one streaming chat request runs code in, from the HTTP handler down to the kernels'
Python wrappers: the path a contributor follows to understand a request (docs/architecture.md lists it).

    python bench/request_path.py [--model PATH | --tiny] [--max-tokens 8]

The server is built in-process (aiohttp's test server) on the device the engine picks (the GPU where there is one),
with the embedded default model unless --model says otherwise, or --tiny: a tiny random Llama with a real tokenizer,
as the tests build it. One request warms it up, then a profiler hook on every thread records the file of each Python
function called while a second streaming chat request runs (the step loop, the worker thread, the handler). Start-up
code is not counted. Prints the files, grouped by package, and their number.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def run(model: str | None, max_tokens: int, max_model_len: int | None) -> set[str]:
    from aiohttp.test_utils import TestClient, TestServer

    from aserve import AsyncEngine, EngineArgs
    from aserve.entrypoints.openai.server import build_app

    engine = AsyncEngine.from_engine_args(EngineArgs(model=model, max_model_len=max_model_len, max_num_seqs=8))
    client = TestClient(TestServer(build_app(engine, "model"), handler_cancellation=True))
    await client.start_server()
    body = {
        "model": "model",
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    packages = tuple(os.path.join(ROOT, name) + os.sep for name in ("aserve", "kernels"))  # (kernels/: older trees)
    files: set[str] = set()
    recording = False

    def profile(frame, event, arg):
        if recording and event == "call":
            path = frame.f_code.co_filename
            if path.startswith(packages):
                files.add(os.path.relpath(path, ROOT))

    # Threads started from now on, this one, and the step thread that already runs (the engine is built in it).
    threading.setprofile(profile)
    sys.setprofile(profile)
    engine._executor.submit(sys.setprofile, profile).result()
    try:
        for measured in (False, True):
            recording = measured
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 200, await resp.text()
            text = await resp.text()
            assert text.endswith("data: [DONE]\n\n"), text[-200:]
            recording = False
    finally:
        engine._executor.submit(sys.setprofile, None).result()
        sys.setprofile(None)
        threading.setprofile(None)
        await client.close()
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama (tests/tiny_models.py)")
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    model = args.model
    if args.tiny:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from tiny_models import make_tiny_model

        model = make_tiny_model(tempfile.mkdtemp(prefix="aserve-request-path-"), "gqa")
    files = asyncio.run(run(model, args.max_tokens, None if args.tiny else 2048))
    by_dir = defaultdict(list)
    for f in sorted(files):
        by_dir[os.path.dirname(f)].append(os.path.basename(f))
    for directory, names in sorted(by_dir.items()):
        print(f"{directory}/: {', '.join(names)}")
    print(f"{len(files)} files")


if __name__ == "__main__":
    main()
