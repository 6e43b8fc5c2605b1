"""Cold vs warm start of `aserve serve` with the default model: seconds from process start until /health is 200.

    python bench/startup_time.py [--runs 2] [-- extra serve flags]

The first run uses empty caches (the GGUF conversion cache and torch.compile's cache, both in a fresh temporary
directory); later runs reuse them, as a user's second start does.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_healthy(env: dict, extra: list[str]) -> float:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", "serve", "--port", str(port), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError("aserve serve exited")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("extra", nargs="*", help="extra flags for aserve serve (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "ASERVE_CACHE": os.path.join(tmp, "aserve"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
        }
        times = [time_to_healthy(env, args.extra) for _ in range(args.runs)]
    print("| start | seconds to healthy |\n|---|---|")
    for i, t in enumerate(times):
        print(f"| {'first (cold caches)' if i == 0 else f'#{i + 1} (warm caches)'} | {t:.1f} |")


if __name__ == "__main__":
    main()
