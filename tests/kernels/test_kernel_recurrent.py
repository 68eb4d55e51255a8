"""The recurrent kernels (causal_conv1d, gated_delta_rule with a decay a head (Gated DeltaNet) or a
key channel (Kimi Delta Attention), ssm_scan): the torch reference against
its own definitions (chunked forms against token-by-token ones, a request split into pieces
against one call, packed requests against each alone) and the Triton kernels against the
reference under the interpreter. Shapes stay tiny: the interpreter walks tokens one by one."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch

from radixkv.kernels import RecurrentMetadata, use_backend
from radixkv.kernels import recurrent_reference as ref
from radixkv.kernels.triton_causal_conv1d import causal_conv1d as triton_causal_conv1d
from radixkv.kernels.triton_gated_delta_rule import gated_delta_rule as triton_gated_delta_rule
from radixkv.kernels.triton_ssm_scan import ssm_scan as triton_ssm_scan

NUM_SLOTS = 6


@dataclass
class Layer:
    """One recurrent kernel with its parameters fixed: `run(tokens, states, metadata)` packs
    per-token inputs (a dict of [T, ...] tensors) and returns the output."""

    kind: str
    params: dict[str, torch.Tensor | None]
    state_shape: tuple[int, ...]
    token_shapes: dict[str, tuple[int, ...]]

    def inputs(self, num_tokens: int, seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        out = {n: torch.randn(num_tokens, *s, generator=gen) for n, s in self.token_shapes.items()}
        if self.kind in ("gdn", "kda"):
            # KDA's decays reach far below Gated DeltaNet's (exp(A_log) up to 16 per channel)
            strength = 4.0 if self.kind == "kda" else 1.0
            out["g"] = -torch.rand(num_tokens, *self.token_shapes["g"], generator=gen) * strength
            out["beta"] = torch.rand(num_tokens, *self.token_shapes["beta"], generator=gen)
        return out

    def run(self, fn: Callable, tokens: dict, states: torch.Tensor, md: RecurrentMetadata):
        p = self.params
        if self.kind == "conv":
            return fn(tokens["x"], p["weight"], p["bias"], states, md, "silu")
        if self.kind in ("gdn", "kda"):
            t = tokens
            return fn(t["q"], t["k"], t["v"], t["g"], t["beta"], states, md, use_qk_l2norm=True)
        t = tokens
        return fn(
            t["x"],
            t["dt"],
            p["A"],
            t["B"],
            t["C"],
            p["D"],
            states,
            md,
            dt_bias=p["dt_bias"],
            dt_softplus=True,
            dt_limit=(0.05, 3.0),
        )


def _layer(kind: str) -> Layer:
    gen = torch.Generator().manual_seed(7)
    if kind == "conv":  # 40 channels, width 4
        params = {
            "weight": torch.randn(40, 4, generator=gen),
            "bias": torch.randn(40, generator=gen),
        }
        return Layer(kind, params, (3, 40), {"x": (40,)})
    if kind == "gdn":  # 2 q/k heads of 8, 4 value heads of 6
        shapes = {"q": (2, 8), "k": (2, 8), "v": (4, 6), "g": (4,), "beta": (4,)}
        return Layer(kind, {}, (4, 8, 6), shapes)
    if kind == "kda":  # the same heads, a decay per value head and key channel
        shapes = {"q": (2, 8), "k": (2, 8), "v": (4, 6), "g": (4, 8), "beta": (4,)}
        return Layer(kind, {}, (4, 8, 6), shapes)
    heads, head_dim, groups, state_dim = (4, 3, 2, 5) if kind == "mamba2" else (6, 1, 1, 4)
    A = -torch.rand(heads, generator=gen) - 0.2
    if kind == "mamba1":  # a Mamba-1 channel is a head of one dim with A per state channel
        A = -torch.rand(heads, state_dim, generator=gen) - 0.2
    params = {"A": A, "D": torch.randn(heads, generator=gen)}
    params["dt_bias"] = torch.randn(heads, generator=gen)
    shapes = {"x": (heads, head_dim), "dt": (heads,), "B": (groups, state_dim)}
    shapes["C"] = (groups, state_dim)
    return Layer(kind, params, (heads, head_dim, state_dim), shapes)


KINDS = ["conv", "gdn", "kda", "mamba2", "mamba1"]
REFERENCE = {"conv": ref.causal_conv1d, "gdn": ref.gated_delta_rule, "mamba2": ref.ssm_scan}
REFERENCE["kda"], REFERENCE["mamba1"] = ref.gated_delta_rule, ref.ssm_scan
TRITON = {"conv": triton_causal_conv1d, "gdn": triton_gated_delta_rule, "mamba2": triton_ssm_scan}
TRITON["kda"], TRITON["mamba1"] = triton_gated_delta_rule, triton_ssm_scan


def _poisoned_states(layer: Layer) -> torch.Tensor:
    """Slots full of NaN: a request without an initial state must never read its slot."""
    return torch.full((NUM_SLOTS, *layer.state_shape), math.nan)


def _slice(tokens: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    return {n: t[start:end] for n, t in tokens.items()}


def _pack(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}


def _one_call(layer: Layer, fn: Callable, tokens: dict, slot: int = 0):
    states = _poisoned_states(layer)
    n = next(iter(tokens.values())).shape[0]
    out = layer.run(fn, tokens, states, RecurrentMetadata.build([n], [slot], [False]))
    return out, states[slot]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split", [(1, 1, 1), (2, 69), (70, 1), (3, 1, 40, 27)])
def test_a_request_split_into_pieces_equals_one_call(kind: str, split: tuple[int, ...]) -> None:
    layer = _layer(kind)
    tokens = layer.inputs(sum(split), seed=1)
    whole, final = _one_call(layer, REFERENCE[kind], tokens)
    states = _poisoned_states(layer)
    outs, pos = [], 0
    for i, n in enumerate(split):  # each piece continues from the slot the last one left
        md = RecurrentMetadata.build([n], [3], [i > 0])
        outs.append(layer.run(REFERENCE[kind], _slice(tokens, pos, pos + n), states, md))
        pos += n
    torch.testing.assert_close(torch.cat(outs), whole, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(states[3], final, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_requests_each_see_only_their_own_state(kind: str) -> None:
    layer = _layer(kind)
    lens = [5, 1, 66, 1, 2]  # decode rows between longer rows, a row past one 64-token chunk
    slots, initial = [4, 0, 2, 5, 1], [True, True, False, False, True]
    gen = torch.Generator().manual_seed(3)
    start_states = torch.randn(NUM_SLOTS, *layer.state_shape, generator=gen)
    for r, has in enumerate(initial):
        if not has:  # whatever a fresh request's slot holds must not matter
            start_states[slots[r]] = math.nan
    parts = [layer.inputs(n, seed=10 + r) for r, n in enumerate(lens)]
    states = start_states.clone()
    packed = layer.run(
        REFERENCE[kind], _pack(parts), states, RecurrentMetadata.build(lens, slots, initial)
    )
    pos = 0
    for r, n in enumerate(lens):
        alone = start_states.clone()
        md = RecurrentMetadata.build([n], [slots[r]], [initial[r]])
        expected = layer.run(REFERENCE[kind], parts[r], alone, md)
        torch.testing.assert_close(packed[pos : pos + n], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[slots[r]], alone[slots[r]], atol=1e-5, rtol=1e-5)
        pos += n
    untouched = sorted(set(range(NUM_SLOTS)) - set(slots))
    assert torch.equal(states[untouched], start_states[untouched])


@pytest.mark.parametrize("length", [1, 7, 8, 9, 30])
@pytest.mark.parametrize("key_decay", [False, True])
def test_gated_delta_rule_chunked_equals_recurrent(length: int, key_decay: bool) -> None:
    gen = torch.Generator().manual_seed(length)
    q, k = (ref.l2_normalize(torch.randn(2, length, 3, 8, generator=gen)) for _ in range(2))
    v = torch.randn(2, length, 3, 5, generator=gen)
    # a decay a key channel (KDA), strong enough that exp(-G) of a chunk would overflow
    g = -torch.rand(2, length, 3, 8, generator=gen) * 30 if key_decay else None
    g = -torch.rand(2, length, 3, generator=gen) if g is None else g
    beta = torch.rand(2, length, 3, generator=gen)
    state = torch.randn(2, 3, 8, 5, generator=gen)
    expected = ref.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    got = ref.gated_delta_rule_chunked(q, k, v, g, beta, state, chunk=8)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 7, 8, 9, 30])
def test_ssd_chunked_equals_recurrent(length: int) -> None:
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, 4, 3, generator=gen)
    step = torch.rand(2, length, 4, generator=gen) + 0.1
    A = -torch.rand(4, generator=gen) - 0.1
    B, C = (torch.randn(2, length, 4, 5, generator=gen) for _ in range(2))
    state = torch.randn(2, 4, 3, 5, generator=gen)
    expected = ref.ssm_recurrent(x, step, A, B, C, state)
    got = ref.ssd_chunked(x, step, A, B, C, state, chunk=8)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_causal_conv1d_is_a_depthwise_conv_after_the_window() -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(9, 5, generator=gen), torch.randn(5, 3, generator=gen), None
    window = torch.randn(2, 5, generator=gen)
    states = torch.zeros(2, 2, 5)
    states[1] = window
    out = ref.causal_conv1d(x, weight, bias, states, RecurrentMetadata.build([9], [1], [True]))
    seq = torch.cat((window, x))
    expected = torch.stack([(seq[t : t + 3].T * weight).sum(1) for t in range(9)])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(states[1], x[-2:])


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_the_reference(kind: str, dtype: torch.dtype) -> None:
    layer = _layer(kind)
    lens, slots, initial = [3, 1, 4, 1], [4, 0, 2, 1], [True, True, False, False]
    tokens = {n: t.to(dtype) for n, t in layer.inputs(sum(lens), seed=5).items()}
    start = torch.randn(NUM_SLOTS, *layer.state_shape, generator=torch.Generator().manual_seed(2))
    start[[2, 1]] = math.nan  # the fresh requests' slots
    md = RecurrentMetadata.build(lens, slots, initial)
    with use_backend("torch"):
        expected_states = start.clone()
        expected = layer.run(REFERENCE[kind], tokens, expected_states, md)
    states = start.clone()
    got = layer.run(TRITON[kind], tokens, states, md)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(states, expected_states, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert torch.isnan(states[[3, 5]]).sum() == 0 and torch.equal(states[[3, 5]], start[[3, 5]])


def test_metadata_checks_its_values() -> None:
    with pytest.raises(ValueError, match="query_len"):
        RecurrentMetadata.build([2, 0], [0, 1], [False, False])
    with pytest.raises(ValueError, match="distinct"):
        RecurrentMetadata.build([2, 1], [1, 1], [False, False])
    with pytest.raises(ValueError, match="one entry per request"):
        RecurrentMetadata.build([2, 1], [0], [False, False])
    with pytest.raises(ValueError, match="num_slots"):
        RecurrentMetadata.build([2], [4], [False], num_slots=4)
    md = RecurrentMetadata.build([2, 1, 3], [5, 0, 2], [True, False, True])
    assert md.cu_seqlens.tolist() == [0, 2, 3, 6] and md.starts() == (0, 2, 3)
    assert (md.num_reqs, md.num_tokens, md.max_query_len) == (3, 6, 3)


def test_the_kernels_name_a_wrong_argument() -> None:
    md = RecurrentMetadata.build([3], [0], [False])
    states = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="conv_states"):
        ref.causal_conv1d(torch.zeros(3, 4), torch.zeros(4, 3), None, states, md)
    with pytest.raises(ValueError, match="x has 2 tokens"):
        ref.causal_conv1d(torch.zeros(2, 4), torch.zeros(4, 4), None, states, md)
    q = torch.zeros(3, 2, 4)
    with pytest.raises(ValueError, match="multiple"):
        ref.gated_delta_rule(
            q,
            q,
            torch.zeros(3, 3, 4),
            torch.zeros(3, 3),
            torch.zeros(3, 3),
            torch.zeros(2, 3, 4, 4),
            md,
        )
    v, beta, states = torch.zeros(3, 2, 4), torch.zeros(3, 2), torch.zeros(2, 2, 4, 4)
    for g in (torch.zeros(3, 2, 3), torch.zeros(3, 2, 4, 1)):  # a decay a key: K of them
        with pytest.raises(ValueError, match=r"g must be \[3, 2\] or \[3, 2, 4\]"):
            ref.gated_delta_rule(q, q, v, g, beta, states, md)
    x = torch.zeros(3, 2, 1)
    with pytest.raises(ValueError, match="A must be"):
        ref.ssm_scan(
            x,
            torch.zeros(3, 2),
            torch.zeros(3),
            torch.zeros(3, 1, 4),
            torch.zeros(3, 1, 4),
            None,
            torch.zeros(2, 2, 1, 4),
            md,
        )
    with pytest.raises(ValueError, match="slots"):
        ref.ssm_scan(
            x,
            torch.zeros(3, 2),
            torch.zeros(2),
            torch.zeros(3, 1, 4),
            torch.zeros(3, 1, 4),
            None,
            torch.zeros(1, 2, 1, 4),
            RecurrentMetadata.build([3], [1], [False]),
        )
