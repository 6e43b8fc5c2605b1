"""Start `aserve serve` (the embedded default model, or any --model) as a subprocess on a free port, for end-to-end
tests."""

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra_args: str, timeout: float = 300, log_path: str | None = None,
                 tls: ssl.SSLContext | None = None) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """Starts the server and returns (process, base URL) once GET /health answers 200. Later flags override the
    defaults given here (argparse keeps the last); `--debug-invariants` is on (`--no-debug-invariants` turns it
    off): every step checks the KV blocks' ref counts and the queues. The server's output goes to `log_path` if
    given (a long run would fill a pipe nobody reads), else to `proc.stdout`. `tls`: the server speaks HTTPS (its
    --ssl-* flags among extra_args), checked with this client context."""
    port = free_port()
    log = open(log_path, "w") if log_path is not None else subprocess.PIPE
    proc = subprocess.Popen(
        [sys.executable, "-m", "aserve", "serve", "--port", str(port), "--max-model-len", "2048",
         "--kv-cache-memory-gb", "0.25", "--debug-invariants", *extra_args],
        stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    if log_path is not None:
        log.close()  # the child has its own copy
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                output = proc.stdout.read() if proc.stdout is not None else open(log_path).read()
                raise RuntimeError(f"aserve serve exited early:\n{output}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1, context=tls) as r:
                    if r.status == 200:
                        return proc, url
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("aserve serve did not become healthy")
            time.sleep(0.2)
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_server(*extra_args: str, timeout: float = 300, tls: ssl.SSLContext | None = None):
    """Yields the base URL once GET /health answers 200; terminates the server afterwards."""
    proc, url = start_server(*extra_args, timeout=timeout, tls=tls)
    try:
        yield url
    finally:
        stop_server(proc)
