"""The CPU linear kernel (`radixkv.kernels.cpu_linear`) against `F.linear`: every tile shape of a
few rows (the 4 x 3, 3 x 4, 2 x 6 and 1 x 12 register tiles and the ragged weight rows past the
last block of 12), lengths off the vector width, fp32 and bf16 weights, a bias, strided rows,
threads, and the inputs it leaves to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixkv.kernels import cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason="no C compiler: linears run F.linear"
)


def _assert_as_close_as_torch(actual, x, w, bias=None) -> None:
    """`actual` is within a few times fp32 `F.linear`'s own rounding error of the exact product
    (the kernel sums in another order, so it cannot equal MKL's bits)."""
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    torch_error = (F.linear(x, w.float(), bias).double() - exact).abs().max().item()
    error = (actual.double() - exact).abs().max().item()
    assert error <= 4 * torch_error + 1e-6, (error, torch_error)


def _case(m: int, n: int, k: int, seed: int, weight_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(weight_dtype)
    bias = torch.randn(n, generator=gen)
    return x, w, bias


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize(("n", "k"), [(12, 16), (37, 45), (192, 576), (5, 3)])
def test_few_rows_equal_f_linear(m, n, k) -> None:
    x, w, bias = _case(m, n, k, seed=m * 1000 + n + k)
    assert cpu_linear.applies(x, w)
    _assert_as_close_as_torch(cpu_linear.linear(x, w, bias), x, w, bias)
    _assert_as_close_as_torch(cpu_linear.linear(x, w), x, w)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_bf16_weights_are_widened_exactly(m) -> None:
    x, w, bias = _case(m, 50, 70, seed=m, weight_dtype=torch.bfloat16)
    _assert_as_close_as_torch(cpu_linear.linear(x, w, bias), x, w, bias)


def test_bf16_activations_come_back_bf16() -> None:
    x, w, _ = _case(4, 24, 32, seed=1, weight_dtype=torch.bfloat16)
    x = x.to(torch.bfloat16)
    out = cpu_linear.linear(x, w)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.double(), w.double()).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def test_rows_of_a_wider_tensor_and_leading_dims() -> None:
    x, w, bias = _case(6, 30, 40, seed=2)
    wide = torch.randn(6, 100)
    wide[:, 10:50] = x
    strided = wide[:, 10:50]  # rows 100 apart
    _assert_as_close_as_torch(cpu_linear.linear(strided, w, bias), x, w, bias)
    batched = cpu_linear.linear(x.view(2, 3, 40), w, bias)
    assert batched.shape == (2, 3, 30)
    assert torch.equal(batched.view(6, 30), cpu_linear.linear(x, w, bias))


def test_threads_split_the_weight_rows_to_the_same_result() -> None:
    x, w, bias = _case(5, 301, 64, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_linear.linear(x, w, bias)
        torch.set_num_threads(2)
        two = cpu_linear.linear(x, w, bias)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output is one thread's sum, in the same order


def test_what_the_kernel_leaves_to_torch() -> None:
    x, w, bias = _case(cpu_linear.MAX_ROWS + 1, 20, 24, seed=4)
    assert not cpu_linear.applies(x, w)  # many rows: MKL's blocking wins
    assert torch.equal(cpu_linear.linear(x, w, bias), F.linear(x, w, bias))
    few = x[:4]
    assert not cpu_linear.applies(few, w.t().contiguous().t())  # a strided weight
    assert not cpu_linear.applies(few.half(), w.half())  # fp16
