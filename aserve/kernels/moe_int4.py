"""Fused mixture-of-experts over int4 experts (AWQ / GPTQ checkpoints kept packed: the layout and the pure-torch
reference are aserve/kernels/moe_int4_reference.py), weight-only: the activations stay 16-bit (or float32), each
weight tile is dequantised in registers as it loads, (q - z) * s in float32 (exact), then used as the 16-bit experts'
tiles are. The two paths of the 16-bit experts, with the same routing and rounding:

    many tokens   aserve/kernels/moe_align.py's routing and grouping by expert (route_and_align, sorted_slots),
                  then one grouped GEMM per projection: a K tile of the expert's packed bytes [BLOCK_N, BLOCK_K / 2]
                  (loaded as the 16-bit tiles are, pipelined), its low and high nibbles dequantised with the group's
                  zero points and scales [BLOCK_N], joined into [BLOCK_N, BLOCK_K] (inputs 2i, 2i + 1) and rounded
                  to the activations' dtype, transposed for tl.dot (so the products are those of the 16-bit stacks a
                  dequantising load would make); SiLU·mul / routing weights in the epilogues
    few tokens    (moe_decode.use_decode) the two kernels of aserve/kernels/moe_decode.py, each program streaming
                  its output rows' packed bytes along K: the low nibbles times the even inputs, the high nibbles
                  times the odd ones (16-bit inputs read as one 32-bit word per pair), float32 products ((q - z) * x
                  summed per byte, times the group's scale)

Nibbles become floats without int-to-float conversions (_mantissa: OR-ed into the mantissa of 2**23, as the dense
AWQ kernels do, aserve/kernels/awq/unpack.py), so the weights cost an AND, an OR and float arithmetic each.

The grouped GEMMs' BLOCK_K divides the group size (every K tile lies in one group: one zero point and scale per
output row and tile), so the group size must be a multiple of 16 (tl.dot's K; the layer keeps other checkpoints
dequantised, aserve/layers/quantization/int4_moe.py); the few-token kernels' K tile may also span several whole
groups (pieces of TILE_G inputs, a zero point and scale each). bench/moe_int4.py times these kernels against the
16-bit ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from aserve.kernels import moe, moe_align, moe_decode, pdl
from aserve.kernels.fused import silu_mul_rounded
from aserve.kernels.moe import grouped_tile, store_tile
from aserve.kernels.moe_decode import slot_rows, sum_slots
from aserve.kernels.moe_int4_reference import Int4Experts
from aserve.kernels.moe_routing import slot_expert

# Launch configurations, read when the kernels are called (bench/moe_int4.py --tune sets them). The grouped GEMMs: the
# 16-bit kernels' (not tuned for int4 tiles), BLOCK_K capped at the group size. The few-token kernels: the fastest of
# bench/moe_int4.py --tune's grid at one token on an H200 (Qwen3-30B-A3B shape, group 128, 2026-12-03: the layer
# 37.4 -> 30.7 us, as fast as its bf16 experts; at 4 tokens 70.1 us against bf16's 89.6).
SMALL_CONFIG, LARGE_CONFIG = moe.SMALL_CONFIG, moe.LARGE_CONFIG  # the grouped GEMMs: few / many tokens per expert
GATE_UP = dict(BLOCK_N=8, BLOCK_K=128, num_warps=4, num_stages=2)
DOWN = dict(BLOCK_N=4, BLOCK_K=128, num_warps=4, num_stages=2)


def moe_config(num_slots: int, num_experts: int) -> dict:
    """The grouped GEMMs' launch configuration for T * k = num_slots routed rows (as moe.moe_config chooses)."""
    return SMALL_CONFIG if num_slots <= 16 * num_experts else LARGE_CONFIG


@triton.jit
def _mantissa(v, nibble):
    """float32 2**23 + q * 16**i for the nibble q of the bytes v (int32) that `nibble` (0x0F: i = 0, 0xF0: i = 1, or
    a tensor of them) masks: the nibble OR-ed into the mantissa of 2**23, exactly, with no int-to-float conversion
    (as aserve/kernels/awq/unpack.py does)."""
    return ((v & nibble) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _int4_tile(q_ptrs, z_ptrs, s_ptrs, g, dtype: tl.constexpr):
    """The weights (q - z) * s of one K tile inside group g, transposed: [BLOCK_N, BLOCK_K] in `dtype`. q_ptrs
    [BLOCK_N, BLOCK_K / 2]: the bytes holding them (input 2i in byte i's low nibble, 2i + 1 in its high one); z_ptrs /
    s_ptrs [BLOCK_N]: the output rows' zero points and scales of group 0. 16 (q - z) and s / 16 are exact in float32,
    and so is their product."""
    v = tl.load(q_ptrs).to(tl.int32)
    z = tl.load(z_ptrs + g).to(tl.float32)[:, None]
    s = tl.load(s_ptrs + g).to(tl.float32)[:, None]
    even = (_mantissa(v, 0x0F) - (8388608.0 + z)) * s
    odd = (_mantissa(v, 0xF0) - (8388608.0 + 16.0 * z)) * (s * 0.0625)
    w = tl.join(even.to(dtype), odd.to(dtype))  # [BLOCK_N, BLOCK_K / 2, 2]: input 2i + j at [n, i, j]
    return tl.reshape(w, [w.shape[0], w.shape[1] * 2])


@triton.jit
def _grouped_gemm_int4_kernel(a_ptr, q_ptr, z_ptr, s_ptr, c_ptr, weights_ptr, sorted_slots_ptr, block_experts_ptr,
                              num_slots, N, K, num_blocks, stride_a, stride_qe, stride_qn, stride_ze, stride_zn,
                              stride_c, NUM_EXPERTS: tl.constexpr, ROW_DIV: tl.constexpr, GATED: tl.constexpr,
                              WEIGHTED: tl.constexpr, IEEE: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr):  # fmt: skip
    """moe.py's _grouped_gemm_kernel over packed experts: c[slot, n] = a[slot // ROW_DIV] . W[expert, n] for the
    BLOCK_M slots of one block and BLOCK_N outputs (q_ptr: the packed weights as bytes [E, N (GATED: 2N), K/2];
    z_ptr / s_ptr: zero points and scales [E, rows, K/GROUP]). GATED / WEIGHTED as there; float32 accumulators;
    padding rows read row 0 and are never stored."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), N, num_blocks, GROUP_M, BLOCK_N)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= NUM_EXPERTS:
        return
    slots = tl.load(sorted_slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = tl.where(valid, slots // ROW_DIV, 0).to(tl.int64)
    offs_n = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)  # past N: earlier columns, never stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    q_ptrs = q_ptr + expert.to(tl.int64) * stride_qe + offs_n[:, None] * stride_qn + tl.arange(0, BLOCK_K // 2)[None, :]
    z_ptrs = z_ptr + expert.to(tl.int64) * stride_ze + offs_n * stride_zn
    s_ptrs = s_ptr + expert.to(tl.int64) * stride_ze + offs_n * stride_zn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs)
        g = k0 // GROUP
        b = tl.trans(_int4_tile(q_ptrs, z_ptrs, s_ptrs, g, a.dtype))
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if GATED:
            u = tl.trans(_int4_tile(q_ptrs + N * stride_qn, z_ptrs + N * stride_zn, s_ptrs + N * stride_zn, g,
                                    a.dtype))  # fmt: skip
            if IEEE:
                acc_up = tl.dot(a, u, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, u, acc_up)
        a_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 2
    store_tile(c_ptr, acc, acc_up, weights_ptr, slots, valid, pid_n, N, stride_c, GATED, WEIGHTED, BLOCK_N)


def _block_k(block_k: int, group_size: int) -> int:
    """The largest power of two <= block_k that divides the group size (module docstring)."""
    assert group_size % 16 == 0, f"int4 experts: group size {group_size} is not a multiple of 16"
    while group_size % block_k:
        block_k //= 2
    return block_k


def _check(w: Int4Experts) -> None:
    assert w.qweight.is_contiguous() and w.qzeros.is_contiguous() and w.scales.is_contiguous()
    assert w.qzeros.shape == w.scales.shape and w.qzeros.dtype == torch.uint8


def grouped_gemm(a, b: Int4Experts, out, sorted_slots, block_experts, block_m: int, config: dict, row_div: int,
                 gated: bool, weights=None) -> torch.Tensor:  # fmt: skip
    """moe.grouped_gemm over packed experts b ([E, N (gated: 2N), K] in moe_int4_reference's layout). Returns out."""
    _check(b)
    cfg = dict(config)
    num_experts, n_rows, k = b.shape
    n = n_rows // 2 if gated else n_rows
    assert a.stride(-1) == 1 and out.stride(-1) == 1 and out.shape[1] == n and a.shape[1] == k
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], max(16, triton.next_power_of_2(n)))  # small shapes (tests): no idle tiles
    cfg["BLOCK_K"] = _block_k(cfg["BLOCK_K"], b.group_size)
    num_blocks = block_experts.numel()
    assert sorted_slots.numel() == num_blocks * block_m, "route_and_align ran with another BLOCK_M"
    q = b.qweight.view(torch.uint8)
    grid = (num_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)
    _grouped_gemm_int4_kernel[grid](
        a, q, b.qzeros, b.scales, out, weights if weights is not None else out, sorted_slots, block_experts,
        out.shape[0], n, k, num_blocks, a.stride(0), q.stride(0), q.stride(1), b.qzeros.stride(0),
        b.qzeros.stride(1), out.stride(0), NUM_EXPERTS=num_experts, ROW_DIV=row_div, GATED=gated,
        WEIGHTED=weights is not None, IEEE=a.dtype == torch.float32, GROUP=b.group_size, BLOCK_M=block_m, **cfg,
    )  # fmt: skip
    return out


@triton.jit
def _input_pairs(rows, offs):
    """The inputs 2i and 2i + 1 as float32 (x_even, x_odd) for the offsets i (`offs`) of pairs from the row starts
    `rows`: 16-bit inputs as one 32-bit word per pair (no shuffle of a loaded tile), float32 ones as two loads."""
    dtype: tl.constexpr = rows.dtype.element_ty
    if dtype == tl.float32:
        return tl.load(rows + 2 * offs), tl.load(rows + 2 * offs + 1)
    pairs = tl.load(rows.to(tl.pointer_type(tl.int32)) + offs)  # little-endian: input 2i in the low half
    if dtype == tl.bfloat16:
        return (pairs << 16).to(tl.float32, bitcast=True), (pairs & -65536).to(tl.float32, bitcast=True)
    lo = (pairs & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _int4_row_dots(a_rows, q_rows, zs_rows, z_ptr, s_ptr, K, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                   TILE_G: tl.constexpr):  # fmt: skip
    """Σ_k a[r, k] W[r, k] for the rows r whose inputs a_rows and packed bytes q_rows [R] point to (zs_rows [R]:
    the offsets of their zero points and scales in z_ptr / s_ptr): float32 [R]. A K tile is BLOCK_K // TILE_G
    pieces of TILE_G inputs, each inside one group (TILE_G = min(GROUP, BLOCK_K))."""
    NG: tl.constexpr = BLOCK_K // TILE_G
    HALF: tl.constexpr = TILE_G // 2
    R: tl.constexpr = a_rows.shape[0]
    piece = tl.arange(0, NG)
    pairs = (piece * HALF)[:, None] + tl.arange(0, HALF)[None, :]  # [NG, HALF]: the tile's bytes / input pairs
    acc = tl.zeros([R, NG, HALF], dtype=tl.float32)
    for k_tile in range(0, K, BLOCK_K):
        k0 = tl.multiple_of(k_tile, BLOCK_K)
        b = tl.load(q_rows[:, None, None] + k0 // 2 + pairs[None, :, :], eviction_policy="evict_first")
        b = b.to(tl.int32)
        x_even, x_odd = _input_pairs(a_rows[:, None, None] + k0, pairs[None, :, :])
        g = zs_rows[:, None] + ((k0 + piece * TILE_G) // GROUP)[None, :]  # [R, NG]
        z = tl.load(z_ptr + g).to(tl.float32)[:, :, None]
        s = tl.load(s_ptr + g).to(tl.float32)[:, :, None]
        lo = _mantissa(b, 0x0F) - (8388608.0 + z)  # q - z of the even inputs
        hi = _mantissa(b, 0xF0) - (8388608.0 + 16.0 * z)  # 16 (q - z) of the odd ones
        acc += (lo * x_even + hi * (x_odd * 0.0625)) * s
    return tl.sum(tl.sum(acc, 2), 1)


@triton.jit
def _gate_up_int4_kernel(x_ptr, logits_ptr, q_ptr, z_ptr, s_ptr, act_ptr, ids_ptr, weights_ptr, N, K, E, stride_x,
                         stride_l, stride_qe, stride_qn, stride_ze, stride_zn, stride_act, TOP_K: tl.constexpr,
                         K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                         GROUP: tl.constexpr, TILE_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_PDL: tl.constexpr):  # fmt: skip
    """moe_decode.py's _gate_up_kernel over packed experts (q_ptr: bytes [E, 2N, K/2])."""
    pdl.gdc_sync(USE_PDL)
    slot = tl.program_id(1)
    token = slot // TOP_K
    expert = slot_expert(logits_ptr, ids_ptr, weights_ptr, slot, E, stride_l, TOP_K, K_PAD, RENORMALIZE, BLOCK_E)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # past N: clamped, never stored
    gate_rows = q_ptr + expert.to(tl.int64) * stride_qe + rows * stride_qn
    gate_zs = expert.to(tl.int64) * stride_ze + rows * stride_zn
    x_rows = x_ptr + token.to(tl.int64) * stride_x + tl.zeros([BLOCK_N], dtype=tl.int64)
    gate = _int4_row_dots(x_rows, gate_rows, gate_zs, z_ptr, s_ptr, K, GROUP, BLOCK_K, TILE_G)
    up = _int4_row_dots(x_rows, gate_rows + N * stride_qn, gate_zs + N * stride_zn, z_ptr, s_ptr, K, GROUP, BLOCK_K,
                        TILE_G)  # fmt: skip
    dtype = act_ptr.dtype.element_ty
    out = silu_mul_rounded(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
    tl.store(act_ptr + slot.to(tl.int64) * stride_act + offs_n, out, mask=offs_n < N)


@triton.jit
def _down_sum_int4_kernel(act_ptr, q_ptr, z_ptr, s_ptr, out_ptr, ids_ptr, weights_ptr, N, K, stride_act, stride_qe,
                          stride_qn, stride_ze, stride_zn, stride_out, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                          GROUP: tl.constexpr, TILE_G: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """moe_decode.py's _down_sum_kernel over packed experts (q_ptr: bytes [E, N, K/2]): the k slots' rows in one
    [K_PAD * BLOCK_N, BLOCK_K] tile."""
    pdl.gdc_sync(USE_PDL)
    token = tl.program_id(1)
    slot, used, expert, rows = slot_rows(ids_ptr, token, N, TOP_K, K_PAD, BLOCK_N)
    y = _int4_row_dots(act_ptr + slot.to(tl.int64) * stride_act, q_ptr + expert * stride_qe + rows * stride_qn,
                       expert * stride_ze + rows * stride_zn, z_ptr, s_ptr, K, GROUP, BLOCK_K, TILE_G)  # fmt: skip
    sum_slots(out_ptr, y, used, weights_ptr, slot, token, N, stride_out, K_PAD, BLOCK_N)


def _decode_tiles(config: dict, n: int, k: int, group_size: int) -> dict:
    """config's tiles for n outputs of k inputs: BLOCK_N narrowed to small shapes (tests), BLOCK_K the largest power
    of two <= its own that divides K and divides the group size or is a multiple of it; TILE_G."""
    cfg = dict(config)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], triton.next_power_of_2(n))
    bk = cfg["BLOCK_K"]
    while k % bk or (group_size % bk if bk <= group_size else bk % group_size):
        bk //= 2
    assert bk >= 16, f"int4 experts: group size {group_size} is not a multiple of 16"
    cfg["BLOCK_K"], cfg["TILE_G"] = bk, min(bk, group_size)
    return cfg


def gate_up(x, router_logits, w13: Int4Experts, top_k: int, renormalize: bool, config: dict | None = None):
    """moe_decode.gate_up over packed experts w13 [E, 2 I, H] -> (act [T k, I], weights float32 [T, k], ids int32
    [T, k]); `config`: the launch configuration (None: GATE_UP)."""
    _check(w13)
    t, e = router_logits.shape
    _, two_i, h = w13.shape
    n = two_i // 2
    assert x.stride(-1) == 1 and x.shape[1] == h
    act = torch.empty(t * top_k, n, dtype=x.dtype, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=x.device)
    cfg = _decode_tiles(config or GATE_UP, n, h, w13.group_size)
    q = w13.qweight.view(torch.uint8)
    _gate_up_int4_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), t * top_k)](
        x, router_logits, q, w13.qzeros, w13.scales, act, ids, weights, n, h, e, x.stride(0),
        router_logits.stride(0), q.stride(0), q.stride(1), w13.qzeros.stride(0), w13.qzeros.stride(1),
        act.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        BLOCK_E=triton.next_power_of_2(e), GROUP=w13.group_size, USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(), **cfg,
    )  # fmt: skip
    return act, weights, ids


def down_sum(act, w2: Int4Experts, ids, weights, config: dict | None = None) -> torch.Tensor:
    """moe_decode.down_sum over packed experts w2 [E, H, I] -> out [T, H]; `config`: the launch configuration
    (None: DOWN)."""
    _check(w2)
    t, top_k = ids.shape
    _, h, i = w2.shape
    assert act.stride(-1) == 1 and act.shape[1] == i
    out = torch.empty(t, h, dtype=act.dtype, device=act.device)
    cfg = _decode_tiles(config or DOWN, h, i, w2.group_size)
    q = w2.qweight.view(torch.uint8)
    _down_sum_int4_kernel[(triton.cdiv(h, cfg["BLOCK_N"]), t)](
        act, q, w2.qzeros, w2.scales, out, ids, weights, h, i, act.stride(0), q.stride(0), q.stride(1),
        w2.qzeros.stride(0), w2.qzeros.stride(1), out.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        GROUP=w2.group_size, USE_PDL=pdl.ENABLED, **pdl.launch_kwargs(), **cfg,
    )  # fmt: skip
    return out


def fused_moe(x, router_logits, w13: Int4Experts, w2: Int4Experts, top_k: int, renormalize: bool,
              config: dict | None = None, fixed_order_sum: bool = False) -> torch.Tensor:  # fmt: skip
    """moe.fused_moe over packed experts: x [T, H], router logits [T, E], w13 [E, 2I, H] (gate rows, then up rows),
    w2 [E, H, I] -> [T, H]. `config`: the grouped GEMMs' launch configuration; None: chosen by the number of slots
    (moe_config), and a few tokens (moe_decode.use_decode) take the few-token kernels instead.
    fixed_order_sum: as moe.fused_moe's (deterministic mode)."""
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    if config is None and moe_decode.use_decode(t, top_k, num_experts):
        act, weights, ids = gate_up(x, router_logits, w13, top_k, renormalize)
        return down_sum(act, w2, ids, weights)
    cfg = config or moe_config(t * top_k, num_experts)
    routing = moe_align.route_and_align(router_logits, top_k, renormalize, cfg["BLOCK_M"])
    weights, _, sorted_slots, block_experts = routing
    act = torch.empty(t * top_k, two_i // 2, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, act, sorted_slots, block_experts, cfg["BLOCK_M"], cfg["gate_up"], top_k, gated=True)
    out = torch.empty(t * top_k, h, dtype=x.dtype, device=x.device)
    grouped_gemm(act, w2, out, sorted_slots, block_experts, cfg["BLOCK_M"], cfg["down"], 1, False, weights)
    out = out.view(t, top_k, h)
    return moe.ordered_sum(out) if fixed_order_sum else out.sum(1)
