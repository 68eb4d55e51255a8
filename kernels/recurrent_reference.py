"""Plain-torch recurrent kernels: the executable spec of the linear-attention and state-space
layers, and the CPU engine's path. Three recurrences cover the hybrid families transformers ships:

- `causal_conv1d`: the depthwise causal convolution over the last K inputs (Mamba-1/2, Gated
  DeltaNet's q/k/v, LFM2's short convolution); its state is the last K - 1 inputs.
- `gated_delta_rule`: Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo hybrid) and Kimi Delta Attention
  (Kimi Linear: the same rule with a decay per key channel); per head a K x V state
      S <- diag(exp(g_t)) S;  S <- S + k_t [beta_t (v_t - S^T k_t)]^T;  o_t = S^T q_t
  g_t one log decay per head (Gated DeltaNet) or one per head and key channel (KDA)
- `ssm_scan`: the selective state space recurrence of Mamba-2 (A a scalar per head: SSD) and
  Mamba-1 (A per head and state channel; a Mamba-1 channel is a head of one dim); per head a
  P x N state
      h <- exp(dt_t A) h + dt_t x_t B_t^T;  y_t = h C_t + D x_t

Every function takes a packed step (tokens of several requests, `RecurrentMetadata`) and the
layer's state tensor with one slot per request; request r starts from its slot (zeros if it has
no initial state) and leaves its final state there, in place. Math is fp32 whatever the dtypes;
outputs come back in the input's dtype and states in the state tensor's.

Decode rows (one token) of a step go through one batched recurrent update; longer rows one by one,
in the chunked form (`gated_delta_rule_chunked`, `ssd_chunked`), which computes the same
recurrence with matrix products over chunks of tokens. The token-by-token forms
(`gated_delta_rule_recurrent`, `ssm_recurrent`) are the definitions the chunked ones are tested
against.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from radixkv.kernels.recurrent_checks import (
    check_causal_conv1d,
    check_gated_delta_rule,
    check_ssm_scan,
)
from radixkv.kernels.recurrent_metadata import RecurrentMetadata

__all__ = [
    "causal_conv1d",
    "gated_delta_rule",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "l2_normalize",
    "ssd_chunked",
    "ssm_recurrent",
    "ssm_scan",
]

# Tokens per chunk of the chunked forms: the intra-chunk score matrices are CHUNK x CHUNK per head.
CHUNK = 64
NO_LIMIT = (0.0, math.inf)


def _rows(metadata: RecurrentMetadata) -> tuple[list[int], list[int]]:
    """The step's decode rows (one token) and its longer rows, by request index."""
    decode = [r for r, n in enumerate(metadata.query_lens) if n == 1]
    longer = [r for r, n in enumerate(metadata.query_lens) if n > 1]
    return decode, longer


def _spans(metadata: RecurrentMetadata, rows: list[int]) -> Iterator[tuple[int, slice]]:
    starts = metadata.starts()
    for r in rows:
        yield r, slice(starts[r], starts[r] + metadata.query_lens[r])


def _token_index(
    metadata: RecurrentMetadata, rows: list[int], device: torch.device
) -> torch.Tensor:
    """The packed index of the one token of each decode row."""
    starts = metadata.starts()
    return torch.tensor([starts[r] for r in rows], dtype=torch.long, device=device)


def _load_states(
    states: torch.Tensor, metadata: RecurrentMetadata, rows: list[int]
) -> torch.Tensor:
    """fp32 copies of the rows' slots; zeros for a request without an initial state."""
    slots = torch.tensor([metadata.slots[r] for r in rows], dtype=torch.long, device=states.device)
    loaded = states.index_select(0, slots).float()
    fresh = [i for i, r in enumerate(rows) if not metadata.has_initial_state[r]]
    if fresh:
        loaded[fresh] = 0.0
    return loaded


def _store_states(
    states: torch.Tensor, metadata: RecurrentMetadata, rows: list[int], values: torch.Tensor
) -> None:
    slots = torch.tensor([metadata.slots[r] for r in rows], dtype=torch.long, device=states.device)
    states.index_copy_(0, slots, values.to(states.dtype))


# ----------------------------------------------------------------------------------------------
# Causal convolution


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    metadata: RecurrentMetadata,
    activation: str | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution of each request's tokens after its window of earlier inputs.

    x: [num_tokens, channels], packed in request order; weight: [channels, K]; bias: [channels];
    conv_states: [num_slots, K - 1, channels], request r's window (its last K - 1 inputs, oldest
    first) in slot `metadata.slots[r]`, updated in place to the window after its tokens.
    activation: None or "silu". Returns [num_tokens, channels] in x's dtype:

        out[t, c] = act(bias[c] + sum_j weight[c, j] * seq[t + j, c]),  seq = window ++ x_r
    """
    check_causal_conv1d(x, weight, bias, conv_states, metadata, activation)
    out = torch.empty_like(x)
    width = weight.shape[1]
    w = weight.float()
    b = None if bias is None else bias.float()
    decode, longer = _rows(metadata)
    if decode:
        index = _token_index(metadata, decode, x.device)
        seq = torch.cat((_load_states(conv_states, metadata, decode), x[index, None].float()), 1)
        y = torch.einsum("nkc,ck->nc", seq, w)  # seq: [n, K, channels]
        if b is not None:
            y = y + b
        out[index] = _activate(y, activation).to(out.dtype)
        _store_states(conv_states, metadata, decode, seq[:, 1:])
    for r, span in _spans(metadata, longer):
        window = _load_states(conv_states, metadata, [r])[0]  # [K - 1, channels]
        seq = torch.cat((window, x[span].float()))  # [K - 1 + n, channels]
        y = F.conv1d(seq.T[None], w[:, None], b, groups=w.shape[0])[0].T  # [n, channels]
        out[span] = _activate(y, activation).to(out.dtype)
        _store_states(conv_states, metadata, [r], seq[None, -(width - 1) :])
    return out


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation == "silu" else y


# ----------------------------------------------------------------------------------------------
# Gated delta rule


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the form transformers and flash-linear-attention
    use for Gated DeltaNet's q and k)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    metadata: RecurrentMetadata,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> torch.Tensor:
    """The gated delta rule over a packed step, each request from and back to its state slot.

    q, k: [num_tokens, num_k_heads, k_dim]; v: [num_tokens, num_v_heads, v_dim] with num_v_heads a
    multiple of num_k_heads (q/k head h serves the value heads h * r .. h * r + r - 1);
    g: the log decay (<= 0), [num_tokens, num_v_heads] (one a head: Gated DeltaNet) or
    [num_tokens, num_v_heads, k_dim] (one a head and key channel: Kimi Delta Attention);
    beta: [num_tokens, num_v_heads];
    states: [num_slots, num_v_heads, k_dim, v_dim]. q is scaled by `scale` (k_dim ** -0.5 by
    default) after the optional L2 normalisation of q and k. Returns [num_tokens, num_v_heads,
    v_dim] in v's dtype.
    """
    check_gated_delta_rule(q, k, v, g, beta, states, metadata)
    out = torch.empty_like(v)
    q, k = _qk_for_values(q, k, v.shape[1], use_qk_l2norm)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    v, g, beta = v.float(), g.float(), beta.float()
    decode, longer = _rows(metadata)
    if decode:
        index = _token_index(metadata, decode, v.device)
        state = _load_states(states, metadata, decode)
        o, state = gated_delta_rule_recurrent(
            q[index, None], k[index, None], v[index, None], g[index, None], beta[index, None], state
        )
        out[index] = o[:, 0].to(out.dtype)
        _store_states(states, metadata, decode, state)
    for r, span in _spans(metadata, longer):
        state = _load_states(states, metadata, [r])
        o, state = gated_delta_rule_chunked(
            q[None, span], k[None, span], v[None, span], g[None, span], beta[None, span], state
        )
        out[span] = o[0].to(out.dtype)
        _store_states(states, metadata, [r], state)
    return out


def _qk_for_values(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q and k with one head per value head (optionally L2-normalised)."""
    q, k = q.float(), k.float()
    if normalize:
        q, k = l2_normalize(q), l2_normalize(k)
    repeat = num_v_heads // q.shape[1]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    return q, k


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, token by token, over a batch of equal-length sequences (fp32).

    q, k: [n, L, H, K] (q already scaled); v: [n, L, H, V]; g: [n, L, H] (a decay a head) or
    [n, L, H, K] (a decay a key channel); beta: [n, L, H]; state: [n, H, K, V].
    Returns (o [n, L, H, V], the final state [n, H, K, V]).
    """
    g = _key_decay(g)
    out = v.new_empty(v.shape)
    for t in range(v.shape[1]):
        state = state * g[:, t, :, :, None].exp()
        predicted = torch.einsum("nhkv,nhk->nhv", state, k[:, t])
        delta = (v[:, t] - predicted) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("nhkv,nhk->nhv", state, q[:, t])
    return out, state


def _key_decay(g: torch.Tensor) -> torch.Tensor:
    """The log decay with a key-channel dim: [n, L, H, 1] for one a head, [n, L, H, K] as it is."""
    return g if g.dim() == 4 else g[..., None]


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule_recurrent` computed chunk by chunk (same arguments and results).

    Within a chunk, with G_i the cumulative log decay from the chunk's start (one a key channel,
    or one for all of them), D_i = diag(exp(G_i)) and S_0 the state before the chunk, the new
    values u_i = beta_i (v_i - predicted_i) satisfy the unit lower-triangular system

        u_i + beta_i sum_{j<i} <k_i, k_j>_{i,j} u_j = beta_i (v_i - S_0^T D_i k_i)

    where <a, b>_{i,j} = sum_c a_c b_c exp(G_i,c - G_j,c), so U = T^-1 (beta V) -
    T^-1 (beta D K) S_0, solved by substitution; then o_i = S_0^T D_i q_i +
    sum_{j<=i} <q_i, k_j>_{i,j} u_j and the chunk's end state is D_last S_0 +
    sum_j (D_last D_j^-1 k_j) u_j^T. Every exponent is <= 0: nothing overflows however strong
    the decay.
    """
    g = _key_decay(g)
    length = q.shape[1]
    out = v.new_empty(v.shape)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        # [n, H, c, ...]: heads before positions, so the chunk's products are batched matmuls
        qc, kc, vc, gc = (t[:, start:end].transpose(1, 2) for t in (q, k, v, g))
        bc = beta[:, start:end].transpose(1, 2)  # [n, H, c]
        cum = gc.cumsum(-2)  # [n, H, c, 1 or K]
        c = end - start
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        system = _decayed_products(kc, kc, cum, causal) * bc[..., :, None]
        system = system.tril(-1) + torch.eye(c, device=q.device)  # I + its strict lower part
        rhs = torch.cat((vc, kc * cum.exp()), -1) * bc[..., None]
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        values, decayed_keys = solved.split((vc.shape[-1], kc.shape[-1]), -1)
        u = values - decayed_keys @ state  # [n, H, c, V]
        scores = _decayed_products(qc, kc, cum, causal)
        o = (qc * cum.exp()) @ state + scores @ u
        out[:, start:end] = o.transpose(1, 2)
        to_end = (cum[..., -1:, :] - cum).exp()  # [n, H, c, 1 or K]
        state = state * cum[..., -1, :, None].exp() + (kc * to_end).transpose(-1, -2) @ u
    return out, state


def _decayed_products(
    a: torch.Tensor, b: torch.Tensor, cum: torch.Tensor, causal: torch.Tensor
) -> torch.Tensor:
    """[n, H, c, c]: sum_ch a_i,ch b_j,ch exp(G_i,ch - G_j,ch) for j <= i, else 0 (the exponent
    masked before exp: no overflow). a, b [n, H, c, K]; cum (G) [n, H, c, 1 or K]."""
    mask = ~causal[..., None]  # [c, c, 1]
    decay = (cum[..., :, None, :] - cum[..., None, :, :]).masked_fill(mask, -math.inf).exp()
    if cum.shape[-1] == 1:  # one decay a head: a matmul, scaled
        return (a @ b.transpose(-1, -2)) * decay[..., 0]
    return torch.einsum("nhik,nhjk,nhijk->nhij", a, b, decay)


# ----------------------------------------------------------------------------------------------
# Selective state space scan (Mamba-2 and Mamba-1)


def ssm_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    states: torch.Tensor,
    metadata: RecurrentMetadata,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT,
) -> torch.Tensor:
    """The selective scan over a packed step, each request from and back to its state slot.

    x: [num_tokens, H, P]; dt: [num_tokens, H], made the step size as
    clamp(softplus(dt + dt_bias), *dt_limit) (each part optional); A: [H] (Mamba-2) or [H, N]
    (Mamba-1, with P = 1), negative; B, C: [num_tokens, G, N], head h reading group
    h // (H / G); D: [H] (the skip connection) or None; states: [num_slots, H, P, N].
    Returns y [num_tokens, H, P] in x's dtype.
    """
    check_ssm_scan(x, dt, A, B, C, D, states, metadata, dt_bias)
    step = step_size(dt, dt_bias, dt_softplus, dt_limit)
    heads, groups = x.shape[1], B.shape[1]
    B = B.float().repeat_interleave(heads // groups, dim=1)  # [T, H, N]
    C = C.float().repeat_interleave(heads // groups, dim=1)
    xf, A = x.float(), A.float()
    out = torch.empty_like(x)
    decode, longer = _rows(metadata)
    if decode:
        index = _token_index(metadata, decode, x.device)
        state = _load_states(states, metadata, decode)
        y, state = ssm_recurrent(
            xf[index, None], step[index, None], A, B[index, None], C[index, None], state
        )
        out[index] = _skip(y[:, 0], xf[index], D).to(out.dtype)
        _store_states(states, metadata, decode, state)
    scan = ssd_chunked if A.dim() == 1 else ssm_recurrent
    for r, span in _spans(metadata, longer):
        state = _load_states(states, metadata, [r])
        y, state = scan(xf[None, span], step[None, span], A, B[None, span], C[None, span], state)
        out[span] = _skip(y[0], xf[span], D).to(out.dtype)
        _store_states(states, metadata, [r], state)
    return out


def step_size(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    softplus: bool,
    limit: tuple[float, float],
) -> torch.Tensor:
    """fp32 clamp(softplus(dt + dt_bias), *limit), each part optional."""
    step = dt.float()
    if dt_bias is not None:
        step = step + dt_bias.float()
    if softplus:
        step = F.softplus(step)
    if limit != NO_LIMIT:
        step = step.clamp(limit[0], limit[1])
    return step


def _skip(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    return y if D is None else y + x * D.float()[:, None]


def ssm_recurrent(
    x: torch.Tensor,
    step: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, token by token, over a batch of equal-length sequences (fp32, no skip).

    x: [n, L, H, P]; step: [n, L, H]; A: [H] or [H, N]; B, C: [n, L, H, N] (one group per head);
    state: [n, H, P, N]. Returns (y [n, L, H, P], the final state [n, H, P, N]).
    """
    decay_rate = A[:, None, None] if A.dim() == 1 else A[:, None, :]  # [H, 1, 1 or N]
    out = x.new_empty(x.shape)
    for t in range(x.shape[1]):
        dt = step[:, t, :, None, None]  # [n, H, 1, 1]
        state = state * (dt * decay_rate).exp() + dt * x[:, t, :, :, None] * B[:, t, :, None, :]
        out[:, t] = torch.einsum("nhpk,nhk->nhp", state, C[:, t])
    return out, state


def ssd_chunked(
    x: torch.Tensor,
    step: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ssm_recurrent` for a scalar decay per head (Mamba-2's A [H]) computed chunk by chunk.

    Within a chunk, with G_i the cumulative log decay (sum of step * A) from its start and h_0
    the state before it:
        y_i = exp(G_i) h_0 C_i + sum_{j<=i} exp(G_i - G_j) (C_i . B_j) step_j x_j
        h_end = exp(G_last) h_0 + sum_j exp(G_last - G_j) step_j x_j B_j^T
    """
    length = x.shape[1]
    out = x.new_empty(x.shape)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        xc = x[:, start:end] * step[:, start:end, :, None]  # [n, c, H, P]
        bc, cc = B[:, start:end], C[:, start:end]  # [n, c, H, N]
        cum = (step[:, start:end] * A).cumsum(1)  # [n, c, H]
        c = end - start
        causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
        gap = cum[:, :, None] - cum[:, None, :]  # [n, i, j, H]
        decay = gap.masked_fill(~causal[None, :, :, None], -math.inf).exp()
        scores = torch.einsum("nihk,njhk->nijh", cc, bc) * decay
        y = torch.einsum("nijh,njhp->nihp", scores, xc)
        y = y + torch.einsum("nihk,nhpk->nihp", cc, state) * cum.exp()[..., None]
        out[:, start:end] = y
        to_end = (cum[:, -1:] - cum).exp()  # [n, c, H]
        state = state * cum[:, -1, :, None, None].exp() + torch.einsum(
            "njh,njhp,njhk->nhpk", to_end, xc, bc
        )
    return out, state
