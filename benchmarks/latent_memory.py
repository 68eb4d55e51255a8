"""KV bytes per cached token: the paged latent cache against the expanded K / V layout.

Run from the repository root:
    .venv/bin/python benchmarks/latent_memory.py

For each MLA model shape (bf16; layers and heads of the installed transformers' config class
defaults, DeepSeek V3's being the released model's: 61 layers, 128 heads, kv_lora_rank 512,
rope 64, nope 128, v 128) it allocates the caches and divides their storage bytes by the tokens
they hold:

    latent    `LatentCacheSpec.allocate`, the tensor the engine keeps: [layers, blocks, block
              size, kv_lora_rank + qk_rope_head_dim]
    expanded  every head's key and value, as transformers' attention hands them out and as the
              engine's K / V cache lays them: K [layers, blocks, block size, heads, nope + rope]
              and V [..., heads, v_head_dim] (torch.empty: counted, never touched)

and prints both, their ratio (goal for DeepSeek V3: >= 60x fewer bytes for the latent layout)
and the latent layout against its floor `(kv_lora_rank + qk_rope_head_dim) x layers x dtype`
(goal: <= 1.05x).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from radixkv.engine.latent_attention import LatentCacheSpec
from radixkv.kernels import LatentDims

DTYPE = torch.bfloat16
MODELS = {  # label: transformers model type
    "DeepSeek V3 / R1, Kimi K2": "deepseek_v3",
    "GLM-4.7-Flash": "glm4_moe_lite",
    "Mistral 4": "mistral4",
    "MiniCPM3": "minicpm3",
}
GOAL_MODEL = "DeepSeek V3 / R1, Kimi K2"
MIN_RATIO = 60.0
MAX_OVER_FLOOR = 1.05


@dataclass(frozen=True, slots=True)
class MemoryResult:
    label: str
    num_layers: int
    dims: LatentDims
    latent_bytes_per_token: float
    expanded_bytes_per_token: float

    @property
    def floor(self) -> int:
        return self.dims.latent_dim * self.num_layers * DTYPE.itemsize

    @property
    def ratio(self) -> float:
        return self.expanded_bytes_per_token / self.latent_bytes_per_token


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def measure(label: str, model_type: str, block_size: int, num_blocks: int) -> MemoryResult:
    config = AutoConfig.for_model(model_type)
    dims = LatentDims(
        config.num_attention_heads,
        config.kv_lora_rank,
        config.qk_rope_head_dim,
        config.qk_nope_head_dim,
        config.v_head_dim,
    )
    layers, tokens = config.num_hidden_layers, num_blocks * block_size
    spec = LatentCacheSpec(layers, dims.latent_dim, block_size, DTYPE)
    latent = spec.allocate(num_blocks, "cpu")
    assert spec.bytes_per_block * num_blocks == _storage_bytes(latent)
    per_head = (layers, num_blocks, block_size, dims.num_heads)
    k = torch.empty((*per_head, dims.qk_nope_head_dim + dims.qk_rope_head_dim), dtype=DTYPE)
    v = torch.empty((*per_head, dims.v_head_dim), dtype=DTYPE)
    expanded = _storage_bytes(k) + _storage_bytes(v)
    return MemoryResult(label, layers, dims, _storage_bytes(latent) / tokens, expanded / tokens)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"# bf16, block size {args.block_size}, {args.num_blocks} blocks allocated per layout")
    print("| model | layers | heads | latent B/token | floor B/token | expanded B/token | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    goal = None
    for label, model_type in MODELS.items():
        r = measure(label, model_type, args.block_size, args.num_blocks)
        goal = r if label == GOAL_MODEL else goal
        print(
            f"| {label} | {r.num_layers} | {r.dims.num_heads} | {r.latent_bytes_per_token:,.0f} | "
            f"{r.floor:,} | {r.expanded_bytes_per_token:,.0f} | {r.ratio:.1f}x |"
        )
    assert goal is not None
    over_floor = goal.latent_bytes_per_token / goal.floor
    print(
        f"# {GOAL_MODEL}: expanded / latent = {goal.ratio:.1f}x (goal >= {MIN_RATIO:.0f}x): "
        f"{'met' if goal.ratio >= MIN_RATIO else 'MISSED'}; latent / floor = {over_floor:.3f}x "
        f"(goal <= {MAX_OVER_FLOOR}x): {'met' if over_floor <= MAX_OVER_FLOOR else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
