"""The scheduler over a window group beside the tree's, with the fake model: window layers'
reads find their KV, memory follows W.

The harness (`scheduler_harness.py`) checks the full group (`KVSim` over the tree's blocks) and
the outputs against the reference; `WindowSim` plays the window layers' memory: each row's queries
read the W - 1 positions before its first token through its window block table, and must find the
KV of exactly its prefix there (a released block reused too early, a missing window copy or a
tail taken for the wrong prefix shows up).
"""

from __future__ import annotations

import pytest
from scheduler_harness import MAX_MODEL_LEN, Harness, KVSim, prefix_keys
from window_cache import window_cache

from radixkv.cache.window import window_budget
from radixkv.engine.config import EngineConfig
from radixkv.scheduler.output import SchedulerOutput
from radixkv.scheduler.scheduler import Scheduler

W = 8


class WindowSim:
    """(window block, slot) -> key of the prefix whose window KV it holds."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.B = scheduler.cache.block_size
        self.slots: dict[tuple[int, int], int] = {}

    def step(self, out: SchedulerOutput) -> None:
        B = self.B
        for c in out.plan(1).copies:
            for i in range(c.num_slots):
                self.slots[(c.dst_block, i)] = self.slots[(c.src_block, i)]
        writes = {}
        for row in out.rows:
            req = self.scheduler.get_request(row.request_id)
            assert req is not None, row
            keys, table, start = (
                prefix_keys(req.all_token_ids),
                row.block_tables[1],
                row.start_position,
            )
            assert len(table) == len(row.block_tables[0]), row
            for p in range(max(0, start - W + 1), start):
                assert self.slots.get((table[p // B], p % B)) == keys[p], f"{row}: window KV at {p}"
            for p in range(start, start + len(row.token_ids)):
                slot = (table[p // B], p % B)
                assert slot not in writes, f"{row} writes {slot}, written this step"
                writes[slot] = keys[p]
        self.slots.update(writes)


def make(num_window_blocks: int, *, block_size: int = 4, **config: object) -> Harness:
    cache = window_cache(64, num_window_blocks, block_size, W)
    settings = {"max_model_len": MAX_MODEL_LEN, **config}
    scheduler = Scheduler(cache, EngineConfig(block_size=block_size, **settings))  # type: ignore[arg-type]
    return Harness(scheduler, KVSim(cache.tree))


@pytest.mark.parametrize("cache_on", [True, False])
@pytest.mark.parametrize(("block_size", "num_window_blocks"), [(1, 40), (4, 10), (4, 40), (16, 8)])
def test_window_reads_find_their_kv_and_outputs_equal_the_reference(
    cache_on, block_size, num_window_blocks
):
    h = make(
        num_window_blocks,
        block_size=block_size,
        max_num_seqs=3,
        max_num_batched_tokens=12,
        chunked_prefill_size=5,
        enable_prefix_cache=cache_on,
    )
    sched = h.scheduler
    assert window_budget(W, block_size, 5) <= num_window_blocks
    wsim, schedule = WindowSim(sched), sched.schedule
    last: list[SchedulerOutput] = []

    def recorded() -> SchedulerOutput:
        last[:] = [schedule()]
        return last[0]

    sched.schedule = recorded  # type: ignore[method-assign]
    shared = list(range(10, 10 + 3 * W))
    prompts = [shared + [i, i + 1] for i in range(4)] + [list(range(50, 50 + 4 * W))] * 2
    reqs = [h.add(f"r{i}", p, max_tokens=6 + i) for i, p in enumerate(prompts)]
    peak = 0
    for _ in range(500):
        if not sched.has_unfinished():
            break
        h.step(in_flight=lambda: wsim.step(last[0]))
        for req in sched.running_requests:
            peak = max(peak, req.table.tables[1].num_live_blocks)
    assert not sched.has_unfinished()
    assert [h.finished[r.request_id].output_token_ids for r in reqs] == [
        h.reference(r) for r in reqs
    ]
    assert peak <= window_budget(W, block_size, 5)
    window = sched.cache.groups[1]
    assert window.pool.num_free + window.num_evictable_blocks() == num_window_blocks
    if num_window_blocks == 10:  # short of window blocks: tails go, requests wait or restart
        assert sched.num_preemptions + window.num_evicted_tails > 0
    if cache_on and num_window_blocks == 40:  # r5 repeats r4: it resumes at a tail r4 kept
        assert h.finished["r5"].num_cached_tokens > 2 * W
