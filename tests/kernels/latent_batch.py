"""A latent attention batch for kernel tests: a paged latent cache, permuted block tables,
NaN-poisoned free slots, and the dense multi-head attention it stands for."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixkv.kernels import LatentDims


@dataclass
class LatentBatch:
    dims: LatentDims
    q_nope: torch.Tensor  # [total_q_tokens, N, P]
    q_pe: torch.Tensor  # [total_q_tokens, N, R]
    cache: torch.Tensor  # [num_blocks, block_size, L + R], NaN where no request wrote
    kv_b_weight: torch.Tensor  # [N * (P + V), L]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks], -1 past each request's blocks
    seq_lens: torch.Tensor  # int32 [num_reqs]
    cu_seqlens_q: torch.Tensor  # int32 [num_reqs + 1]
    scale: float

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.block_tables, self.seq_lens, self.cu_seqlens_q

    def w_uk(self) -> torch.Tensor:
        """[N, P, L]: the key half of each head's rows of kv_b_proj."""
        d = self.dims
        return self.kv_b_weight.view(d.num_heads, -1, d.kv_lora_rank)[:, : d.qk_nope_head_dim]

    def w_uv(self) -> torch.Tensor:
        """[N, V, L]."""
        d = self.dims
        return self.kv_b_weight.view(d.num_heads, -1, d.kv_lora_rank)[:, d.qk_nope_head_dim :]

    def q_latent(self) -> torch.Tensor:
        """q_nope absorbed into latent space: [total_q_tokens, N, L] (a head-major tensor's
        token-major view, as the model's bmm hands it over)."""
        return torch.bmm(self.q_nope.transpose(0, 1), self.w_uk()).transpose(0, 1)

    def up_project(self, latents: torch.Tensor) -> torch.Tensor:
        """Weighted latents [T, N, L] -> [T, N, V], as the model finishes the absorbed form."""
        w_uv = self.w_uv().to(latents.dtype)
        return torch.bmm(latents.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def dense(self) -> torch.Tensor:
        """The multi-head attention the batch stands for, in fp32, position by position: keys
        [latent @ W_UK^T | k_pe], values latent @ W_UV^T. [total_q_tokens, N, V]."""
        d = self.dims
        lora, block_size = d.kv_lora_rank, self.cache.shape[1]
        outs = []
        cu = self.cu_seqlens_q.tolist()
        for r, seq_len in enumerate(self.seq_lens.tolist()):
            q_len = cu[r + 1] - cu[r]
            pos = torch.arange(seq_len)
            c = self.cache[self.block_tables[r, pos // block_size].long(), pos % block_size]
            c = c.double()
            w_uk, w_uv = self.w_uk().double(), self.w_uv().double()
            k_nope = torch.einsum("sl,npl->nsp", c[:, :lora], w_uk)
            k = torch.cat((k_nope, c[None, :, lora:].expand(d.num_heads, -1, -1)), dim=-1)
            v = torch.einsum("sl,nvl->nsv", c[:, :lora], w_uv)
            rows = slice(cu[r], cu[r + 1])
            q = torch.cat((self.q_nope[rows], self.q_pe[rows]), dim=-1).double().transpose(0, 1)
            scores = q @ k.transpose(1, 2) * self.scale
            q_pos = seq_len - q_len + torch.arange(q_len)
            scores.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            outs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
        return torch.cat(outs).float() if outs else self.q_nope.new_empty((0, d.num_heads, 1))


def build_latent_batch(
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    *,
    block_size: int,
    dims: LatentDims,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LatentBatch:
    """Requests r with q_lens[r] new tokens ending seq_lens[r] context tokens, their blocks drawn
    from a random permutation of a pool twice as large as needed; every slot no request covers
    holds NaN, so a kernel that reads one fails loudly. Values are O(1): latents as a layer norm
    leaves them, weights scaled so that scores and outputs stay near 1."""
    assert len(seq_lens) == len(q_lens)
    assert all(0 <= q <= s for q, s in zip(q_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 2 * sum(blocks_per_req) + 3
    max_blocks = max(blocks_per_req, default=0) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, dims.latent_dim), float("nan"), dtype=dtype)
    used = 0
    for r, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_req, strict=True)):
        tables[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
        pos = torch.arange(seq_len)
        latents = torch.randn(seq_len, dims.latent_dim, generator=gen)
        cache[tables[r, pos // block_size].long(), pos % block_size] = latents.to(dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(list(q_lens), dtype=torch.int64).cumsum(0).to(torch.int32)
    n, p, r = dims.num_heads, dims.qk_nope_head_dim, dims.qk_rope_head_dim
    num_tokens = int(cu[-1])
    weight = torch.randn(n * (p + dims.v_head_dim), dims.kv_lora_rank, generator=gen)
    weight /= dims.kv_lora_rank**0.5
    return LatentBatch(
        dims=dims,
        q_nope=torch.randn(num_tokens, n, p, generator=gen).to(dtype),
        q_pe=torch.randn(num_tokens, n, r, generator=gen).to(dtype),
        cache=cache,
        kv_b_weight=weight.to(dtype),
        block_tables=tables,
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32),
        cu_seqlens_q=cu,
        scale=(p + r) ** -0.5,
    )
