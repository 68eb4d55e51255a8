"""ModelRunner driven directly with hand-built scheduler rows: logits equal a dense forward."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_llama import build_model, build_qwen2

from radixkv.engine.config import EngineConfig
from radixkv.engine.step.kv_tensors import DEFAULT_CPU_KV_CACHE_BYTES, KVCacheSpec, plan_num_blocks
from radixkv.engine.step.model_runner import ModelRunner
from radixkv.kernels import cpu_attention, metadata, reference
from radixkv.scheduler.output import BlockCopy, GroupPlan, ScheduledRequest, SchedulerOutput

ATOL = 1e-4


@pytest.fixture(scope="module", params=["gqa", "mha", "qwen2"])
def models(request):
    """(model for the runner, an independent eager copy as the reference). The Llamas run the
    fused modules, the Qwen2 transformers' own modules through the generic attention hooks."""
    model = build_qwen2() if request.param == "qwen2" else build_model(request.param)
    reference = copy.deepcopy(model)  # deep copy: the runner switches its config's attention
    reference.set_attn_implementation("eager")
    return model, reference


def dense_last_logits(reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0, -1]


COPY_9_TO_11 = GroupPlan(copies=(BlockCopy(9, 11, 2),))  # its first 2 slots


def row(rid, tokens, start, table, sample=True):
    return ScheduledRequest(rid, tuple(tokens), start, (tuple(table),), sample)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_packed_prefill_chunks_and_decode(models, block_size):
    model, reference = models
    runner = ModelRunner(model, EngineConfig(block_size=block_size, num_blocks=64))
    B = block_size
    a = list(range(10, 31))  # 21 tokens, prefilled in two chunks
    b = list(range(40, 49))  # 9 tokens, one chunk
    # Permuted, non-contiguous block tables.
    table_a = [63 - i for i in range(-(-22 // B))]
    table_b = [2 * i + 1 for i in range(-(-10 // B))]
    n_a0 = 13

    def blocks(table, n):
        return table[: -(-n // B)]

    # Step 1: first chunk of a (not sampled) packed with the whole of b (sampled).
    logits = runner.execute(
        SchedulerOutput(
            rows=(
                row("a", a[:n_a0], 0, blocks(table_a, n_a0), sample=False),
                row("b", b, 0, blocks(table_b, len(b))),
            )
        )
    )
    assert logits.shape == (1, model.config.vocab_size)
    torch.testing.assert_close(logits[0], dense_last_logits(reference, b), atol=ATOL, rtol=0)
    # Step 2: rest of a + decode of b.
    tok_b = int(logits[0].argmax())
    logits = runner.execute(
        SchedulerOutput(
            rows=(
                row("a", a[n_a0:], n_a0, blocks(table_a, len(a))),
                row("b", [tok_b], len(b), blocks(table_b, len(b) + 1)),
            )
        )
    )
    torch.testing.assert_close(logits[0], dense_last_logits(reference, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(
        logits[1], dense_last_logits(reference, [*b, tok_b]), atol=ATOL, rtol=0
    )
    # Step 3: decode of a alone.
    tok_a = int(logits[0].argmax())
    logits = runner.execute(SchedulerOutput(rows=(row("a", [tok_a], len(a), table_a),)))
    torch.testing.assert_close(
        logits[0], dense_last_logits(reference, [*a, tok_a]), atol=ATOL, rtol=0
    )


def test_only_unsampled_rows_return_no_logits(models):
    model, _ = models
    runner = ModelRunner(model, EngineConfig(block_size=4, num_blocks=8))
    logits = runner.execute(SchedulerOutput(rows=(row("a", [5, 6, 7], 0, [3], sample=False),)))
    assert logits.shape == (0, model.config.vocab_size)


@pytest.mark.filterwarnings("error::FutureWarning")
def test_the_forward_uses_no_deprecated_argument(models):
    """transformers deprecates `past_key_values` in favour of `cache`: a step warns about
    neither (the runner passes the name this version declares)."""
    model, _ = models
    runner = ModelRunner(model, EngineConfig(block_size=4, num_blocks=8))
    logits = runner.execute(SchedulerOutput(rows=(row("a", [5, 6, 7], 0, [3]),)))
    assert logits.shape == (1, model.config.vocab_size)


def test_copy_on_write_of_a_partial_block(models):
    """c shares a's first 6 tokens: block 5 (full) is shared, the 2 valid slots of block 9 are
    copied into c's private block 11 before the forward."""
    model, reference = models
    runner = ModelRunner(model, EngineConfig(block_size=4, num_blocks=16))
    a = [11, 12, 13, 14, 15, 16, 17, 18]
    runner.execute(SchedulerOutput(rows=(row("a", a, 0, [5, 9]),)))
    c = [*a[:6], 99, 98, 97]
    logits = runner.execute(
        SchedulerOutput(
            rows=(row("c", c[6:], 6, [5, 11, 12]),),
            plans=(GroupPlan(copies=(BlockCopy(9, 11, 2),)),),
        )
    )
    torch.testing.assert_close(logits[0], dense_last_logits(reference, c), atol=ATOL, rtol=0)
    # a's block 9 is untouched by c's writes.
    logits = runner.execute(SchedulerOutput(rows=(row("a", [3], 8, [5, 9, 1]),)))
    torch.testing.assert_close(logits[0], dense_last_logits(reference, [*a, 3]), atol=ATOL, rtol=0)


def _recording(fn, calls: list):
    def wrapped(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    return wrapped


def test_a_step_is_one_host_copy_and_its_token_ids_are_checked_before_the_forward(
    models, monkeypatch
):
    """An eager step, copies included, crosses to the device in one copy; a token id past the
    embedding stops it before the forward writes any KV (on CUDA it would be a device assert)."""
    model, _ = models
    runner = ModelRunner(model, EngineConfig(block_size=4, num_blocks=16))
    calls: list = []
    monkeypatch.setattr(runner.stager, "to_device", _recording(runner.stager.to_device, calls))
    a = [11, 12, 13, 14, 15, 16]
    runner.execute(SchedulerOutput(rows=(row("a", a, 0, [5, 9]),)))
    runner.execute(
        SchedulerOutput(
            rows=(row("c", [7, 8], 6, [5, 11]),), plans=(GroupPlan(copies=(BlockCopy(9, 11, 2),)),)
        )
    )
    assert len(calls) == 2
    k_cache = runner.kv[0].k_cache.clone()
    vocab = model.config.vocab_size
    with pytest.raises(AssertionError, match="token id out of range"):
        runner.execute(SchedulerOutput(rows=(row("b", [1, vocab], 0, [3]),)))
    assert torch.equal(runner.kv[0].k_cache, k_cache)


@pytest.mark.parametrize("validate_steps", [True, False])
def test_metadata_is_validated_once_per_step_for_every_layer(models, monkeypatch, validate_steps):
    """With validate_steps the values are checked once per step (never per layer); without it
    (the default hot path) not at all."""
    model, _ = models
    validated, stored, attended = [], [], []
    # The metadata's values are checked when it is built; each step kernel checks its own tensors
    # (looked up in the namespace of the CPU backend's module: the compiled kernel's, or the
    # reference's where it cannot be built; its store is the reference's either way).
    monkeypatch.setattr(
        metadata, "check_metadata_values", _recording(metadata.check_metadata_values, validated)
    )
    monkeypatch.setattr(
        reference, "check_store_step", _recording(metadata.check_store_step, stored)
    )
    for module in (reference, cpu_attention):
        check = _recording(metadata.check_attention_step, attended)
        monkeypatch.setattr(module, "check_attention_step", check)
    runner = ModelRunner(
        model, EngineConfig(block_size=4, num_blocks=16), validate_steps=validate_steps
    )
    runner.execute(SchedulerOutput(rows=(row("a", [5, 6, 7], 0, [3]), row("b", [8], 0, [4]))))
    assert len(validated) == int(validate_steps)
    assert len(stored) == len(attended) == model.config.num_hidden_layers
    # one metadata object, shared by every layer's store and attention
    assert len({id(args[4]) for args in stored} | {id(args[3]) for args in attended}) == 1


@pytest.mark.interpreter
@pytest.mark.parametrize("build", [lambda: build_model("gqa"), build_qwen2], ids=["llama", "qwen2"])
def test_only_plain_llamas_on_triton_get_the_fused_modules(build):
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm

    from radixkv.engine.step.fused_llama import FusedLlamaRMSNorm, PagedLlamaAttention
    from radixkv.kernels import use_backend

    model = build()
    config = EngineConfig(block_size=4, num_blocks=8)
    assert not ModelRunner(model, config).fused_modules  # torch backend
    with use_backend("triton"):
        runner = ModelRunner(model, config)
    is_llama = type(model).__name__ == "LlamaForCausalLM"
    assert runner.fused_modules == is_llama
    classes = {type(m) for m in model.modules()}
    assert (PagedLlamaAttention in classes) == (FusedLlamaRMSNorm in classes) == is_llama
    assert LlamaAttention not in classes and LlamaRMSNorm not in classes  # all swapped, or none


def test_kv_cache_layout(models):
    model, _ = models
    runner = ModelRunner(model, EngineConfig(block_size=8, num_blocks=10))
    cfg = model.config
    shape = (cfg.num_hidden_layers, 10, 8, cfg.num_key_value_heads, cfg.hidden_size // 4)
    assert runner.kv[0].k_cache.shape == runner.kv[0].v_cache.shape == shape
    assert model.config._attn_implementation == "radixkv"


def test_plan_num_blocks():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    assert spec.bytes_per_block == 2 * 2 * 4 * 2 * 16 * 4
    cpu = torch.device("cpu")
    assert plan_num_blocks(spec, cpu, num_blocks=7) == 7
    assert plan_num_blocks(spec, cpu, kv_cache_bytes=10 * spec.bytes_per_block + 1) == 10
    assert plan_num_blocks(spec, cpu) == DEFAULT_CPU_KV_CACHE_BYTES // spec.bytes_per_block
    with pytest.raises(ValueError, match="holds no KV block"):
        plan_num_blocks(spec, cpu, kv_cache_bytes=100)
    with pytest.raises(ValueError, match="num_blocks"):  # sizes are checked at the door
        EngineConfig(num_blocks=0)


@pytest.mark.interpreter
def test_runner_through_the_triton_kernels(models):
    """The same steps through the Triton kernels (interpreted on CPU), on a fresh copy of the
    model (the runner swaps a Llama's fused modules in): the runner's tensors meet the
    launchers' shape / dtype / stride checks, not only the reference's."""
    pytest.importorskip("triton")
    from radixkv.kernels import use_backend

    model, reference = models
    with use_backend("triton"):
        test_packed_prefill_chunks_and_decode((copy.deepcopy(model), reference), block_size=4)
        test_copy_on_write_of_a_partial_block((copy.deepcopy(model), reference))


def test_cpu_runs_eager_and_enforce_eager_must_be_a_bool(models):
    model, _ = models
    runner = ModelRunner(model, EngineConfig(block_size=4, num_blocks=8, enforce_eager=False))
    assert runner.decode_graphs is None  # CUDA graphs exist on CUDA only
    with pytest.raises(TypeError, match="enforce_eager"):  # checked at the door
        EngineConfig(block_size=4, num_blocks=8, enforce_eager="no")  # type: ignore[arg-type]
