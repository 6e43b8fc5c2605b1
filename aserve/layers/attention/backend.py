"""Attention over a flat batch with a paged KV cache: the step's metadata, the cache's element type, and the interface
every backend implements.

Layout of one layer's cache (vLLM's flash layout), shared by every backend:

    kv_cache[layer]  [2, num_blocks, block_size, num_kv_heads, head_dim]     (0 = K, 1 = V)
    slot s           = block_id * block_size + offset   (one token's K/V)

A step's batch is flat: the query tokens of all requests are concatenated (no padding). Requests with a single query
token ("decodes") come first, so a backend can treat them as one batch.

    tokens     | r0 | r1 | r2 r2 r2 r2 | r3 r3 |        query_start_loc = [0, 1, 2, 6, 8], num_decodes = 2
    seq_lens   | 37 | 12 |     4      |  130  |        (tokens in the cache after this step, incl. new ones)

One backend object is chosen at engine start (select_attention_backend, this package's __init__) and shared by all
layers; what it works out once per step (which requests batch together, gather indices, masks, split-KV segments) is
its own dataclass, which prepare() puts into AttentionMetadata.state. What differs between layers (the softmax scale,
a sliding window, soft-capping: Gemma 2/3 interleave sliding and global layers) is the layer's AttentionParams, fixed
when the model is built and handed to every call.

The KV cache's element type (`kv_cache_dtype`, vLLM's engine argument and values), chosen once at engine start:

auto               the model's dtype
fp8, fp8_e4m3      FP8 e4m3 (torch.float8_e4m3fn), one byte per element: twice the tokens of a 16-bit cache in the
                   same memory (four times a float32 model's)

An FP8 cache holds x / scale, clamped to e4m3's range (+-448) and rounded; attention reads x.float() * scale. Each
layer has one scale for its keys and one for its values (per tensor; AttentionParams.k_scale / v_scale): 1.0, or
the checkpoint's where it has them (vLLM's and llm-compressor's `self_attn.k_scale` / `v_scale`, older writers'
`kv_scale` or `k_proj.output_scale` / `v_proj.output_scale`; a compressed-tensors `kv_cache_scheme` stores them
so). Every key a query sees, its own step's included, is read back from the cache, so a prompt computes the same
whether its prefix came from the prefix cache or not.

A KVCacheDtype object is handed to the attention backend when it is built; the torch backends call its write /
read / round_trip, which for `auto` are the plain cache write and no-ops. The Triton kernels quantise and
dequantise in place (aserve/kernels/fused.py, cache_write.py, paged_attention.py). Reference: quantize_fp8 and
dequantize_fp8 below.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any

import torch

from aserve.config import KV_CACHE_DTYPES


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [2, num_blocks, block_size, Hkv, D]: kv_cache[:, slot] = (k, v) for every token."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale, clamped to +-448, as e4m3 (round to nearest even)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


class KVCacheDtype:
    """`auto`: the cache holds K/V in the model's dtype, as computed."""

    name = "auto"
    quantized = False

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype

    def write(self, k, v, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
        """k / v [T, Hkv, D] -> kv_cache [2, num_blocks, block_size, Hkv, D] at their slots."""
        write_kv_cache(k, v, kv_cache, slot_mapping)

    def read(self, x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Cache elements (gathered) -> values in `dtype`."""
        return x

    def round_trip(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """Fresh K or V -> what reading it back from the cache gives."""
        return x

    def scales(self, params) -> tuple[float, float]:
        """The layer's (k_scale, v_scale) as the kernels apply them (AttentionParams `params`): 1.0 unquantised."""
        return 1.0, 1.0


class FP8KVCache(KVCacheDtype):
    name = "fp8"
    quantized = True

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return FP8

    def write(self, k, v, kv_cache, slot_mapping, k_scale: float, v_scale: float) -> None:
        # (CPU torch has no index_copy_ for float8: the bytes are copied as uint8)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        for i, (x, scale) in enumerate(((k, k_scale), (v, v_scale))):
            dest = kv_cache[i].view(torch.uint8).view(-1, num_kv_heads, head_dim)
            dest.index_copy_(0, slot_mapping, quantize_fp8(x, scale).view(torch.uint8))

    def read(self, x, scale: float, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(x, scale, dtype)

    def round_trip(self, x, scale: float) -> torch.Tensor:
        return dequantize_fp8(quantize_fp8(x, scale), scale, x.dtype)

    def scales(self, params) -> tuple[float, float]:
        return params.k_scale, params.v_scale


AUTO = KVCacheDtype()


def kv_cache_dtype(name: str) -> KVCacheDtype:
    """The engine argument's value (one of KV_CACHE_DTYPES, which EngineArgs.validate checks) -> its KVCacheDtype."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return AUTO if name == "auto" else FP8KVCache()


_SCALE_SUFFIXES = {
    ".k_scale": "k",
    ".v_scale": "v",
    ".kv_scale": "kv",  # one scale for both (older writers)
    ".k_proj.output_scale": "k",
    ".v_proj.output_scale": "v",
}


def kv_scale_of(name: str) -> tuple[str, str] | None:
    """A checkpoint tensor name -> (the attention module's name, "k" / "v" / "kv") where it is a KV-cache scale,
    else None."""
    for suffix, which in _SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix), which
    return None


def scale_value(name: str, tensor: torch.Tensor) -> float:
    """A per-tensor KV-cache scale's value (ValueError for per-head or per-channel scales, or one <= 0)."""
    if tensor.numel() != 1:
        shape = tuple(tensor.shape)
        raise ValueError(f"KV-cache scale {name!r} has shape {shape}: only per-tensor scales are supported")
    value = float(tensor.reshape(()).float())
    if not value > 0 or value == float("inf"):
        raise ValueError(f"KV-cache scale {name!r} is {value}: it must be a positive finite number")
    return value


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """One layer's attention. scale: of q . k (None: head_dim ** -0.5). sliding_window: a query at position p sees
    keys p - sliding_window < k <= p (transformers' convention), and blocks wholly before that are not read (None:
    every k <= p). softcap: each scaled score s becomes softcap * tanh(s / softcap) (None: none). k_scale / v_scale:
    the per-tensor scales of the layer's keys and values in a quantised KV cache (KVCacheDtype above; unused by an
    unquantised one)."""

    scale: float | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0


FULL_ATTENTION = AttentionParams()


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    num_decodes: int  # the first `num_decodes` requests have exactly one query token
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with 0
    # Host copies, so backends that loop over requests need no device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_seq_len: int
    max_query_len: int
    # The attention backend's per-step state (its own dataclass), built once per step by its prepare() for all layers.
    state: Any = None
    # A hybrid KV layout (aserve/core/kv_cache_groups.py): the metadata of groups 1.. of layers, this being group 0's
    # (the same step with each group's slot_mapping, block_tables and state).
    groups: tuple[AttentionMetadata, ...] = ()

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


def split_groups(meta: AttentionMetadata) -> AttentionMetadata:
    """`meta` with a row of slots and a block table per group of layers (slot_mapping [G, T], block_tables
    [G, R, B]) -> group 0's metadata, with the others' in its `groups`."""
    slots, tables = meta.slot_mapping, meta.block_tables
    meta.slot_mapping, meta.block_tables = slots[0], tables[0]
    meta.groups = tuple(replace(meta, slot_mapping=slots[g], block_tables=tables[g]) for g in range(1, len(slots)))
    return meta


class AttentionBackend(ABC):
    """Writes the step's new K/V into the paged cache and computes causal attention for every query token."""

    # True: rotate_and_write(qkv, cos, sin, kv_cache, meta, num_heads, head_dim, params) -> (q, k_new, v_new): rotary
    # and the cache write in one pass (a Triton kernel: the model uses it where its element-wise ops are Triton's
    # too), and attend(q, k_new, v_new, kv_cache, meta, params) then computes attention.
    writes_rotated_kv = False
    # True (with writes_rotated_kv): rotate_and_write(..., qk_norm=(q_weight, k_weight, eps)) RMS-normalises each q and
    # k head before rotary in the same pass (Qwen3's q/k norm, one launch fewer a layer).
    fuses_qk_norm = False
    # True: prepare() reads nothing per step on the host that a replay would need afresh, so decode steps can be
    # captured in CUDA graphs (aserve/worker/cuda_graphs.py) and replayed with other inputs.
    supports_cuda_graphs = False

    @abstractmethod
    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Builds the step's state into meta.state (once per step, before the forward)."""

    def prepare_groups(self, meta: AttentionMetadata, block_size: int) -> None:
        """prepare() for the metadata of every group of layers (meta and meta.groups)."""
        self.prepare(meta, block_size)
        for group in meta.groups:
            self.prepare(group, block_size)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        params: AttentionParams = FULL_ATTENTION,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv_cache [2, num_blocks, block_size, Hkv, D] -> out [T, H, D], for a layer
        with `params`."""
