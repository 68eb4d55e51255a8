"""How one layer's queries attend: the per-layer options of `paged_attention`.

A model's layers differ in more than their weights: Mistral, Gemma 2 / 3 and GPT-OSS mix full
causal layers with sliding-window ones, Gemma 2 caps its logits, GPT-OSS adds a learned sink per
head. An `AttentionKind` says which of these a layer does; it is fixed per layer, so a kernel
launch (grid, split count, compiled variant) depends on it and on tensor shapes only, never on
per-step values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixkv.kernels.checks import CACHE_DTYPES, _check_tensor, _require

__all__ = ["FULL", "AttentionKind", "check_kind"]


@dataclass(frozen=True, slots=True, eq=False)
class AttentionKind:
    """One layer's attention: full causal by default. Checked when built (ValueError)."""

    # The query at position p sees (p - window, p] only; None: [0, p].
    window: int | None = None
    # Scores s = scale * q.k become softcap * tanh(s / softcap) before the mask (Gemma 2).
    softcap: float | None = None
    # [num_q_heads] learned logits (GPT-OSS): each joins its head's softmax denominator as one
    # more score that has no value.
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        window, softcap, sinks = self.window, self.softcap, self.sinks
        _require(
            window is None
            or (isinstance(window, int) and not isinstance(window, bool) and window >= 1),
            f"window must be a positive int or None, got {window!r}",
        )
        _require(
            softcap is None
            or (
                isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap > 0
            ),
            f"softcap must be a positive float or None, got {softcap!r}",
        )
        if sinks is not None:
            _check_tensor("sinks", sinks)
            _require(sinks.dim() == 1, f"sinks must be [num_q_heads], got {tuple(sinks.shape)}")
            _require(
                sinks.dtype in CACHE_DTYPES, f"sinks dtype {sinks.dtype} not in {CACHE_DTYPES}"
            )
            _require(sinks.is_contiguous(), "sinks must be contiguous")

    @property
    def is_full(self) -> bool:
        """Plain full causal attention: none of the options is set."""
        return self.window is None and self.softcap is None and self.sinks is None


FULL = AttentionKind()


def check_kind(q: torch.Tensor, kind: object) -> AttentionKind:
    """`kind` (None: FULL) against a checked q: its sinks, if any, one per query head on q's
    device."""
    if kind is None:
        return FULL
    _require(
        isinstance(kind, AttentionKind),
        f"kind must be an AttentionKind or None, got {type(kind).__name__}",
    )
    sinks = kind.sinks
    if sinks is not None:
        _require(
            sinks.shape[0] == q.shape[1],
            f"sinks must be [num_q_heads={q.shape[1]}], got {tuple(sinks.shape)}",
        )
        _require(sinks.device == q.device, f"sinks on {sinks.device} != q on {q.device}")
    return kind
