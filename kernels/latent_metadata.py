"""The paged latent cache of multi-head latent attention (MLA) and a step's plan over it.

MLA (DeepSeek V2 / V3, Kimi K2, GLM-4.7-Flash, Mistral 4, MiniCPM3, LongCat) keeps one vector per
token and layer instead of every head's key and value. One layer's latent cache:

    cache: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
    cache[block, offset] = [ latent: the compressed KV after kv_a_layernorm (L) | k_pe: the
                             shared key part, RoPE applied (R) ]

Token i of a request lives at `block_tables[r, i // block_size]`, offset `i % block_size`, as in
the K/V cache. The step's `AttentionMetadata` serves a latent layer unchanged: its
kv_cache_shape reads the cache as one KV head of width L + R (`latent_cache_shape`), so every
check it runs and everything it precomputes (block ids, slots, the reference's gather plan)
holds as for K/V.

Per head h, with W_UK [N, P, L] and W_UV [N, V, L] the two halves of kv_b_proj's weight, the
keys are [latent @ W_UK[h]^T | k_pe] and the values latent @ W_UV[h]^T. Attention runs in one of
two forms, per request (`LatentDims.prefers_absorbed`):

    absorbed  q_latent = q_nope @ W_UK[h]: [N, L]; scores = q_latent . latent + q_pe . k_pe; the
              output is a softmax-weighted sum of latents [N, L], then @ W_UV[h]^T -> [N, V].
              Every head reads the same latents: one pass over the cache (multi-query
              attention of width L + R).
    expanded  the context's latents up-projected by kv_b_proj, a chunk of positions at a time,
              into k_nope [S, N, P] and v [S, N, V]; attention per head; the chunks merged by
              their log-sum-exp. It costs the up-projection of every context position but
              narrower dots (P + R and V instead of L + R and L), so it wins for prefills and long
              extends.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from radixkv.kernels.checks import _require
from radixkv.kernels.metadata import AttentionMetadata

__all__ = [
    "TORCH_MERGE_COST",
    "TRITON_MERGE_COST",
    "LatentDims",
    "LatentPart",
    "LatentStep",
    "latent_cache_shape",
    "plan_latent_step",
]


@dataclass(frozen=True, slots=True)
class LatentDims:
    """The sizes of one model's latent attention (the same in every latent layer)."""

    num_heads: int  # N
    kv_lora_rank: int  # L: the latent's width
    qk_rope_head_dim: int  # R: the shared RoPE'd key part (0 for NoPE models: Kimi Linear)
    qk_nope_head_dim: int  # P: each head's key part computed from the latent
    v_head_dim: int  # V

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value > 0, f"{name} must be > 0, got {value!r}")
        rope = self.qk_rope_head_dim
        _require(isinstance(rope, int) and rope >= 0, f"qk_rope_head_dim must be >= 0, got {rope}")

    @property
    def latent_dim(self) -> int:
        """Values per token in the cache: L + R."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def _sizes(self) -> tuple[int, int, int, int]:
        return self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim

    def absorbed_flops(self, q_len: int, seq_len: int) -> int:
        """Multiply-adds per head of the absorbed form for q_len new tokens ending a seq_len-token
        context: the queries into latent space (P x L each), scores over L + R and sums over L
        for every visible (query, position) pair, the output out of it (L x V each)."""
        L, R, P, V = self._sizes
        return q_len * L * (P + V) + _visible_pairs(q_len, seq_len) * (2 * L + R)

    def expanded_flops(self, q_len: int, seq_len: int, merge_cost: int = 0) -> int:
        """Multiply-adds per head of the expanded form: every context position up-projected
        (L x (P + V)), then scores over P + R and sums over V per visible pair, plus
        `merge_cost` a pair for the work its chunks' merge adds (see TORCH_MERGE_COST)."""
        L, R, P, V = self._sizes
        return seq_len * L * (P + V) + _visible_pairs(q_len, seq_len) * (P + R + V + merge_cost)

    def prefers_absorbed(self, q_len: int, seq_len: int, merge_cost: int) -> bool:
        """Whether a request of q_len new tokens ending a seq_len-token context attends in the
        absorbed form: every decode row does (one form for a whole decode batch, which a
        captured graph needs; the expanded form would only win on a 1-token context), a longer
        request when its cost is the smaller (`absorbed_flops`, `expanded_flops` with the
        backend's `merge_cost`). Without merge cost a prefill without a cached prefix is
        always expanded (absorbing each query and up-projecting each output costs what
        up-projecting its own latents does) and over a long prefix the absorbed form wins up to
        L (P + V) / (2L - P - V) new tokens: 170 at DeepSeek V3's shape; 204 with the torch
        reference's merge cost."""
        if q_len <= 1:
            return True
        absorbed = self.absorbed_flops(q_len, seq_len)
        return absorbed <= self.expanded_flops(q_len, seq_len, merge_cost)


# The expanded form's work per (query, position) pair beyond its dots, in multiply-adds: the torch
# reference computes each chunk's log-sum-exp in a pass of its own and merges the chunks' outputs.
# Fitted to CPU-seconds of the two forms (benchmarks/latent_forms_bench.py, RESULTS.md): with it
# the rule picks the faster form at 18 of 20 measured shapes (the two misses short prefills
# within 15 %), without it at 11 (it would expand the tiny test models' prefills, which run
# absorbed in 0.4-0.65x the time).
TORCH_MERGE_COST = 128
# The Triton chunk kernel keeps the running softmax in registers: nothing beyond the dots, until
# a GPU measures the two kernels against each other.
TRITON_MERGE_COST = 0


def _visible_pairs(q_len: int, seq_len: int) -> int:
    """(query, position) pairs causal attention computes: query j of q_len (at position
    seq_len - q_len + j) sees seq_len - q_len + j + 1 positions."""
    ctx_len = seq_len - q_len
    return q_len * ctx_len + q_len * (q_len + 1) // 2


def latent_cache_shape(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """The kv_cache_shape of a latent layer's `AttentionMetadata`: the cache [num_blocks,
    block_size, latent_dim] read as one KV head of width latent_dim."""
    num_blocks, block_size, latent_dim = cache.shape
    return (num_blocks, block_size, 1, latent_dim)


@dataclass(frozen=True, slots=True, eq=False)
class LatentPart:
    """Consecutive requests of a step that attend in one form."""

    absorbed: bool
    rows: slice  # the part's rows of the step's queries and output
    metadata: AttentionMetadata  # the part's requests only (its rows rebased to 0)


@dataclass(frozen=True, slots=True, eq=False)
class LatentStep:
    """A step of latent layers: the metadata every layer stores its new latents with, and its
    requests in runs of one form (usually one part, or decodes then a long prefill), built once
    per step and read by every latent layer."""

    metadata: AttentionMetadata
    parts: tuple[LatentPart, ...]


def plan_latent_step(
    metadata: AttentionMetadata,
    dims: LatentDims,
    *,
    merge_cost: int = TORCH_MERGE_COST,
    host_block_tables: torch.Tensor | None = None,
) -> LatentStep:
    """Split the step's requests into runs of the form each prefers (`prefers_absorbed` with the
    backend's `merge_cost`: TORCH_MERGE_COST or TRITON_MERGE_COST).

    `host_block_tables` is a CPU copy of `metadata.block_tables`, which a part's metadata reads
    its rows from without a device sync; it may be left out when the metadata lives on the CPU.
    A request with no new tokens joins whichever run it sits in.
    """
    _require(isinstance(metadata, AttentionMetadata), "metadata must be an AttentionMetadata")
    _require(isinstance(dims, LatentDims), "dims must be a LatentDims")
    lens, cu = metadata.seq_lens_host, metadata.cu_seqlens_q_host
    forms: list[bool] = []
    for seq_len, (start, end) in zip(lens, pairwise(cu), strict=True):
        q_len = end - start
        if q_len == 0 and forms:
            forms.append(forms[-1])
        else:
            forms.append(dims.prefers_absorbed(q_len, seq_len, merge_cost))
    runs = _runs(forms)
    if len(runs) <= 1:
        absorbed = forms[0] if forms else True
        return LatentStep(metadata, (LatentPart(absorbed, slice(0, cu[-1]), metadata),))
    if host_block_tables is None:
        _require(
            metadata.device.type == "cpu",
            f"host_block_tables is needed to split a step whose metadata is on {metadata.device}",
        )
        host_block_tables = metadata.block_tables
    parts = tuple(
        LatentPart(forms[a], slice(cu[a], cu[b]), _sub_metadata(metadata, host_block_tables, a, b))
        for a, b in runs
    )
    return LatentStep(metadata, parts)


def _runs(forms: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of equal consecutive values."""
    runs: list[tuple[int, int]] = []
    for r, form in enumerate(forms):
        if runs and forms[runs[-1][0]] == form:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def _sub_metadata(
    metadata: AttentionMetadata, host_block_tables: torch.Tensor, a: int, b: int
) -> AttentionMetadata:
    """The metadata of requests [a, b): views of the step's tensors, its query rows rebased,
    nothing re-validated (the step's metadata was) and no device sync."""
    cu = metadata.cu_seqlens_q_host
    cu_host = torch.tensor([c - cu[a] for c in cu[a : b + 1]], dtype=torch.int32)
    lens_host = torch.tensor(metadata.seq_lens_host[a:b], dtype=torch.int32)
    device = metadata.device
    return AttentionMetadata(
        metadata.block_tables[a:b],
        metadata.seq_lens[a:b],
        cu_host.to(device, non_blocking=True),
        metadata.kv_cache_shape,
        device=device,
        validate=False,
        host_tensors=(host_block_tables[a:b], lens_host, cu_host, None),
    )
