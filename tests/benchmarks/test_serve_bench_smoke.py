"""The serving benchmark runs end to end in its small configuration (real `radixkv serve`
processes on 127.0.0.1, the tiny test model), and its parts do what the report says they do. No
timing assertions: only that every request of each workload completed, what was counted, and how
the report pairs and compares the servers."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks import serve_bench, serve_servers, serve_workloads

TINY_WORKLOADS = [
    "--workloads",
    "chat,shared-prefix,no-sharing",
    "--gsp-groups",
    "2",
    "--gsp-prompts",
    "2",
    "--gsp-system-tokens",
    "24",
    "--gsp-question-tokens",
    "8",
    "--gsp-max-tokens",
    "3",
    "--ns-prompts",
    "3",
    "--ns-prompt-tokens",
    "16",
    "--ns-max-tokens",
    "3",
    "--concurrency",
    "2",
]


def _cells(out: str, workload: str, server: str, number: int = 1) -> list[str]:
    section = out.split(f"### {workload}\n", 1)[1].split("###", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith(f"| {number} | {server} |"))
    return [c.strip() for c in row.split("|")]


def test_serve_bench_tiny_runs_every_workload(tiny_model_dir, capsys) -> None:
    args = ["--tiny", "--model", str(tiny_model_dir("gqa")), *TINY_WORKLOADS]
    assert serve_bench.main(args) == 0
    out = capsys.readouterr().out
    assert "- chat: 2 clients x 2 turns" in out
    assert "- shared-prefix: 2 groups x 2 prompts, 24-token system prompt" in out
    chat = _cells(out, "chat", "radixkv")
    assert chat[3] == "4"  # requests: every turn of every client
    assert chat[8] != "n/a s" and float(chat[8].removesuffix(" s")) >= 0  # from /proc
    assert chat[12] == "4/4"  # the reference of its own round: itself
    assert chat[13] != "n/a ms"  # the server overhead came from /metrics
    assert chat[15] != "n/a ms"  # and so did the receive time
    shared = _cells(out, "shared-prefix", "radixkv")
    assert shared[3] == "4"
    # Two prompts of a group share its system prompt: the second finds it cached.
    assert shared[10] != "n/a" and float(shared[10].removesuffix("%")) > 0
    assert _cells(out, "no-sharing", "radixkv")[3] == "3"


def test_two_servers_alternate_and_their_replies_are_compared(tiny_model_dir, capsys) -> None:
    model = str(tiny_model_dir("gqa"))
    args = ["--tiny", "--model", model, "--servers", "radixkv,radixkv:t2", "--rounds", "2"]
    args += ["--workloads", "no-sharing", "--ns-prompts", "2", "--ns-max-tokens", "3"]
    assert serve_bench.main(args) == 0
    out = capsys.readouterr().out
    for number in (1, 2):
        # Greedy with one thread or two: the same replies.
        assert _cells(out, "no-sharing", "radixkv:t2", number)[12] == "2/2"
    assert out.count("| radixkv:t2 |") == 2


def _row(number: int, server: str, ttft_s: float, tok_s: float, workload: str = "chat") -> dict:
    return {
        "round": number,
        "server": server,
        "workload": workload,
        "requests": 4,
        "ttft_p50_s": ttft_s,
        "ttft_p99_s": ttft_s,
        "output_tok_s": tok_s,
        "hit_rate": None,
        "overhead_p50_ms": 1.0 if server.startswith("radixkv") else None,
        "admission_p50_ms": None,
        "wall_s": 1.0,
        "server_cpu_s": 2.0 if server == "vllm" else 1.0,
    }


def test_report_pairs_radixkv_with_each_peer_per_round_and_over_rounds() -> None:
    rows = [
        _row(1, "radixkv", 0.2, 30.0),
        _row(1, "vllm", 0.8, 10.0),
        _row(2, "radixkv", 0.3, 20.0),
        _row(2, "vllm", 0.3, 40.0),
        _row(3, "radixkv", 1, 1),
    ]
    ratios = [line for line in serve_bench.report(rows).splitlines() if "radixkv / vllm" in line]
    assert len(ratios) == 3  # rounds 1 and 2, then their median; round 3 has no vLLM row
    assert "TTFT p50 x0.25" in ratios[0] and "output tok/s x3.00" in ratios[0]
    assert "server CPU x0.50" in ratios[0]
    assert ratios[2].startswith("median of 2 rounds") and "output tok/s x1.75" in ratios[2]


def test_report_compares_radixkv_with_radixkv_from_another_source_only() -> None:
    rows = [_row(1, "radixkv@/src/main", 0.4, 20.0), _row(1, "radixkv", 0.2, 30.0)]
    rows.append(_row(1, "radixkv:t2", 0.1, 60.0))
    lines = [line for line in serve_bench.report(rows).splitlines() if line.startswith("round ")]
    # This checkout's servers against the other tree's; never this checkout's against itself.
    assert [line.split(": ")[0] for line in lines] == [
        "round 1, radixkv / radixkv@/src/main",
        "round 1, radixkv:t2 / radixkv@/src/main",
    ]
    assert "TTFT p50 x0.50" in lines[0] and "output tok/s x1.50" in lines[0]


def test_report_has_a_table_per_workload() -> None:
    rows = [_row(1, "radixkv", 0.2, 30.0), _row(1, "radixkv", 0.2, 10.0, "no-sharing")]
    text = serve_bench.report(rows)
    assert text.index("### chat") < text.index("### no-sharing")


def test_report_compares_schema_constrained_requests_with_free_ones() -> None:
    constrained = {**_row(1, "radixkv+schema", 0.2, 27.0), "wall_s": 1.08}
    rows = [_row(1, "radixkv", 0.2, 30.0), constrained]
    (line,) = [line for line in serve_bench.report(rows).splitlines() if "constrained" in line]
    assert "schema-constrained / unconstrained: wall x1.08" in line and "tok/s x0.90" in line


def test_identical_replies_are_counted_against_the_first_server_of_the_round() -> None:
    rows = [{**_row(1, "radixkv", 1, 1)}, {**_row(1, "vllm", 1, 1)}]
    replies = {
        (1, "chat", "radixkv"): {"c0.t0": "Paris.", "c1.t0": "Rome."},
        (1, "chat", "vllm"): {"c0.t0": "Paris.", "c1.t0": "Rome!"},
    }
    serve_bench.mark_identical(rows, replies)
    assert [r["identical"] for r in rows] == ["2/2", "1/2"]


@pytest.mark.parametrize(
    ("name", "kind", "threads", "dtype", "eager", "schema"),
    [
        ("radixkv:inproc", "radixkv", 1, "float32", False, False),
        ("radixkv", "radixkv", 1, "float32", False, False),
        ("radixkv:t2:bf16", "radixkv", 2, "bfloat16", False, False),
        ("radixkv+schema", "radixkv", 1, "float32", False, True),
        ("vllm:eager", "vllm", 1, "float32", True, False),
        ("vllm:t2", "vllm", 2, "float32", False, False),
    ],
)
def test_server_names_carry_their_options(name, kind, threads, dtype, eager, schema) -> None:
    spec = serve_servers.parse_server(name, default_threads=1)
    assert (spec.kind, spec.threads, spec.dtype, spec.eager, spec.schema) == (
        kind,
        threads,
        dtype,
        eager,
        schema,
    )


@pytest.mark.parametrize("name", ["sglang", "vllm@/src", "vllm+schema", "radixkv:eager", "vllm:t0"])
def test_unknown_servers_and_options_are_refused(name) -> None:
    with pytest.raises(ValueError, match=name.split(":")[0].split("@")[0].split("+")[0]):
        serve_servers.parse_server(name, default_threads=1)


def test_vllm_gets_the_same_cache_and_bounds_and_its_own_thread_binding() -> None:
    spec = serve_servers.parse_server("vllm:t2:eager", default_threads=1)
    cmd = serve_servers.server_command(spec, "/models/m", 8123, max_num_seqs=12, kv_cache_gib=2)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "12" and "--enforce-eager" in cmd
    assert "--enable-prefix-caching" in cmd and cmd[cmd.index("--dtype") + 1] == "float32"
    env = serve_servers.server_env(spec, kv_cache_gib=2)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    ours = serve_servers.parse_server("radixkv", default_threads=1)
    cmd = serve_servers.server_command(ours, "/models/m", 8123, max_num_seqs=12, kv_cache_gib=2)
    assert (
        cmd[cmd.index("--cache-mb") + 1] == "2048" and cmd[cmd.index("--max-num-seqs") + 1] == "12"
    )


def test_the_process_tree_counts_the_cpu_of_children(tmp_path) -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {burn!r} + 'time.sleep(30)'])\n"
        "time.sleep(30)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 20
        total = 0.0
        while time.monotonic() < deadline and total < 0.5:
            time.sleep(0.2)
            total = serve_servers.process_tree_cpu_s(parent.pid) or 0.0
        own = serve_servers.process_tree_cpu_s(parent.pid)
        assert total >= 0.5, total  # the child's burn, which the parent's own stat lacks
        assert own is not None
    finally:
        parent.kill()
        parent.wait()


class _Tokenizer:
    """Enough of a tokenizer for the prompt generators: ids are characters."""

    all_special_ids = (0,)

    def get_vocab(self) -> dict[str, int]:
        return {chr(65 + i): i for i in range(20)}

    def decode(self, ids) -> str:
        return "".join(chr(65 + i) for i in ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_shared_prefix_traffic_is_groups_of_one_system_prompt_each_and_repeatable() -> None:
    make = lambda seed: serve_workloads.shared_prefix(  # noqa: E731
        _Tokenizer(),
        groups=3,
        prompts_per_group=4,
        system_tokens=10,
        question_tokens=5,
        max_tokens=2,
        concurrency=2,
        seed=seed,
    )
    first = make(7)
    assert first.prompts == make(7).prompts and first.prompts != make(8).prompts
    assert len(first.prompts) == 12
    systems = {}
    for key, text in first.prompts:
        group = key.split(".")[0]
        system, question = text.split("\n\n")
        assert len(system) == 10 and len(question) == 5 and "A" not in text  # no special token
        systems.setdefault(group, set()).add(system)
    assert all(len(s) == 1 for s in systems.values()) and len(systems) == 3
    # shuffled, as bench_serving shuffles them: not group after group
    assert [k.split(".")[0] for k, _ in first.prompts] != sorted(
        k.split(".")[0] for k, _ in first.prompts
    )


def test_the_long_system_prompt_reaches_its_length_in_numbered_rules() -> None:
    text = serve_workloads.long_system_prompt(_Tokenizer(), 700)
    assert 700 <= len(text) < 800 and "\n8. For questions about maps" in text
