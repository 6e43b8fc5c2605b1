"""Fused element-wise kernels of a Llama layer (one launch instead of 5-10 small ones each):

    add_rms_norm     x + residual -> (RMSNorm(x + residual) * weight, x + residual)
    rotary_split     fused qkv row -> rotated q, rotated k, v (each contiguous)
    silu_and_mul     [gate | up] -> silu(gate) * up
    qk_norm_         fused qkv row: RMSNorm over each head of q and of k, in place (Qwen3)

Each rounds to the model dtype where HF's eager code does, so bf16 results match HF's op by op, not just closely.
References: aserve.layers.elementwise (add_rms_norm, split_rotate_qkv, silu_and_mul, qk_norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import pdl
from aserve.kernels.cache_write import to_cache


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps, stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.gdc_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    y = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """-> (norm(x + residual) * weight, x + residual); without a residual, (norm(x) * weight, x)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](
        x, res, weight, out, res_out, n, eps, x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8, USE_PDL=pdl.ENABLED,
        **pdl.launch_kwargs(),
    )  # fmt: skip
    return out, res_out


@triton.jit
def head_norm_rounded(x, r, w, dtype: tl.constexpr):
    """float32 x of one head, its RMS factor r and the norm weight w -> (x * r rounded to `dtype`) * w in `dtype`: the
    roundings of HF's Qwen3 q/k RMSNorm, shared by _qk_norm_kernel and the rotary kernel's fused norm."""
    return ((x * r).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)


@triton.jit
def _rotary_split_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, stride_qkv, stride_cos, stride_sin,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, HALF: tl.constexpr, USE_PDL: tl.constexpr,
    WRITE_CACHE: tl.constexpr, slot_ptr, stride_c_slot, KEEP_K: tl.constexpr, k_scale, v_scale, QUANT: tl.constexpr,
    qw_ptr, kw_ptr, eps, QK_NORM: tl.constexpr,
):  # fmt: skip
    pdl.gdc_sync(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    if WRITE_CACHE:  # k / v go straight to their cache slot (k_ptr / v_ptr are the caches); slot < 0: padding
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        kv_row = slot * stride_c_slot
    else:
        kv_row = tok * NUM_KV_HEADS * HEAD_DIM
    dtype = q_ptr.dtype.element_ty
    j = tl.arange(0, HALF)
    # cos/sin of the token's position, already in the model dtype (as HF); each half repeats the other.
    c = tl.load(cos_ptr + tok * stride_cos + j).to(tl.float32)
    s = tl.load(sin_ptr + tok * stride_sin + j).to(tl.float32)
    # q and k heads are consecutive rows of HEAD_DIM in the fused row: rotate them together.
    h = tl.arange(0, BLOCK_H)
    h_ok = h < NUM_HEADS + NUM_KV_HEADS
    row = qkv_ptr + tok * stride_qkv + h[:, None] * HEAD_DIM
    x1 = tl.load(row + j[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + j[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
    is_q = h < NUM_HEADS
    if QK_NORM:  # each q and k head RMS-normalised first, rounded as qk_norm_ rounds it
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.where(is_q[:, None], tl.load(qw_ptr + j)[None, :], tl.load(kw_ptr + j)[None, :])
        w2 = tl.where(is_q[:, None], tl.load(qw_ptr + HALF + j)[None, :], tl.load(kw_ptr + HALF + j)[None, :])
        x1 = head_norm_rounded(x1, r, w1, dtype).to(tl.float32)
        x2 = head_norm_rounded(x2, r, w2, dtype).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded like HF's
    o1 = ((x1 * c[None, :]).to(dtype).to(tl.float32) + (-x2 * s[None, :]).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * c[None, :]).to(dtype).to(tl.float32) + (x1 * s[None, :]).to(dtype).to(tl.float32)).to(dtype)
    q_off = tok * NUM_HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + j[None, :]
    tl.store(q_ptr + q_off, o1, mask=is_q[:, None])
    tl.store(q_ptr + q_off + HALF, o2, mask=is_q[:, None])
    is_k = (h >= NUM_HEADS) & h_ok
    if KEEP_K:  # the rotated k also back into the fused row (read above, by this program only)
        tl.store(row + j[None, :], o1, mask=is_k[:, None])
        tl.store(row + HALF + j[None, :], o2, mask=is_k[:, None])
    if WRITE_CACHE:
        is_k = is_k & ((h * 0 + slot) >= 0)  # (as a vector: Triton's interpreter rejects scalar masks here)
    k_off = kv_row + (h - NUM_HEADS)[:, None] * HEAD_DIM + j[None, :]
    cache_dtype = k_ptr.dtype.element_ty  # QUANT: an FP8 cache, written quantised (to_cache)
    tl.store(k_ptr + k_off, to_cache(o1, k_scale, cache_dtype, QUANT), mask=is_k[:, None])
    tl.store(k_ptr + k_off + HALF, to_cache(o2, k_scale, cache_dtype, QUANT), mask=is_k[:, None])
    d = tl.arange(0, BLOCK_KV)
    d_ok = d < NUM_KV_HEADS * HEAD_DIM
    v = tl.load(qkv_ptr + tok * stride_qkv + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + d, mask=d_ok)
    if WRITE_CACHE:
        d_ok = d_ok & ((d * 0 + slot) >= 0)
    tl.store(v_ptr + kv_row + d, to_cache(v, v_scale, cache_dtype, QUANT), mask=d_ok)


def qkv_kv_views(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Fused qkv rows [T, (H + 2 Hkv) D] -> their k and v columns as [T, Hkv, D] views (paged_attention's
    k_new / v_new)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    k = qkv[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(-1, num_kv_heads, head_dim)
    return k, v


def rotary_split(qkv, cos, sin, num_heads: int, num_kv_heads: int, head_dim: int, cache=None, keep_k: bool = False,
                 kv_scales: tuple[float, float] = (1.0, 1.0), qk_norm: tuple | None = None):  # fmt: skip
    """qkv [T, (H + 2 Hkv) D], cos / sin [T, 1, D] (model dtype) -> q [T, H, D], k, v [T, Hkv, D].
    With cache = (k_cache, v_cache, slot_mapping) ([num_blocks, block_size, Hkv, D] each): k and v are written
    into their cache slots instead (aserve/kernels/cache_write.py's job, fused; negative slots write nothing) -> q.
    keep_k (with cache): the rotated k is also written back over qkv's k columns -> (q, k, v) with k and v views
    of qkv (qkv_kv_views: the step's rotated keys and values, for paged_attention's k_new / v_new). An FP8 cache
    (float8_e4m3fn) gets k / k_scale and v / v_scale (kv_scales), clamped to +-448 and rounded. qk_norm = (q_weight,
    k_weight, eps): each q and k head RMS-normalised before rotary, as qk_norm_ would (Qwen3), in the same launch."""
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    q_weight, k_weight, eps = qk_norm or (q, q, 0.0)  # (without qk_norm: unused)
    if cache is None:
        k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
        slots, stride_slot = q, 0
    else:
        k, v, slots = cache
        assert k.stride(1) == num_kv_heads * head_dim and k.stride(0) == k.shape[1] * k.stride(1)
        assert k.stride() == v.stride() and k.stride(-1) == 1
        stride_slot = k.stride(1)
    _rotary_split_kernel[(t,)](
        qkv, cos, sin, q, k, v, qkv.stride(0), cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads + num_kv_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads * head_dim), HALF=head_dim // 2, USE_PDL=pdl.ENABLED,
        WRITE_CACHE=cache is not None, slot_ptr=slots, stride_c_slot=stride_slot, KEEP_K=keep_k,
        k_scale=kv_scales[0], v_scale=kv_scales[1], QUANT=k.dtype != q.dtype,
        qw_ptr=q_weight, kw_ptr=k_weight, eps=eps, QK_NORM=qk_norm is not None, **pdl.launch_kwargs(),
    )  # fmt: skip
    if cache is None:
        return q, k, v
    return (q, *qkv_kv_views(qkv, num_heads, num_kv_heads, head_dim)) if keep_k else q


@triton.jit
def silu_mul_rounded(g, u, dtype: tl.constexpr):
    """float32 gate and up (values of `dtype`) -> silu(g) * u in `dtype`, rounded after the SiLU and after the
    product. Every kernel that fuses SiLU·mul (aserve/kernels/gemv.py, aserve/kernels/awq/) uses this, so they stay
    bit-identical to silu_and_mul below."""
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (act * u).to(dtype)


@triton.jit
def gelu_tanh_mul_rounded(g, u, dtype: tl.constexpr):
    """The same for Gemma's GeGLU: gelu_tanh(g) = g / 2 (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3), tanh
    from exp(-2 |z|) (no overflow)."""
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    act = (0.5 * g * (1.0 + tl.where(z < 0, -t, t))).to(dtype).to(tl.float32)
    return (act * u).to(dtype)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):  # fmt: skip
    pdl.gdc_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + offs, mask=ok, other=0.0).to(tl.float32)
    if GELU_TANH:
        out = gelu_tanh_mul_rounded(g, u, out_ptr.dtype.element_ty)
    else:
        out = silu_mul_rounded(g, u, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=ok)


def silu_and_mul(gate_up: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """gate_up [T, 2 I] -> act(gate) * up [T, I]: SiLU, or with gelu_tanh Gemma's GELU (aserve/kernels/gemma.py)."""
    rows, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _act_and_mul_kernel[(rows, triton.cdiv(n, block))](
        gate_up, out, n, gate_up.stride(0), out.stride(0), GELU_TANH=gelu_tanh, BLOCK=block, USE_PDL=pdl.ENABLED,
        **pdl.launch_kwargs(),
    )  # fmt: skip
    return out


@triton.jit
def _qk_norm_kernel(
    qkv_ptr, qw_ptr, kw_ptr, eps, stride_t, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ONE_PLUS_W: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.gdc_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then k heads
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    ptr = qkv_ptr + row * stride_t + head * HEAD_DIM + d
    x = tl.load(ptr, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, 0) / HEAD_DIM + eps)
    if head < NUM_HEADS:
        w = tl.load(qw_ptr + d, mask=ok, other=0.0).to(tl.float32)
    else:
        w = tl.load(kw_ptr + d, mask=ok, other=0.0).to(tl.float32)
    if ONE_PLUS_W:  # Gemma: (1 + w) in float32, one rounding at the end
        y = (xf * r * (1.0 + w)).to(x.dtype)
    else:  # rounded to the model's dtype, then times w
        y = head_norm_rounded(xf, r, w, x.dtype)
    tl.store(ptr, y, mask=ok)


def qk_norm_(qkv, q_weight, k_weight, eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
             one_plus_weight: bool = False) -> torch.Tensor:  # fmt: skip
    """qkv [T, (H + 2 Hkv) D]: each head of q (weight q_weight [D]) and of k (k_weight) RMS-normalised in place,
    v untouched -> qkv. One program per (token, head). one_plus_weight: Gemma's norm, x / rms(x) * (1 + w) in float32
    (aserve/kernels/gemma.py)."""
    assert qkv.stride(-1) == 1
    _qk_norm_kernel[(qkv.shape[0], num_heads + num_kv_heads)](
        qkv, q_weight, k_weight, eps, qkv.stride(0), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), ONE_PLUS_W=one_plus_weight, USE_PDL=pdl.ENABLED,
        **pdl.launch_kwargs(),
    )  # fmt: skip
    return qkv
