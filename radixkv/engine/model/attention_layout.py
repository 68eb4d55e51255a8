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
    num_kv_heads, head_dim   one KV layout shared by every layer (the paged cache's)

A model this engine cannot run exactly is refused here, with one line saying why (ModelLoadError):
layers that do not attend through transformers' attention interface (recurrent or linear layers,
architectures with attention code of their own), non-causal or chunked attention, key and value
heads of different sizes (multi-head latent attention), options the paged kernels do not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from radixkv.cache.group import GroupSpec
from radixkv.cache.window import WindowSpec
from radixkv.engine.model.model_loader import ModelLoadError
from radixkv.kernels import FULL, AttentionKind

PROBE_ATTENTION_NAME = "radixkv-probe"
# Layer types (config.layer_types) the paged kernels compute as transformers does.
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
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
    """Layers whose KV one cache group keeps (`spec` names its kind), in tensor order."""

    spec: GroupSpec
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """The attention of every decoder layer of one model, as it runs (see module docstring)."""

    layers: tuple[AttentionKind, ...]  # indexed by the attention module's layer_idx
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def cache_groups(self) -> tuple[LayerGroup, ...]:
        """The tree's group first (the layers that read every token; it is there, bookkeeping
        only, even when every layer is windowed: it holds the tree), then one window group for
        every windowed layer, of the largest window (a smaller window reads fewer of its
        tokens)."""
        full = tuple(i for i, k in enumerate(self.layers) if k.window is None)
        windowed = tuple(i for i, k in enumerate(self.layers) if k.window is not None)
        groups = [LayerGroup(GroupSpec(), full)]
        if windowed:
            window = max(self.layers[i].window for i in windowed)  # type: ignore[type-var]
            groups.append(LayerGroup(WindowSpec(window), windowed))
        return tuple(groups)

    def describe(self) -> str:
        """One line: the layers of each kind, e.g. "2 full + 4 window-512 layers"."""
        windows = sorted({k.window for k in self.layers}, key=lambda w: (w is not None, w or 0))
        counts = [sum(k.window == w for k in self.layers) for w in windows]
        kinds = ["full" if w is None else f"window-{w}" for w in windows]
        return " + ".join(f"{n} {kind}" for n, kind in zip(counts, kinds, strict=True)) + " layers"


@dataclass(slots=True)
class _Call:
    """What one layer's attention call handed the hook."""

    module: Any
    q_shape: tuple[int, ...]  # [1, heads, tokens, head_dim]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    kwargs: dict[str, Any]


class _RecordingCache(Cache):
    """A cache that writes nothing and notes which layers store K/V through it."""

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.updated: list[int] = []

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *a, **kw
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.updated.append(layer_idx)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def probe_attention(model: Any, name: str, cache_arg: str) -> AttentionLayout:
    """Run `model` once over two tokens with recording attention and cache hooks, and describe
    its layers. Leaves the model's attention implementation as the probe's: the caller sets its
    own next. Raises ModelLoadError (naming `name` and what is unsupported) for a model whose
    attention the paged kernels cannot compute exactly."""
    cfg = model.config.get_text_config()
    unsupported = sorted(set(getattr(cfg, "layer_types", None) or ()) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        why = f"it has {'/'.join(unsupported)} layers (supported: full and sliding window)"
        raise _refusal(name, model, why)
    calls: list[_Call] = []

    def record(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append(
            _Call(module, tuple(query.shape), tuple(key.shape), tuple(value.shape), kwargs)
        )
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[3])
        return out, None

    AttentionInterface.register(PROBE_ATTENTION_NAME, record)
    cache = _RecordingCache()
    device = next(model.parameters()).device
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
    return _layout(calls, cache.updated, cfg, lambda why: _refusal(name, model, why))


def _layout(calls: Sequence[_Call], updated: Sequence[int], cfg: Any, refuse) -> AttentionLayout:
    num_layers = cfg.num_hidden_layers
    layer_types = list(getattr(cfg, "layer_types", None) or ())
    indices = [getattr(c.module, "layer_idx", None) for c in calls]
    missing = set(range(num_layers)) - set(indices)
    if missing:
        raise refuse(
            f"{len(missing)} of its {num_layers} layers do not attend through transformers' "
            "attention interface (recurrent or linear layers, or attention code of its own)"
        )
    if len(indices) != num_layers:  # every layer called, so some module attended twice
        raise refuse("its attention modules do not attend once each per layer (shared modules?)")
    if sorted(updated) != list(range(num_layers)):
        raise refuse("its layers do not all store their K/V through the cache interface")
    kinds: list[AttentionKind] = [FULL] * num_layers
    shapes = set()
    for call, i in zip(calls, indices, strict=True):
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
    if len(shapes) != 1:
        raise refuse(f"its layers differ in head counts or sizes {sorted(shapes)}")
    if all(k.window is None for k in kinds) and _config_window(cfg) is not None:
        raise refuse(
            f"its config sets sliding_window={_config_window(cfg)} but no layer passes a window "
            "to the attention hook (a mask radixkv would not see)"
        )
    ((heads, kv_heads, head_dim),) = shapes
    return AttentionLayout(tuple(kinds), heads, kv_heads, head_dim)


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
