"""Multi-turn chat over the engine: the session, the terminal UI, the tree view.

The session loads torch, so it is imported on first use: `radixkv --help` answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.chat.session import ChatReply, ChatSession

__all__ = ["ChatReply", "ChatSession"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from radixkv.chat import session

        return getattr(session, name)
    raise AttributeError(f"module 'radixkv.chat' has no attribute {name!r}")
