"""Multi-head latent attention over the paged latent cache: the modules the runner swaps in for MLA.

transformers' MLA modules (DeepSeek V2 / V3 and the families that copy them) up-project the
cached latents by kv_b_proj into every head's keys and values before an ordinary attention call.
radixkv keeps one vector a token and layer instead (`kernels/latent_metadata.py`) and attends
over it directly. For the attention classes in `FAMILIES` the runner swaps the class of every
module for a subclass here (`swap_latent_modules`), keeping transformers' weights, parameter
names and submodules as they are:

    q          q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj; split into q_nope | q_pe
    latent     kv_a_proj_with_mqa -> [latent | k_pe]; kv_a_layernorm on the latent
    RoPE       the family's own function, on q_pe and k_pe (DeepSeek V2's complex rotation,
               V3's interleaved or half-split one, the tables' yarn scaling included)
    store      kernels.store_latent_step: [latent | k_pe] into the step's slots
    attention  per run of requests of the step's plan (`LatentStep`): absorbed (q_nope @ W_UK,
               kernels.latent_attention_step, @ W_UV) or expanded
               (kernels.expanded_latent_attention_step, kv_b_proj's weight as it is)
    out        o_proj

W_UK [N, P, L] and W_UV [N, V, L] are views of kv_b_proj's weight, taken once when the class is
swapped (no copy: the model's memory does not grow); swap after the model is on its device.

Family details are data (`LatentFamily`): the RoPE function, LongCat's LoRA scales of q and of
the latent (the latent is stored scaled, as transformers caches it), Mistral 4's per-position
query scale. Models with DeepSeek's sparse attention (an indexer choosing top-k positions per
query: DeepSeek V3.2, Mistral Large 4, GLM-5 / DSA and the others in `SPARSE_ATTENTION`) are
refused with one line: the latent kernels attend to every position.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixkv import kernels
from radixkv.engine.model.model_loader import ModelLoadError
from radixkv.kernels import LatentDims, LatentStep

logger = logging.getLogger(__name__)

# RoPE of the rope parts: (module, q_pe [1, N, T, R], k_pe [1, 1, T, R], position_embeddings)
# -> both rotated, as transformers' own function rotates them.
Rope = Callable[[Any, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class LatentFamily:
    """How one transformers attention class differs from DeepSeek V3's MLA."""

    rope: Rope | None  # None: NoPE (Kimi Linear), k_pe stored as projected
    lora_scales: bool = False  # LongCat: q * sqrt(hidden / q_lora_rank), latent * ... kv
    llama4_query_scale: bool = False  # Mistral 4: q * (1 + beta log(1 + floor(pos / max)))


def _module(name: str) -> Any:
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _v3_rope(name: str) -> Rope:
    """DeepSeek V3's flavour: interleaved pairs when the config says `rope_interleave`, else
    half-split, both from the family's own module."""
    module = _module(name)

    def rope(attn: Any, q_pe: torch.Tensor, k_pe: torch.Tensor, embeddings: Any) -> Any:
        cos, sin = embeddings
        if getattr(attn.config, "rope_interleave", False):
            return module.apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
        return module.apply_rotary_pos_emb(q_pe, k_pe, cos, sin)

    return rope


def _half_rope(name: str, *, interleave: bool) -> Rope:
    module = _module(name)
    apply = module.apply_rotary_pos_emb_interleave if interleave else module.apply_rotary_pos_emb

    def rope(attn: Any, q_pe: torch.Tensor, k_pe: torch.Tensor, embeddings: Any) -> Any:
        cos, sin = embeddings
        return apply(q_pe, k_pe, cos, sin)

    return rope


def _complex_rope(attn: Any, q_pe: torch.Tensor, k_pe: torch.Tensor, embeddings: Any) -> Any:
    """DeepSeek V2: pairs rotated as complex numbers by the position's freqs_cis."""
    return _module("deepseek_v2").apply_rotary_emb(q_pe, k_pe, embeddings.to(q_pe.device))


# transformers model type -> (its MLA attention class's name, how it differs from V3's)
FAMILY_SPECS: dict[str, tuple[str, Callable[[], LatentFamily]]] = {
    "deepseek_v2": ("DeepseekV2Attention", lambda: LatentFamily(_complex_rope)),
    "deepseek_v3": ("DeepseekV3Attention", lambda: LatentFamily(_v3_rope("deepseek_v3"))),
    "glm4_moe_lite": ("Glm4MoeLiteAttention", lambda: LatentFamily(_v3_rope("glm4_moe_lite"))),
    "mistral4": (
        "Mistral4Attention",
        lambda: LatentFamily(_v3_rope("mistral4"), llama4_query_scale=True),
    ),
    "minicpm3": (
        "MiniCPM3Attention",
        lambda: LatentFamily(_half_rope("minicpm3", interleave=False)),
    ),
    "longcat_flash": (
        "LongcatFlashMLA",
        lambda: LatentFamily(_half_rope("longcat_flash", interleave=True), lora_scales=True),
    ),
    "kimi_linear": ("KimiLinearAttention", lambda: LatentFamily(None)),
    "axk1": ("AXK1Attention", lambda: LatentFamily(_v3_rope("axk1"))),
    "youtu": ("YoutuAttention", lambda: LatentFamily(_v3_rope("youtu"))),
}
# Model types whose MLA layers attend to the top-k positions an indexer picks (DeepSeek Sparse
# Attention): not what the latent kernels compute.
SPARSE_ATTENTION = {
    "deepseek_v32": "DeepseekV32Attention",
    "mistral_large4": "MistralLarge4TextAttention",
    "glm_moe_dsa": "GlmMoeDsaAttention",
    "glm5_next": "Glm5NextTextAttention",
    "dots3_note": "Dots3NoteAttention",
    "hy_v4": "HYV4Attention",
    "axk2": "AXK2Attention",
}


class LatentLayers:
    """The step's latent caches, as every latent layer reads them through the model's
    `radixkv_cache` keyword: `caches[layer_idx]` is the layer's [num_blocks, block_size,
    L + R] cache, `step` the step's metadata and plan (built once, shared by every layer)."""

    def __init__(self, caches: Sequence[torch.Tensor], step: LatentStep) -> None:
        self.caches = caches
        self.step = step

    def latent_layer(self, layer_idx: int) -> tuple[torch.Tensor, LatentStep]:
        return self.caches[layer_idx], self.step


class PagedLatentAttention(nn.Module):
    """The forward of an MLA attention module over the paged latent cache. Mixed in front of
    transformers' class by `swap_latent_modules` (which sets `latent_family`, `latent_dims`,
    `w_uk`, `w_uv`); called by the decoder layer with the step's `radixkv_cache` (anything with
    `latent_layer(layer_idx)`, e.g. `LatentLayers`). Ignores transformers' cache and mask."""

    latent_family: LatentFamily
    latent_dims: LatentDims
    w_uk: torch.Tensor  # [N, P, L]: a view of kv_b_proj.weight
    w_uv: torch.Tensor  # [N, V, L]

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        radixkv_cache: Any = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        family, dims = self.latent_family, self.latent_dims
        if radixkv_cache is None or (family.rope is not None and position_embeddings is None):
            raise RuntimeError(
                f"{type(self).__name__} runs only inside the radixkv model runner, with the "
                "step's latent cache and the rotary embeddings"
            )
        # hidden_states: [1, num_tokens, hidden] (the runner packs a step into one row)
        num_tokens = hidden_states.shape[1]
        q_nope, q_pe = self._queries(hidden_states[0])  # [T, N, P], [T, N, R]
        compressed = self.kv_a_proj_with_mqa(hidden_states[0])  # [T, L + R]
        latent, k_pe = compressed.split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        if family.lora_scales:
            q_nope, q_pe = q_nope * self.mla_scale_q_lora, q_pe * self.mla_scale_q_lora
            latent = latent * self.mla_scale_kv_lora
        if family.rope is not None:
            # transformers' layout: [batch, heads, tokens, R]; views, no copies
            q_rot, k_rot = family.rope(
                self, q_pe.transpose(0, 1)[None], k_pe[None, None], position_embeddings
            )
            q_pe, k_pe = q_rot[0].transpose(0, 1), k_rot[0, 0]
        cache, step = radixkv_cache.latent_layer(self.layer_idx)
        kernels.store_latent_step(latent, k_pe, cache, step.metadata)
        if family.llama4_query_scale:
            scale = self._llama4_scale(position_ids, q_nope.dtype)  # [T, 1, 1]
            q_nope, q_pe = q_nope * scale, q_pe * scale
        out = self._attend(q_nope, q_pe, cache, step)  # [T, N, V]
        return self.o_proj(out.reshape(1, num_tokens, -1)), None

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope [T, N, P] and q_pe [T, N, R]: views of the q projection."""
        q_proj = getattr(self, "q_proj", None)  # None (or absent) with a q LoRA
        if q_proj is None:
            return self._split(self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))))
        return self._split(q_proj(x))

    def _split(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dims = self.latent_dims
        q = q.view(q.shape[0], dims.num_heads, -1)
        return q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)

    def _llama4_scale(self, position_ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if position_ids is None:
            raise RuntimeError(f"{type(self).__name__} needs the step's position_ids")
        params = self.config.rope_parameters
        scale = _module("mistral4").get_llama_4_attn_scale(
            position_ids,
            params.get("llama_4_scaling_beta"),
            params.get("original_max_position_embeddings"),
        )  # [1, 1, T, 1]
        return scale[0, 0].to(dtype)[:, :, None]

    def _attend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, step: LatentStep
    ) -> torch.Tensor:
        """[T, N, V]: each run of the step's plan in its form."""
        parts = step.parts
        if len(parts) == 1:
            return self._attend_part(q_nope, q_pe, cache, parts[0].metadata, parts[0].absorbed)
        out = q_nope.new_empty((q_nope.shape[0], q_nope.shape[1], self.latent_dims.v_head_dim))
        for part in parts:
            rows = part.rows
            out[rows] = self._attend_part(
                q_nope[rows], q_pe[rows], cache, part.metadata, part.absorbed
            )
        return out

    def _attend_part(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        metadata: kernels.AttentionMetadata,
        absorbed: bool,
    ) -> torch.Tensor:
        if not absorbed:
            return kernels.expanded_latent_attention_step(
                q_nope, q_pe, cache, metadata, self.kv_b_proj.weight, self.scaling
            )
        # [T, N, P] @ W_UK -> [T, N, L]; the head-major product viewed token-major, no copy
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        latents = kernels.latent_attention_step(q_latent, q_pe, cache, metadata, self.scaling)
        return torch.bmm(latents.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)


def latent_dims_of(module: Any) -> LatentDims:
    """The sizes of one transformers MLA attention module, read from its own attributes."""
    return LatentDims(
        num_heads=module.num_heads,
        kv_lora_rank=module.kv_lora_rank,
        qk_rope_head_dim=module.qk_rope_head_dim,
        qk_nope_head_dim=module.qk_nope_head_dim,
        v_head_dim=module.v_head_dim,
    )


def _families() -> dict[type, tuple[str, LatentFamily]]:
    """transformers attention class -> (model type, family), of the families installed."""
    found: dict[type, tuple[str, LatentFamily]] = {}
    for model_type, (class_name, family) in FAMILY_SPECS.items():
        try:
            cls = getattr(_module(model_type), class_name)
        except (ImportError, AttributeError):  # an older transformers without it
            continue
        found[cls] = (model_type, family())
    return found


def _sparse_classes() -> dict[type, str]:
    found: dict[type, str] = {}
    for model_type, class_name in SPARSE_ATTENTION.items():
        try:
            found[getattr(_module(model_type), class_name)] = model_type
        except (ImportError, AttributeError):
            continue
    return found


_PAGED_CLASSES: dict[type, type] = {}


def _paged_class(cls: type) -> type:
    """`PagedLatentAttention` mixed in front of transformers' class, built once per class."""
    paged = _PAGED_CLASSES.get(cls)
    if paged is None:
        paged = type(f"Paged{cls.__name__}", (PagedLatentAttention, cls), {})
        _PAGED_CLASSES[cls] = paged
    return paged


def swap_latent_modules(model: nn.Module) -> LatentDims | None:
    """Give every MLA attention module of `model` its paged class (in place) and its W_UK /
    W_UV views. Returns the model's latent sizes, or None, changing nothing, for a model
    without MLA layers. Raises ModelLoadError, changing nothing, for sparse (indexer) MLA or
    for latent layers of different sizes."""
    modules = list(model.modules())
    sparse = _sparse_classes()
    for m in modules:
        if type(m) in sparse:
            raise ModelLoadError(
                f"{sparse[type(m)]}: DeepSeek sparse attention (an indexer picks the top-k "
                "positions of each query) is not supported; radixkv's latent kernels attend to "
                "every position"
            )
    families = _families()
    latent = [m for m in modules if type(m) in families or isinstance(m, PagedLatentAttention)]
    if not latent:
        return None
    dims = {latent_dims_of(m) for m in latent}
    if len(dims) > 1:
        raise ModelLoadError(f"latent layers of different sizes: {sorted(map(str, dims))}")
    (model_dims,) = dims
    for m in latent:
        cls = type(m)
        if cls not in families:  # swapped before: its transformers class is the next base
            cls = cls.__mro__[2]
        m.__class__ = _paged_class(cls)
        m.latent_family = families[cls][1]
        m.latent_dims = model_dims
        heads = m.kv_b_proj.weight.view(model_dims.num_heads, -1, model_dims.kv_lora_rank)
        m.w_uk = heads[:, : model_dims.qk_nope_head_dim]
        m.w_uv = heads[:, model_dims.qk_nope_head_dim :]
    logger.debug("latent attention swapped into %d layers of %s", len(latent), type(model).__name__)
    return model_dims


def unswap_latent_modules(model: nn.Module) -> None:
    """Undo `swap_latent_modules` (in place; nothing to do for a model it never changed)."""
    _restore(model.modules())


def _restore(modules: Iterable[nn.Module]) -> None:
    for m in modules:
        if isinstance(m, PagedLatentAttention):
            m.__class__ = type(m).__mro__[2]
            for name in ("latent_family", "latent_dims", "w_uk", "w_uv"):
                m.__dict__.pop(name, None)


@dataclass(frozen=True, slots=True)
class LatentCacheSpec:
    """The paged latent cache of one model: one [num_blocks, block_size, L + R] tensor a
    latent layer."""

    num_layers: int
    latent_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """One block over all latent layers."""
        return self.num_layers * self.block_size * self.latent_dim * self.dtype.itemsize

    def allocate(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        """The zeroed caches of every latent layer, [num_layers, num_blocks, block_size, L + R]
        (zeros, not empty, as the K/V cache: a padded row of a captured graph reads block 0)."""
        shape = (self.num_layers, num_blocks, self.block_size, self.latent_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device)
