"""The latent cache's speed goals on a CPU: decode step time against expanded K / V, warm TTFT.

A tiny random model of DeepSeek V3's class (`deepseek_v3`: its MLA, its grouped MoE routing, a
dense first layer) with V3's per-head sizes by default (kv_lora_rank 512, RoPE 64, nope 128,
V 128) and few heads, layers and experts, runs through `LLM` twice, in one process:

    latent     as radixkv runs it: one latent vector a token and layer (swap_latent_modules)
    expanded   the same engine, scheduler and cache, the same weights, with MLA's keys and values
               up-projected per token before they are stored (`ExpandedMLA`): the paged K / V
               layout every other model uses, V zero-padded to the key's head size as vLLM's
               non-MLA path for DeepSeek pads it (the K / V kernels take one head size)

transformers' own module cannot be that baseline: it caches the latents and expands the whole
context at every step, which no paged engine does.

Rounds interleave the two sides (order alternating), so both face the same machine load:

    decode  `--batch` requests of a `--context`-token prompt (the same prompts every round: after
            the first the cache serves all but their last token), `--decode` tokens each; every
            engine step after the last prefill is timed. Goal: latent / expanded <= 1.2x.
    ttft    a `--conversation`-token first turn on a cold cache (fresh tokens every round: one
            chunked prefill), then the next turn (that turn, a `--reply`-token reply, a
            `--turn`-token question), whose prefix the cache holds. Goal: warm / cold <= 0.3x.

Each figure is the median over rounds of wall time and CPU time of the process
(`time.process_time`, all threads); the load average is printed beside them. One torch thread by
default (two stall on OpenMP spin-waits when the other core is busy). Greedy tokens of the two
sides are compared: they compute the same function, in different orders.

    python benchmarks/latent_engine_bench.py [--rounds 5] [--context 2048] [--conversation 2048]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_archs import build_config, save_tiny_model
from tiny_llama import VOCAB_SIZE

from radixkv import LLM, SamplingParams
from radixkv.engine.model import attention_layout

SIDES = ("latent", "expanded")
DECODE_GOAL, TTFT_GOAL = 1.2, 0.3


class ExpandedMLA(v3.DeepseekV3Attention):
    """DeepSeek V3's MLA with keys and values expanded per token into the paged K / V cache: the
    new tokens' latents up-projected by kv_b_proj, K = [k_nope | k_rope] and V zero-padded to
    K's head size, stored and attended through the engine's K / V hooks (`radixkv.engine.step.
    attention`); the padded columns of the output dropped before o_proj. The same function as
    transformers' module."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        batch, num_tokens = hidden_states.shape[:-1]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(batch, num_tokens, -1, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden_states)
        latent, k_rope = compressed.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(batch, 1, num_tokens, self.kv_lora_rank)
        k_rope = k_rope.view(batch, 1, num_tokens, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        rope = (
            v3.apply_rotary_pos_emb_interleave
            if self.config.rope_interleave
            else v3.apply_rotary_pos_emb
        )
        q_rope, k_rope = rope(q_rope, k_rope, cos, sin)
        key, value = self.expand_kv(latent, k_rope)  # this step's tokens only
        value = F.pad(value, [0, self.qk_head_dim - self.v_head_dim])
        key, value = cache.update(key, value, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, _ = attend(
            self,
            torch.cat((q_nope, q_rope), dim=-1),
            key,
            value,
            attention_mask,
            scaling=self.scaling,
            **kwargs,
        )  # [batch, tokens, heads, qk_head_dim]
        out = out[..., : self.v_head_dim].reshape(batch, num_tokens, -1)
        return self.o_proj(out), None


def _expand_mla(model: torch.nn.Module) -> None:
    """Stands in for `swap_latent_modules` on the expanded side: MLA modules get `ExpandedMLA`'s
    forward (same weights) and the model reports no latent layers."""
    for m in model.modules():
        if type(m) is v3.DeepseekV3Attention:
            m.__class__ = ExpandedMLA


@contextmanager
def _expanded_loading() -> Iterator[None]:
    swap = attention_layout.swap_latent_modules
    attention_layout.swap_latent_modules = _expand_mla  # type: ignore[assignment]
    try:
        yield
    finally:
        attention_layout.swap_latent_modules = swap


def v3_shaped_config(args: argparse.Namespace) -> Any:
    """DeepSeek V3's attention per head (unless the sizes are given), at `args`' scale."""
    experts = 8
    return build_config(
        "deepseek_v3",
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_rope_head_dim=args.rope_dim,
        qk_nope_head_dim=args.nope_dim,
        v_head_dim=args.v_dim,
        n_routed_experts=experts,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=args.hidden // 2,
        first_k_dense_replace=1,
        max_position_embeddings=2 * (args.context + args.conversation) + 256,
    )


def load_sides(path: Path, args: argparse.Namespace) -> dict[str, LLM]:
    # Room for the decode batch and two conversations: what a round reads is never evicted.
    tokens = args.batch * (args.context + args.decode) + 2 * (args.conversation + 2 * args.turn)
    settings = dict(
        block_size=args.block_size,
        num_blocks=-(-tokens // args.block_size) + 4 * args.batch + 16,
        chunked_prefill_size=args.chunk,
        max_num_batched_tokens=max(args.chunk, args.batch),
        max_num_seqs=args.batch,
        num_threads=args.threads,
    )
    latent = LLM(str(path), **settings)
    with _expanded_loading():
        expanded = LLM(str(path), **settings)
    assert latent.runner.layout.latent is not None and expanded.runner.layout.latent is None
    return {"latent": latent, "expanded": expanded}


class Timing(NamedTuple):
    wall_s: float
    cpu_s: float


@contextmanager
def _timed(into: list[Timing]) -> Iterator[None]:
    w0, c0 = time.perf_counter(), time.process_time()
    yield
    into.append(Timing(time.perf_counter() - w0, time.process_time() - c0))


def decode_round(
    llm: LLM, prompts: list[list[int]], new_tokens: int
) -> tuple[list[Timing], list[list[int]]]:
    """(timings of the decode-only steps, each request's tokens) of one batch."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    steps: list[Timing] = []
    while llm.has_unfinished_requests():
        decoding = all(tokens[i] for i in ids)  # every prompt computed: a decode step
        with _timed(steps if decoding else []):
            updates = llm.step()
        for u in updates:
            tokens[u.request_id].extend(u.new_token_ids)
    llm.check_integrity()
    return steps, [tokens[i] for i in ids]


def first_token(llm: LLM, prompt: list[int]) -> tuple[Timing, int]:
    """Time to the first token of `prompt` (a generate of one token), and that token."""
    into: list[Timing] = []
    with _timed(into):
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    return into[0], out.token_ids[0]


def ttft_round(
    llm: LLM, rng: random.Random, args: argparse.Namespace
) -> tuple[Timing, Timing, list[int]]:
    """(cold, warm) time to first token of a fresh conversation's first turn and of the next,
    and the tokens the turns got (the first token, the reply, the next turn's first)."""
    first = _tokens(rng, args.conversation)
    cold, first_token_id = first_token(llm, first)
    (reply,) = llm.generate([first], SamplingParams(max_tokens=args.reply, ignore_eos=True))
    warm, next_token_id = first_token(llm, first + list(reply.token_ids) + _tokens(rng, args.turn))
    llm.check_integrity()
    return cold, warm, [first_token_id, *reply.token_ids, next_token_id]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


def _median(timings: list[Timing]) -> Timing:
    return Timing(*(statistics.median(t[i] for t in timings) for i in range(2)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every round of both sides, interleaved; the medians and whether the sides agree."""
    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        path = save_tiny_model(v3_shaped_config(args), Path(folder))
        sides = load_sides(path, args)
    rng = random.Random(0)
    prompts = [_tokens(rng, args.context) for _ in range(args.batch)]
    decode: dict[str, list[Timing]] = {s: [] for s in SIDES}
    cold: dict[str, list[Timing]] = {s: [] for s in SIDES}
    warm: dict[str, list[Timing]] = {s: [] for s in SIDES}
    outputs: dict[str, list] = {s: [] for s in SIDES}
    for r in range(args.rounds + 1):  # round 0 warms both sides up (prefills the prompts)
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for side in order:
            steps, tokens = decode_round(sides[side], prompts, args.decode)
            c, w, turns = ttft_round(sides[side], random.Random(1000 + r), args)
            if r:
                decode[side].append(_median(steps))
                cold[side].append(c)
                warm[side].append(w)
            outputs[side].append((tokens, turns))
    return {
        "decode": {s: _median(decode[s]) for s in SIDES},
        "cold": {s: _median(cold[s]) for s in SIDES},
        "warm": {s: _median(warm[s]) for s in SIDES},
        "same_tokens": outputs["latent"] == outputs["expanded"],
        "load": (load_at_start, os.getloadavg()),
        "kv_bytes_per_token": {
            s: sum(kv.bytes_per_block for kv in sides[s].runner.kv) // args.block_size
            for s in SIDES
        },
    }


def report(result: dict[str, Any], args: argparse.Namespace, print_: Callable = print) -> None:
    start, end = (" / ".join(f"{x:.2f}" for x in load) for load in result["load"])
    print_(
        f"tiny DeepSeek V3 shape: {args.layers} layers, {args.heads} heads, hidden {args.hidden},"
        f" L {args.kv_lora_rank}, R {args.rope_dim}, P {args.nope_dim}, V {args.v_dim};"
        f" fp32, block {args.block_size}, {args.threads} torch thread(s), {args.rounds} rounds"
    )
    print_(f"load average (1 / 5 / 15 min) at the start: {start}, at the end: {end}")
    kv = result["kv_bytes_per_token"]
    print_(f"KV bytes a token: latent {kv['latent']:,}, expanded {kv['expanded']:,}")
    print_("side     | decode step ms (wall / cpu) | cold ttft ms (wall / cpu) | warm ttft ms")
    for s in SIDES:
        d, c, w = result["decode"][s], result["cold"][s], result["warm"][s]
        print_(
            f"{s:<8} | {_ms(d)} | {_ms(c)} | {_ms(w)}"
            f"   (batch {args.batch} x {args.context} context; {args.conversation}-token turn)"
        )
    d_lat, d_exp = result["decode"]["latent"], result["decode"]["expanded"]
    print_(
        f"decode latent / expanded: wall {d_lat.wall_s / d_exp.wall_s:.2f}x,"
        f" cpu {d_lat.cpu_s / d_exp.cpu_s:.2f}x (goal <= {DECODE_GOAL}x)"
    )
    for s in SIDES:
        c, w = result["cold"][s], result["warm"][s]
        goal = f" (goal <= {TTFT_GOAL}x)" if s == "latent" else ""
        print_(
            f"ttft warm / cold, {s}: wall {w.wall_s / c.wall_s:.2f}x,"
            f" cpu {w.cpu_s / c.cpu_s:.2f}x{goal}"
        )
    print_(f"greedy tokens of the two sides equal: {result['same_tokens']}")


def _ms(t: Timing) -> str:
    return f"{1000 * t.wall_s:8.2f} / {1000 * t.cpu_s:8.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--q-lora-rank", type=int, default=192)
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--nope-dim", type=int, default=128)
    parser.add_argument("--v-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=2048, help="decode: prompt tokens")
    parser.add_argument("--decode", type=int, default=16, help="decode: tokens a request")
    parser.add_argument("--conversation", type=int, default=2048, help="ttft: first turn")
    parser.add_argument("--reply", type=int, default=32, help="ttft: the first turn's reply")
    parser.add_argument("--turn", type=int, default=32, help="ttft: the next question")
    parser.add_argument("--chunk", type=int, default=512, help="chunked prefill size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    report(run(args), args)


if __name__ == "__main__":
    main()
