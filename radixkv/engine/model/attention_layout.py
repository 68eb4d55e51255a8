"""What each layer of a model does in attention, read from the model itself at load.

Configs describe attention loosely: GPT-NeoX's config carries a `num_key_value_heads` its
attention ignores, Mistral's `sliding_window` is a per-layer mask and not a context length, and
architectures differ in whether and how they pass a window, a logit soft-cap or sinks. So the
runner asks the model: `probe_attention` runs one two-token forward with a recording attention
function registered in transformers' attention interface and a recording cache, and reads what
every layer hands them (the shapes of query, key and value, the window, soft-cap and sinks
keyword arguments, the layer's `is_causal`). The result is an `AttentionLayout`:

    layers[i]        the AttentionKind layer i attends with (full, window W, soft-cap, sinks)
    cache_groups()   the layers by the KV they need, one KV cache group each (`LayerGroup`):
                     the layers that read every token keep KV of every token (the tree's group),
                     window-W layers only of the last W (one window group, of the largest W);
                     each group owns a pool of blocks (`radixkv.cache.group`). This is the one
                     place above the cache that names the kinds of group.
    num_kv_heads, head_dim   one KV layout shared by every layer that stores K and V
    latent, latent_layers    multi-head latent attention (MLA): the layers that keep one latent
                     vector a token instead (`radixkv.engine.step.latent_attention`), its sizes
    recurrent        the recurrent layers (Gated DeltaNet, Mamba, short convolutions): one
                     fixed-size state a request instead of KV (`radixkv.engine.step.recurrent`),
                     their state's shapes; `state_group` is their cache group, the state kind's
                     (`radixkv.cache.state`), kept apart from the KV groups' tensors. A model of
                     recurrent layers alone (Mamba, Mamba 2) keeps no KV: 0 heads of size 0, its
                     tree group a group of no layers that holds token ids

MLA modules (DeepSeek V2 / V3 and kin) attend in code of their own, not through the attention
interface: the probe swaps them for radixkv's paged modules first (`swap_latent_modules`, as the
runner runs them) and they report to the recording cache's `latent_layer`. Their layers are the
tree's group's, with a latent tensor layout (the engine's business, not the cache's). Recurrent
modules likewise: the probe swaps in the packed ones (`pack_recurrent_layers`), which read their
state through the recording cache's `recurrent_layer`.

A model this engine cannot run exactly is refused here, with one line saying why (ModelLoadError):
layers that do not attend through transformers' attention interface (architectures with
attention code of their own, recurrent layers radixkv has no packed module for), non-causal or
chunked attention, key and value heads of different sizes
outside latent attention, DeepSeek's sparse attention, full layers that mix latent and K/V
caches, options the paged kernels do not have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from radixkv.cache.group import GroupSpec
from radixkv.cache.state import StateSpec
from radixkv.cache.window import WindowSpec
from radixkv.engine.model.model_loader import ModelLoadError
from radixkv.engine.step.attention import attended_layer
from radixkv.engine.step.latent_attention import swap_latent_modules
from radixkv.engine.step.recurrent import (
    RecurrentLayerSpec,
    RecurrentStates,
    RecurrentStep,
    pack_recurrent_layers,
)
from radixkv.kernels import (
    FULL,
    AttentionKind,
    AttentionMetadata,
    LatentDims,
    RecurrentMetadata,
    plan_latent_step,
)

PROBE_ATTENTION_NAME = "radixkv-probe"
# Layer types (config.layer_types) the paged kernels compute as transformers does, and the ones
# the packed recurrent modules do where the probe swapped them in.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid")
# Layer types of a hybrid model with no token mixer at all (Nemotron-H's MLP and MoE layers).
MIXERLESS_LAYER_TYPES = ("mlp", "moe")
# Keyword arguments the paged attention reads, and the ones models pass that do not change what
# attention computes (bookkeeping of the forward). Any other one with a value is refused.
_READ_KWARGS = frozenset(
    {"scaling", "dropout", "sliding_window", "softcap", "s_aux", "radixkv_cache"}
)
_INERT_KWARGS = frozenset(
    {"position_ids", "use_cache", "output_attentions", "output_router_logits", "cache_position"}
)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers whose KV one cache group keeps (`spec` names its kind), in tensor order. `latent`:
    the layers keep one latent vector of these sizes a token (MLA) instead of K and V."""

    spec: GroupSpec
    layers: tuple[int, ...]
    latent: LatentDims | None = None


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """The attention of every decoder layer of one model, as it runs (see module docstring)."""

    layers: tuple[AttentionKind, ...]  # indexed by the attention module's layer_idx
    num_q_heads: int
    num_kv_heads: int  # a model whose layers are all latent: 1 head of the latent's width
    head_dim: int
    latent: LatentDims | None = None  # the latent layers' sizes (None: no latent layer)
    latent_layers: tuple[int, ...] = ()
    recurrent: tuple[RecurrentLayerSpec, ...] = ()  # in layer order
    # The layers that keep no KV: a recurrent mixer alone (Falcon-H1's run attention beside it)
    # or no mixer at all (Nemotron-H's MLP layers); their `layers[i]` (FULL) is never read.
    no_kv_layers: tuple[int, ...] = ()

    def cache_groups(self) -> tuple[LayerGroup, ...]:
        """The tree's group first (the layers that read every token; it is there, bookkeeping
        only, even when every layer is windowed: it holds the tree), then one window group for
        every windowed layer, of the largest window (a smaller window reads fewer of its
        tokens)."""
        full = tuple(
            i for i, k in enumerate(self.layers) if k.window is None and i not in self.no_kv_layers
        )
        windowed = tuple(i for i, k in enumerate(self.layers) if k.window is not None)
        latent = self.latent if full and full[0] in self.latent_layers else None
        groups = [LayerGroup(GroupSpec(), full, latent)]
        if windowed:
            window = max(self.layers[i].window for i in windowed)  # type: ignore[type-var]
            groups.append(LayerGroup(WindowSpec(window), windowed))
        return tuple(groups)

    def state_group(self, dtype: torch.dtype, snapshot_dtype: str = "exact") -> LayerGroup | None:
        """The recurrent layers' cache group, its slots of one state of every one of them at
        `dtype`, its snapshots in `snapshot_dtype` (None: no recurrent layer). It comes after
        the KV groups: the cache's group order is theirs, then it."""
        if not self.recurrent:
            return None
        slot_bytes = sum(s.nbytes(dtype) for s in self.recurrent)
        snapshot_bytes = None
        if snapshot_dtype != "exact":  # compact: in slots of their own
            snapshot_bytes = sum(s.snapshot_nbytes(dtype, snapshot_dtype) for s in self.recurrent)
        spec = StateSpec(slot_bytes, snapshot_bytes)
        return LayerGroup(spec, tuple(s.layer_idx for s in self.recurrent))

    def describe(self) -> str:
        """One line: the layers of each kind, e.g. "2 full + 4 window-512 layers" (latent
        layers: "4 full (latent 576) layers")."""
        attending = [k for i, k in enumerate(self.layers) if i not in self.no_kv_layers]
        windows = sorted({k.window for k in attending}, key=lambda w: (w is not None, w or 0))
        counts = [sum(k.window == w for k in attending) for w in windows]
        full = "full" if self.latent is None else f"full (latent {self.latent.latent_dim})"
        kinds = [full if w is None else f"window-{w}" for w in windows]
        if self.recurrent:
            counts, kinds = [*counts, len(self.recurrent)], [*kinds, "recurrent"]
        return " + ".join(f"{n} {kind}" for n, kind in zip(counts, kinds, strict=True)) + " layers"


@dataclass(slots=True)
class _Call:
    """What one layer's attention call handed the hook, and the layer it attended for."""

    module: Any
    q_shape: tuple[int, ...]  # [1, heads, tokens, head_dim]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    kwargs: dict[str, Any]
    layer_idx: int | None


class _RecordingCache(Cache):
    """A cache that writes nothing and notes which layers store K/V through it, which latent
    layers (radixkv's MLA modules) ask it for their cache (`latent_layer`: a scratch one) and
    which recurrent layers for their state (`recurrent_layer`: scratch slots)."""

    def __init__(
        self,
        latent: LatentDims | None,
        device: torch.device,
        dtype: torch.dtype,
        recurrent: Sequence[RecurrentLayerSpec] = (),
    ) -> None:
        super().__init__(layers=[])
        self.updated: list[int] = []
        self.latent_layers: list[int] = []
        self.recurrent_layers: list[int] = []
        self._latent_step = None
        self._recurrent_step = None
        if recurrent:  # the probe's two tokens, one request from a zero state in slot 0
            states = RecurrentStates(recurrent, 1, dtype, device)
            metadata = RecurrentMetadata.build([2], [0], [False], device, num_slots=1)
            self._recurrent_step = RecurrentStep(states, metadata)
        if latent is not None:  # the probe's two tokens in one block
            cache = torch.zeros((1, 2, latent.latent_dim), dtype=dtype, device=device)
            metadata = AttentionMetadata(
                torch.zeros((1, 1), dtype=torch.int32),
                torch.tensor([2], dtype=torch.int32),
                torch.tensor([0, 2], dtype=torch.int32),
                (1, 2, 1, latent.latent_dim),
                slot_mapping=torch.arange(2, dtype=torch.int32),
                device=device,
            )
            self._latent_step = (cache, plan_latent_step(metadata, latent))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *a, **kw
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.updated.append(layer_idx)
        return key_states, value_states

    def latent_layer(self, layer_idx: int) -> tuple[torch.Tensor, Any]:
        assert self._latent_step is not None, "a latent layer in a model swap_latent_modules missed"
        self.latent_layers.append(layer_idx)
        return self._latent_step

    def recurrent_layer(
        self, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, RecurrentMetadata]:
        assert self._recurrent_step is not None, "a recurrent layer pack_recurrent_layers missed"
        self.recurrent_layers.append(layer_idx)
        return self._recurrent_step.recurrent_layer(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def probe_attention(model: Any, name: str, cache_arg: str) -> AttentionLayout:
    """Swap `model`'s MLA modules for radixkv's (in place; they stay swapped: the runner runs
    them), run it once over two tokens with recording attention and cache hooks, and describe
    its layers. Leaves the model's attention implementation as the probe's: the caller sets its
    own next. Raises ModelLoadError (naming `name` and what is unsupported) for a model whose
    attention the paged kernels cannot compute exactly."""
    try:
        latent = swap_latent_modules(model)
    except ModelLoadError as exc:  # sparse attention, or latent layers of different sizes
        raise _refusal(name, model, str(exc)) from exc
    try:
        recurrent = pack_recurrent_layers(model)
    except ValueError as exc:  # a convolution's activation the kernel lacks
        raise _refusal(name, model, str(exc)) from exc
    cfg = model.config.get_text_config()
    supported = SUPPORTED_LAYER_TYPES
    if recurrent:
        supported += RECURRENT_LAYER_TYPES + MIXERLESS_LAYER_TYPES
    unsupported = sorted(set(getattr(cfg, "layer_types", None) or ()) - set(supported))
    if unsupported:
        why = f"it has {'/'.join(unsupported)} layers (supported: full and sliding window)"
        raise _refusal(name, model, why)
    calls: list[_Call] = []

    def record(module, query, key, value, attention_mask, *args, **kwargs):
        shapes = tuple(query.shape), tuple(key.shape), tuple(value.shape)
        stored = cache.updated[-1] if cache.updated else None
        calls.append(_Call(module, *shapes, kwargs, attended_layer(module, stored)))
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[3])
        return out, None

    AttentionInterface.register(PROBE_ATTENTION_NAME, record)
    param = next(model.parameters())
    device = param.device
    cache = _RecordingCache(latent, device, param.dtype, recurrent)
    try:
        model.set_attn_implementation(PROBE_ATTENTION_NAME)
        with torch.inference_mode():
            model(
                input_ids=torch.zeros((1, 2), dtype=torch.long, device=device),
                position_ids=torch.arange(2, device=device)[None],
                **{cache_arg: cache},
                use_cache=True,
                radixkv_cache=cache,  # the runner's hook finds the step's cache this way
            )
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise _refusal(
            name, model, f"its forward fails with the paged cache hooks ({first_line})"
        ) from exc
    if any(call.kwargs.get("radixkv_cache") is not cache for call in calls):
        raise _refusal(name, model, "its attention does not pass the forward's keywords on")
    refuse = partial(_refusal, name, model)
    if sorted(cache.recurrent_layers) != [s.layer_idx for s in recurrent]:
        raise refuse("its recurrent layers do not each run once per forward")
    latent_calls = (latent, cache.latent_layers)
    return _layout(calls, cache.updated, latent_calls, cfg, refuse, recurrent)


def _layout(
    calls: Sequence[_Call],
    updated: Sequence[int],
    latent_calls: tuple[LatentDims | None, Sequence[int]],
    cfg: Any,
    refuse: Callable[[str], ModelLoadError],
    recurrent: Sequence[RecurrentLayerSpec] = (),
) -> AttentionLayout:
    """The layout from what the probe recorded: the attention interface's `calls`, the layers
    that stored K/V through the cache (`updated`), the latent layers' sizes and the layers that
    asked for a latent cache (`latent_calls`), and the recurrent layers (a layer whose mixer is
    recurrent alone counts as attending)."""
    latent, latent_layers = latent_calls
    num_layers = cfg.num_hidden_layers
    layer_types = list(getattr(cfg, "layer_types", None) or ())
    indices = [c.layer_idx for c in calls] + list(latent_layers)
    mixerless = [i for i, t in enumerate(layer_types) if recurrent and t in MIXERLESS_LAYER_TYPES]
    stateful = sorted({s.layer_idx for s in recurrent} - set(indices))  # recurrent only
    stateful = sorted([*stateful, *mixerless])  # the layers that keep no KV
    indices += stateful
    missing = set(range(num_layers)) - set(indices)
    if missing:
        raise refuse(
            f"{len(missing)} of its {num_layers} layers do not attend through transformers' "
            "attention interface (recurrent or linear layers, or attention code of its own)"
        )
    if len(indices) != num_layers:  # every layer called, so some module attended twice
        raise refuse("its attention modules do not attend once each per layer (shared modules?)")
    if sorted([*updated, *latent_layers, *stateful]) != list(range(num_layers)):
        raise refuse("its layers do not all store their K/V through the cache interface")
    kinds: list[AttentionKind] = [FULL] * num_layers  # a latent layer attends to every token
    shapes = set()
    for call, i in zip(calls, indices, strict=False):  # the latent layers made no call
        kinds[i] = _kind_of(call, i, layer_types, refuse)
        (_, heads, _, q_dim), (_, kv_heads, _, k_dim), v_dim = (
            call.q_shape,
            call.k_shape,
            call.v_shape[3],
        )
        if not q_dim == k_dim == v_dim:
            raise refuse(
                f"layer {i}'s query / key / value heads have sizes {q_dim} / {k_dim} / {v_dim} "
                "(the paged cache needs one head size)"
            )
        if heads % kv_heads:
            raise refuse(f"layer {i} has {heads} query heads for {kv_heads} KV heads")
        shapes.add((heads, kv_heads, k_dim))
    if not shapes and not latent_layers:
        # Recurrent layers alone (Mamba, Mamba 2): no layer keeps KV, the tree's group holds
        # token ids alone (`kv_tensors.plan_num_blocks`); every layer that got here is stateful.
        assert recurrent and len(stateful) == num_layers, "a layer neither attends nor recurs"
        shapes.add((0, 0, 0))
    if latent_layers and not shapes:
        # Every layer latent: its absorbed form is multi-query attention over the latents (one
        # KV head of their width).
        assert latent is not None, "latent layers without their sizes"
        shapes.add((latent.num_heads, 1, latent.latent_dim))
    if len(shapes) != 1:
        raise refuse(f"its layers differ in head counts or sizes {sorted(shapes)}")
    if all(k.window is None for k in kinds) and _config_window(cfg) is not None:
        raise refuse(
            f"its config sets sliding_window={_config_window(cfg)} but no layer passes a window "
            "to the attention hook (a mask radixkv would not see)"
        )
    full_kv = [
        i
        for i in range(num_layers)
        if kinds[i].window is None and i not in latent_layers and i not in stateful
    ]
    if latent_layers and full_kv:
        raise refuse(
            f"its full-attention layers {full_kv} keep keys and values beside latent layers "
            "(one KV layout per cache group)"
        )
    ((heads, kv_heads, head_dim),) = shapes
    latent_sorted = tuple(sorted(latent_layers))
    dims = latent if latent_layers else None
    return AttentionLayout(
        tuple(kinds),
        heads,
        kv_heads,
        head_dim,
        dims,
        latent_sorted,
        tuple(recurrent),
        tuple(stateful),
    )


def _kind_of(call: _Call, i: int, layer_types: Sequence[str], refuse) -> AttentionKind:
    """Layer i's AttentionKind from what its attention passed the hook."""
    kwargs = call.kwargs
    other = sorted(
        k for k, v in kwargs.items() if v is not None and k not in _READ_KWARGS | _INERT_KWARGS
    )
    if other:
        raise refuse(f"layer {i}'s attention passes {', '.join(other)}, which radixkv lacks")
    if getattr(call.module, "is_causal", True) is not True:
        raise refuse(f"layer {i}'s attention is not causal")
    window = kwargs.get("sliding_window")
    if layer_types and (layer_types[i] == "sliding_attention") != (window is not None):
        raise refuse(f"layer {i} is a {layer_types[i]} layer but passes sliding_window={window}")
    softcap = kwargs.get("softcap")
    try:
        return AttentionKind(
            window=None if window is None else int(window),
            softcap=None if softcap is None else float(softcap),
            sinks=kwargs.get("s_aux"),
        )
    except ValueError as exc:
        raise refuse(f"layer {i}: {exc}") from exc


def _config_window(cfg: Any) -> int | None:
    """The config's sliding window where it can hide a position: set, switched on, and shorter
    than the positions the model has."""
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    positions = getattr(cfg, "max_position_embeddings", None)
    return window if positions is None or window < positions else None


def _refusal(name: str, model: Any, why: str) -> ModelLoadError:
    return ModelLoadError(f"cannot run model {name!r} ({type(model).__name__}): {why}")
