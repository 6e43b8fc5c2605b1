"""The CPU bf16 GEMV (aserve/kernels/cpu.py) against a float32 matrix-vector product of the same bf16 values, and
through Linear (one-row inputs of a prepacked bf16 linear)."""

import pytest
import torch

from aserve.kernels import cpu
from aserve.layers.linear import Linear

pytestmark = pytest.mark.skipif(
    not cpu.gemv_supports(torch.empty(1, 32, dtype=torch.bfloat16)), reason="no compiler or no AVX512-BF16"
)


@pytest.mark.parametrize("n, k", [(16, 32), (960, 576), (37, 1536), (5, 64), (40, 14336), (17, 16384)])
def test_gemv_matches_reference(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(k, generator=gen).to(torch.bfloat16)
    got = cpu.gemv(w, x)
    expected = (w.float() @ x.float()).to(torch.bfloat16)  # float32 sums, another order: within a bf16 step or so
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=2**-7)


def test_rows_up_to_max_gemv_k():
    """Rows of up to cpu.MAX_GEMV_K (Llama-3-8B's and Mixtral's 14,336-long down projections), not longer."""
    assert cpu.gemv_supports(torch.empty(4, cpu.MAX_GEMV_K, dtype=torch.bfloat16))
    assert not cpu.gemv_supports(torch.empty(4, cpu.MAX_GEMV_K + 32, dtype=torch.bfloat16))


def test_linear_one_row_runs_the_kernel_and_matches_many_rows():
    gen = torch.Generator().manual_seed(0)
    lin = Linear(64, 48, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=gen))
        lin.bias.copy_(torch.randn(48, generator=gen))
    lin.process_weights_after_loading()
    assert lin.packed_weight is not None and lin.cpu_gemv
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        one = lin(x[1:2])
        many = lin(x)
    torch.testing.assert_close(one.float(), many[1:2].float(), atol=1e-2, rtol=2**-7)
