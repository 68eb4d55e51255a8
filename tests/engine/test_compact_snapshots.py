"""Compact snapshots (`snapshot_dtype` "bf16" / "int8"): the quantizer's error bounds, the bytes a
snapshot takes and how many a budget holds, the slot copies between exact running slots and
compact snapshots, and hybrid models run end to end resuming from compact snapshots.

Greedy output in a compact mode may differ from the exact mode's (a resumed state is rounded
once); benchmarks/compact_snapshots.py measures by how much. The default, "exact", is what
`test_hybrid_models` checks against transformers."""

from __future__ import annotations

import pytest
import torch
from test_hybrid_models import GAP, MAX_NEW, VARIANTS, Workload, _generate
from tiny_archs import build_arch
from tiny_llama import random_prompts

from radixkv import LLM, SamplingParams
from radixkv.engine.step.recurrent import RecurrentLayerSpec, RecurrentStates
from radixkv.engine.step.recurrent.compact import dequantize_int8, quantize_int8
from radixkv.engine.tiers.host_state import HostStatePool, StateCopier

# Qwen3.5-4B's linear layer: 32 value heads of 128 x 128, a conv over q | k | v of 8,192 channels
QWEN3_5_4B = RecurrentLayerSpec(0, (3, 8192), (32, 128, 128))
# per layer kind: a state shape and the axis its int8 scale reduces over
SHAPES = {"gdn": ((4, 8, 6), 2), "mamba2": ((8, 16, 8), 1), "mamba1": ((24, 1, 8), 2)}


def _state(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A state whose rows differ in range by 1e4 (a per-row scale must follow them), one row
    all zero (a fresh state's)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-2, 2, shape[0])[:, None, None]
    x[0] = 0.0
    return x


@pytest.mark.parametrize("kind", list(SHAPES))
def test_int8_round_trip_is_within_half_a_scale_of_each_entry(kind):
    shape, axis = SHAPES[kind]
    state = _state(shape, seed=3)
    q, scale = quantize_int8(state, axis)
    assert q.dtype == torch.int8 and scale.dtype == state.dtype
    assert scale.shape == tuple(1 if a == axis else n for a, n in enumerate(shape))
    back = dequantize_int8(q, scale, state.dtype)
    error = (back - state).abs()
    assert (error <= scale / 2 * (1 + 1e-6)).all()
    # each scale is its slice's largest magnitude / 127: the error relative to that range
    amax = state.abs().amax(dim=axis, keepdim=True)
    assert (error <= amax / 254 * (1 + 1e-6)).all()
    assert torch.equal(back[0], state[0])  # zeros stay zeros (scale 1, no division by 0)
    assert error.max() > 0  # and the rest is really rounded


def test_a_bf16_snapshot_rounds_each_entry_to_8_bits_of_mantissa():
    state = _state((4, 8, 6), seed=4)
    back = state.to(torch.bfloat16).float()
    assert ((back - state).abs() <= state.abs() * 2**-8).all()


def test_a_snapshot_takes_about_half_the_bytes_in_int8():
    spec = QWEN3_5_4B
    bf16, fp32 = torch.bfloat16, torch.float32
    exact = spec.snapshot_nbytes(bf16, "exact")
    assert exact == spec.nbytes(bf16) == 2 * (3 * 8192 + 32 * 128 * 128)
    int8 = spec.snapshot_nbytes(bf16, "int8")
    assert int8 == 3 * 8192 * 2 + 32 * 128 * 128 + 32 * 128 * 2  # conv, data, scales
    assert 1.85 < exact / int8 < 2.0  # the bf16 conv window and the scales keep it under 2x
    assert spec.snapshot_nbytes(bf16, "bf16") == exact
    # an fp32 model: bf16 halves it, int8 about a quarter (the fp32 conv window and scales)
    assert spec.snapshot_nbytes(fp32, "exact") / spec.snapshot_nbytes(fp32, "bf16") > 1.9
    assert spec.snapshot_nbytes(fp32, "exact") / spec.snapshot_nbytes(fp32, "int8") > 3.3
    conv_only = RecurrentLayerSpec(0, (3, 64), None)  # a short convolution: nothing to compact
    assert conv_only.snapshot_nbytes(fp32, "int8") == conv_only.nbytes(fp32)


@pytest.mark.parametrize("snapshot_dtype", ["bf16", "int8"])
def test_slot_copies_compact_and_expand_and_running_slots_stay_exact(snapshot_dtype):
    specs = [
        RecurrentLayerSpec(0, (3, 10), (4, 8, 6)),
        RecurrentLayerSpec(1, (2, 12), None),
        RecurrentLayerSpec(2, (3, 16), (8, 16, 8), quant_axis=1),
    ]
    states = RecurrentStates(specs, 5, num_running=2, snapshot_dtype=snapshot_dtype)
    states.check_integrity()
    assert states.ssm[0].shape[0] == 2 and states.snapshots is not None
    assert states.snapshots.num_slots == 3
    assert states.nbytes() == 2 * states.slot_nbytes() + 3 * states.snapshot_nbytes()
    assert states.snapshots.slot_nbytes() == states.snapshot_nbytes() < states.slot_nbytes()
    gen = torch.Generator().manual_seed(5)
    for t in (*states.conv.values(), *states.ssm.values()):
        t[0].copy_(torch.randn(t[0].shape, generator=gen))
    conv, ssm = {i: t[0].clone() for i, t in states.conv.items()}, states.ssm[0][0].clone()
    states.copy_slot(0, 3)  # a snapshot taken
    states.copy_slot(3, 4)  # moved as stored
    states.copy_slot(4, 1)  # a resume
    for i, window in conv.items():  # the conv window is kept exact
        assert torch.equal(states.conv[i][1], window)
    error = (states.ssm[0][1] - ssm).abs().max()
    assert (
        0 < error <= (ssm.abs().max() / 254 if snapshot_dtype == "int8" else ssm.abs().max() / 256)
    )
    states.copy_slot(0, 1)  # running to running: exact
    assert torch.equal(states.ssm[0][1], ssm)
    states.check_integrity()


@pytest.mark.parametrize("snapshot_dtype", ["bf16", "int8"])
def test_a_compact_snapshot_goes_to_the_host_as_stored_and_comes_back_expanded(snapshot_dtype):
    """The host tier's copier: an offload copies a snapshot slot's bytes as stored (a host slot
    is `snapshot_nbytes`), a load expands them into a running slot exactly as a resume copy from
    the device's snapshot does."""
    specs = [
        RecurrentLayerSpec(0, (3, 10), (4, 8, 6)),
        RecurrentLayerSpec(1, (2, 12), None),
        RecurrentLayerSpec(2, (3, 16), (8, 16, 8), quant_axis=1),
    ]
    states = RecurrentStates(specs, 4, num_running=2, snapshot_dtype=snapshot_dtype)
    gen = torch.Generator().manual_seed(6)
    for t in (*states.conv.values(), *states.ssm.values()):
        t[0].copy_(torch.randn(t[0].shape, generator=gen))
    states.copy_slot(0, 3)  # the snapshot, in snapshot slot 3
    host = HostStatePool(2, states.snapshot_nbytes(), pin_memory=False)
    copier = StateCopier(states, host)
    assert copier.offload([3], [1]).nbytes == states.snapshot_nbytes() < states.slot_nbytes()
    snaps = states.snapshots
    assert snaps is not None
    # per layer: conv, the state as stored, an int8 state's scales
    tensors = (snaps.conv, snaps.ssm, snaps.scale)
    stored = [d[i][1] for i in sorted(states.specs) for d in tensors if i in d]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in stored])
    assert torch.equal(host.data[1], flat)  # slot 3 is the compact pool's row 1
    states.copy_slot(3, 1)  # the device's resume, for comparison
    expected = [t[1].clone() for t in (*states.conv.values(), *states.ssm.values())]
    for t in (*states.conv.values(), *states.ssm.values(), *snaps.ssm.values()):
        t.zero_()  # the snapshot slot is reused; running slot 1 is another request's
    copier.load([1], [1])
    got = [t[1] for t in (*states.conv.values(), *states.ssm.values())]
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    states.check_integrity()
    host.check_integrity()


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = build_arch("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))
    return path, Workload(path)


def test_a_byte_budget_holds_more_snapshots_the_more_compact_they_are(qwen3_5):
    path, _ = qwen3_5
    budget, seqs = 2**20, 2
    slots, per_snapshot = {}, {}
    for mode in ("exact", "bf16", "int8"):
        llm = LLM(
            str(path), block_size=4, kv_cache_bytes=budget, max_num_seqs=seqs, snapshot_dtype=mode
        )
        states = llm.runner.states
        assert states is not None
        share = int(llm.config.snapshot_share * budget)
        assert states.num_slots == seqs + share // states.snapshot_nbytes()
        assert llm.cache.groups[-1].ledger.snapshot_bytes == states.snapshot_nbytes()
        assert states.num_running == (states.num_slots if mode == "exact" else seqs)
        slots[mode], per_snapshot[mode] = states.num_slots - seqs, states.snapshot_nbytes()
        llm.check_integrity()
    # the tiny model's conv windows are as large as its states: int8 stores each state in a
    # quarter of its fp32 bytes (plus scales), the conv window stays fp32
    assert slots["int8"] > slots["bf16"] > slots["exact"]
    assert per_snapshot["exact"] / per_snapshot["int8"] > 1.5


@pytest.mark.parametrize("snapshot_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("family", ["qwen3_5", "mamba2", "nemotron_h", "jamba"])
def test_a_compact_mode_run_resumes_from_its_snapshots(family, snapshot_dtype, tmp_path):
    """The chat workload of `test_hybrid_models`: the cold round (no resume yet) equals
    transformers exactly, the warm round resumes where the exact mode does, from compact
    snapshots, and finishes every request."""
    path = build_arch(family, tmp_path)
    work = Workload(path)
    llm = LLM(str(path), **VARIANTS["b16"], snapshot_dtype=snapshot_dtype)
    first = _generate(llm, work.first[:1], MAX_NEW[:1]) + _generate(
        llm, work.first[1:], MAX_NEW[1:]
    )
    assert [list(o.token_ids) for o in first] == work.first_replies  # nothing resumed yet
    warm = _generate(llm, work.warm, MAX_NEW)
    assert [o.stats.num_cached_tokens for o in warm] == work.warm_hits()
    assert [o.finish_reason in ("stop", "length") for o in warm] == [True] * 3
    state = llm.cache.group_stats()[-1]
    assert state.num_hits == 3 and state.snapshot_bytes < state.slot_bytes
    assert not llm.scheduler.has_unfinished()


def test_compact_snapshots_under_eviction_and_preemption_return_every_slot(qwen3_5):
    path, work = qwen3_5
    llm = LLM(str(path), **VARIANTS["eviction"], snapshot_dtype="int8")
    _generate(llm, work.first[:1], MAX_NEW[:1]), _generate(llm, work.first[1:], MAX_NEW[1:])
    _generate(llm, work.warm, MAX_NEW)
    state = llm.cache.group_stats()[-1]
    assert state.num_evicted > 0 and llm.cache.stats().num_evicted_blocks > 0
    assert state.num_running_slots == 0 and llm.cache.stats().num_in_use_blocks == 0
    assert state.num_free_slots + state.num_snapshots == state.num_slots
    # three requests growing past 20 blocks: preempted ones resume from compact snapshots of
    # their own states
    prompts = random_prompts(61, 3, min_len=20, max_len=30)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = LLM(str(path), block_size=4, num_blocks=20, max_num_seqs=3, snapshot_dtype="int8", **GAP)
    outs = llm.generate(prompts, params)
    llm.check_integrity()
    assert [len(o.token_ids) for o in outs] == [24] * 3
    assert llm.scheduler.num_preemptions > 0 and llm.cache.group_stats()[-1].num_hits > 0
    assert llm.cache.group_stats()[-1].num_running_slots == 0


def test_an_unknown_snapshot_dtype_is_refused_at_the_door(qwen3_5):
    with pytest.raises(ValueError, match="snapshot_dtype"):
        LLM(str(qwen3_5[0]), snapshot_dtype="fp8")


@pytest.mark.parametrize("run", range(4))
def test_a_fault_in_a_compacting_copy_fails_only_its_requests(qwen3_5, run):
    """An exception in the n-th slot copy (a snapshot compacted, or a resume expanded): the
    step's requests fail, no slot stays in use, no snapshot of a copy that may not have run is
    kept; the next round runs from what is left."""
    path, work = qwen3_5
    overlap, at = run % 2 == 1, 1 + run // 2
    llm = LLM(
        str(path),
        block_size=4,
        num_blocks=256,
        async_scheduling=overlap,
        **GAP,
        snapshot_dtype="int8",
    )
    _generate(llm, work.first[:1], MAX_NEW[:1]), _generate(llm, work.first[1:], MAX_NEW[1:])
    copies = iter(range(1, 10**6))
    copy_slot = RecurrentStates.copy_slot

    def faulty_copy(self, src: int, dst: int) -> None:
        if next(copies) == at:
            raise RuntimeError(f"injected {run}")
        copy_slot(self, src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RecurrentStates, "copy_slot", faulty_copy)
        with pytest.raises(RuntimeError, match=f"injected {run}"):
            llm.generate(work.warm, [SamplingParams(max_tokens=n) for n in MAX_NEW])
    llm.check_integrity()
    assert not llm.scheduler.has_unfinished()
    assert llm.cache.group_stats()[-1].num_running_slots == 0
    outs = _generate(llm, work.warm, MAX_NEW)
    assert [len(o.token_ids) > 0 for o in outs] == [True] * 3
