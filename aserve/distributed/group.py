"""The process group of a tensor-parallel engine and the collectives run over it.

torch.distributed with NCCL between GPUs (rank r on GPU base + r), gloo between CPU processes. The ranks meet at a
TCPStore that rank 0 opens on a free port before it starts the others. NCCL_NVLS_ENABLE=0 (NVLink multicast off)
unless set otherwise: it needs memory and driver support that shared machines may lack, and nothing here needs it.

Only the tensors of the model's forward travel here (all-reduces, the logits gather, the broadcast of sampled
tokens); what a step is to run reaches the other ranks over their pipes (aserve/worker/tp_workers.py), which have no
timeout, so an idle engine waits as long as it likes.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# How long one collective may wait for the other ranks. They run the same forward in step, so only a rank that died
# or failed mid-step makes one wait this long (and the engine notices a dead worker well before: tp_workers.py).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class TensorParallelError(RuntimeError):
    """The ranks of a tensor-parallel engine can no longer run together (a worker process died, or a step failed on
    one rank after the others began it): the engine stops."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: GPU base + rank (base: the engine's device index, 0 if none); the CPU for every rank."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    return torch.device("cuda", index)


def check_devices(device: torch.device, size: int) -> None:
    if device.type == "cuda":
        base, count = device.index or 0, torch.cuda.device_count()
        if base + size > count:
            raise ValueError(
                f"tensor_parallel_size {size} on {device} needs GPUs {base}..{base + size - 1}, but torch sees {count}"
            )


def open_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous: a TCPStore on a free port of this host (its .port goes to the other ranks)."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)


@dataclass
class TensorParallelGroup:
    rank: int
    size: int
    device: torch.device

    @classmethod
    def join(cls, rank: int, size: int, store: dist.Store, device: torch.device) -> TensorParallelGroup:
        """Joins the group (every rank calls it; it returns once all have). One group per process at a time."""
        if dist.is_initialized():
            raise ValueError(
                "another tensor-parallel engine is running in this process: shut it down (LLMEngine.shutdown) first"
            )
        if device.type == "cuda":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT,
                                    device_id=device)  # fmt: skip
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, size, device)

    @property
    def backend(self) -> str:
        return "NCCL" if self.device.type == "cuda" else "gloo"

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place (captured inside CUDA graphs like any kernel)."""
        dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x [..., n] -> on rank 0, [..., size * n] (rank order); None on the others."""
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=0)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1)

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype), in place."""
        dist.broadcast(x, src=0)
        return x

    def min_int(self, n: int) -> int:
        """The smallest of every rank's n."""
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def abort(self) -> None:
        """Makes collectives blocked on a rank that is gone fail instead of waiting (NCCL; gloo fails by itself
        when a peer's connection closes)."""
        if self.device.type == "cuda" and dist.is_initialized():
            try:
                dist.distributed_c10d._abort_process_group()
            except (AttributeError, RuntimeError):
                pass

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
