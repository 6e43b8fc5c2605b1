"""CPU, bf16: the forward of a one-token step (batch-1 decode) as a flat loop of C kernel calls through raw pointers.

At batch 1 on a 2-core CPU the layer's arithmetic is small: what the module forward adds on top of it (module calls,
~10 tensor allocations, an index_copy_ per cache, the attention backend's checks) cost about as much as the weight
streaming itself. Here every buffer is allocated once, and a layer is nine C calls with the same kernels the module
forward runs (so the same roundings):

    add_rms_norm -> gemv qkv -> rotary_split (k / v written straight into their cache slot) -> paged attention
    -> gemv o -> add_rms_norm -> gemv gate_up -> silu_mul -> gemv down

With an FP8 KV cache (`--kv-cache-dtype fp8`) rotary_split writes k / v into buffers, fp8_write_kv quantises them
into their slot with the layer's k_scale / v_scale (the rounding of FP8KVCache.write), and attention is the C decode
kernel over e4m3 pages.

It runs over the model's own modules: each call reads the current weight of every norm and linear (a pointer per
weight, ~20 us a step for 30 layers), so weights replaced after it was built are the ones it uses, as the module
forward would. Built by LlamaForCausalLM.process_weights_after_loading where every piece applies (bf16, no biases,
the C kernels compiled, AVX512-BF16 for the GEMV, the CPU attention backend), which decides that again whenever it
runs; used for every step of one token (which that backend runs on its decode kernel).

The linears' GEMV is the bf16 one, or with `--quantization int8` (every decoder linear int8, aserve/layers/
quantization/int8.py) gemm_int8 over the int8 weights and their scales, or in deterministic mode (aserve/layers/
batch_invariant.py) gemm_rows over the packed weights, the kernel those linears run at every row count: chosen once,
when this is built.
"""

from __future__ import annotations

import torch

from aserve.kernels import cpu
from aserve.layers.attention.torch_backend import CPUAttentionBackend
from aserve.layers.linear import Linear, UnquantizedLinearMethod


class OneTokenForward:
    def __init__(self, model) -> None:
        attn0 = model.layers[0].self_attn
        self.H, self.Hkv, self.D = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        self.hidden = model.config.hidden_size
        self.inter = model.layers[0].mlp.intermediate_size
        self.eps = [(layer.input_layernorm.eps, layer.post_attention_layernorm.eps) for layer in model.layers]
        self.windows = [layer.self_attn.attn_params.sliding_window or 0 for layer in model.layers]  # 0: none
        # Per layer, the parameter tables of the modules whose weights a step reads, in call order. A module's table
        # holds its current parameters (assigning module.weight replaces the entry), and reading it directly costs
        # ~0.1 us where nn.Module's attribute lookup costs ~0.5 us. Deterministic mode's linears (rows_packed) are
        # read from their attribute tables instead: gemm_rows runs over their packed_weight.
        rows = getattr(model.layers[0].self_attn.qkv_proj, "rows_packed", False)
        self.params = [
            tuple(
                m.__dict__ if rows and isinstance(m, Linear) else m._parameters
                for m in (
                    layer.input_layernorm,
                    layer.self_attn.qkv_proj,
                    layer.self_attn.o_proj,
                    layer.post_attention_layernorm,
                    layer.mlp.gate_up_proj,
                    layer.mlp.down_proj,
                )
            )  # fmt: skip
            for layer in model.layers
        ]
        qkv = (self.H + 2 * self.Hkv) * self.D
        buf = {"x": self.hidden, "res": self.hidden, "h": self.hidden, "qkv": qkv, "q": self.H * self.D,
               "k": self.Hkv * self.D, "v": self.Hkv * self.D, "attn": self.H * self.D, "gu": 2 * self.inter,
               "sm": self.inter}  # fmt: skip
        self.buf = {k: torch.zeros(n, dtype=torch.bfloat16) for k, n in buf.items()}
        self.ptr = {k: v.data_ptr() for k, v in self.buf.items()}
        self.lib = cpu.library()  # the extension's raw entry points
        int8 = model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
        self.gemv = self._gemv_rows if rows else self._gemv_int8 if int8 else self._gemv_bf16
        # The KV cache's element type: bf16, or FP8 with each layer's scales (read at every step, as the module forward
        # reads its AttentionParams).
        self.kv = model.backend.kv
        self.kv_dtype = self.kv.cache_dtype(torch.bfloat16)
        self.attns = [layer.self_attn for layer in model.layers]
        self.rotary_attention = self._rotary_attention_fp8 if self.kv.quantized else self._rotary_attention

    @staticmethod
    def applies(model) -> bool:
        """Every layer bf16, without biases, with its linears unquantised (or all int8) and on a C GEMV; the
        element-wise kernels in C, and attention on the C decode kernel (a bf16 or FP8 cache)."""
        if not (len(model.layers) and model.ops.kind == "native" and isinstance(model.backend, CPUAttentionBackend)):
            return False
        weight_dtypes = set()
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not isinstance(m.quant_method, UnquantizedLinearMethod) or m.bias is not None:
                    return False
                if not (m.cpu_gemv or getattr(m, "rows_packed", False)):
                    return False
                weight_dtypes.add(m.weight.dtype)
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if norm.weight.dtype != torch.bfloat16:
                    return False
        return attn.head_dim <= cpu.MAX_ATTENTION_HEAD_DIM and len(weight_dtypes) == 1

    def _gemv_bf16(self, table: dict, x: int, y: int, n: int, k: int, nt: int) -> None:
        self.lib.gemv_bf16(table["weight"].data_ptr(), x, y, n, k, nt)

    def _gemv_rows(self, table: dict, x: int, y: int, n: int, k: int, nt: int) -> None:
        self.lib.gemm_rows(table["packed_weight"].data_ptr(), x, y, 1, n, k, k, n, 1, nt)

    def _gemv_int8(self, table: dict, x: int, y: int, n: int, k: int, nt: int) -> None:
        self.lib.gemm_int8(table["weight"].data_ptr(), table["weight_scale"].data_ptr(), x, y, 1, n, k, k, n, 1, nt, 0)

    def _rotary_attention(self, i: int, k_cache: int, v_cache: int, slot_off: int, step: tuple) -> None:
        """Layer i's rotary, k / v written straight into their cache slot, and attention (a bf16 cache)."""
        lib, p, H, Hkv, D = self.lib, self.ptr, self.H, self.Hkv, self.D
        cos_p, sin_p, cs_stride, bt_ptr, bt_stride, sl_ptr, block_size, nt = step
        lib.rotary_split(p["qkv"], cos_p, sin_p, p["q"], k_cache + slot_off, v_cache + slot_off, 1, H, Hkv, D,
                         (H + 2 * Hkv) * D, cs_stride, 1, nt)  # fmt: skip
        lib.paged_decode_attention(p["q"], k_cache, v_cache, bt_ptr, sl_ptr, p["attn"], 1, H, Hkv, D, block_size,
                                   bt_stride, H * D, H * D, D**-0.5, 1, nt, 0, self.windows[i], 0.0)  # fmt: skip

    def _rotary_attention_fp8(self, i: int, k_cache: int, v_cache: int, slot_off: int, step: tuple) -> None:
        """The same over an FP8 cache: k / v rotated into buffers, quantised into their slot with the layer's scales
        (as FP8KVCache.write), and attention over the e4m3 pages."""
        lib, p, H, Hkv, D = self.lib, self.ptr, self.H, self.Hkv, self.D
        cos_p, sin_p, cs_stride, bt_ptr, bt_stride, sl_ptr, block_size, nt = step
        k_scale, v_scale = self.kv.scales(self.attns[i].attn_params)
        lib.rotary_split(p["qkv"], cos_p, sin_p, p["q"], p["k"], p["v"], 1, H, Hkv, D, (H + 2 * Hkv) * D, cs_stride,
                         1, nt)  # fmt: skip
        lib.fp8_write_kv(p["k"], p["v"], k_cache + slot_off, v_cache + slot_off, Hkv * D, k_scale, v_scale, 1)
        lib.paged_decode_attention_fp8(p["q"], k_cache, v_cache, bt_ptr, sl_ptr, p["attn"], 1, H, Hkv, D, block_size,
                                       bt_stride, H * D, H * D, D**-0.5, k_scale, v_scale, 1, nt, 0, self.windows[i],
                                       0.0)  # fmt: skip

    def __call__(self, x, cos, sin, kv_caches: torch.Tensor, meta, num_layers: int | None) -> torch.Tensor:
        """x [1, hidden] (the token's embedding), cos / sin [1, 1, D], kv_caches [layers, 2, blocks, block_size,
        Hkv, D] -> x + residual after the layers [1, hidden] (as LlamaForCausalLM.forward)."""
        lib, p, gemv, rotary_attention = self.lib, self.ptr, self.gemv, self.rotary_attention
        H, Hkv, D, hidden, inter = self.H, self.Hkv, self.D, self.hidden, self.inter
        qkv_rows = (H + 2 * Hkv) * D
        nt = torch.get_num_threads()
        assert kv_caches.is_contiguous() and kv_caches.dtype == self.kv_dtype and cos.stride(-1) == 1
        block_size, size = kv_caches.shape[3], kv_caches.element_size()
        layer_stride, kv_stride = kv_caches.stride(0) * size, kv_caches.stride(1) * size  # bytes
        slot_off = int(meta.slot_mapping[0]) * Hkv * D * size
        cache0 = kv_caches.data_ptr()
        bt, seq_lens = meta.block_tables, meta.seq_lens
        step = (cos.data_ptr(), sin.data_ptr(), cos.stride(0), bt.data_ptr(), bt.stride(0), seq_lens.data_ptr(),
                block_size, nt)  # fmt: skip
        self.buf["res"].copy_(x[0])
        for i, (t_ln1, t_qkv, t_o, t_ln2, t_gu, t_down) in enumerate(self.params[:num_layers]):
            ln1, ln2 = t_ln1["weight"].data_ptr(), t_ln2["weight"].data_ptr()
            eps1, eps2 = self.eps[i]
            if i == 0:  # no residual yet: h = norm(x), residual = x
                lib.add_rms_norm(p["res"], p["res"], ln1, p["h"], p["res"], 1, hidden, eps1, 0, 1, nt)
            else:
                lib.add_rms_norm(p["x"], p["res"], ln1, p["h"], p["res"], 1, hidden, eps1, 1, 1, nt)
            gemv(t_qkv, p["h"], p["qkv"], qkv_rows, hidden, nt)
            k_cache = cache0 + i * layer_stride
            v_cache = k_cache + kv_stride
            rotary_attention(i, k_cache, v_cache, slot_off, step)
            gemv(t_o, p["attn"], p["x"], hidden, H * D, nt)
            lib.add_rms_norm(p["x"], p["res"], ln2, p["h"], p["res"], 1, hidden, eps2, 1, 1, nt)
            gemv(t_gu, p["h"], p["gu"], 2 * inter, hidden, nt)
            lib.silu_mul(p["gu"], p["sm"], 1, inter, 1, nt)
            gemv(t_down, p["sm"], p["x"], hidden, inter, nt)
        return (self.buf["x"] + self.buf["res"]).unsqueeze(0)
