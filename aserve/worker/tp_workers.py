"""The processes of a tensor-parallel engine: rank 0 is the engine's own process (the API server, the scheduler and its
model runner stay there, as with one rank); ranks 1..N-1 are worker processes it starts (torch.multiprocessing,
spawn), each with a model runner over its part of the model, which runs whatever rank 0's runner runs:

    rank 0 (engine process)                              rank r (worker process)
    ModelRunner.launch: fill the host buffers            _serve: wait on the pipe (no timeout: idle is fine)
        workers.call("replay_step", plan) ──── pipe ───▶  runner.replay_step(plan): the same buffers
        forward ◀────── all-reduces (NCCL / gloo) ──────▶ forward
        logits  ◀────── gather on rank 0 ───────────────  logits
        sample (rank 0 only); async scheduling: broadcast the sampled tokens ──▶ the next step's in-flight inputs

Start-up: rank 0 opens the rendezvous (a TCPStore), starts the workers, waits for each to say hello (so a worker that
cannot even start is an error at once, not a rendezvous timeout), joins the process group with them, and each rank
builds its runner (loading its slice of the weights in parallel); `wait_ready` reports a worker's start-up error.

Failure and shutdown: a watcher thread waits on the workers' process sentinels. A worker that exits while the engine
runs marks the engine failed: `check` raises TensorParallelError, the collectives blocked on it are aborted (gloo fails
by itself), and the front ends stop (the server exits with an error; LLM.generate raises). `close` (the engine's
shutdown, or when the engine is garbage collected, or at interpreter exit) asks each worker to stop, then terminates
and kills what is left. A worker exits by itself when rank 0's process is gone (its pipe closes, or its parent's
sentinel fires while it is blocked elsewhere), so no worker outlives the engine's process.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aserve.distributed.group import (
    COLLECTIVE_TIMEOUT,
    TensorParallelError,
    TensorParallelGroup,
    open_store,
    rank_device,
)
from aserve.kernels import cpu
from aserve.worker.host_memory import retain_freed_memory
from aserve.worker.model_runner import ModelRunner

logger = logging.getLogger("aserve")

_START_TIMEOUT_S = 600.0  # a worker's hello (importing torch and aserve) and its model build each
_STOP_TIMEOUT_S = 10.0  # a worker asked to stop gets this long before it is terminated


class _Health:
    """What the watcher thread and the engine share (not the TensorParallelWorkers object, which the watcher must not
    keep alive): the first failure, and whom to tell."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.closing = False
        self.group: TensorParallelGroup | None = None
        self.listeners: list = []

    def fail(self, message: str) -> None:
        if self.error is not None or self.closing:
            return
        self.error = message
        logger.error("tensor parallelism: %s; the engine stops", message)
        if self.group is not None:
            self.group.abort()
        for listener in list(self.listeners):
            listener()


def _watch(processes: list, stop: multiprocessing.connection.Connection, health: _Health) -> None:
    by_sentinel = {p.sentinel: (rank, p) for rank, p in processes}
    ready = multiprocessing.connection.wait([*by_sentinel, stop])
    for sentinel in ready:
        if sentinel in by_sentinel:
            rank, p = by_sentinel[sentinel]
            p.join(1.0)
            health.fail(f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}")
            return


def _shutdown(processes: list, conns: list, stop, health: _Health, threads: int) -> None:
    """Stops every worker (asked, then terminated, then killed), leaves the process group and gives this process its
    torch threads back (`threads`: how many it had, 0 if unchanged)."""
    health.closing = True
    try:
        stop.send(None)  # ends the watcher (if it still runs): what follows are exits it was told of
    except OSError:
        pass
    message = pickle.dumps(("shutdown", ()))
    for conn in conns:
        try:
            conn.send_bytes(message)
        except OSError:
            pass
    deadline = time.monotonic() + (_STOP_TIMEOUT_S if health.error is None else 1.0)
    for _, p in processes:
        p.join(max(deadline - time.monotonic(), 0.0))
    for _, p in processes:
        if p.is_alive():
            p.terminate()
            p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()
    if health.group is not None:
        health.group.close()
    if threads:
        torch.set_num_threads(threads)


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..size-1 (see the module docstring)."""

    def __init__(self, size: int, device: torch.device, runner_kwargs: dict) -> None:
        self.size = size
        self.health = _Health()
        threads = threads_before = 0
        if device.type == "cpu":  # CPU ranks share the cores: each takes its part (threads that contend stall steps)
            threads_before = torch.get_num_threads()
            threads = max(1, threads_before // size)
            torch.set_num_threads(threads)
        store = open_store(size)
        ctx = mp.get_context("spawn")
        self.processes, self.conns = [], []
        for rank in range(1, size):
            here, there = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, size, store.port, there, device, runner_kwargs, threads),
                            name=f"aserve-tp{rank}", daemon=True)  # fmt: skip
            p.start()
            there.close()
            self.processes.append((rank, p))
            self.conns.append(here)
        stop_reader, stop_writer = multiprocessing.Pipe(duplex=False)
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self.conns, stop_writer, self.health,
                                           threads_before)  # fmt: skip
        try:
            self._wait_for("hello")
            self.group = TensorParallelGroup.join(0, size, store, rank_device(device, 0))
        except BaseException:
            self.close()
            raise
        self.health.group = self.group
        logger.info("Tensor parallelism: %d ranks over %s; worker processes %s%s", size, self.group.backend,
                    self.pids, f"; {threads} threads each" if threads else "")  # fmt: skip
        self._watcher = threading.Thread(target=_watch, args=(self.processes, stop_reader, self.health),
                                         name="aserve-tp-watch", daemon=True)  # fmt: skip
        self._watcher.start()

    def _wait_for(self, what: str) -> None:
        """Each worker's next message must be `what`; a worker's error, or its exit, raises (ValueError: a start-up
        problem such as a model that cannot split, for the command line to print)."""
        for (rank, p), conn in zip(self.processes, self.conns):
            deadline = time.monotonic() + _START_TIMEOUT_S
            while not conn.poll(0.1):
                if not p.is_alive():
                    raise ValueError(
                        f"tensor-parallel worker rank {rank} exited during start-up (code {p.exitcode}; its error "
                        "is above). A script that starts a tensor-parallel engine must do so under "
                        "`if __name__ == '__main__':` (workers are spawned: they import the main module)"
                    )
                if time.monotonic() > deadline:
                    raise ValueError(f"tensor-parallel worker rank {rank} did not start within {_START_TIMEOUT_S} s")
            try:
                kind, detail = pickle.loads(conn.recv_bytes())
            except EOFError:
                raise ValueError(f"tensor-parallel worker rank {rank} exited during start-up") from None
            if kind == "error":
                raise ValueError(f"tensor-parallel worker rank {rank}: {detail}")
            assert kind == what, (kind, what)

    def wait_ready(self) -> None:
        """After rank 0's own runner is built: every worker has built its runner (or its error is raised here)."""
        try:
            self._wait_for("ready")
        except BaseException:
            self.close()
            raise

    def call(self, method: str, *args) -> None:
        """Every worker's runner runs `method(*args)` (rank 0's runs it too, right after)."""
        self.check()
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for (rank, _), conn in zip(self.processes, self.conns):
            try:
                conn.send_bytes(message)
            except OSError as e:
                self.health.fail(f"worker rank {rank} is unreachable ({e!r})")
                raise TensorParallelError(self.health.error) from e

    def check(self, grace: float = 0.0) -> None:
        """TensorParallelError if a worker has exited. `grace`: wait up to that long for an exit (after a step failed,
        to tell a dead worker from a fault of the step)."""
        deadline = time.monotonic() + grace
        while self.health.error is None:
            for rank, p in self.processes:
                if p.exitcode is not None:
                    self.health.fail(f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}")
            if self.health.error is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if self.health.error is not None:
            raise TensorParallelError(f"tensor-parallel {self.health.error}")

    def add_failure_listener(self, listener) -> None:
        """`listener()` is called (from the watcher thread) when a worker fails."""
        self.health.listeners.append(listener)

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, p in self.processes]

    def close(self) -> None:
        self._finalizer()


# -- the worker process ---------------------------------------------------------------------------------------


def _exit_with_parent() -> None:
    """A daemon thread: when rank 0's process is gone (even while this one is blocked in a collective), exit."""
    parent = mp.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=wait, name="aserve-tp-parent", daemon=True).start()


def _worker_main(rank: int, size: int, port: int, conn, device: torch.device, runner_kwargs: dict,
                 threads: int) -> None:  # fmt: skip
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    _exit_with_parent()
    device = rank_device(device, rank)
    try:
        if threads:
            torch.set_num_threads(threads)
        if device.type == "cpu":
            retain_freed_memory()
            cpu.load()
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        conn.send_bytes(pickle.dumps(("hello", None)))
        group = TensorParallelGroup.join(rank, size, store, device)
        runner = ModelRunner(**runner_kwargs, device=device, tp=group)
        conn.send_bytes(pickle.dumps(("ready", None)))
    except BaseException as e:
        traceback.print_exc()
        try:
            conn.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}")))
        finally:
            os._exit(1)
    _serve(rank, conn, runner)
    group.close()


def _serve(rank: int, conn, runner: ModelRunner) -> None:
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # rank 0 is gone
        if method == "shutdown":
            return
        try:
            getattr(runner, method)(*args)
        except BaseException:
            print(f"aserve: tensor-parallel worker rank {rank} failed in {method}:", file=sys.stderr)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
