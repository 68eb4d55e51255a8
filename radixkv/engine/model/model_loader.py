"""Resolve a model argument to a loaded Hugging Face causal LM and its tokenizer.

* `None` -> the bundled default, SmolLM2-135M-Instruct, converted once from its GGUF into the user
  cache directory by `radixkv.bundled_model`, then loaded from that folder.
* A local directory or a Hugging Face id -> `AutoModelForCausalLM` / `AutoTokenizer` (with
  `HF_HUB_OFFLINE=1` only the local HF cache is consulted); a config whose type the auto class
  does not map to a causal LM (Mistral 4) loads as the `...ForCausalLM` class its
  `architectures` names.
* An already built `PreTrainedModel` -> used as is (the engine switches its attention
  implementation, so do not share it with code that expects the old one).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from radixkv import bundled_model
from radixkv.engine.model.model_source import OFFLINE_HINT, downloads_off, is_local_path

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]


class ModelLoadError(ValueError):
    """The model cannot be loaded: nothing found, or a broken folder (corrupt or truncated
    weights, shapes that do not match the config, missing weights), or, for a chat, no tokenizer
    or no chat template. The message names the model and what to check."""


class ModelNotFoundError(ModelLoadError):
    """The model argument names nothing loadable; the message says what to install or check."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any  # transformers PreTrainedModel, in eval mode, on its device
    tokenizer: Any | None  # transformers tokenizer, or None when the model folder ships none
    name: str  # what the user asked for, or the default model's name
    # The local folder the tokenizer was read from (None for a Hugging Face id or a model object):
    # what a replica reports to routers, which would otherwise try to download `name`.
    tokenizer_path: str | None = None


def load_model(
    model: str | os.PathLike[str] | Any | None = None,
    *,
    tokenizer: Any | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    progress: Progress | None = None,
) -> LoadedModel:
    """Load `model` (see module docstring) onto `device` in `dtype` (default: fp32 on CPU, the
    checkpoint's dtype on CUDA). Raises ValueError for a device this machine does not have,
    ModelNotFoundError when nothing can be loaded, and its base ModelLoadError when the model
    folder is broken."""
    from transformers import PreTrainedModel

    device = _check_device(device) if device is not None else _default_device()
    if isinstance(model, PreTrainedModel):
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        net = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
        return LoadedModel(net.eval(), tokenizer, name)
    if model is None:
        try:
            folder = bundled_model.ensure_converted(progress)
        except FileNotFoundError as exc:
            raise ModelNotFoundError(str(exc)) from exc
        loaded = load_model(folder, tokenizer=tokenizer, device=device, dtype=dtype)
        gen = loaded.model.generation_config
        for key, value in bundled_model.RECOMMENDED_SAMPLING.items():
            if getattr(gen, key, None) is None:
                setattr(gen, key, value)
        return LoadedModel(loaded.model, loaded.tokenizer, bundled_model.NAME, str(folder))
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model must be None, a path, a Hugging Face id or a PreTrainedModel, "
            f"got {type(model).__name__}"
        )
    source = os.path.expanduser(os.fspath(model))  # no Hugging Face id starts with "~"
    if not source.strip():
        raise ModelNotFoundError("model must be a non-empty path or Hugging Face id")
    if is_local_path(source) and not os.path.exists(source):
        # Said here: transformers would answer with advice about Hugging Face repo ids.
        raise ModelNotFoundError(f"cannot load model {source!r}: no such folder")
    net = _load_causal_lm(source, device, dtype)
    if tokenizer is not None:
        return LoadedModel(net, tokenizer, source)
    folder = os.path.abspath(source) if os.path.isdir(source) else None
    return LoadedModel(net, load_tokenizer(source), source, folder)


def _check_device(device: object) -> torch.device:
    """`device` as a torch.device. Raises TypeError for a value of another type, ValueError for
    an unknown device or a CUDA device this machine does not have."""
    message = f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}"
    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except TypeError as exc:
        raise TypeError(message) from exc
    except RuntimeError as exc:
        raise ValueError(message) from exc
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(
            f"device is {str(dev)!r}, but this machine has {torch.cuda.device_count()} CUDA devices"
        )
    return dev


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _load_causal_lm(source: str, device: torch.device, dtype: torch.dtype | None) -> Any:
    """Raises ModelNotFoundError when there is nothing to load, ModelLoadError when what is there
    is broken."""
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else "auto"
    try:
        # Mismatched shapes are loaded (re-initialised) and reported in `info`, checked below.
        net, info = _causal_lm_class(source).from_pretrained(
            source, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
        )
    except (OSError, ValueError) as exc:
        if os.path.isdir(source):
            hint = "the folder has no loadable config.json / weights"
        elif not downloads_off():
            hint = "no such local folder, and it is not a Hugging Face id available online"
        else:
            hint = OFFLINE_HINT
        raise ModelNotFoundError(f"cannot load model {source!r}: {hint} ({exc})") from exc
    except Exception as exc:
        # e.g. safetensors' SafetensorError for a corrupt or truncated file: whatever a broken
        # checkpoint makes transformers raise.
        raise ModelLoadError(
            f"cannot load model {source!r}: its weights are broken ({_first_line(exc)})"
        ) from exc
    mismatched = sorted(
        f"{key} {tuple(saved)} (config: {tuple(expected)})"
        for key, saved, expected in info.get("mismatched_keys") or ()
    )
    if mismatched:
        raise ModelLoadError(
            f"cannot load model {source!r}: weight shapes do not match its config.json: "
            + _some(mismatched)
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelLoadError(f"cannot load model {source!r}: its weights lack {_some(missing)}")
    return net.to(device).eval()


def _causal_lm_class(source: str) -> Any:
    """AutoModelForCausalLM, or the causal LM class the config's `architectures` names where the
    auto class maps none to its type (transformers has `Mistral4ForCausalLM` but maps mistral4
    only to the multimodal model). Raises what loading the config raises for a bad source."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError):
        return AutoModelForCausalLM  # let its own load report the source
    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    names = [n for n in getattr(config, "architectures", None) or () if n.endswith("ForCausalLM")]
    found = [getattr(transformers, n) for n in names if hasattr(transformers, n)]
    return found[0] if found else AutoModelForCausalLM


def _some(items: list[str]) -> str:
    more = f" and {len(items) - 2} more" if len(items) > 2 else ""
    return ", ".join(items[:2]) + more


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def load_tokenizer(source: str) -> Any | None:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:
        # A model folder without (usable) tokenizer files is usable with token-id prompts only.
        logger.info("no tokenizer for %s (%s); prompts must be token ids", source, exc)
        return None


def eos_token_ids(model: Any, tokenizer: Any | None) -> tuple[int, ...]:
    """The EOS ids of the model's generation config, then the tokenizer's, without repeats."""
    ids: list[int] = []
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for eos in (config_eos, getattr(tokenizer, "eos_token_id", None)):
        if eos is not None:
            ids += list(eos) if isinstance(eos, Sequence) else [eos]
    return tuple(dict.fromkeys(int(t) for t in ids))


def model_max_len(model: Any) -> int:
    """The positions the model was trained for; a sliding window limits what a layer sees, not
    the context (GPT-2's n_positions answers to this name too)."""
    cfg = model.config.get_text_config()
    return int(getattr(cfg, "max_position_embeddings", None) or 8192)
