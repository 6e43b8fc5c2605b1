"""Triton GEMV for one row (batch-1 decode): y[1, N] = x[1, K] @ W[N, K]^T (+ bias), W row-major as nn.Linear keeps
it. Memory-bound: the kernel's only job is to stream W at the memory's read bandwidth.

Each program owns BLOCK_N output rows and walks K in BLOCK_K steps; every step loads a [BLOCK_N, BLOCK_K] tile
(each row contiguous: 16-byte loads, fully coalesced) and the matching slice of x, and keeps an element-wise
float32 accumulator, reduced over K once at the end. Rows past N are clamped to N - 1 (loaded, never stored) so the
hot loop has no masks; K must be a multiple of BLOCK_K (true of every model shape; `gemv_config` checks it).

SILU_MUL fuses a Llama MLP's activation into the down projection: x is the gate_up output [gate | up] and each
K slice of silu(gate) * up is computed in the loop (one kernel less per layer). (The add + RMSNorm before q/k/v and
gate/up fused the same way was slower: every program must read and reduce the whole row before its weights.) With
programmatic dependent launch (kernels/pdl.py) a GEMV's launch overlaps the previous kernel's tail.

Epilogue fusions for the one-token forward (LlamaForCausalLM.enable_fused_decode):
    gemv_add_rms_norm   the o / down projection adds the residual, and its last program to finish (an atomic
                        ticket) computes the next sub-layer's RMSNorm over the whole row: no add + norm kernel.
    gemv_rotary_cache   the q/k/v projection's programs own whole rotary pairs (rows d and d + D/2 of a head), rotate
                        q and k and write k / v into the KV cache: no rotary / cache-write kernel.
Reference: torch.nn.functional.linear (after kernels/fused.py's silu_and_mul for SILU_MUL; then add_rms_norm or
rotary_split(cache=...) for the fusions).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl

# Launch configurations chosen on an H200 (bench/decode_kernels.py, docs/benchmarks.md): few output rows want
# bigger row blocks (enough work per program), many rows small ones (more programs in flight).
FEW_ROWS = 4096
GEMV_CONFIG_FEW_ROWS = dict(BLOCK_N=16, BLOCK_K=1024, num_warps=8, num_stages=2)
GEMV_CONFIG = dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=2)


@triton.jit
def _x_tile(x_ptr, k, K, SILU_MUL: tl.constexpr):
    """x[k] as float32; SILU_MUL: x holds [gate | up] (2K wide) and this is silu(gate) * up, rounded to x's dtype
    where kernels/fused.py's silu_and_mul rounds."""
    dtype = x_ptr.dtype.element_ty
    if SILU_MUL:
        g = tl.load(x_ptr + k).to(tl.float32)
        u = tl.load(x_ptr + K + k).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        return (act * u).to(dtype).to(tl.float32)
    else:
        return tl.load(x_ptr + k).to(tl.float32)


@triton.jit
def _gemv_rows(x_ptr, w_ptr, rows, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr):
    """float32 [BLOCK_N]: x . W[rows] (rows int64, all in range). The caller has passed its gdc_sync."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * stride_w + rk[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * _x_tile(x_ptr, k0 + rk, K, SILU_MUL)[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gemv_block(x_ptr, w_ptr, bias_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """This program's output rows rn [BLOCK_N] and their float32 values (rows past N: clamped, not to be stored)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    # (Loading the first weight tile before gdc_sync, to overlap it with the previous kernel's tail, measured
    # slower on the H200: docs/benchmarks.md.)
    pdl.gdc_sync(USE_PDL)
    y = _gemv_rows(x_ptr, w_ptr, rows, K, stride_w, BLOCK_N, BLOCK_K, SILU_MUL)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    return rn, y


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_w,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    rn, y = _gemv_block(x_ptr, w_ptr, bias_ptr, N, K, stride_w, BLOCK_N, BLOCK_K, HAS_BIAS, SILU_MUL, USE_PDL)
    tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _gemv_add_norm_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, res_out_ptr, norm_w_ptr, out_ptr, counter_ptr, N, K, stride_w, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
    NORM: tl.constexpr, BLOCK_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """res_out = x @ W^T (+ bias) + residual, then (NORM) out = RMSNorm(res_out) * norm_w, computed by the program
    that finishes last (an atomic ticket), so the add + norm that opens the next sub-layer needs no kernel."""
    rn, y = _gemv_block(x_ptr, w_ptr, bias_ptr, N, K, stride_w, BLOCK_N, BLOCK_K, HAS_BIAS, SILU_MUL, USE_PDL)
    dtype = out_ptr.dtype.element_ty
    # As the unfused path rounds: the linear's output, then the sum, in the model dtype.
    r = tl.load(res_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    h = (y.to(dtype).to(tl.float32) + r).to(dtype)
    tl.store(res_out_ptr + rn, h, mask=rn < N)
    if NORM:
        # Every thread's store is issued before the ticket (CTA barrier), and the ticket is taken with release
        # semantics at GPU scope; the last program reads the row through L2 (.cg), after its acquire.
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) - 1:
            offs = tl.arange(0, BLOCK_NORM)
            ok = offs < N
            xf = tl.load(res_out_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
            yn = (xf * rstd).to(dtype).to(tl.float32)
            nw = tl.load(norm_w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + offs, (yn * nw).to(dtype), mask=ok)
            tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch (kernel boundaries order it)


@triton.jit
def _gemv_rotary_cache_kernel(
    x_ptr, w_ptr, bias_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, K, stride_w, stride_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """The fused q/k/v projection of one token with neox rotary and the cache write in its epilogue: q rotated to
    q_ptr [H, D], k rotated and v into their cache slot (slot < 0: nothing). A program of the rotated part (q and k
    heads) owns BLOCK_N / 2 rotary pairs (d, d + D/2) of one head, so it can rotate what it computed."""
    HALF: tl.constexpr = HEAD_DIM // 2
    P: tl.constexpr = BLOCK_N // 2
    ROT_ROWS: tl.constexpr = (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
    pid = tl.program_id(0)
    j = tl.arange(0, BLOCK_N)
    row0 = pid * BLOCK_N
    is_rot = row0 < ROT_ROWS
    # rotated part: element j is pair j // 2, half j % 2 -> row head * D + d + (j % 2) * D/2
    head = row0 // HEAD_DIM
    d0 = row0 % HEAD_DIM // 2
    rot_rn = head * HEAD_DIM + d0 + j // 2 + (j % 2) * HALF
    rn = tl.where(is_rot, rot_rn, row0 + j)
    rows = rn.to(tl.int64)
    pdl.gdc_sync(USE_PDL)
    y = _gemv_rows(x_ptr, w_ptr, rows, K, stride_w, BLOCK_N, BLOCK_K, False)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn).to(tl.float32)
    dtype = q_ptr.dtype.element_ty
    y = y.to(dtype)  # the projection's output, rounded as the unfused path rounds it
    slot = tl.load(slot_ptr).to(tl.int64)
    if is_rot:
        x1, x2 = tl.split(tl.reshape(y.to(tl.float32), [P, 2]))
        d = d0 + tl.arange(0, P)
        c = tl.load(cos_ptr + d).to(tl.float32)
        s = tl.load(sin_ptr + d).to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded as HF's (kernels/fused.py's rotary_split)
        o1 = ((x1 * c).to(dtype).to(tl.float32) + (-x2 * s).to(dtype).to(tl.float32)).to(dtype)
        o2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
        if head < NUM_HEADS:
            tl.store(q_ptr + head * HEAD_DIM + d, o1)
            tl.store(q_ptr + head * HEAD_DIM + d + HALF, o2)
        else:
            k_row = k_cache_ptr + slot * stride_slot + (head - NUM_HEADS) * HEAD_DIM
            ok = (d * 0 + slot) >= 0  # (as a vector: Triton's interpreter rejects scalar masks here)
            tl.store(k_row + d, o1, mask=ok)
            tl.store(k_row + d + HALF, o2, mask=ok)
    else:
        ok = (j * 0 + slot) >= 0
        tl.store(v_cache_ptr + slot * stride_slot + (row0 - ROT_ROWS) + j, y, mask=ok)


def gemv_config(n: int, k: int, config: dict | None = None) -> dict | None:
    """The launch configuration for an [n, k] weight, or None when the kernel does not apply (K not a multiple of
    BLOCK_K)."""
    cfg = dict(config or (GEMV_CONFIG_FEW_ROWS if n <= FEW_ROWS else GEMV_CONFIG))
    block_k = cfg["BLOCK_K"]
    while block_k > 64 and k % block_k:
        block_k //= 2
    if k % block_k:
        return None
    cfg["BLOCK_K"] = block_k
    return cfg


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
         config: dict | None = None, silu_mul: bool = False) -> torch.Tensor:  # fmt: skip
    """x [1, K] @ weight[N, K]^T (+ bias) -> [1, N] in x's dtype. silu_mul: x is [1, 2K] = [gate | up] and the
    product is silu(gate) * up @ weight^T (a Llama MLP's down projection with its activation fused in)."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == (2 if silu_mul else 1) * weight.shape[1]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    n, k = weight.shape
    cfg = gemv_config(n, k, config)
    assert cfg is not None, f"K={k} is not a multiple of 64"
    out = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def gemv_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor | None,
                      eps: float, counter: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None,
                      silu_mul: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """The linear of a sub-layer's end and the add + RMSNorm that opens the next one, in one kernel:
    h = x @ weight^T (+ bias) + residual -> (RMSNorm(h) * norm_weight, h) ([1, N] each); norm_weight None: (None, h).
    `counter`: an int32 device scalar, zero between calls (the kernel leaves it so); one per call site is simplest.
    silu_mul as in gemv."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.shape[1] == (2 if silu_mul else 1) * weight.shape[1]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and residual.is_contiguous()
    n, k = weight.shape
    cfg = gemv_config(n, k, config)
    assert cfg is not None, f"K={k} is not a multiple of 64"
    res_out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device) if norm_weight is not None else res_out
    _gemv_add_norm_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, residual, res_out,
        norm_weight if norm_weight is not None else weight, out, counter, n, k, weight.stride(0), eps,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        NORM=norm_weight is not None, BLOCK_NORM=triton.next_power_of_2(n), USE_PDL=pdl.ENABLED,
        **pdl.launch_kwargs(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return (out if norm_weight is not None else None), res_out


def rotary_cache_config(weight: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                        config: dict | None = None) -> dict | None:  # fmt: skip
    """gemv_config for gemv_rotary_cache, or None when its row blocks cannot hold whole rotary pairs of one head."""
    cfg = gemv_config(*weight.shape, config)
    if cfg is None or weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim or head_dim % 2:
        return None
    block_n = cfg["BLOCK_N"]
    if block_n < 2 or (head_dim // 2) % (block_n // 2) or (num_kv_heads * head_dim) % block_n:
        return None
    return cfg


def gemv_rotary_cache(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                      num_kv_heads: int, head_dim: int, bias: torch.Tensor | None = None,
                      config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """One token's fused q/k/v projection [1, K] @ weight[(H + 2 Hkv) D, K]^T (+ bias), with neox rotary on q and k
    (cos / sin [1, 1, D] in the model dtype) and k / v written into their cache slot (slot_mapping[0]; caches
    [num_blocks, block_size, Hkv, D]; a negative slot writes nothing) -> q [1, H, D]. Equals gemv followed by
    kernels/fused.py's rotary_split(..., cache=...). `config` must satisfy rotary_cache_config."""
    assert x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k_cache.stride(1) == num_kv_heads * head_dim and k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)
    cfg = rotary_cache_config(weight, num_heads, num_kv_heads, head_dim, config)
    assert cfg is not None, "row blocks do not hold whole rotary pairs"
    n, k = weight.shape
    q = torch.empty(1, num_heads, head_dim, dtype=x.dtype, device=x.device)
    _gemv_rotary_cache_kernel[(n // cfg["BLOCK_N"],)](
        x, weight, bias if bias is not None else weight, cos, sin, q, k_cache, v_cache, slot_mapping, k,
        weight.stride(0), k_cache.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], HAS_BIAS=bias is not None, USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return q
