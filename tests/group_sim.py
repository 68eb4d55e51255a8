"""A simulated KV of a grouped cache's groups (`radixkv.cache.grouped`): each group's pool is a
map (block, slot) -> the key of the prefix whose KV the slot holds, written exactly where a model
runner writes; a query at position q reads every earlier position in the tree's group and the
last W in a window-W group, through the request's table in that group, and must find the KV of
exactly its prefix. `GroupSim.serve` runs one request the way the scheduler does (admit, chunks,
commits at chunk and prompt ends, slides), checking every read and that its hit is the deepest
point every group serves."""

from __future__ import annotations

import random

from radixkv.cache.grouped import GroupedCache, GroupedTable
from radixkv.cache.tokens import PackedTokens


def _kv(tokens: list[int], position: int) -> int:
    return hash(tuple(tokens[: position + 1]))


class GroupSim:
    def __init__(self, cache: GroupedCache) -> None:
        self.cache = cache
        self.kv: list[dict[tuple[int, int], int]] = [{} for _ in cache.groups]
        # tokens a query at position q reads before it, per group (None: all)
        self.reach = [getattr(g, "window", None) for g in cache.groups]

    def copies(self, table: GroupedTable) -> None:
        for store, t in zip(self.kv, table.tables, strict=True):
            if t.copy is not None:
                src, dst, slots = t.copy
                for s in range(slots):
                    store[(dst, s)] = store[(src, s)]

    def write(self, table: GroupedTable, tokens: list[int], start: int, end: int) -> None:
        B = self.cache.block_size
        for store, t in zip(self.kv, table.tables, strict=True):
            for p in range(start, end):
                block = t.blocks[p // B]
                assert block is not None, f"position {p} has no block"
                store[(block, p % B)] = _kv(tokens, p)

    def read(self, table: GroupedTable, tokens: list[int], query: int) -> None:
        B = self.cache.block_size
        for g, (store, t) in enumerate(zip(self.kv, table.tables, strict=True)):
            reach = self.reach[g]
            for p in range(0 if reach is None else max(0, query - reach + 1), query + 1):
                block = t.blocks[p // B]
                assert block is not None, f"group {g}: query {query} lost its key {p}"
                assert store[(block, p % B)] == _kv(tokens, p), (g, query, p)

    def check_hit(self, tokens: list[int], max_hit: int, hit: int) -> None:
        """`hit` is a point every group serves, and no deeper point up to the tree's match is."""
        cache = self.cache
        m, probe = cache._probe(PackedTokens(tokens), max_hit, None)
        assert hit <= m.num_cached_tokens
        assert all(g.find(probe, hit).end == hit for g in cache.groups[1:]), hit
        for p in range(hit + 1, m.num_cached_tokens + 1):
            assert min(g.find(probe, p).end for g in cache.groups[1:]) < p, (hit, p)

    def serve(self, rng: random.Random, tokens: list[int], num_prompt: int, chunk: int) -> int:
        cache = self.cache
        max_hit = num_prompt - 1
        expected = cache.match(tokens, max_tokens=max_hit).num_cached_tokens
        before = [repr(s) for s in cache.group_stats()]
        table = cache.admit(tokens, max_hit=max_hit, first_chunk=rng.choice([0, chunk]))
        if table is None:
            assert [repr(s) for s in cache.group_stats()] == before, "a refused admit changed"
            return -1
        cache.check_integrity()
        hit = table.num_cached_tokens
        assert hit == expected, "admit resumes where match said"
        self.check_hit(tokens, max_hit, hit)
        self.copies(table)
        pos = hit
        try:
            while pos < len(tokens):
                end = min(pos + chunk, len(tokens))
                if not cache.extend(table, end):
                    return -1
                cache.slide(table, pos)
                self.write(table, tokens, pos, end)
                for query in range(pos, end):
                    self.read(table, tokens, query)
                pos = end
                if pos <= num_prompt and rng.random() < 0.4:
                    cache.commit(table, tokens[:pos], prompt_end=pos == num_prompt)
                cache.check_integrity()
            cache.slide(table, len(tokens) - 1)
            cache.commit(table, tokens)  # every token written (never fewer than committed before)
            cache.check_integrity()
        finally:
            cache.close(table)
            cache.check_integrity()
        return hit
