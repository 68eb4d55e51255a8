"""Where a step's time goes, on `gpu_bench.py`'s ~1B random Llama (bf16, CUDA).

    python3 -P benchmarks/step_profile.py           # a GPU
    python3 -P benchmarks/step_profile.py --tiny    # the tiny model on the CPU: the plumbing

1. Host time per step phase over the decode workload (64 x 512 -> 256): schedule, execute (pack,
   copy, then a graph replay or eager launches), draw (queued behind the forward), finish (waits
   for the GPU, then reads the tokens), update (the scheduler's `fill`), and the rest of the
   engine's step; medians over the full-batch decodes.
   The engine runs its steps synchronously here (`async_scheduling=False`), so each phase shows:
   these are the host costs that overlapped steps hide (gpu_bench's `sync` system vs `on`).
2. GPU time of one graph replay per bucket at a 640-token context, beside its roofline (the
   weights and the K/V read at the copy bandwidth measured in the run; CUDA only).
3. The kernels of one bucket-64 replay by category (torch.profiler): GEMMs, radixkv's Triton
   kernels, everything else, and the largest (on the CPU: one eager decode step's ops); the
   GEMMs' time against reading the weights at the copy bandwidth.
4. A turn-6-like prefill step (32 rows x 129 new tokens over 2,432-token contexts): host enqueue
   time against GPU time, and the GPU time against the step's FLOPs at the measured matrix
   rate (CUDA only).
5. That prefill step's host time by Python function (cProfile; on the CPU: a small decode step).
6. The chat workload (gpu_bench's `run_chat`); its last turn's mean TTFT and its first step's
   host phases: schedule (of which the in-batch prefix deferral) and the step's wall time.
   `--host-shapes` runs the full workloads' shapes over the tiny model on the CPU: the host's
   share of that turn at full size, without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # siblings by name: these scripts run with -P
import roofline  # noqa: E402

OURS = ("_paged_attention", "_merge_splits", "_store_kv", "_copy_blocks", "_rms_norm", "_rope_")
GEMMS = ("gemm", "cutlass", "nvjet", "xmma", "cublas", "splitk", "aten::mm", "aten::addmm")


def _ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values) if values else float("nan")


def _load_gpu_bench() -> Any:
    path = Path(__file__).with_name("gpu_bench.py")
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def build_engine(tiny: bool, host_shapes: bool = False) -> tuple[Any, Any]:
    """The engine over gpu_bench's model (FULL on CUDA, TINY on the CPU) and that config;
    `host_shapes`: TINY's model and device with FULL's workloads."""
    from radixkv import LLM
    from radixkv.engine import freeze_startup_heap

    bench = _load_gpu_bench()
    cfg = bench.TINY if tiny else bench.FULL
    if host_shapes:
        model_fields = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate")
        tiny_model = {k: getattr(bench.TINY, k) for k in (*model_fields, "dtype", "device")}
        cfg = dataclasses.replace(bench.FULL, **tiny_model)
    t0 = time.perf_counter()
    llm = LLM(
        bench.build_model(cfg),
        device=cfg.device,
        dtype=cfg.dtype,
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        chunked_prefill_size=cfg.chunked_prefill_size,
        async_scheduling=False,
    )
    print(f"LLM() with KV cache, warm-up and graph capture: {time.perf_counter() - t0:.1f} s")
    freeze_startup_heap()
    return llm, cfg


def _sync(llm: Any) -> None:
    if llm.runner.device.type == "cuda":
        torch.cuda.synchronize(llm.runner.device)


def _timing(owner: Any, name: str, record: Callable[[float, Any], None]) -> Callable[[], None]:
    """Wrap `owner.name` to pass (seconds, result) to `record`; returns the undo."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = inner(*args, **kwargs)
        record(time.perf_counter() - t0, result)
        return result

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, inner)


def step_phases(llm: Any, cfg: Any, ceilings: Any) -> None:
    """Section 1: the decode workload with every step's phases timed."""
    import radixkv.engine.step as step_module
    from radixkv import SamplingParams

    current: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []

    def phase(label: str) -> Callable[[float, Any], None]:
        def record(seconds: float, result: Any) -> None:
            current[label] = seconds
            if label == "schedule":
                current["rows"] = len(result.rows)

        return record

    undo = [
        _timing(llm.scheduler, "schedule", phase("schedule")),
        _timing(llm.runner, "execute", phase("execute")),
        _timing(step_module, "draw", phase("draw")),
        _timing(llm._steps, "finish", phase("finish")),
        _timing(llm.scheduler, "fill", phase("update")),
        _timing(llm, "_run_step", lambda s, _: steps.append({**current, "step": s})),
    ]
    gen = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(1, cfg.vocab, (cfg.decode_prompt_tokens,), generator=gen).tolist()
        for _ in range(cfg.decode_prompts)
    ]
    try:
        _sync(llm)
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=cfg.decode_new_tokens, ignore_eos=True))
        _sync(llm)
        wall = time.perf_counter() - t0
    finally:
        for u in undo:
            u()
    full = [s for s in steps if s.get("rows") == cfg.decode_prompts]
    decodes = full[-(cfg.decode_new_tokens - 1) :]
    tokens = cfg.decode_prompts * cfg.decode_new_tokens
    print(
        f"\n## 1. decode workload {cfg.decode_prompts} x {cfg.decode_prompt_tokens} -> "
        f"{cfg.decode_new_tokens}: {wall:.3f} s, {tokens / wall:.0f} output tok/s, {len(steps)} "
        f"steps, {len(decodes)} full-batch decodes"
    )
    phases = ("schedule", "execute", "draw", "finish", "update")
    parts = {k: _ms([s[k] for s in decodes]) for k in phases}
    step = _ms([s["step"] for s in decodes])
    cells = ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
    print(f"median decode step {step:.3f} ms = {cells}, rest {step - sum(parts.values()):.3f} ms")
    print("  (finish waits for the GPU; host work = the other phases and the rest)")


def _decode_step(rows: int, context: int, block_size: int, first_block: int = 0) -> Any:
    from radixkv.scheduler.output import ScheduledRequest, SchedulerOutput

    per_row = -(-context // block_size)
    return SchedulerOutput(
        rows=tuple(
            ScheduledRequest(
                f"p{i}",
                (5,),
                context - 1,
                tuple(range(first_block + i * per_row, first_block + (i + 1) * per_row)),
                True,
            )
            for i in range(rows)
        )
    )


@torch.inference_mode()
def staged_graph(graphs: Any, rows: int, context: int, block_size: int) -> Any:
    """Replay the bucket of a `rows`-row decode step once, which leaves its inputs in the static
    buffer; returns that bucket's graph. Under inference mode, as the runner runs it: the static
    buffer is an inference tensor, which a write outside that mode refuses."""
    from radixkv.engine.cuda_graphs import choose_bucket

    graphs.run(_decode_step(rows, context, block_size).rows)
    return graphs._graphs[choose_bucket(rows, graphs.buckets)][0]


def replay_times(llm: Any, cfg: Any, ceilings: Any) -> None:
    """Section 2: GPU time per replay of each bucket."""
    graphs = llm.runner.decode_graphs
    context = 640
    model = roofline.Model.of(cfg)
    print(f"\n## 2. graph replay GPU time, context {context} (roofline: weights + K/V read)")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for bucket in graphs.buckets:
        graph = staged_graph(graphs, bucket, context, cfg.block_size)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 20
        floor = 1e3 * roofline.step_floor_s(model, [(1, context - 1)] * bucket, ceilings)
        print(
            f"bucket {bucket:3d}: {ms:.3f} ms per replay, roofline {floor:.3f} ({floor / ms:.2f})"
        )


def kernel_split(llm: Any, cfg: Any, ceilings: Any) -> None:
    """Section 3: one bucket-64 replay (CUDA) or one eager decode step (CPU), by category."""
    from torch.profiler import ProfilerActivity, profile

    cuda = llm.runner.device.type == "cuda"
    rows = min(64, cfg.max_num_seqs)
    if cuda:
        graph = staged_graph(llm.runner.decode_graphs, rows, 640, cfg.block_size)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        repeats, what = 5, f"one bucket-{rows} replay"
    else:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.runner.execute(_decode_step(rows, 32, cfg.block_size))
        repeats, what = 1, f"one eager decode step of {rows} rows (CPU ops, self time)"
    events = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", 0.0) if cuda else evt.self_cpu_time_total
        if us > 0:
            events.append((us / repeats, evt.count / repeats, evt.key))
    categories = {"GEMM": [0.0, 0.0], "radixkv Triton": [0.0, 0.0], "other": [0.0, 0.0]}
    for us, count, name in events:
        lowered = name.lower()
        if any(s in lowered for s in GEMMS):
            key = "GEMM"
        elif any(s in lowered for s in OURS):
            key = "radixkv Triton"
        else:
            key = "other"
        categories[key][0] += us
        categories[key][1] += count
    total = sum(v[0] for v in categories.values())
    print(f"\n## 3. kernels of {what}: {total / 1e3:.3f} ms in total")
    for key, (us, count) in categories.items():
        print(f"  {key}: {us / 1e3:.3f} ms in {count:.0f} calls")
    read_us = 1e6 * roofline.Model.of(cfg).weight_bytes / (ceilings.copy_gbps * 1e9)
    gemm_us = categories["GEMM"][0]
    if gemm_us > 0:
        print(
            f"  the GEMMs read the weights in {gemm_us / 1e3:.3f} ms, against "
            f"{read_us / 1e3:.3f} ms at the copy bandwidth: {read_us / gemm_us:.2f} of it"
        )
    for us, count, name in sorted(events, reverse=True)[:12]:
        print(f"  {us:9.1f} us  x{count:5.0f}  {name[:100]}")


PREFILL_SHAPE = (2432, 129, 32)  # context, new tokens, rows: turn 6 of gpu_bench's chat


def _prefill_step(cfg: Any) -> Any:
    from radixkv.scheduler.output import ScheduledRequest, SchedulerOutput

    context, new, rows = PREFILL_SHAPE
    per_row = -(-context // cfg.block_size)
    return SchedulerOutput(
        rows=tuple(
            ScheduledRequest(
                f"t{i}",
                tuple(range(100, 100 + new)),
                context - new,
                tuple(range(4000 + i * per_row, 4000 + (i + 1) * per_row)),
                True,
            )
            for i in range(rows)
        )
    )


def prefill_step(llm: Any, cfg: Any, ceilings: Any) -> None:
    """Section 4: the turn-6-like prefill: host enqueue time against GPU time."""
    context, new, rows = PREFILL_SHAPE
    step = _prefill_step(cfg)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        llm.runner.execute(step)
        enqueue = time.perf_counter() - t0
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append((enqueue, time.perf_counter() - t0, start.elapsed_time(end) / 1e3))
    enqueue, wall, gpu = (_ms([t[i] for t in times]) for i in range(3))
    bound = "host-bound: the GPU waited" if enqueue > 0.8 * wall else "GPU-bound"
    floor = 1e3 * roofline.step_floor_s(
        roofline.Model.of(cfg), [(new, context - new)] * rows, ceilings
    )
    print(
        f"\n## 4. turn-6-like prefill step ({rows} x {new} new over {context}): host enqueue "
        f"{enqueue:.2f} ms, wall {wall:.2f} ms, GPU {gpu:.2f} ms ({bound}); roofline "
        f"{floor:.2f} ms ({floor / gpu:.2f} of the GPU time)"
    )


def prefill_host_ops(llm: Any, cfg: Any, ceilings: Any) -> None:
    """Section 5: where the prefill step's host time goes: its Python functions by own time
    (cProfile: the Triton launchers and transformers' modules are Python too)."""
    import cProfile
    import pstats

    step = _prefill_step(cfg) if llm.runner.device.type == "cuda" else _decode_step(4, 32, 4)
    llm.runner.execute(step)
    _sync(llm)
    t0 = time.perf_counter()
    llm.runner.execute(step)
    enqueue = time.perf_counter() - t0
    _sync(llm)
    profiler = cProfile.Profile()
    profiler.enable()
    llm.runner.execute(step)
    profiler.disable()
    _sync(llm)
    print(f"\n## 5. host time of one prefill step: {enqueue * 1e3:.2f} ms enqueued; by function")
    print("  (cProfile, which slows what it measures: read the shares)")
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows)
    for (file, line, name), (_, calls, own, cumulative, _) in rows[:20]:
        where = f"{Path(file).name}:{line} {name}"
        print(
            f"  {100 * own / total:5.1f} %  own {own * 1e3:8.3f} ms  cum {cumulative * 1e3:8.3f}"
            f"  x{calls:5d}  {where[:80]}"
        )


class _LastTurnTimed:
    """gpu_bench's `System` over the engine: the last turn's first step timed by phase."""

    def __init__(self, llm: Any, cfg: Any) -> None:
        self.llm, self.turns_left = llm, cfg.chat_turns
        self.first_step: dict[str, float] = {}
        self.ttft_ms = float("nan")

    def generate(self, prompts: list[list[int]], max_new: int) -> Any:
        from radixkv import SamplingParams

        self.turns_left -= 1
        times: dict[str, float] = {}
        undo = []
        if self.turns_left == 0:
            sched = self.llm.scheduler

            def first(label: str) -> Callable[[float, Any], None]:
                def record(seconds: float, _: Any) -> None:
                    times.setdefault(label, seconds)

                return record

            def deferral(seconds: float, _: Any) -> None:
                if "step" not in times:  # the first step's calls only
                    times["deferral"] = times.get("deferral", 0.0) + seconds

            undo = [
                _timing(sched, "schedule", first("schedule")),
                _timing(sched, "_defer_for_in_batch_prefix", deferral),
                _timing(self.llm, "_run_step", first("step")),
            ]
        try:
            outs = self.llm.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
        finally:
            for u in undo:
                u()
        self.first_step = times
        self.ttft_ms = 1e3 * statistics.mean(o.stats.ttft_s for o in outs)
        return sys.modules["gpu_bench"].Generated([list(o.token_ids) for o in outs], None)


def chat_turns(llm: Any, cfg: Any, ceilings: Any) -> None:
    """Section 6: the chat workload, its last turn's TTFT and first step's host phases."""
    bench = sys.modules["gpu_bench"]
    system = _LastTurnTimed(llm, cfg)
    result = bench.run_chat(system, cfg)
    t = system.first_step
    prompt_tokens = cfg.chat_system_tokens + (2 * cfg.chat_turns - 1) * cfg.chat_turn_tokens
    print(
        f"\n## 6. chat {cfg.chat_conversations} x {cfg.chat_turns} turns: {result.total_s:.3f} s; "
        f"turn {cfg.chat_turns} ({cfg.chat_conversations} prompts of {prompt_tokens} tokens) "
        f"mean TTFT {system.ttft_ms:.1f} ms"
    )
    print(
        f"its first step: {1e3 * t['step']:.2f} ms wall, of which schedule "
        f"{1e3 * t['schedule']:.2f} ms (in-batch deferral {1e3 * t.get('deferral', 0.0):.2f} ms)"
    )


SECTIONS = {
    1: step_phases,
    2: replay_times,
    3: kernel_split,
    4: prefill_step,
    5: prefill_host_ops,
    6: chat_turns,
}
CUDA_ONLY = (2, 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU")
    parser.add_argument(
        "--host-shapes",
        action="store_true",
        help="the tiny model on the CPU under the full workloads' shapes (try --sections 6)",
    )
    parser.add_argument(
        "--sections", default="1,2,3,4,5,6", help="comma-separated section numbers (default: all)"
    )
    args = parser.parse_args(argv)
    tiny = args.tiny or args.host_shapes
    if not tiny and not torch.cuda.is_available():
        print("step_profile needs a CUDA device (or --tiny for the CPU)", file=sys.stderr)
        return 2
    llm, cfg = build_engine(tiny, args.host_shapes)
    ceilings = roofline.measure(torch.device(cfg.device), cfg.dtype, tiny=cfg.device == "cpu")
    print(ceilings.describe())
    cuda = llm.runner.decode_graphs is not None
    for number in sorted({int(n) for n in args.sections.split(",")}):
        if cuda or number not in CUDA_ONLY:
            SECTIONS[number](llm, cfg, ceilings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
