"""`EngineConfig`: every setting of one engine, in one place, with one set of defaults.

`LLM(model, **settings)` builds it from its keyword arguments, as nano-vllm builds its `Config`;
the model runner and the scheduler (through its `SchedulerConfig` protocol) read it and trust it:
each value is checked here, once, before a model is loaded. The command-line options of
`radixkv chat` and `radixkv serve` map onto these fields (`radixkv.options`), so a new setting is a
field here and a row there.

Torch-free, so the command line's help can show the defaults without loading torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from radixkv.cache import check_size
from radixkv.cache.keys import BLOCK_HASHES, make_block_hasher
from radixkv.engine.sampling_params import check_seed
from radixkv.kv_events import EVENT_LAYOUTS, check_address, check_event_layout, check_kv_events
from radixkv.scheduler.policy import POLICIES

__all__ = ["BLOCK_HASHES", "EVENT_LAYOUTS", "SNAPSHOT_DTYPES", "EngineConfig"]  # the choices
# of the options table

# How kept recurrent-state snapshots are stored (`radixkv.engine.step.recurrent.compact`).
SNAPSHOT_DTYPES = ("exact", "bf16", "int8")

if TYPE_CHECKING:
    import torch

# (field, lowest value) of the int settings; the ones that may be None say so in their type.
_SIZES = {
    "block_size": 1,
    "num_blocks": 1,
    "num_window_blocks": 1,
    "num_snapshots": 0,
    "snapshot_min_gap_tokens": 1,
    "kv_cache_bytes": 0,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 1,
    "chunked_prefill_size": 1,
    "defer_shared_prefix_tokens": 0,
    "max_model_len": 1,
    "num_threads": 1,
    "host_cache_bytes": 0,
    "disk_cache_bytes": 1,
}
_SWITCHES = (
    "enable_prefix_cache",
    "prefill_first",
    "enforce_eager",
    "async_scheduling",
    "kv_events_connect",
    "host_cache_write_through",
    "parse_special_tokens_in_content",
    "jump_forward",
    "detokenize",
)
# Switches whose None means "decided by the device".
_AUTO_SWITCHES = ("async_scheduling",)
# Settings of the events' wire, which only an address has.
_WIRE_SETTINGS = ("kv_events_layout", "kv_events_topic", "kv_events_replay", "kv_events_connect")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The settings of an engine: its KV cache, its scheduler, its model runner.

    Raises TypeError / ValueError naming the field for a value of the wrong type or range (numpy
    ints are taken as ints). `LLM` keeps the config it runs with as `llm.config`, `max_model_len`
    filled in from the model.
    """

    # The KV cache: blocks of `block_size` tokens; `num_blocks` of them, or as many as
    # `kv_cache_bytes` holds, or (neither given) 512 MiB on a CPU, 80 % of a GPU's free memory.
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    # A model with sliding-window layers keeps their KV in a pool of its own, which only the last
    # W tokens of each request and the window tails of cached prefixes use
    # (`radixkv.cache.window`): `num_window_blocks` blocks. None: room for `max_num_seqs` requests'
    # windows and chunks, twice (tails share them). The engine refuses a pool that holds not one
    # request's. Its bytes come out of the byte budget where that sizes the cache (`kv_cache_bytes`
    # or the device's default), the default's at most half of it.
    num_window_blocks: int | None = None
    # A model with recurrent layers (Gated DeltaNet, Mamba, short convolutions) keeps one state of
    # them per running request and snapshots of it where later requests resume
    # (`radixkv.cache.state`), in one pool of slots: `max_num_seqs` for running requests and
    # `num_snapshots` more (snapshots may also fill the running requests' slots while they are
    # free). None: `snapshot_share` of the byte budget where that sizes the cache (0.28: where
    # the model-free simulation met its goals, benchmarks/RESULTS.md), else 2 per running
    # request. A snapshot closer than `snapshot_min_gap_tokens` to the point its request resumed
    # from or its previous snapshot is not taken.
    num_snapshots: int | None = None
    snapshot_share: float = 0.28
    snapshot_min_gap_tokens: int = 64
    # How snapshots are stored: "exact" (a running state's format: greedy output equal to a
    # cold run's), "bf16" or "int8" (the SSM / delta-rule state in bfloat16, or int8 with a
    # scale per head and key channel; the conv window as is). A compact snapshot is rounded
    # once, when taken: a hit resumes from the rounded state, and output may then differ
    # (benchmarks/RESULTS.md, compact snapshots); it sits in a slot of its own, `max_num_seqs`
    # slots stay for the running requests, exact. At Qwen3.5-4B's sizes a byte budget holds
    # 1.9x the snapshots in int8 of a bf16 model (3.4x of an fp32 one; bf16 1.9x of fp32).
    snapshot_dtype: str = "exact"
    # False: no match and no insert; every block is private and freed at finish. Used to check that
    # output with the cache off equals output with it on.
    enable_prefix_cache: bool = True

    # The scheduler: the bounds of one step and the waiting order.
    max_num_seqs: int = 16  # running requests at once (decoding or mid-prefill)
    max_num_batched_tokens: int = 1024  # tokens computed per step, all rows together
    chunked_prefill_size: int = 512  # prefill tokens per request per step
    policy: str = "lpm"  # waiting order: "fcfs" (arrival) | "lpm" (longest cached prefix first)
    # In-batch prefix caching (SGLang's deprioritise threshold): requests admitted in the same step
    # insert nothing until the step is done, so N requests sharing an uncached prompt prefix would
    # each compute it. A waiting request is held back for this step when a request admitted earlier
    # in the step is computing at least this many tokens of its prefix beyond its own cache hit;
    # next step it finds them cached. Costs the held-back request one step of time to first token,
    # so a short overlap (below the threshold) is recomputed instead. 0 disables; no effect with
    # the prefix cache off.
    defer_shared_prefix_tokens: int = 32
    # Prefill first (SGLang's default order): a step that admits waiting requests runs the
    # running requests' prefill chunks, then the new prompts' prefill, and no decode rows; a step
    # that admits nothing decodes as usual. New requests get their first token a step or more
    # sooner, running ones wait that step (a little less throughput for a batch). Decodes are
    # never held back for long: every admission adds a running request, so admission stops at
    # `max_num_seqs` or when the pool is full, and then they run.
    prefill_first: bool = False
    # The context of one sequence: prompt + generated tokens. None: the model's; a value is capped
    # at the model's.
    max_model_len: int | None = None

    # The model and its runner.
    device: str | torch.device | None = None  # None: CUDA if present, else the CPU
    dtype: torch.dtype | None = None  # None: fp32 on a CPU, the checkpoint's dtype on CUDA
    enforce_eager: bool = False  # no CUDA graphs for decode steps (a CPU always runs eager)
    # Overlapped steps (`radixkv.engine.step.launch`): the host schedules and packs the next step
    # while the device runs this one; sampled tokens are read one step late, the output is the
    # same, with penalties, logprobs and tiers. None: on where the device is CUDA (1.5x the
    # output tok/s there: benchmarks/RESULTS.md); a CPU runs the forward on the host itself, so
    # there it cannot help.
    async_scheduling: bool | None = None
    # Torch threads on a CPU. None: half the cores (1 on a 2-core machine), because OpenMP
    # spin-waiting collapses when a co-tenant keeps the other cores busy.
    num_threads: int | None = None
    # Jump-forward for structured output (`radixkv.engine.sampling.jump_forward`): the text a
    # request's grammar forces is computed as one extend step, not a decode step per token; a
    # request's `SamplingParams.jump_forward` overrides it. Output may differ from token-by-token
    # decoding (benchmarks/RESULTS.md, structured output).
    jump_forward: bool = True
    # False: updates and outputs carry token ids and no text (their `new_text` and `text` are
    # ""): the caller detokenizes, as `radixkv serve`'s front end does in its own process while
    # the engine's process keeps its core for the forward.
    detokenize: bool = True
    seed: int = 0  # mixed with the submit order into the seed of a sampled request without one
    # Chat messages are what users typed: by default special-token text in their content (say
    # "<|im_end|><|im_start|>system") is tokenized as plain text, so no user can forge a turn;
    # True parses it as the chat template's own text (`radixkv.engine.model.chat_template`).
    parse_special_tokens_in_content: bool = False
    # Where the prefix cache's KV events go: None, a ZeroMQ address such as "tcp://*:5557" (vLLM's
    # wire format, for cache-aware routers) or a callable taking each event
    # (`radixkv.kv_events`), drained after each step; `llm.kv_events.close()` stops them.
    kv_events: str | Callable[[Any], None] | None = None
    # The wire, for an address (`radixkv.kv_events` explains each): the events' layout, "map"
    # (current vLLM's, read by vllm-router and Dynamo) or "array" (older vLLM's, llm-d's); the
    # topic frame (llm-d reads the replica's identity from it); an address that serves missed
    # batches (vLLM's replay ROUTER socket, bound); connect to the address instead of binding it.
    kv_events_layout: str = "map"
    kv_events_topic: str = ""
    kv_events_replay: str | None = None
    kv_events_connect: bool = False
    # The block-hash chain of the events: "xxh64" (radixkv's) or "sha256_cbor" (vLLM's, which
    # llm-d computes request keys with), seeded as vLLM is by PYTHONHASHSEED (None: vLLM's
    # default seed). `radixkv.cache.keys.make_block_hasher`.
    block_hash: str = "xxh64"
    block_hash_seed: str | None = None

    # The tiers below the device pool (`radixkv.cache.tiers`): a host pool of `host_cache_bytes`
    # (0: none; pinned on CUDA) takes the full blocks the device pool evicts, and a disk tier in
    # the folder `kv_cache_dir` (None: none; it needs the host tier) of at most
    # `disk_cache_bytes` takes what the host evicts and outlives the process. A model with
    # recurrent layers keeps its snapshots there too, in `snapshot_share` of both budgets.
    host_cache_bytes: int = 0
    # Copy every committed full block to the host at once, instead of when the device evicts it
    # (write-back, the default: see benchmarks/RESULTS.md, tiers); for a model with window
    # layers, the full blocks of each window tail too, when the tail is kept.
    host_cache_write_through: bool = False
    kv_cache_dir: str | os.PathLike[str] | None = None
    disk_cache_bytes: int = 8 * 2**30
    # A deployment's secret: block files then carry a checksum keyed by it (and live in a folder
    # of their own), so a file forged by whoever can write the folder without the secret is
    # never loaded (`radixkv.engine.tiers.disk_store`). None: unkeyed. The command line takes it
    # from the environment variable RADIXKV_KV_CACHE_SECRET (`radixkv.options`), never from argv.
    kv_cache_secret: str | bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name, low in _SIZES.items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_size(value, name, low=low))
        object.__setattr__(self, "seed", check_seed(self.seed))
        share = self.snapshot_share
        if isinstance(share, bool) or not isinstance(share, (int, float)):
            raise TypeError(f"snapshot_share must be a number, got {type(share).__name__}")
        if not 0 <= share < 1:
            raise ValueError(f"snapshot_share must be in [0, 1), got {share}")
        if not isinstance(self.snapshot_dtype, str):
            raise TypeError(f"snapshot_dtype must be a str, got {self.snapshot_dtype!r}")
        if self.snapshot_dtype not in SNAPSHOT_DTYPES:
            raise ValueError(
                f"snapshot_dtype must be one of {SNAPSHOT_DTYPES}, got {self.snapshot_dtype!r}"
            )
        for name in _SWITCHES:
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name in _AUTO_SWITCHES and value is None):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        names = tuple(POLICIES)  # a tuple: `in` a dict raises a bare TypeError for a list
        if self.policy not in names:
            raise ValueError(f"policy must be one of {names}, got {self.policy!r}")
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        if self.kv_cache_dir is not None:
            if not isinstance(self.kv_cache_dir, (str, os.PathLike)):
                raise TypeError(f"kv_cache_dir must be a path, got {self.kv_cache_dir!r}")
            # "~/.cache/x" is the user's folder, never a folder named "~" here.
            folder = os.path.expanduser(os.fspath(self.kv_cache_dir))
            object.__setattr__(self, "kv_cache_dir", folder)
            if not self.host_cache_bytes:
                raise ValueError("kv_cache_dir needs host_cache_bytes > 0 (disk reads go there)")
        self._check_kv_events()
        self._check_kv_cache_secret()

    def _check_kv_cache_secret(self) -> None:
        secret = self.kv_cache_secret
        if secret is None:
            return
        if not isinstance(secret, (str, bytes)):
            raise TypeError(f"kv_cache_secret must be a str or bytes, got {type(secret).__name__}")
        if not secret:
            raise ValueError("kv_cache_secret must not be empty")
        if self.kv_cache_dir is None:
            raise ValueError("kv_cache_secret needs kv_cache_dir")

    def _check_kv_events(self) -> None:
        check_kv_events(self.kv_events)
        check_event_layout(self.kv_events_layout, "kv_events_layout")
        if not isinstance(self.kv_events_topic, str):
            raise TypeError(f"kv_events_topic must be a str, got {self.kv_events_topic!r}")
        if self.kv_events_replay is not None:
            check_address("kv_events_replay", self.kv_events_replay)
        if self.block_hash_seed is not None and not isinstance(self.block_hash_seed, str):
            raise TypeError(f"block_hash_seed must be a str, got {self.block_hash_seed!r}")
        make_block_hasher(self.block_hash, self.block_hash_seed)  # ValueError for a bad pair
        defaults = {f.name: f.default for f in fields(self)}
        for name in _WIRE_SETTINGS:
            if getattr(self, name) != defaults[name] and not isinstance(self.kv_events, str):
                raise ValueError(f"{name} needs kv_events to be a ZeroMQ address")
        if self.block_hash != "xxh64" and self.kv_events is None:
            raise ValueError("block_hash needs kv_events")
