"""The CUDA-graph decode path on the CPU: capture and replay faked, everything else real.

No GPU has run the graph path yet, so this harness runs it here: `capture_graph` is replaced by a
stand-in whose "graph" re-runs the captured forward on replay and writes its output where the
real graph would, and the Triton kernels run interpreted, reading the static input buffer on every
replay as the captured kernels would (the torch reference would read the metadata planned at
capture). What is real: bucketing, packing into the static buffer, pad rows, the fused Llama
modules, the kernels, the block-table width.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from tiny_llama import build_model

from radixkv.engine.config import EngineConfig
from radixkv.engine.step import cuda_graphs
from radixkv.engine.step.cuda_graphs import DecodeGraphs
from radixkv.engine.step.launch import token_feed
from radixkv.engine.step.model_runner import ModelRunner
from radixkv.engine.step.step_inputs import InputStager
from radixkv.kernels import use_backend
from radixkv.scheduler.output import BlockCopy, GroupPlan, ScheduledRequest, SchedulerOutput

pytestmark = pytest.mark.interpreter

BLOCK = 4


class ReplayingGraph:
    """Stands in for a captured graph: replay() recomputes `fn` into the captured output."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())

    def pool(self) -> None:
        return None


def fake_capture(fn, device, pool):
    fn()  # the warm-up run off the capture stream
    out = fn()
    return ReplayingGraph(fn, out), out


def _graph_runners() -> list[ModelRunner]:
    model = build_model("gqa")
    runners = []
    with use_backend("triton"):
        for graphs in (True, False):
            config = EngineConfig(block_size=BLOCK, num_blocks=32)
            runner = ModelRunner(build_model("gqa") if graphs else model, config)
            if graphs:  # built as the runner builds them: under inference mode
                with torch.inference_mode():
                    runner.decode_graphs = DecodeGraphs(
                        runner._forward, runner.stager, runner.kv_shapes, 3, max_model_len=40
                    )
            runners.append(runner)
    return runners


@pytest.fixture(scope="module")
def graph_runner():
    """(a runner whose decode steps replay fake graphs, an eager runner on a copy of the model).

    Shared by the module's tests (the capture is most of their time): each runs the same steps on
    both runners, so their caches stay equal, and each test's rows read only KV it wrote itself."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cuda_graphs, "capture_graph", fake_capture)
        patch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        yield _graph_runners()


def row(rid, tokens, start, table, window=False):
    """A sampled row; `window`: its window layers' table is the same blocks (their own pool)."""
    tables = (tuple(table), tuple(table)) if window else (tuple(table),)
    return ScheduledRequest(rid, tuple(tokens), start, tables, True)


def test_graph_replays_equal_eager_steps(graph_runner):
    """Prefill eager, then decode steps of 1, 2 and 3 rows (buckets 1, 2, 3: pad rows only in
    none; 2 rows replay bucket 2), one with a copy-on-write, one too wide for the graph."""
    graphs_runner, eager_runner = graph_runner
    graphs = graphs_runner.decode_graphs
    assert graphs.buckets == (1, 2, 3)
    assert graphs.max_blocks == 10  # the engine's 40 tokens, not the model's 1024 positions
    a, b = list(range(10, 19)), list(range(30, 35))
    steps = [
        SchedulerOutput(rows=(row("a", a, 0, [3, 7, 1]), row("b", b, 0, [5, 2]))),
        SchedulerOutput(rows=(row("a", [40], 9, [3, 7, 1]),)),
        SchedulerOutput(rows=(row("a", [41], 10, [3, 7, 1]), row("b", [42], 5, [5, 2]))),
        SchedulerOutput(
            rows=(row("b", [43], 6, [5, 2]), row("c", [44], 6, [5, 9])),
            plans=(GroupPlan(copies=(BlockCopy(src_block=2, dst_block=9, num_slots=2),)),),
        ),
        SchedulerOutput(rows=(row("d", [45], 40, [*range(11, 21), 21]),)),  # 11 blocks: eager
    ]
    with use_backend("triton"):
        for i, step in enumerate(steps):
            replays = graphs.num_replays
            expected = eager_runner.execute(step)
            got = graphs_runner.execute(step)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            assert graphs.num_replays - replays == (1 if i in (1, 2, 3) else 0), i
    torch.testing.assert_close(
        graphs_runner.kv[0].k_cache, eager_runner.kv[0].k_cache, rtol=1e-5, atol=1e-5
    )


def test_fed_tokens_reach_replays_and_eager_steps(graph_runner):
    """Overlapped steps' placeholders, fed on the device from the previous step's sampled tokens
    (`radixkv.engine.step.launch`), compute what the real tokens do: in a replay's static inputs and
    in an eager mixed step (the placeholder ends a decode row beside a prefill chunk)."""
    graphs_runner, eager_runner = graph_runner
    a, b, c = list(range(10, 19)), list(range(30, 35)), list(range(50, 56))
    prefill = SchedulerOutput(rows=(row("a", a, 0, [3, 7, 1]), row("b", b, 0, [5, 2])))
    real = SchedulerOutput(rows=(row("a", [40], 9, [3, 7, 1]), row("b", [41], 5, [5, 2])))
    held = SchedulerOutput(rows=(row("a", [0], 9, [3, 7, 1]), row("b", [0], 5, [5, 2])))
    mixed_real = SchedulerOutput(rows=(row("c", c, 0, [8, 9]), row("a", [42], 10, [3, 7, 1])))
    mixed_held = SchedulerOutput(rows=(row("c", c, 0, [8, 9]), row("a", [0], 10, [3, 7, 1])))
    sampled = torch.tensor([41, 40, 42])  # the previous step's tokens, in its own row order
    stager = InputStager(torch.device("cpu"))
    with use_backend("triton"):
        for runner in (eager_runner, graphs_runner):
            runner.execute(prefill)
        replays = graphs_runner.decode_graphs.num_replays
        expected = eager_runner.execute(real)
        got = graphs_runner.execute(held, token_feed(stager, [0, 1], [1, 0], sampled))
        assert graphs_runner.decode_graphs.num_replays == replays + 1
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        expected = eager_runner.execute(mixed_real)
        got = graphs_runner.execute(mixed_held, token_feed(stager, [6], [2], sampled))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        graphs_runner.kv[0].k_cache, eager_runner.kv[0].k_cache, rtol=1e-5, atol=1e-5
    )


def test_step_profile_stages_a_replay_as_the_runner_runs_it(graph_runner):
    """step_profile's replay timings write a bucket's inputs into the static buffer, an inference
    tensor: outside inference mode torch refuses that write, which is what crashed the profile's
    second section before it ran under inference mode."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "step_profile.py"
    spec = importlib.util.spec_from_file_location("step_profile", path)
    step_profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_profile)
    graphs = graph_runner[0].decode_graphs
    rows = step_profile._decode_step(2, 9, BLOCK).rows
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        graphs.run(rows)
    with use_backend("triton"):
        graph = step_profile.staged_graph(graphs, 2, 9, BLOCK)
    assert graph is graphs._graphs[2][0]
    assert graphs.static[:2].tolist() == [5, 5]  # the staged rows' input tokens


def test_graph_replays_of_window_softcap_and_sink_layers(monkeypatch):
    """GPT-OSS (window / full layers, sinks) and Gemma 2 (soft-cap, query_pre_attn_scalar):
    replayed decode steps past the window equal eager ones. Each layer's kind is fixed at
    capture, like the shapes the launches are computed from."""
    from tiny_archs import WINDOW, arch_config, tiny_model

    monkeypatch.setattr(cuda_graphs, "capture_graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    prompt = list(range(10, 10 + 3 * WINDOW))
    table = list(range(1, 1 + 4 * WINDOW // BLOCK))
    for arch in ("gpt-oss", "gemma2"):
        model = tiny_model(arch_config(arch))
        config = EngineConfig(block_size=BLOCK, num_blocks=32)
        with use_backend("triton"):
            eager = ModelRunner(model, config)
            graphs = ModelRunner(model, config)
            with torch.inference_mode():
                graphs.decode_graphs = DecodeGraphs(
                    graphs._forward,
                    graphs.stager,
                    graphs.kv_shapes,
                    2,
                    max_model_len=40,
                )
            for runner in (eager, graphs):
                runner.execute(SchedulerOutput(rows=(row("a", prompt, 0, table, True),)))
            for i in range(3):
                step = SchedulerOutput(rows=(row("a", [50 + i], len(prompt) + i, table, True),))
                replays = graphs.decode_graphs.num_replays
                expected = eager.execute(step)
                torch.testing.assert_close(graphs.execute(step), expected, rtol=1e-5, atol=1e-5)
                assert graphs.decode_graphs.num_replays == replays + 1


def test_graph_replays_of_latent_layers(monkeypatch):
    """DeepSeek V3's latent layers (two: a dense one, a MoE one): replayed decode steps of one
    and two rows equal eager ones, with the latent cache's plan made once at capture (every
    decode row attends absorbed)."""
    from tiny_archs import ARCHITECTURES, build_config, tiny_model

    monkeypatch.setattr(cuda_graphs, "capture_graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    model_type, fields = ARCHITECTURES["deepseek-v3"]
    model = tiny_model(build_config(model_type, **{**fields, "num_hidden_layers": 2}))
    config = EngineConfig(block_size=BLOCK, num_blocks=32)
    a, b = list(range(10, 23)), list(range(30, 36))
    prefill = SchedulerOutput(rows=(row("a", a, 0, [3, 7, 1, 9]), row("b", b, 0, [5, 2])))
    with use_backend("triton"):
        eager = ModelRunner(model, config)
        graphs = ModelRunner(model, config)
        assert graphs.kv[0].latent is not None
        with torch.inference_mode():
            graphs.decode_graphs = graphs.capture_decode_graphs(2, max_len=40)
        for runner in (eager, graphs):
            runner.execute(prefill)
        steps = [
            SchedulerOutput(rows=(row("a", [40], 13, [3, 7, 1, 9]),)),
            SchedulerOutput(rows=(row("a", [41], 14, [3, 7, 1, 9]), row("b", [42], 6, [5, 2]))),
        ]
        for step in steps:
            replays = graphs.decode_graphs.num_replays
            expected = eager.execute(step)
            torch.testing.assert_close(graphs.execute(step), expected, rtol=1e-5, atol=1e-5)
            assert graphs.decode_graphs.num_replays == replays + 1
    torch.testing.assert_close(graphs.kv[0].k_cache, eager.kv[0].k_cache, rtol=1e-5, atol=1e-5)


def test_a_forward_that_cannot_be_captured_runs_eager(monkeypatch, caplog):
    """A model whose decode forward cannot be captured (transformers' grouped MoE experts copy
    host tensors during the capture, which CUDA refuses) runs its decode steps eager, with a
    warning, instead of failing to load."""
    # A runner of its own: the captures below run its forward, which the shared ones must not see.
    with use_backend("triton"):
        runner = ModelRunner(build_model("gqa"), EngineConfig(block_size=BLOCK, num_blocks=32))

    def refuse(fn, device, pool):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    monkeypatch.setattr(cuda_graphs, "capture_graph", refuse)
    with use_backend("triton"), caplog.at_level("WARNING"):
        assert runner.capture_decode_graphs(3, 40) is None
    assert "CUDA graphs off: the decode step cannot be captured (Cannot copy" in caplog.text
    monkeypatch.setattr(cuda_graphs, "capture_graph", fake_capture)
    with use_backend("triton"):
        assert runner.capture_decode_graphs(3, 40) is not None


def test_a_model_another_runner_fused_loads_again():
    """A runner swaps the fused Llama modules into the model it is given; a second runner over
    the same model (a test, a benchmark reusing its model) probes transformers' own modules."""
    model = build_model("gqa")
    with use_backend("triton"):
        first = ModelRunner(model, EngineConfig(block_size=BLOCK, num_blocks=16))
        assert first.fused_modules
        second = ModelRunner(model, EngineConfig(block_size=BLOCK, num_blocks=16))
    assert second.fused_modules and second.layout.describe() == first.layout.describe()
    assert second.kv_shapes == first.kv_shapes
