"""What KV written by this engine depends on: the fingerprint every disk-tier file carries.

KV of a prefix is a function of the model (its config and weights), of how the engine computes
and stores it (dtype, device type, the versions of torch and transformers: their kernels round
differently) and of the block layout (block size, layers, heads, head size, the host block
layout). Two processes whose fingerprints are equal can use each other's block files; any
difference, and `DiskStore` keeps the files apart (another folder) and never loads one of them.

The weights' identity is a digest of every tensor's name, shape, dtype and a sample of its values
(`SAMPLES_PER_TENSOR` evenly spaced elements): cheap for any model size and on any device, and any
fine-tune or other checkpoint of the same architecture changes it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import transformers

from radixkv.engine.tiers.disk_store import FORMAT_VERSION

SAMPLES_PER_TENSOR = 256
# Config keys that say how a model was saved or loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype")
HOST_BLOCK_LAYOUT = "[layers, K/V, block_size, kv_heads, head_dim]"
# The host block of each KV layout (`radixkv.engine.step.kv_tensors.GroupKV.layout`).
HOST_BLOCK_LAYOUTS = {
    "kv": HOST_BLOCK_LAYOUT,
    "latent": "[layers, latent | k_pe, block_size, 1, kv_lora_rank + qk_rope_head_dim]",
}


def kv_fingerprint(
    model: Any,
    *,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_layout: str = "kv",
) -> dict[str, Any]:
    """The fingerprint of the KV `model` produces in blocks of this shape and layout (a key of
    HOST_BLOCK_LAYOUTS; a latent layout counts as one KV head of the latent's width), as a
    JSON-serialisable dict."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    config = {
        k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS
    }
    return {
        "format": FORMAT_VERSION,
        "config": config,
        "weights": weights_digest(model),
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": block_size,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "block_layout": HOST_BLOCK_LAYOUTS[kv_layout],
        "device": device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


@torch.inference_mode()
def weights_digest(model: Any) -> str:
    """blake2b-128 (hex) of every state tensor's name, shape, dtype and sampled values."""
    digest = hashlib.blake2b(digest_size=16)
    samples = []
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype};".encode())
        flat = tensor.detach().reshape(-1)
        n = flat.numel()
        if n:
            k = min(SAMPLES_PER_TENSOR, n)
            index = torch.arange(k, device=flat.device) * (n - 1) // max(k - 1, 1)
            samples.append(flat[index].to(torch.float64))  # exact for the float dtypes of weights
    if samples:
        digest.update(torch.cat(samples).cpu().numpy().tobytes())  # one device sync
    return digest.hexdigest()
