"""The machine's two ceilings, measured in the run, and the floor they put under each benchmark row.

A decode step must read every weight once and the K/V of every context token; a prefill must do
its FLOPs (the linear layers' 2 per weight per token, attention's 4 * head_dim per query head per
visible key). Time at the measured copy bandwidth (bytes) or the measured bf16 matrix rate
(FLOPs), whichever is longer, is the floor: no implementation runs faster. The benchmarks print
measured figures beside `floor / measured` (1.0 is the roofline).

The model is gpu_bench's Llama (any object with its config fields); the workloads are its chat and
decode workloads. A system that reuses cached prefixes computes only what its cache lacks; one
that does not recomputes every prompt.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written per second / 1e9
    matmul_tflops: float  # the model dtype's matrix product on random data

    def describe(self) -> str:
        return (
            f"ceilings measured in this run: copy {self.copy_gbps:.0f} GB/s (read + write), "
            f"matrix product {self.matmul_tflops:.0f} TFLOP/s"
        )


def _median_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Host-timed median ms per call: triton's do_bench on CUDA (L2 flushed), a few plain
    calls elsewhere (the CPU figures only exercise the plumbing)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def copy_gbps(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Device-to-device copy of a buffer far larger than L2: (read + write) bytes per second.
    Host-timed: a millisecond copy has no launch gap worth removing, and the same copy captured
    in a CUDA graph ran slower than launched (benchmarks/RESULTS.md, first H200 run)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device)
    return 2 * num_bytes / ms / 1e6


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float:
    """An n x n x n product on random data (zeros ran 13 % faster on an H200)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    ms = _median_ms(lambda: a @ b, device)
    return 2 * n**3 / ms / 1e9


def measure(device: torch.device, dtype: torch.dtype, tiny: bool = False) -> Ceilings:
    """Both ceilings; `tiny`: small sizes (a CPU dry run: the plumbing, not a figure)."""
    if tiny:
        return Ceilings(copy_gbps(device, 1 << 20), matmul_tflops(device, dtype, 128))
    return Ceilings(copy_gbps(device), matmul_tflops(device, dtype))


def fraction(floor_s: float, measured_s: float | None) -> float | None:
    """floor / measured: 1.0 at the roofline."""
    if measured_s is None or measured_s <= 0:
        return None
    return floor_s / measured_s


# ------------------------------------------------------------------------------- the model


class Model:
    """What the floor needs of a Llama: its weights, KV bytes and FLOPs. `cfg` is anything with
    gpu_bench's model fields (hidden, layers, heads, kv_heads, head_dim, intermediate, vocab,
    dtype)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.elem = torch.empty(0, dtype=cfg.dtype).element_size()

    @classmethod
    def of(cls, cfg: Any) -> Model:
        return cls(cfg)

    @property
    def layer_params(self) -> int:
        c = self.cfg
        attention = c.hidden * c.head_dim * (2 * c.heads + 2 * c.kv_heads)
        return c.layers * (attention + 3 * c.hidden * c.intermediate)

    @property
    def weight_bytes(self) -> int:
        """Read once per forward: every layer and the LM head (embeddings: a few rows)."""
        return (self.layer_params + self.cfg.vocab * self.cfg.hidden) * self.elem

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        return 2 * c.layers * c.kv_heads * c.head_dim * self.elem

    def attention_flops(self, new: int, prefix: int) -> float:
        """QK^T and PV of `new` causal queries after `prefix` cached keys."""
        visible = new * prefix + new * (new + 1) / 2
        return 4.0 * self.cfg.layers * self.cfg.heads * self.cfg.head_dim * visible

    def forward_flops(self, rows: Sequence[tuple[int, int]]) -> float:
        """One forward over rows of (new tokens, cached prefix); logits for each row's last."""
        tokens = sum(new for new, _ in rows)
        logits = 2.0 * self.cfg.vocab * self.cfg.hidden * len(rows)
        linear = 2.0 * self.layer_params * tokens + logits
        return linear + sum(self.attention_flops(new, prefix) for new, prefix in rows)


def step_floor_s(model: Model, rows: Sequence[tuple[int, int]], ceilings: Ceilings) -> float:
    """One forward step: reading the weights and every row's K/V, or its FLOPs, the longer."""
    kv = sum(new + prefix for new, prefix in rows) * model.kv_bytes_per_token
    read_s = (model.weight_bytes + kv) / (ceilings.copy_gbps * 1e9)
    compute_s = model.forward_flops(rows) / (ceilings.matmul_tflops * 1e12)
    return max(read_s, compute_s)


def decode_steps_floor_s(
    model: Model, contexts: Sequence[int], steps: int, ceilings: Ceilings
) -> float:
    """`steps` decode steps of one token per request after `contexts` tokens, each growing."""
    return sum(step_floor_s(model, [(1, c + j) for c in contexts], ceilings) for j in range(steps))


# ---------------------------------------------------------------------------- the workloads


def _prefill_floor_s(
    model: Model, rows: Sequence[tuple[int, int]], step_tokens: int, ceilings: Ceilings
) -> float:
    """Rows prefilled in steps of at most `step_tokens` new tokens (rows split across steps)."""
    total, step, room = 0.0, [], step_tokens
    for new, prefix in rows:
        while new:
            take = min(new, room)
            step.append((take, prefix))
            new, prefix, room = new - take, prefix + take, room - take
            if room == 0:
                total += step_floor_s(model, step, ceilings)
                step, room = [], step_tokens
    return total + (step_floor_s(model, step, ceilings) if step else 0.0)


@dataclass(frozen=True, slots=True)
class ChatFloor:
    total_s: float
    turn_prefill_s: list[float]  # each turn's prefill: the floor under its TTFT


def chat_floor(cfg: Any, ceilings: Ceilings, reuses_prefixes: bool) -> ChatFloor:
    """gpu_bench's chat: turn t's prompt is the system prompt, t earlier turns (user + reply)
    and a new user message. With prefix reuse a turn computes the system prompt once (turn 1,
    shared in the batch) and then per conversation the new message plus the previous reply's
    last token (sampled, never fed); without, every prompt whole."""
    model = Model.of(cfg)
    system, turn, convs = cfg.chat_system_tokens, cfg.chat_turn_tokens, cfg.chat_conversations
    total, prefills = 0.0, []
    for t in range(cfg.chat_turns):
        prompt = system + (2 * t + 1) * turn
        if not reuses_prefixes:
            rows = [(prompt, 0)] * convs
        elif t == 0:
            rows = [(system + turn, 0)] + [(turn, system)] * (convs - 1)
        else:
            rows = [(turn + 1, prompt - turn - 1)] * convs
        prefill = _prefill_floor_s(model, rows, cfg.max_num_batched_tokens, ceilings)
        prefills.append(prefill)
        total += prefill + decode_steps_floor_s(model, [prompt] * convs, turn - 1, ceilings)
    return ChatFloor(total, prefills)


def decode_workload_floor_s(cfg: Any, ceilings: Ceilings) -> float:
    """gpu_bench's decode: every prompt prefilled, then one token per request per step."""
    model = Model.of(cfg)
    rows = [(cfg.decode_prompt_tokens, 0)] * cfg.decode_prompts
    prefill = _prefill_floor_s(model, rows, cfg.max_num_batched_tokens, ceilings)
    contexts = [cfg.decode_prompt_tokens] * cfg.decode_prompts
    return prefill + decode_steps_floor_s(model, contexts, cfg.decode_new_tokens - 1, ceilings)
