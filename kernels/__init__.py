"""Paged KV-cache kernels (Triton on CUDA, plain torch on CPU). Imported as `radixkv.kernels`."""
