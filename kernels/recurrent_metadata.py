"""Per-step metadata of the recurrent layers: which state slot each request of a packed step reads
and writes, and where its tokens lie in the packed row.

A step packs several requests' new tokens into one row (prefill chunks and decode tokens alike):

    packed tokens   | request 0 (a chunk) | request 1 (1 decode token) | request 2 (a chunk) |
    cu_seqlens      0 .................... 5 .......................... 6 ................... 9

Each request owns one slot of every recurrent layer's state tensors (the conv window and the SSM /
delta-rule state). A layer reads the slot at the start of the request's tokens (zeros instead when
`has_initial_state` is False: a request that starts here, from no snapshot) and writes it at their
end, so a request's state carries across chunks and steps, and no request reads another's slot.

Built once per step on the host, checked there (no device sync), and read by every recurrent
layer; the host tuples serve the torch reference's per-request loops without reading the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

__all__ = ["RecurrentMetadata"]


@dataclass(frozen=True, slots=True)
class RecurrentMetadata:
    """The packed step of the recurrent layers (build it with `RecurrentMetadata.build`)."""

    query_lens: tuple[int, ...]  # new tokens per request, in packed order (each >= 1)
    slots: tuple[int, ...]  # the state slot of each request (distinct)
    has_initial_state: tuple[bool, ...]  # False: the request starts from a zero state
    cu_seqlens: torch.Tensor  # int32 [num_reqs + 1] on the device: request r's tokens
    slot_ids: torch.Tensor  # int64 [num_reqs] on the device: `slots`
    initial: torch.Tensor  # int32 [num_reqs] on the device: 1 where `has_initial_state`

    @staticmethod
    def build(
        query_lens: Sequence[int],
        slots: Sequence[int],
        has_initial_state: Sequence[bool],
        device: torch.device | str = "cpu",
        num_slots: int | None = None,
    ) -> RecurrentMetadata:
        """Check the step's values on the host and copy them to `device` once. `num_slots`, when
        given, bounds the slot ids (the size of the state tensors)."""
        query_lens, slots = tuple(map(int, query_lens)), tuple(map(int, slots))
        has_initial_state = tuple(map(bool, has_initial_state))
        n = len(query_lens)
        if len(slots) != n or len(has_initial_state) != n:
            raise ValueError(
                f"query_lens, slots and has_initial_state must have one entry per request, got "
                f"{n}, {len(slots)} and {len(has_initial_state)}"
            )
        if any(q < 1 for q in query_lens):
            raise ValueError(f"every query_len must be >= 1, got {query_lens}")
        if any(s < 0 for s in slots) or len(set(slots)) != n:
            raise ValueError(f"slots must be distinct non-negative ids, got {slots}")
        if num_slots is not None and any(s >= num_slots for s in slots):
            raise ValueError(f"slots must be < num_slots={num_slots}, got {slots}")
        cu = (0, *accumulate(query_lens))
        return RecurrentMetadata(
            query_lens=query_lens,
            slots=slots,
            has_initial_state=has_initial_state,
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
            slot_ids=torch.tensor(slots, dtype=torch.int64, device=device),
            # int32, not bool: what Triton loads as a plain integer on every backend
            initial=torch.tensor(has_initial_state, dtype=torch.int32, device=device),
        )

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    def starts(self) -> tuple[int, ...]:
        """The packed index of each request's first token."""
        return tuple(accumulate(self.query_lens, initial=0))[:-1]
