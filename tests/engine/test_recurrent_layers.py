"""radixkv's packed recurrent layers against transformers' own modules, on the same weights and
inputs (fp32, tiny random configs): a request's outputs over any chunking and packing of steps
must equal transformers' module run on that request's whole sequence, with no state leaking
between the requests of a step."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch

from radixkv.engine.step.recurrent import (
    RecurrentStates,
    RecurrentStep,
    pack_recurrent_layers,
    unpack_recurrent_layers,
)
from radixkv.engine.step.recurrent.layers import packed_classes
from radixkv.kernels import RecurrentMetadata, use_backend

HIDDEN = 32
LAYER = 1  # the mixer's layer index (its slot tensors are keyed by it)


def _gdn_config(config_cls: type, **extra: object) -> object:
    return config_cls(
        hidden_size=HIDDEN,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_hidden_layers=2,
        layer_types=["full_attention", "linear_attention"],
        **extra,
    )


def _mamba2_config(config_cls: type, **extra: object) -> object:
    # Mamba-2 configs check heads x head_dim == expand x hidden (here 8 x 8 == 2 x 32)
    return config_cls(hidden_size=HIDDEN, num_hidden_layers=2, **extra)


def _mixer(family: str) -> torch.nn.Module:
    """A transformers recurrent mixer of `family` with tiny random weights (seeded)."""
    import transformers as tf
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

    mamba2 = {"mamba_n_heads": 8, "mamba_d_head": 8, "mamba_expand": 2, "mamba_n_groups": 2}
    mamba2 |= {"mamba_d_state": 8, "mamba_chunk_size": 16}
    configs: dict[str, Callable[[], object]] = {
        "qwen3_next": lambda: _gdn_config(tf.Qwen3NextConfig),
        "qwen3_5": lambda: _gdn_config(tf.Qwen3_5TextConfig),
        "qwen3_5_moe": lambda: _gdn_config(tf.Qwen3_5MoeTextConfig),
        "olmo_hybrid": lambda: _gdn_config(tf.OlmoHybridConfig, linear_allow_neg_eigval=True),
        "mamba2": lambda: _mamba2_config(
            tf.Mamba2Config,
            num_heads=8,
            head_dim=8,
            expand=2,
            n_groups=2,
            state_size=8,
            chunk_size=16,
        ),
        "bamba": lambda: _mamba2_config(tf.BambaConfig, attn_layer_indices=[0], **mamba2),
        "granitemoehybrid": lambda: _mamba2_config(
            tf.GraniteMoeHybridConfig, layer_types=["attention", "mamba"], **mamba2
        ),
        "falcon_h1": lambda: _mamba2_config(tf.FalconH1Config, mamba_d_ssm=64, **mamba2),
        "falcon_h1_norm": lambda: _mamba2_config(
            tf.FalconH1Config, mamba_d_ssm=64, mamba_rms_norm=True, **mamba2
        ),
        "nemotron_h": lambda: _mamba2_config(
            tf.NemotronHConfig,
            mamba_num_heads=8,
            mamba_head_dim=8,
            n_groups=2,
            ssm_state_size=8,
            chunk_size=16,
        ),
        "zamba2": lambda: _mamba2_config(
            tf.Zamba2Config,
            layers_block_type=["hybrid", "mamba"],
            n_mamba_heads=8,
            mamba_headdim=8,
            mamba_expand=2,
            mamba_ngroups=2,
            mamba_d_state=8,
            chunk_size=16,
        ),
        "mamba": lambda: tf.MambaConfig(
            hidden_size=HIDDEN,
            intermediate_size=48,
            state_size=8,
            num_hidden_layers=2,
            time_step_rank=4,
        ),
        "jamba": lambda: tf.JambaConfig(
            hidden_size=HIDDEN,
            mamba_expand=2,
            mamba_d_state=8,
            num_hidden_layers=2,
            mamba_dt_rank=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        "lfm2": lambda: tf.Lfm2Config(
            hidden_size=HIDDEN,
            conv_L_cache=3,
            num_hidden_layers=2,
            layer_types=["full_attention", "conv"],
        ),
        "lfm2_moe": lambda: tf.Lfm2MoeConfig(
            hidden_size=HIDDEN,
            conv_L_cache=3,
            num_hidden_layers=2,
            layer_types=["full_attention", "conv"],
        ),
        "lfm3": lambda: tf.Lfm3Config(
            hidden_size=HIDDEN,
            conv_L_cache=3,
            num_hidden_layers=2,
            layer_types=["full_attention", "conv"],
        ),
        "kimi_linear": lambda: tf.KimiLinearConfig(
            hidden_size=HIDDEN,
            linear_num_heads=4,
            linear_head_dim=8,
            linear_conv_kernel_dim=4,
            num_hidden_layers=2,
            layer_types=["full_attention", "linear_attention"],
        ),
    }
    config = configs[family]()
    mixer_class = _mixer_class(family)
    torch.manual_seed(0)
    module = mixer_class(config, layer_idx=LAYER).float().eval()
    if family.startswith("falcon_h1"):  # the decoder layer registers it on its mixer
        module.register_buffer("mup_vector", compute_mup_vector(config), persistent=False)
    if family == "kimi_linear":  # its gate's decay is left empty until the model's init
        _init_kda_gate(module.forget_gate)
    _randomize(module)
    return module


def _mixer_class(family: str) -> type:
    base = {
        "qwen3_next": "Qwen3NextGatedDeltaNet",
        "qwen3_5": "Qwen3_5GatedDeltaNet",
        "qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
        "olmo_hybrid": "OlmoHybridGatedDeltaNet",
        "mamba2": "Mamba2Mixer",
        "bamba": "BambaMixer",
        "granitemoehybrid": "GraniteMoeHybridMambaLayer",
        "falcon_h1": "FalconH1Mixer",
        "falcon_h1_norm": "FalconH1Mixer",
        "nemotron_h": "NemotronHMamba2Mixer",
        "zamba2": "Zamba2MambaMixer",
        "mamba": "MambaMixer",
        "jamba": "JambaMambaMixer",
        "lfm2": "Lfm2ShortConv",
        "lfm2_moe": "Lfm2MoeShortConv",
        "lfm3": "Lfm3ShortConv",
        "kimi_linear": "KimiLinearDeltaAttention",
    }[family]
    return next(cls for cls in packed_classes() if cls.__name__ == base)


def _init_kda_gate(gate: torch.nn.Module) -> None:
    """KDA's forget gate as the model's init draws it: decay rates exp(A_log) in [1, 16] a head,
    dt_bias the inverse softplus of steps in [1e-3, 1e-1] a channel."""
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        gate.A_log.copy_(torch.empty(gate.A_log.shape).uniform_(1.0, 16.0, generator=gen).log())
        dt = torch.empty(gate.dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen)
        dt = dt.exp()
        gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def _randomize(module: torch.nn.Module) -> None:
    """Norm weights and biases away from their constant inits, so a mixed-up one shows."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", ".bias", "D")):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))


FAMILIES = [
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "olmo_hybrid",
    "mamba2",
    "bamba",
    "granitemoehybrid",
    "falcon_h1",
    "falcon_h1_norm",
    "nemotron_h",
    "zamba2",
    "mamba",
    "jamba",
    "lfm2",
    "lfm2_moe",
    "lfm3",
    "kimi_linear",
]


@dataclass
class Requests:
    """Each request's whole input sequence; steps hand out consecutive pieces of them."""

    inputs: list[torch.Tensor]  # [len, hidden] per request
    fed: list[int] = field(default_factory=list)
    outputs: list[list[torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.fed = [0] * len(self.inputs)
        self.outputs = [[] for _ in self.inputs]


def _run_steps(
    module: torch.nn.Module,
    requests: Requests,
    steps: Sequence[Sequence[tuple[int, int]]],
    slots: Sequence[int],
) -> RecurrentStates:
    """Run `steps` (each a list of (request, new tokens)) through the packed module; request r
    lives in slot slots[r]. Slots start as NaN: a request's first piece must not read one."""
    (spec,) = [s for s in pack_recurrent_layers(module) if s.layer_idx == LAYER]
    states = RecurrentStates([spec], num_slots=max(slots) + 2)
    for t in (*states.conv.values(), *states.ssm.values()):
        t.fill_(math.nan)
    for step in steps:
        pieces = []
        for r, n in step:
            pieces.append(requests.inputs[r][requests.fed[r] : requests.fed[r] + n])
        metadata = RecurrentMetadata.build(
            [n for _, n in step],
            [slots[r] for r, _ in step],
            [requests.fed[r] > 0 for r, _ in step],
        )
        with torch.no_grad():
            out = module(torch.cat(pieces)[None], cache=RecurrentStep(states, metadata))
        assert out.shape == (1, metadata.num_tokens, HIDDEN)
        pos = 0
        for r, n in step:
            requests.outputs[r].append(out[0, pos : pos + n])
            requests.fed[r] += n
            pos += n
    return states


def _transformers_outputs(module: torch.nn.Module, requests: Requests) -> list[torch.Tensor]:
    """transformers' own module on each request's whole sequence (no cache: from zeros)."""
    plain = copy.deepcopy(module)
    unpack_recurrent_layers(plain)
    assert type(plain) not in set(packed_classes().values())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [plain(x[None])[0] for x in requests.inputs]


def _check_against_transformers(
    family: str, lens: list[int], steps, slots, backend: str = "torch"
) -> None:
    module = _mixer(family)
    gen = torch.Generator().manual_seed(2)
    requests = Requests([torch.randn(n, HIDDEN, generator=gen) for n in lens])
    expected = _transformers_outputs(module, requests)
    packed = copy.deepcopy(module)
    with use_backend(backend):
        _run_steps(packed, requests, steps, slots)
    for r, want in enumerate(expected):
        assert requests.fed[r] == lens[r]
        got = torch.cat(requests.outputs[r])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"request {r}")


@pytest.mark.parametrize("family", FAMILIES)
def test_one_request_in_one_call(family: str) -> None:
    _check_against_transformers(family, [11], [[(0, 11)]], [0])


@pytest.mark.parametrize("family", FAMILIES)
def test_one_request_in_two_chunks_then_decode(family: str) -> None:
    steps = [[(0, 6)], [(0, 5)], [(0, 1)], [(0, 1)]]
    _check_against_transformers(family, [13], steps, [1])


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_packed_in_one_call_keep_their_own_state(family: str) -> None:
    # step 1: request 0's first chunk beside request 1 whole and request 2's first token;
    # step 2: request 0's second chunk, request 2 decoding, request 3 arriving (2 tokens);
    # step 3: everyone still running decodes one token.
    lens = [9, 7, 3, 3]
    steps = [
        [(0, 5), (1, 7), (2, 1)],
        [(2, 1), (0, 3), (3, 2)],
        [(0, 1), (3, 1), (2, 1)],
    ]
    _check_against_transformers(family, lens, steps, [3, 0, 2, 1])


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_requests_longer_than_a_chunk_of_the_chunked_forms(family: str) -> None:
    # past 64 tokens both sides run several chunks of their chunked forms, over other borders:
    # request 0 in pieces of 70, 1 and 79 tokens beside request 1's 130 in one piece
    steps = [[(0, 70), (1, 130)], [(0, 1)], [(0, 79)], [(0, 1), (1, 1)]]
    _check_against_transformers(family, [151, 131], steps, [2, 0])


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["qwen3_5", "mamba2", "mamba", "lfm2", "kimi_linear"])
def test_the_triton_kernels_run_the_packed_layers(family: str) -> None:
    # one family per kernel mix: GDN, Mamba-2, Mamba-1, short convolution, KDA
    steps = [[(0, 3), (1, 2)], [(1, 1), (0, 2), (2, 1)], [(0, 1), (2, 1)]]
    _check_against_transformers(family, [6, 3, 2], steps, [1, 3, 0], backend="triton")


def test_every_family_has_a_packed_class() -> None:
    # every packed class is tested above (falcon_h1 twice: with and without its norm)
    assert {_mixer_class(f) for f in FAMILIES} == set(packed_classes())
    assert len(set(packed_classes().values())) == len(packed_classes()) == 16


def test_a_state_spec_sizes_the_slots_a_layer_reads() -> None:
    module = _mixer("qwen3_5")
    (spec,) = pack_recurrent_layers(module)
    assert spec.layer_idx == LAYER
    assert spec.conv_shape == (3, 2 * 2 * 8 + 4 * 6) and spec.ssm_shape == (4, 8, 6)
    assert spec.nbytes(torch.bfloat16) == 2 * (3 * 56 + 4 * 8 * 6)
    states = RecurrentStates([spec], num_slots=3)
    states.check_integrity()
    assert states.slot_nbytes() == spec.nbytes(torch.float32)
    states.ssm[LAYER][0].normal_()
    states.copy_slot(0, 2)
    assert torch.equal(states.ssm[LAYER][2], states.ssm[LAYER][0])


def test_a_packed_layer_refuses_to_run_without_the_step_states() -> None:
    module = _mixer("mamba2")
    pack_recurrent_layers(module)
    with pytest.raises(RuntimeError, match="radixkv model runner"):
        module(torch.zeros(1, 2, HIDDEN))


def test_a_convolution_activation_without_a_kernel_is_refused_before_any_swap() -> None:
    module = _mixer("mamba2")
    module.activation = "gelu"
    with pytest.raises(ValueError, match="gelu"):
        pack_recurrent_layers(module)
    assert type(module) in packed_classes()  # unchanged
