"""Multi-turn chat over the engine: the session, the terminal UI, the tree view."""

from radixkv.chat.session import ChatReply, ChatSession

__all__ = ["ChatReply", "ChatSession"]
