"""The engine options of `radixkv chat` and `radixkv serve`: one table, each row a command-line
option and the `EngineConfig` field it sets. Defaults come from `EngineConfig` (a command may
override some, as `serve` does for `prefill_first`); a new setting is a field there and a row here.

Torch-free: `radixkv --help` answers at once.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from radixkv.engine.config import BLOCK_HASHES, EVENT_LAYOUTS, SNAPSHOT_DTYPES, EngineConfig
from radixkv.engine.model.model_source import missing_model


@dataclass(frozen=True, slots=True)
class Option:
    flag: str
    field: str  # the EngineConfig field it sets
    help: str
    type: Callable[[str], Any] | None = int  # None: an on/off switch (--x / --no-x)
    choices: tuple[str, ...] | None = None
    to_field: Callable[[Any], Any] | None = None  # the parsed value -> the field's value


# The environment variable of `EngineConfig.kv_cache_secret`: a secret on the command line would
# show in every process listing.
SECRET_ENV = "RADIXKV_KV_CACHE_SECRET"

_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_UNITS |= {f"{k}B": v for k, v in _UNITS.items() if k not in ("", "B")}
_UNITS |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_bytes(text: str) -> int:
    """A size in bytes from "4GiB", "512MiB", "1.5GB", "100k" or "65536" (case-insensitive
    units; KiB, MiB... are powers of 2, KB, MB... powers of 10). argparse.ArgumentTypeError
    for anything else."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    units = {k.lower(): v for k, v in _UNITS.items()}
    if match is None or match.group(2).lower() not in units:
        raise argparse.ArgumentTypeError(f"not a size like 4GiB or 512MB: {text!r}")
    return int(float(match.group(1)) * units[match.group(2).lower()])


def format_bytes(num_bytes: int) -> str:
    """A size as `parse_bytes` reads it back, in the largest binary unit it is a whole number
    of ("8GiB", "512MiB"); plain bytes otherwise."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if num_bytes and num_bytes % _UNITS[unit] == 0:
            return f"{num_bytes // _UNITS[unit]}{unit}"
    return str(num_bytes)


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


OPTIONS = (
    Option("--block-size", "block_size", "tokens per KV block"),
    Option("--num-blocks", "num_blocks", "KV cache size in blocks"),
    Option("--cache-mb", "kv_cache_bytes", "KV cache size in MiB", to_field=lambda mb: mb * 2**20),
    Option("--num-window-blocks", "num_window_blocks", "window layers' KV blocks"),
    Option("--num-snapshots", "num_snapshots", "recurrent-state snapshots kept (hybrid models)"),
    Option(
        "--snapshot-share",
        "snapshot_share",
        "share of the KV cache bytes for recurrent-state snapshots (hybrid models)",
        type=float,
    ),
    Option(
        "--snapshot-min-gap-tokens",
        "snapshot_min_gap_tokens",
        "fewest tokens between a request's recurrent-state snapshots (hybrid models)",
    ),
    Option(
        "--snapshot-dtype",
        "snapshot_dtype",
        "how recurrent-state snapshots are stored: exact, or compact (bf16 / int8 SSM state;"
        " output may differ)",
        type=str,
        choices=SNAPSHOT_DTYPES,
    ),
    Option("--prefix-cache", "enable_prefix_cache", "reuse cached prompt prefixes", type=None),
    Option("--max-num-seqs", "max_num_seqs", "requests running at once"),
    Option("--max-num-batched-tokens", "max_num_batched_tokens", "tokens per step"),
    Option("--chunked-prefill-size", "chunked_prefill_size", "prompt tokens per request per step"),
    Option(
        "--policy",
        "policy",
        "waiting order: longest cached prefix first, or arrival",
        type=str,
        choices=("lpm", "fcfs"),
    ),
    Option(
        "--prefill-first",
        "prefill_first",
        "a step that admits new requests runs no decodes: sooner first tokens, a little less"
        " throughput",
        type=None,
    ),
    Option("--device", "device", "torch device (default: CUDA if present)", type=str),
    Option(
        "--dtype",
        "dtype",
        "model dtype (default: fp32 on a CPU, the checkpoint's on CUDA)",
        type=str,
        choices=("float32", "float16", "bfloat16"),
        to_field=_torch_dtype,
    ),
    Option("--enforce-eager", "enforce_eager", "no CUDA-graph decode (GPU only)", type=None),
    Option(
        "--async-scheduling",
        "async_scheduling",
        "schedule the next step while the device runs this one (same output; default: on"
        " with CUDA)",
        type=None,
    ),
    Option(
        "--jump-forward",
        "jump_forward",
        "structured output: compute the text a grammar forces as one extend step, not a decode"
        " step per token",
        type=None,
    ),
    Option("--num-threads", "num_threads", "CPU torch threads (default: half the cores)"),
    Option("--seed", "seed", "seed of sampled requests without their own"),
    Option(
        "--parse-special-tokens-in-content",
        "parse_special_tokens_in_content",
        "read special-token text in chat messages (e.g. <|im_start|>) as special tokens, not as"
        " plain text: a user could then forge a system turn",
        type=None,
    ),
    Option(
        "--kv-events",
        "kv_events",
        "publish KV events for cache-aware routers on this ZeroMQ address, bound (e.g."
        " tcp://127.0.0.1:5557; tcp://*:5557 binds every interface)",
        type=str,
    ),
    Option(
        "--kv-events-layout",
        "kv_events_layout",
        "event layout: current vLLM's tagged maps (vllm-router, Dynamo) or older vLLM's arrays"
        " (llm-d)",
        type=str,
        choices=EVENT_LAYOUTS,
    ),
    Option("--kv-events-topic", "kv_events_topic", "ZeroMQ topic of the events", type=str),
    Option(
        "--kv-events-replay",
        "kv_events_replay",
        "bind this ZeroMQ address to serve missed event batches (vLLM's replay endpoint)",
        type=str,
    ),
    Option(
        "--kv-events-connect",
        "kv_events_connect",
        "connect to the --kv-events address instead of binding it",
        type=None,
    ),
    Option(
        "--block-hash",
        "block_hash",
        "block-hash chain of the KV events: radixkv's xxh64, or vLLM's sha256_cbor (for routers"
        " that hash requests as vLLM does, such as llm-d)",
        type=str,
        choices=BLOCK_HASHES,
    ),
    Option(
        "--block-hash-seed",
        "block_hash_seed",
        "sha256_cbor's seed: the PYTHONHASHSEED of the vLLM replicas it must match (default:"
        " vLLM's, 'vllm-none-hash')",
        type=str,
    ),
    Option(
        "--host-cache",
        "host_cache_bytes",
        "host-memory tier under the KV cache, e.g. 4GiB (0: none)",
        type=parse_bytes,
    ),
    Option(
        "--kv-cache-dir",
        "kv_cache_dir",
        "disk tier in this folder, kept across restarts (needs --host-cache); its files hold"
        " prompts' token ids, readable by this user alone; with the environment variable"
        f" {SECRET_ENV} set, their checksums are keyed by it and a forged file is never loaded",
        type=str,
    ),
    Option("--disk-cache", "disk_cache_bytes", "disk tier budget, e.g. 20GiB", type=parse_bytes),
)


def add_engine_options(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add --model and every option of `OPTIONS` to `parser`. `defaults`: this command's own
    defaults for some EngineConfig fields (the config's otherwise)."""
    parser.add_argument(
        "--model",
        default=None,
        help="local path or Hugging Face id (default: embedded SmolLM2-135M-Instruct)",
    )
    config_defaults = {f.name: f.default for f in fields(EngineConfig)} | defaults
    for opt in OPTIONS:
        metavar = None if opt.choices else opt.flag[2:].upper().replace("-", "_")
        kind: dict[str, Any] = {"type": opt.type, "choices": opt.choices, "metavar": metavar}
        if opt.type is None:
            kind = {"action": argparse.BooleanOptionalAction}
        default = config_defaults[opt.field]
        if opt.type is parse_bytes and isinstance(default, int):
            default = format_bytes(default)
        help_text = opt.help + _default_text(default)
        parser.add_argument(opt.flag, dest=opt.field, default=None, help=help_text, **kind)
    parser.set_defaults(engine_defaults=defaults)


def _default_text(default: object) -> str:
    if default is None:  # the field's comment in EngineConfig says what None means
        return ""
    if default == "":
        return ' (default: "")'
    if isinstance(default, bool):
        return f" (default: {'on' if default else 'off'})"
    return f" (default: {default})"


def engine_settings(args: argparse.Namespace, *, convert: bool = True) -> dict[str, Any]:
    """The `LLM` keyword arguments (EngineConfig fields) of the options given on the command line,
    over the command's own defaults, and the disk tier's secret from the environment.
    `convert=False` leaves out the options whose conversion imports torch (`--dtype`, whose
    name argparse has checked)."""
    settings = dict(args.engine_defaults)
    for opt in OPTIONS:
        value = getattr(args, opt.field)
        if value is not None and (convert or opt.to_field is not _torch_dtype):
            settings[opt.field] = value if opt.to_field is None else opt.to_field(value)
    if os.environ.get(SECRET_ENV) and settings.get("kv_cache_dir") is not None:
        settings["kv_cache_secret"] = os.environ[SECRET_ENV]
    return settings


def check_engine_options(args: argparse.Namespace) -> None:
    """Check the engine options of the command line before any model loads, without torch:
    every value (as `EngineConfig` checks them), the disk tier's folder and that `--model`
    names something there. Raises ValueError / TypeError; pass the text through `name_flags`
    for the user."""
    missing = missing_model(args.model)
    if missing is not None:
        raise ValueError(missing)
    config = EngineConfig(**engine_settings(args, convert=False))
    if config.kv_cache_dir is not None:
        check_writable_folder(os.fspath(config.kv_cache_dir), "--kv-cache-dir")


def check_writable_folder(folder: str, flag: str) -> None:
    """Create `folder` if need be and check that this process can write in it; ValueError
    naming `flag` otherwise."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{flag} {folder} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag} {folder} cannot be created: {exc.strerror or exc}") from None
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise ValueError(f"{flag} {folder} cannot be written: {exc.strerror or exc}") from None


def name_flags(message: str, extra: Mapping[str, str] | None = None) -> str:
    """`message`, about settings by their field names (`kv_cache_dir needs host_cache_bytes`),
    with each field named by the command-line flag that sets it (`--kv-cache-dir needs
    --host-cache`); `extra`: more field -> flag pairs (a command's own options)."""
    names = {opt.field: opt.flag for opt in OPTIONS} | dict(extra or {})
    alternatives = "|".join(re.escape(name) for name in sorted(names, key=len, reverse=True))
    # A one-word field ("device", "seed") is a field only where the message begins with it;
    # elsewhere it may be a plain word ("a torch device").
    pattern = rf"^({alternatives})\b|\b({alternatives})\b"

    def flag(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return names[name] if match.group(1) or "_" in name else name

    return re.sub(pattern, flag, message)
