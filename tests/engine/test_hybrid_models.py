"""Hybrid models through `LLM`: recurrent layers (Gated DeltaNet, Kimi Delta Attention, Mamba-2,
short convolutions) beside full or latent attention, greedy output equal to transformers' token
for token, cold and warm.

Tiny random models of each family (`tiny_archs.HYBRIDS`). The workload is a chat's shape: three
prompts sharing a 28-token prefix, the first alone (the tree then holds the prefix, so the other
two are snapshotted where they leave it), then a warm round that resumes from the snapshots:
the first and third conversations' next turns (prompt + reply + a new message: from their
finished ends) and the second prompt again (from the junction at 28). Resuming from a snapshot
that held another state, or a copy run out of order, changes the greedy output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_archs import HYBRIDS, build_arch, greedy_tokens
from tiny_llama import random_prompts

from radixkv import LLM, RequestOutput, SamplingParams
from radixkv.cache.group import GroupSpec
from radixkv.cache.state import StateSpec
from radixkv.engine.step.recurrent import RecurrentStates
from radixkv.engine.step.recurrent.gated_deltanet import PackedQwen3_5GatedDeltaNet
from radixkv.engine.step.recurrent.kimi_delta_attention import PackedKimiLinearDeltaAttention
from radixkv.serve.cache_view import capture

PREFIX = 28
MAX_NEW = [7, 6, 8]
GAP = dict(snapshot_min_gap_tokens=4)
VARIANTS = {f"b{size}": dict(GAP, block_size=size, num_blocks=2048 // size) for size in (1, 16, 64)}
# Chunks of 5 tokens: chunk ends, blocks and snapshot points all disagree.
VARIANTS["chunked"] = dict(
    GAP, block_size=4, num_blocks=512, chunked_prefill_size=5, max_num_batched_tokens=8
)
# Overlapped steps: the next step is scheduled before the last one's tokens are read, so a
# request's last row may run past its stop (its state then holds no point to keep).
VARIANTS["overlap"] = dict(GAP, block_size=4, num_blocks=512, async_scheduling=True)
# 24 blocks of 4 and two running requests of up to ~70 tokens: KV eviction and preemption by
# recompute; one snapshot slot beside the running ones: snapshots evicted for each other.
VARIANTS["eviction"] = dict(
    GAP, block_size=4, num_blocks=24, max_num_seqs=2, chunked_prefill_size=16, num_snapshots=1
)
# every family runs every variant: 15 x 6 cases, about 45 s on one core
CASES = [(family, variant) for family in HYBRIDS for variant in VARIANTS]


class Workload:
    """The two rounds' prompts and transformers' greedy replies to them."""

    def __init__(self, path: Path) -> None:
        self.first = random_prompts(31, 3, shared_prefix=PREFIX, min_len=6, max_len=14)
        self.first_replies = greedy_tokens(path, self.first, MAX_NEW)
        # (seed 32's messages meet a router near-tie in the MoE model's second turn: there
        # transformers' generate and its own one-pass forward pick different tokens)
        news = random_prompts(33, 2, min_len=5, max_len=9)
        p0, p1, p2 = self.first
        r0, _, r2 = self.first_replies
        self.warm = [p0 + r0 + news[0], p1, p2 + r2 + news[1]]
        self.warm_replies = greedy_tokens(path, self.warm, MAX_NEW)

    def warm_hits(self) -> list[int]:
        """Where each warm prompt resumes: a turn at its conversation's written end (the last
        sampled token has no state yet), the repeated prompt at the junction."""
        (p0, _, p2), (r0, _, r2) = self.first, self.first_replies
        return [len(p0) + len(r0) - 1, PREFIX, len(p2) + len(r2) - 1]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """family -> (folder of its tiny model, its workload)."""
    made: dict[str, tuple[Path, Workload]] = {}

    def get(family: str) -> tuple[Path, Workload]:
        if family not in made:
            path = build_arch(family, tmp_path_factory.mktemp(family))
            made[family] = (path, Workload(path))
        return made[family]

    return get


def _generate(llm: LLM, prompts: list[list[int]], budgets: list[int]) -> list[RequestOutput]:
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n) for n in budgets])
    llm.check_integrity()
    return outs


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.token_ids) for o in outs]


@pytest.mark.parametrize(("family", "variant"), CASES)
def test_greedy_matches_transformers_cold_and_warm(family, variant, hybrid):
    path, work = hybrid(family)
    llm = LLM(str(path), **VARIANTS[variant])
    # the first prompt alone, then the two that leave the tree where it ends
    first = _generate(llm, work.first[:1], MAX_NEW[:1]) + _generate(
        llm, work.first[1:], MAX_NEW[1:]
    )
    assert _tokens(first) == work.first_replies
    warm = _generate(llm, work.warm, MAX_NEW)
    assert _tokens(warm) == work.warm_replies
    state = llm.cache.group_stats()[-1]
    hits = [o.stats.num_cached_tokens for o in warm]
    if variant == "eviction":
        assert state.num_evicted > 0 and llm.cache.stats().num_evicted_blocks > 0
    elif variant == "chunked":  # a chunk end past the junction may hold a deeper snapshot
        assert [h >= w for h, w in zip(hits, work.warm_hits(), strict=True)] == [True] * 3
        assert hits[0] == work.warm_hits()[0] and hits[2] == work.warm_hits()[2]
    elif variant == "overlap":  # a reply that stopped at EOS: a later row moved its state on,
        # so its turn resumes from the junction (a reply stopped by its length keeps its end)
        assert [h in (w, PREFIX) for h, w in zip(hits, work.warm_hits(), strict=True)] == [True] * 3
    else:
        assert hits == work.warm_hits()
        assert state.num_hits == 3 and state.num_hit_tokens == sum(hits)
    assert not llm.scheduler.has_unfinished()


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_a_preempted_hybrid_request_resumes_from_its_own_snapshot(hybrid, family):
    """Three requests growing past a pool of 20 blocks: some are preempted, a preempted one's
    state is kept as a snapshot where it stopped and its recompute resumes there; the output
    equals a roomy engine's without the cache."""
    path, _ = hybrid(family)
    prompts = random_prompts(61, 3, min_len=20, max_len=30)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    roomy = LLM(str(path), block_size=4, num_blocks=256, enable_prefix_cache=False)
    expected = _tokens(roomy.generate(prompts, params))
    llm = LLM(str(path), block_size=4, num_blocks=20, max_num_seqs=3, **GAP)
    outs = llm.generate(prompts, params)
    llm.check_integrity()
    assert _tokens(outs) == expected
    assert llm.scheduler.num_preemptions > 0
    assert llm.cache.group_stats()[-1].num_hits > 0


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_choices_of_a_hybrid_prompt_follow_their_seeds(hybrid, family):
    """n choices: the second is snapshotted where it leaves the first's path (one token short of
    the prompt), the third resumes there; each equals its seed's stream run alone, cold."""
    path, work = hybrid(family)
    llm = LLM(str(path), block_size=4, num_blocks=256, **GAP)
    prompt = work.first[0]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    choices = llm.generate([prompt], params)
    llm.check_integrity()
    # the first computes the prompt, the second too (no state at its last token yet), the
    # third resumes from the second's snapshot there
    assert [c.stats.num_cached_tokens for c in choices] == [0, 0, len(prompt) - 1]
    cold = LLM(str(path), block_size=4, num_blocks=256, enable_prefix_cache=False)
    for i, c in enumerate(choices):
        alone = SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True)
        (expected,) = cold.generate([prompt], alone)
        assert c.token_ids == expected.token_ids
    assert len({c.token_ids for c in choices}) > 1  # distinct streams


def test_a_hybrid_model_keeps_one_state_slot_a_running_request(hybrid):
    path, _ = hybrid("qwen3_5")
    llm = LLM(str(path), block_size=4, num_blocks=64, max_num_seqs=3, num_snapshots=5)
    layout = llm.runner.layout
    assert layout.describe() == "2 full + 2 recurrent layers"
    assert [(g.spec, g.layers) for g in layout.cache_groups()] == [(GroupSpec(), (1, 3))]
    states = llm.runner.states
    assert states is not None and sorted(states.specs) == [0, 2]
    assert llm.runner.group_specs[-1] == StateSpec(states.slot_nbytes())
    # the slots are sized once, whatever the requests' lengths: 3 running + 5 snapshots
    assert states.num_slots == 8 and states.ssm[0].shape == (8, 4, 8, 8)
    assert llm.cache.groups[-1].num_blocks == 8
    # the live page's capture reads the tree and shows no window group for the state group
    _generate(llm, [[7, 8, 9, 10]], [2])
    assert capture(llm, None).window is None


def test_a_model_of_recurrent_layers_alone_keeps_no_kv(hybrid):
    """Mamba 2: no layer attends, so the tree's group has no layers and no device bytes; sized
    by a byte budget, its blocks are room for twice the running requests' contexts and the
    budget goes to the state slots."""
    path, work = hybrid("mamba2")
    budget, seqs = 2**20, 2
    llm = LLM(str(path), block_size=4, kv_cache_bytes=budget, max_num_seqs=seqs, max_model_len=64)
    layout = llm.runner.layout
    assert layout.describe() == "4 recurrent layers"
    assert (layout.num_kv_heads, layout.head_dim) == (0, 0)
    assert [(g.spec, g.layers) for g in layout.cache_groups()] == [(GroupSpec(), ())]
    (tree_kv,) = llm.runner.kv
    assert tree_kv.layers == () and tree_kv.bytes_per_block == 0
    assert llm.cache.groups[0].num_blocks == 2 * seqs * 64 // 4
    states = llm.runner.states
    assert states is not None and states.num_slots > seqs
    # the running requests' slots and `snapshot_share` of the budget
    snapshots = int(llm.config.snapshot_share * budget) // states.slot_nbytes()
    assert states.num_slots == seqs + snapshots
    first = _generate(llm, work.first[:1], MAX_NEW[:1]) + _generate(
        llm, work.first[1:], MAX_NEW[1:]
    )
    assert _tokens(first) == work.first_replies


def test_kimi_linear_keeps_latents_in_the_tree_group_and_kda_states_in_slots(hybrid):
    """Kimi Linear: its latent-attention layers keep one latent vector a token (kv_lora_rank 96
    + the shared key part 8) in the tree's group, its KDA layers a state a request (4 heads of
    8 x 8, the conv window over q|k|v) in the state group's slots."""
    path, _ = hybrid("kimi_linear")
    llm = LLM(str(path), block_size=4, num_blocks=64, max_num_seqs=3, num_snapshots=5)
    layout = llm.runner.layout
    assert layout.describe() == "2 full (latent 104) + 2 recurrent layers"
    assert layout.latent_layers == (1, 3) and layout.no_kv_layers == (0, 2)
    (group,) = layout.cache_groups()
    assert group.layers == (1, 3) and group.latent == layout.latent
    (kv,) = llm.runner.kv
    assert kv.layout == "latent" and tuple(kv.k_cache.shape) == (2, 64, 4, 1, 104)
    states = llm.runner.states
    assert states is not None and sorted(states.specs) == [0, 2]
    assert states.ssm[0].shape == (8, 4, 8, 8) and states.conv[0].shape == (8, 3, 3 * 32)
    assert llm.runner.group_specs[-1] == StateSpec(states.slot_nbytes())
    mixers = [type(layer.self_attn).__name__ for layer in llm.model.model.layers]
    assert mixers == ["PackedKimiLinearDeltaAttention", "PagedKimiLinearAttention"] * 2


def test_a_reset_drops_every_snapshot(hybrid):
    path, work = hybrid("lfm2")
    llm = LLM(str(path), block_size=4, num_blocks=256, **GAP)
    _generate(llm, work.first[:1], MAX_NEW[:1]), _generate(llm, work.first[1:], MAX_NEW[1:])
    state = llm.cache.groups[-1]
    assert state.num_snapshots > 0
    assert llm.cache.reset()
    llm.check_integrity()
    assert state.num_snapshots == 0 and state.stats().num_free_slots == state.num_blocks
    warm = _generate(llm, work.warm, MAX_NEW)
    assert _tokens(warm) == work.warm_replies
    assert [o.stats.num_cached_tokens for o in warm] == [0, 0, 0]


# the second recurrent layer's class (layer 2) of the families the fault test runs
FAULT_LAYERS = {
    "qwen3_5": PackedQwen3_5GatedDeltaNet,
    "kimi_linear": PackedKimiLinearDeltaAttention,
}


@pytest.mark.parametrize("family", FAULT_LAYERS)
@pytest.mark.parametrize("run", range(12))
def test_a_fault_in_a_hybrid_step_fails_only_its_requests(hybrid, family, run):
    """An exception in a slot copy or between the recurrent layers (the second one, after the
    first wrote the rows' slots) fails the step's requests, leaves no slot or block in use and
    no snapshot of a half-written state: the warm round afterwards still equals transformers.
    Kimi Linear's latent layers write their paged latent cache between its KDA layers."""
    path, work = hybrid(family)
    layer_class = FAULT_LAYERS[family]
    overlap, point, at = run % 2 == 1, ("copy", "layer")[run // 2 % 2], 1 + run // 4
    llm = LLM(str(path), block_size=4, num_blocks=256, async_scheduling=overlap, **GAP)
    _generate(llm, work.first[:1], MAX_NEW[:1]), _generate(llm, work.first[1:], MAX_NEW[1:])
    passes = iter(range(1, 10**6))

    def trip() -> None:
        if next(passes) == at:
            raise RuntimeError(f"injected {run}")

    copy_slot, forward = RecurrentStates.copy_slot, layer_class.packed_forward

    def faulty_copy(self, src: int, dst: int) -> None:
        trip()
        copy_slot(self, src, dst)

    def faulty_forward(self, *args, **kwargs):
        if self.layer_idx == 2:
            trip()
        return forward(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        if point == "copy":
            mp.setattr(RecurrentStates, "copy_slot", faulty_copy)
        else:
            mp.setattr(layer_class, "packed_forward", faulty_forward)
        with pytest.raises(RuntimeError, match=f"injected {run}"):
            llm.generate(work.warm, [SamplingParams(max_tokens=n) for n in MAX_NEW])
    llm.check_integrity()
    assert not llm.scheduler.has_unfinished()
    assert llm.cache.stats().num_in_use_blocks == 0
    assert llm.cache.group_stats()[-1].num_running_slots == 0
    assert _tokens(_generate(llm, work.warm, MAX_NEW)) == work.warm_replies
