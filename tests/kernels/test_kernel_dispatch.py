"""The backend switch: CUDA tensors -> Triton, CPU tensors -> the compiled CPU kernels (the
reference where they cannot be built), `use_backend` overrides it; triton stays optional for the
CPU paths."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import radixkv.kernels as kernels
from radixkv.kernels import backend_for, cpu_attention, reference, use_backend
from radixkv.kernels import triton_paged_attention as triton_module

CPU_DEFAULT = "cpu" if cpu_attention.available() else "torch"


def test_default_backend_follows_the_device():
    assert backend_for(torch.device("cpu")) == CPU_DEFAULT
    assert backend_for(torch.device("cuda", 0)) == "triton"


def test_use_backend_overrides_and_restores():
    with use_backend("triton"):
        assert backend_for(torch.device("cpu")) == "triton"
        with use_backend("torch"):
            assert backend_for(torch.device("cuda")) == "torch"
        with use_backend(None):
            assert backend_for(torch.device("cpu")) == CPU_DEFAULT
        assert backend_for(torch.device("cpu")) == "triton"
    assert backend_for(torch.device("cpu")) == CPU_DEFAULT


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        (None, {"cpu": "cpu", "torch": "reference"}[CPU_DEFAULT]),
        ("torch", "reference"),
        pytest.param("cpu", "cpu", marks=pytest.mark.skipif(CPU_DEFAULT != "cpu", reason="no cc")),
        pytest.param("triton", "triton", marks=pytest.mark.interpreter),
    ],
)
def test_paged_attention_dispatch(paged_batch, monkeypatch, backend, expected):
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(reference, "paged_attention", spy("reference", reference.paged_attention))
    monkeypatch.setattr(cpu_attention, "paged_attention", spy("cpu", cpu_attention.paged_attention))
    monkeypatch.setattr(
        triton_module, "paged_attention", spy("triton", triton_module.paged_attention)
    )
    batch = paged_batch([17, 3], [1, 3], block_size=16, group=2)
    with use_backend(backend):
        out = kernels.paged_attention(*batch.args, num_kv_splits=2)
    assert calls == [expected]
    assert torch.isfinite(out).all()


def test_reference_path_works_without_triton(tmp_path):
    # Block `import triton` (as on a machine without it): importing the package and running the
    # reference kernels must work; asking for Triton must fail clearly; CUDA falls back to torch.
    script = textwrap.dedent(
        """
        import sys
        import radixkv.kernels as k
        assert "triton" not in sys.modules, "importing radixkv.kernels imported triton"
        sys.modules["triton"] = None  # any later `import triton` raises ImportError
        k.dispatch._triton_available.cache_clear()
        import torch
        cache = torch.zeros(4, 2, 1, 8)
        k.store_kv(torch.ones(3, 1, 8), torch.ones(3, 1, 8), cache, cache.clone(),
                   torch.tensor([0, 1, 2]))
        out = k.paged_attention(torch.ones(1, 2, 8), cache, cache, torch.tensor([[0, 1]],
                                dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                                torch.tensor([0, 1], dtype=torch.int32), 0.5)
        assert out.shape == (1, 2, 8)
        k.copy_blocks(cache, cache.clone(), torch.tensor([0]), torch.tensor([3]),
                      torch.tensor([2]))
        assert k.backend_for(torch.device("cuda")) == "torch"
        try:
            with k.use_backend("triton"):
                k.store_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, cache.clone(),
                           torch.tensor([0]))
        except RuntimeError as e:
            assert "triton" in str(e)
        else:
            raise AssertionError("the triton backend ran without triton")
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
