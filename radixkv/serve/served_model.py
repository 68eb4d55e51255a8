"""What the server's front end knows of the model its engine serves, wherever the engine runs.

The front end parses, templates, tokenizes, compiles grammars and detokenizes; for that it needs
the tokenizer and a few of the engine's figures (its settings as it runs them, its vocabulary, the
KV pool's size), never the model. `ServedModel.of(llm)` reads them off an `LLM` in this process;
an engine process sends the same record when it is ready (`engine_process`), without the
tokenizer, which the front end loads itself from `tokenizer_path` (a message carries only the
project's own objects: see `wire`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from radixkv.engine.config import EngineConfig
from radixkv.engine.model.text import ModelText

if TYPE_CHECKING:
    from radixkv.engine.llm import LLM


@dataclass(frozen=True, slots=True)
class CacheSize:
    """The tree group's KV pool, what a request can fill: `num_blocks` of `block_size`."""

    num_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class KVPool:
    """One KV cache group's pool of device blocks, as `/stats` and `/metrics` describe it."""

    group: str  # the group's kind: "full" (the tree's), "window"
    layout: str  # what a block holds: "kv" (keys and values) or "latent" (one MLA vector a token)
    num_layers: int
    num_blocks: int
    bytes_per_block: int  # over the group's layers


@dataclass(frozen=True, slots=True)
class ServedModel:
    text: ModelText  # the tokenizer and its text functions
    config: EngineConfig  # as the engine runs it (max_model_len filled in from the model)
    vocab_size: int
    cache: CacheSize
    kv_pools: tuple[KVPool, ...]  # every KV cache group's, the tree's first
    tokenizer_path: str  # a local folder where known, else the model's name
    model_type: str | None  # the model's config's, for /model_info
    architectures: tuple[str, ...]

    @classmethod
    def of(cls, llm: LLM) -> ServedModel:
        model_config = llm.model.config
        return cls(
            text=llm.text,
            config=llm.config,
            vocab_size=llm.vocab_size,
            cache=CacheSize(llm.cache.num_blocks, llm.cache.block_size),
            kv_pools=tuple(
                KVPool(kv.name, kv.layout, len(kv.layers), kv.num_blocks, kv.bytes_per_block)
                for kv in llm.runner.kv
            ),
            tokenizer_path=llm.tokenizer_path,
            model_type=getattr(model_config, "model_type", None),
            architectures=tuple(getattr(model_config, "architectures", None) or ()),
        )

    def without_tokenizer(self) -> ServedModel:
        return replace(self, text=replace(self.text, tokenizer=None))

    def with_own_tokenizer(self) -> ServedModel:
        """This record with the tokenizer loaded here from `tokenizer_path`, as the engine
        loaded its own (None where the engine found none either)."""
        from radixkv.engine.model.model_loader import load_tokenizer

        return replace(self, text=replace(self.text, tokenizer=load_tokenizer(self.tokenizer_path)))
