"""Scheduler test harness: a fake model, a reference KV simulation and step-by-step checks.

No model and no torch: the fake model's next token is a fixed function of the whole token history,
so a request's output is the same however it is batched, chunked, preempted or cached, and equals
`reference_output`. `KVSim` plays the KV cache: every slot holds a key of the prefix whose KV it
stores, so a row reading a wrong block, a missing copy-on-write or two requests writing one slot
show up as failed asserts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from radixkv.cache.grouped import GroupedCache
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.engine.config import EngineConfig
from radixkv.engine.sampling_params import SamplingParams
from radixkv.scheduler.config import SchedulerConfig
from radixkv.scheduler.output import SchedulerOutput
from radixkv.scheduler.request import Request
from radixkv.scheduler.scheduler import Scheduler

VOCAB = 1000
MAX_MODEL_LEN = 8192  # the context of a harness that names none


def fake_token(tokens: Sequence[int]) -> int:
    """The fake model: a hash of the whole history, in [1, VOCAB) (0 is never sampled)."""
    h = 17
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 4_294_967_291
    return 1 + h % (VOCAB - 1)


def reference_output(
    prompt: Sequence[int], max_tokens: int, stop_token_ids: Iterable[int], max_model_len: int
) -> list[int]:
    """What the fake model generates for a prompt run alone, token by token."""
    tokens, out = list(prompt), []
    while True:
        t = fake_token(tokens)
        out.append(t)
        tokens.append(t)
        if t in stop_token_ids:
            return out
        if len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


def prefix_keys(tokens: Sequence[int]) -> list[int]:
    """keys[p] identifies tokens[0..p]: the KV at position p depends on exactly that."""
    keys, h = [], 0
    for t in tokens:
        h = hash((h, t))
        keys.append(h)
    return keys


class KVSim:
    """Reference simulation of the paged KV memory: slot -> key of the prefix it holds."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.B = cache.block_size
        self.slots: dict[tuple[int, int], int] = {}  # (block, slot) -> prefix key

    def vouched_slots(self) -> dict[tuple[int, int], int]:
        """Slots the tree says hold valid KV, mapped to the node that vouches for them.

        A node starting mid-block also vouches for the leading slots of its first block: they hold
        its ancestors' KV (a co-owned block, or the copy-on-write copy its inserter made).
        """
        out: dict[tuple[int, int], int] = {}
        for node in self.cache.nodes():
            first = node.start // self.B
            for p in range(first * self.B, node.end):
                out[(node.block_ids[p // self.B - first], p % self.B)] = node.node_id
        return out

    def live_slots(self, scheduler: Scheduler) -> dict[tuple[int, int], set[str]]:
        """Slots running requests rely on (positions before their first uncomputed one), mapped
        to those requests. A request admitted this step relies on its copy-on-write copy too."""
        out: dict[tuple[int, int], set[str]] = {}
        for req in scheduler.running_requests:
            for p in range(req.num_computed_tokens):
                out.setdefault((req.table.tables[0].blocks[p // self.B], p % self.B), set()).add(
                    req.request_id
                )
        return out

    def step(self, output: SchedulerOutput, scheduler: Scheduler) -> None:
        """Apply the copies and the rows' writes; check every read and write.

        A write may only go to a slot nobody relies on: not one the tree vouches for, not one a
        running request has written, not one another row writes this step. A read (every position
        before a row's first) must find the KV of exactly the row's prefix, and nobody may write
        that slot in the same step.
        """
        B = self.B
        vouched = self.vouched_slots()
        live = self.live_slots(scheduler)
        for c in output.plan(0).copies:
            assert 0 < c.num_slots < B, c
            for i in range(c.num_slots):
                assert (c.src_block, i) in vouched, f"copy of a slot the tree does not hold: {c}"
                assert (c.dst_block, i) not in vouched, f"copy into a tree block: {c}"
                users = live.get((c.dst_block, i), set())
                assert len(users) == 1, f"copy into a slot {sorted(users)} rely on: {c}"
                self.slots[(c.dst_block, i)] = self.slots[(c.src_block, i)]
        writes: dict[tuple[int, int], tuple[str, int]] = {}  # slot -> (writer, prefix key)
        rows = []
        for row in output.rows:
            req = scheduler.get_request(row.request_id)
            assert req is not None, row
            keys = prefix_keys(req.all_token_ids)
            rows.append((row, keys))
            end = row.start_position + len(row.token_ids)
            assert len(row.block_tables[0]) == -(-end // B), f"table does not cover the row: {row}"
            for p in range(row.start_position, end):
                slot = (row.block_tables[0][p // B], p % B)
                rid = row.request_id
                assert slot not in writes, f"{rid} and {writes[slot][0]} both write {slot}"
                assert slot not in vouched, f"{rid} overwrites tree slot {slot}"
                assert slot not in live, f"{rid} overwrites {live[slot]}'s slot {slot}"
                writes[slot] = (rid, keys[p])
        for row, keys in rows:
            for p in range(row.start_position):
                slot = (row.block_tables[0][p // B], p % B)
                assert slot not in writes, f"{row.request_id} reads {slot}, written this step"
                assert self.slots.get(slot) == keys[p], f"{row.request_id}: wrong KV at {p}"
        for slot, (_, key) in writes.items():
            self.slots[slot] = key


@dataclass
class Harness:
    """Drives a scheduler with the fake model, checking everything after every step."""

    scheduler: Scheduler
    sim: KVSim
    outputs: list[SchedulerOutput] = field(default_factory=list)
    finished: dict[str, Request] = field(default_factory=dict)
    check_sim: bool = True
    # The overlapped step in flight: its output and the tokens the fake model sampled for it.
    launched: tuple[SchedulerOutput, dict[str, int]] | None = None

    @property
    def cache(self) -> GroupedCache:
        return self.scheduler.cache

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    @property
    def max_model_len(self) -> int:
        assert self.config.max_model_len is not None
        return self.config.max_model_len

    def add(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int = 8,
        *,
        eos: Sequence[int] = (),
        **params: object,
    ) -> Request:
        # The stop tokens as the engine gives them: the params' own, and EOS unless ignore_eos.
        stop = SamplingParams(max_tokens=max_tokens, **params).stop_tokens(eos)  # type: ignore[arg-type]
        req = Request(request_id, prompt, max_tokens, stop)
        self.scheduler.add_request(req)
        return req

    def step(
        self,
        model: Callable[[Sequence[int]], int] = fake_token,
        *,
        in_flight: Callable[[], object] | None = None,
    ) -> SchedulerOutput:
        """schedule(), check, run the fake model, update_from_output(), check integrity.
        `in_flight` is called between the forward and the update (e.g. to abort a request)."""
        sched, cfg = self.scheduler, self.config
        running = {r.request_id: r.num_tokens_to_compute for r in sched.running_requests}
        waiting = [r.request_id for r in sched.waiting_requests]
        out = sched.schedule()
        # A step with requests pending always runs something: an engine treats an empty step
        # as a fault (it could wait for ever).
        assert out.rows or not sched.has_unfinished(), "scheduled nothing with requests pending"
        self.check_output(out)
        self.check_decisions(out, running, waiting)
        if self.check_sim:
            self.sim.step(out, sched)
        sampled = {}
        for row in out.rows:
            if row.sample:
                req = sched.get_request(row.request_id)
                assert req is not None
                sampled[row.request_id] = model(req.all_token_ids)
        if in_flight is not None:
            in_flight()
        for req in sched.update_from_output(out, sampled):
            assert req.is_finished and req.request_id not in self.finished, req
            self.finished[req.request_id] = req
        sched.check_integrity()
        assert sched.num_running <= cfg.max_num_seqs
        self.outputs.append(out)
        return out

    def step_overlapped(
        self,
        model: Callable[[Sequence[int]], int] = fake_token,
        *,
        in_flight: Callable[[], object] | None = None,
    ) -> SchedulerOutput:
        """An overlapped engine's step (`radixkv.engine.overlap`): schedule(), run the fake model
        with the previous step's tokens fed over their placeholders (as the device does),
        advance(), then (`in_flight` called first) fill() the previous step's tokens."""
        sched = self.scheduler
        out = sched.schedule()
        previous, self.launched = self.launched, None
        fed = previous[1] if previous is not None else {}
        assert out.rows or previous is not None or not sched.has_unfinished(), "scheduled nothing"
        self.check_output(out)
        sampled = {}
        for row in out.rows:
            if row.sample:
                req = sched.get_request(row.request_id)
                assert req is not None
                history = list(req.all_token_ids)
                if row.request_id in fed:  # the row computes the placeholder: its real token
                    assert req.num_pending == 1, req
                    history[-1] = fed[row.request_id]
                else:
                    assert req.num_pending == 0, req
                sampled[row.request_id] = model(history)
        if out.rows:
            sched.record_launched(out)
            self.launched = (out, sampled)
        if in_flight is not None:
            in_flight()
        if previous is not None:
            for req in sched.fill(*previous):
                if req.is_finished:
                    assert req.request_id not in self.finished, req
                    self.finished[req.request_id] = req
        sched.check_integrity()
        self.outputs.append(out)
        return out

    def check_output(self, out: SchedulerOutput) -> None:
        sched, cfg, B = self.scheduler, self.config, self.cache.block_size
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens, out
        assert len(out.rows) <= cfg.max_num_seqs, out
        ids = [r.request_id for r in out.rows]
        assert len(set(ids)) == len(ids), f"a request twice in one step: {ids}"
        for row in out.rows:
            req = sched.get_request(row.request_id)
            assert req is not None and req.status.value == "running", row
            end = row.start_position + len(row.token_ids)
            assert 1 <= len(row.token_ids) <= cfg.chunked_prefill_size, row
            assert row.start_position == req.num_computed_tokens, (row, req)
            assert row.token_ids == tuple(req.all_token_ids[row.start_position : end]), row
            assert row.sample == (end == req.num_tokens), row
            assert len(row.block_tables[0]) == -(-end // B), row

    def check_decisions(
        self, out: SchedulerOutput, running: dict[str, int], waiting: list[str]
    ) -> None:
        """The step's choices, given the running requests before it (admission order -> tokens
        left) and the waiting queue before it: rows are running decodes, then running prefills,
        then admissions (with `prefill_first` and a queue: running prefills, admissions, and
        decodes only if nothing was admitted); a victim is
        the most recently admitted running request without a row; victims go back to the front
        of the queue, the latest first; a step that preempted admits only if no running request
        got a row; FCFS without deferral admits a prefix of the queue."""
        cfg = self.config
        ids = [r.request_id for r in out.rows]
        # A victim can be readmitted in its step (by the idle-cache fallback): then it is new.
        new = [rid for rid in ids if rid not in running or rid in out.preempted_ids]
        old = [rid for rid in ids if rid not in new]
        assert all(rid in waiting or rid in out.preempted_ids for rid in new), out
        chunks = [rid for rid in old if running[rid] > 1]
        decodes = [rid for rid in old if running[rid] <= 1]
        if cfg.prefill_first and waiting:
            assert ids == chunks + new + decodes, f"row order: {ids}"
            assert not (new and decodes), f"a decode beside admissions: {ids}"
        else:
            assert ids == old + new, f"row order: {ids}"
            assert old == decodes + chunks, f"running rows out of order: {ids}"
        order = list(running)  # admission order
        for kind in (chunks, decodes):
            assert kind == [rid for rid in order if rid in kind], f"out of order: {ids}"
        unscheduled = [rid for rid in running if rid not in old]
        victims = unscheduled[::-1][: len(out.preempted_ids)]
        assert list(out.preempted_ids) == victims, (out.preempted_ids, running, ids)
        if out.preempted_ids and old:
            assert not new, f"admitted in a step that preempted: {ids}"
        queue = [*out.preempted_ids[::-1], *waiting]
        after = [rid for rid in queue if rid not in new]
        assert [r.request_id for r in self.scheduler.waiting_requests] == after, queue
        if cfg.policy == "fcfs" and not (
            cfg.enable_prefix_cache and cfg.defer_shared_prefix_tokens
        ):
            assert new == queue[: len(new)], f"FCFS admitted {new} from {queue}"

    def run(self, max_steps: int = 10_000, arrivals: dict[int, Iterable[Request]] | None = None):
        """Step until nothing is left (adding `arrivals[step]` before each step)."""
        arrivals = dict(arrivals or {})
        for i in range(max_steps):
            for req in arrivals.pop(i, ()):
                self.scheduler.add_request(req)
            if not self.scheduler.has_unfinished() and not arrivals:
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def reference(self, req: Request) -> list[int]:
        """The request's output when run alone, token by token."""
        return reference_output(
            req.prompt_token_ids, req.max_tokens, req.stop_token_ids, self.max_model_len
        )

    def assert_no_leak(self) -> None:
        """Nothing in use; every block is free or cached (evictable)."""
        s = self.cache.stats()
        assert not self.scheduler.has_unfinished()
        assert s.num_in_use_blocks == 0 and s.num_private_blocks == 0, s
        assert s.num_locked_tables == 0, s
        assert s.num_free_blocks == s.num_blocks - s.num_evictable_blocks, s
        self.scheduler.check_integrity()


def make_harness(num_blocks: int = 64, block_size: int = 4, **config: object) -> Harness:
    cache = PrefixCache(num_blocks=num_blocks, block_size=block_size)
    config = {"max_model_len": MAX_MODEL_LEN, **config}
    scheduler = Scheduler(GroupedCache([cache]), EngineConfig(**config))  # type: ignore[arg-type]
    return Harness(scheduler, KVSim(cache))
