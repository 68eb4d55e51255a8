"""What a model argument names, checked without torch or transformers: the command line asks
this before it imports them (seconds), so that a model that is not there is one line at once.

A local path must exist; a Hugging Face id, when downloads are off (`HF_HUB_OFFLINE`, the
command line's default), must be in the local Hugging Face cache. `model_loader` loads what
passes, and says the same words when what is there cannot be loaded.
"""

from __future__ import annotations

import os

OFFLINE_HINT = (
    "no such local folder, and it is not a Hugging Face id available offline "
    "(HF_HUB_OFFLINE is set; allow downloads with HF_HUB_OFFLINE=0)"
)


def is_local_path(source: str) -> bool:
    """Whether `source` can only be a path: a Hugging Face id is "name" or "owner/name"."""
    return (
        os.path.isabs(source)
        or source.startswith((".", "~"))
        or source.count("/") > 1
        or (os.sep != "/" and os.sep in source)
    )


def downloads_off() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")


def missing_model(model: str | os.PathLike[str] | None) -> str | None:
    """Why `model` (a `--model` value; None: the bundled default) names nothing loadable, or
    None when it may load (a folder that exists, a cached or downloadable id: whether its
    files load is the loader's to say)."""
    if model is None:
        return None
    source = os.path.expanduser(os.fspath(model))  # no Hugging Face id starts with "~"
    if not source.strip():
        return "model must be a non-empty path or Hugging Face id"
    if os.path.exists(source):
        return None
    if is_local_path(source):
        return f"cannot load model {source!r}: no such folder"
    if downloads_off() and not _in_hub_cache(source):
        return f"cannot load model {source!r}: {OFFLINE_HINT}"
    return None


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds `repo_id`'s config (huggingface_hub imports
    in a fraction of a second; without it, say yes and let the loader decide)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return True
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id: the loader's message says why
        return True
    return isinstance(found, str)
