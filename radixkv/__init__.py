"""radixkv: a prefix-cache engine for LLM inference.

The core (`BlockPool`, `PrefixCache`) is pure Python; the kernels live in `radixkv.kernels`, the
continuous-batching scheduler in `radixkv.scheduler`.
"""

from radixkv.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
