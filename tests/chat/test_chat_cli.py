"""The `radixkv chat` command driven as a user would: a subprocess, a scripted conversation."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from processes import ctrl_c_inside, sigint_restored
from transformers import AutoTokenizer

from radixkv.chat import cli

STATUS = re.compile(
    r"^  \[prompt (\d+) tok · cached (\d+) \(([\d.]+)%\) · ttft \d+ ms · reply (\d+) tok"
    r" · decode [\d.]+ tok/s\]$"
)


def _run(args: list[str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    # Run from a scratch folder: the repository root must not be on sys.path: transformers
    # imports any top-level `kernels` module it can find. This is how an installed user runs it.
    return subprocess.run(
        [sys.executable, "-m", "radixkv", *args],
        cwd=cwd,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_scripted_four_turn_chat_hits_the_cache(tmp_path: Path) -> None:
    script = tmp_path / "chat.txt"
    script.write_text(
        "\n".join(
            [
                "What is the capital of France?",
                "Name one famous museum there.",
                "How old is it?",
                "Thank you! Summarise our chat in one sentence.",
                "/tree",
                "/stats",
                "/quit",
                "this line is never read",
            ]
        )
    )
    # 12-token replies: every assertion holds at any reply length (a reply of one token too)
    args = ["chat", "--script", str(script), "--max-tokens", "12", "--temperature", "0"]
    proc = _run(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("radixkv chat · SmolLM2-135M-Instruct · greedy · ")

    replies = [line[len("assistant> ") :] for line in lines if line.startswith("assistant> ")]
    assert len(replies) == 4 and all(r.strip() for r in replies)
    statuses = [STATUS.match(line) for line in lines if line.startswith("  [prompt")]
    assert len(statuses) == 4 and all(statuses)
    turns = [tuple(int(m.group(i)) for i in (1, 2, 4)) for m in statuses if m]
    for (prev_prompt, _, prev_reply), (prompt, cached, _) in itertools.pairwise(turns):
        # Turn k's prompt extends turn k-1's prompt + reply; everything but the last sampled
        # token (which never had KV written) must come from the cache.
        assert prompt > prev_prompt + prev_reply
        assert cached >= prev_prompt + prev_reply - 1
        assert cached < prompt  # the last prompt token is always computed
    assert "this line is never read" not in proc.stdout

    tree = proc.stdout[proc.stdout.index("you> /tree") : proc.stdout.index("you> /stats")]
    tree_lines = tree.splitlines()[1:]
    assert tree_lines[0].startswith("root  ")
    cached_tokens = int(re.search(r"nodes, (\d+) tokens", tree_lines[0]).group(1))  # type: ignore[union-attr]
    last_prompt, _, last_reply = turns[-1]
    assert cached_tokens >= last_prompt + last_reply - 1  # the whole conversation is in the tree
    assert any("unlocked" in line for line in tree_lines[1:])  # nothing runs between turns

    stats = proc.stdout[proc.stdout.index("you> /stats") :]
    hit = re.search(r"hit rate\s+([\d.]+)%\s+\((\d+) of (\d+) prompt tokens", stats)
    assert hit is not None
    hits, queried = int(hit.group(2)), int(hit.group(3))
    assert queried == sum(p for p, _, _ in turns)
    assert hits == sum(c for _, c, _ in turns)
    assert re.search(r"blocks\s+\d+ x 16 tokens: \d+ free, [1-9]\d* cached, 0 in use", stats)


@pytest.mark.slow
def test_the_default_model_chats_with_its_recommended_sampling(tmp_path: Path) -> None:
    proc = _run(["chat"], cwd=tmp_path, stdin="/quit\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(
        "radixkv chat · SmolLM2-135M-Instruct · temperature 0.2, top-p 0.9 · "
    )


def test_bad_model_path_is_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = _run(["chat", "--model", str(missing)], cwd=tmp_path, stdin="hello\n")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("radixkv: ") and str(missing) in err[0]
    assert "Traceback" not in proc.stderr


def test_bad_option_values_are_rejected_before_loading(tmp_path: Path) -> None:
    proc = _run(["chat", "--top-p", "0"], cwd=tmp_path, stdin="")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "radixkv: top_p must be in (0, 1], got 0.0"
    missing = tmp_path / "missing.txt"
    proc = _run(["chat", "--script", str(missing)], cwd=tmp_path)
    assert proc.returncode == 2 and str(missing) in proc.stderr


@pytest.mark.parametrize("case", ["a file", "no host tier"])
def test_disk_tier_options_are_checked_before_the_model_loads(
    tmp_path: Path, capsys, monkeypatch, case
) -> None:
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("radixkv.engine.LLM", load)
    file = tmp_path / "file"
    file.write_text("not a folder")
    if case == "a file":
        argv, expected = ["--host-cache", "64KiB", "--kv-cache-dir", str(file)], "is a file"
    else:
        argv, expected = ["--kv-cache-dir", str(tmp_path)], "--kv-cache-dir needs --host-cache"
    capsys.readouterr()
    assert cli.main(["chat", *argv, "--script", str(file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("radixkv: ") and len(err.splitlines()) == 1 and expected in err, err


def _chat_in_process(
    model: Path, lines: list[str] | bytes, tmp_path: Path, capsys, *extra: str
) -> tuple[int, str, str]:
    script = tmp_path / "chat.txt"
    if isinstance(lines, bytes):
        script.write_bytes(lines)
    else:
        script.write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    args = ["chat", "--model", str(model), "--script", str(script), "--block-size", "4"]
    code = cli.main([*args, "--num-blocks", "256", "--max-tokens", "8", *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_tiny_temperatures_sample_without_failing(tiny_model_dir, tmp_path, capsys):
    code, out, err = _chat_in_process(
        tiny_model_dir("gqa"), ["w10 w11", "w12"], tmp_path, capsys, "--temperature", "1e-50"
    )
    assert code == 0 and err == ""
    assert "temperature 1e-50" in out.splitlines()[0]
    assert len([line for line in out.splitlines() if STATUS.match(line)]) == 2


def test_undecodable_line_is_one_message_and_the_chat_goes_on(tiny_model_dir, tmp_path, capsys):
    code, out, err = _chat_in_process(
        tiny_model_dir("gqa"), b"w10 \xff\xfe w11\nw12 w13\n", tmp_path, capsys
    )
    assert code == 0
    assert err.splitlines() == [
        "radixkv: message is not valid UTF-8 text (undecodable byte at position 4)"
    ]
    assert "you> w10 \\udcff\\udcfe w11" in out  # echoed, escaped
    assert len([line for line in out.splitlines() if STATUS.match(line)]) == 1


def test_ctrl_c_in_a_reply_returns_to_the_prompt(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from radixkv.engine.step.model_runner import ModelRunner

    real_execute = ModelRunner.execute
    calls = 0

    def ctrl_c_on_fourth_step(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 4:
            raise KeyboardInterrupt
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "execute", ctrl_c_on_fourth_step)
    model = tiny_model_dir("gqa")
    lines = ["w20", "w30 w31", "w40", "/stats"]
    code, out, err = _chat_in_process(model, lines, tmp_path, capsys, "--system", "w10")
    assert code == 0 and err == ""
    # The first reply (prefill + 2 decode steps) is interrupted; the other two complete.
    assert out.count("(reply interrupted; this turn is not kept") == 1
    assert out.index("(reply interrupted") < out.index("you> w30 w31")
    statuses = [STATUS.match(line) for line in out.splitlines()]
    prompts = [int(m.group(1)) for m in statuses if m]
    assert len(prompts) == 2
    # The second turn's prompt holds neither the interrupted message nor its partial reply.
    tok = AutoTokenizer.from_pretrained(model)
    system, user = {"role": "system", "content": "w10"}, {"role": "user", "content": "w30 w31"}
    text = tok.apply_chat_template([system, user], add_generation_prompt=True, tokenize=False)
    assert prompts[0] == len(tok(text, add_special_tokens=False)["input_ids"])
    assert re.search(r"blocks\s+256 x 4 tokens: \d+ free, \d+ cached, 0 in use", out)


def test_a_real_ctrl_c_inside_a_cache_update_waits_for_the_step(
    tiny_model_dir, tmp_path, capsys, monkeypatch, python_sigint
):
    """A real SIGINT delivered in the middle of the scheduler's cache commit during a reply: the
    commit runs to its end (a KeyboardInterrupt there could leave the tree half updated), the
    reply stops when the step is over, and the chat goes on with every block returned."""
    from radixkv.cache import PrefixCache

    commit = ctrl_c_inside(monkeypatch, PrefixCache, "commit")  # the first reply's prefill
    lines = ["w20", "w30 w31", "w40", "/stats"]
    code, out, err = _chat_in_process(
        tiny_model_dir("gqa"), lines, tmp_path, capsys, "--system", "w10"
    )
    assert code == 0 and err == ""
    assert commit.started and commit.finished  # the commit ran to its end
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert out.count("(reply interrupted; this turn is not kept") == 1
    assert out.index("(reply interrupted") < out.index("you> w30 w31")
    assert len([line for line in out.splitlines() if STATUS.match(line)]) == 2
    assert re.search(r"blocks\s+256 x 4 tokens: \d+ free, \d+ cached, 0 in use", out)


def test_context_limit_notice(tmp_path, capsys):
    from tiny_llama import build_model, build_tokenizer

    folder = tmp_path / "short-context"
    build_model("gqa", max_position_embeddings=48).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    lines = [f"w{20 + i} w{40 + i} w{60 + i} w{80 + i}" for i in range(8)]
    code, out, err = _chat_in_process(folder, lines, tmp_path, capsys)
    assert code == 0 and err == ""
    assert len([line for line in out.splitlines() if STATUS.match(line)]) == 8
    assert "(context full: dropped the oldest 1 turn(s); the system prompt stays)" in out


def test_chat_sampling_follows_the_generation_config_unless_given():
    from transformers import GenerationConfig

    args = cli.build_parser().parse_args(["chat"])
    sampled = GenerationConfig(do_sample=True, temperature=0.2, top_p=0.9)
    p = cli.chat_sampling(args, sampled)
    assert (p.temperature, p.top_p, p.top_k) == (0.2, 0.9, 0)
    assert cli.chat_sampling(args, GenerationConfig()).greedy  # no do_sample: greedy
    assert cli.chat_sampling(args, None).greedy
    args = cli.build_parser().parse_args(["chat", "--temperature", "0", "--top-k", "5"])
    p = cli.chat_sampling(args, sampled)
    assert p.greedy and p.top_k == 5


def test_chat_min_p_and_repetition_penalty_follow_the_generation_config_unless_given():
    from transformers import GenerationConfig

    args = cli.build_parser().parse_args(["chat"])
    card = GenerationConfig(do_sample=True, temperature=0.7, min_p=0.05, repetition_penalty=1.05)
    p = cli.chat_sampling(args, card)
    assert (p.min_p, p.repetition_penalty) == (0.05, 1.05)
    text = "temperature 0.7, top-p 1, min-p 0.05, repetition penalty 1.05"
    assert cli.sampling_text(p) == text
    greedy = cli.chat_sampling(args, GenerationConfig(repetition_penalty=1.2))
    assert greedy.greedy and greedy.repetition_penalty == 1.2 and greedy.min_p == 0.0
    assert cli.sampling_text(greedy) == "greedy, repetition penalty 1.2"
    assert cli.chat_sampling(args, None).repetition_penalty == 1.0
    given = ["chat", "--min-p", "0.2", "--repetition-penalty", "1.3"]
    p = cli.chat_sampling(cli.build_parser().parse_args(given), card)
    assert (p.min_p, p.repetition_penalty) == (0.2, 1.3)
    with pytest.raises(ValueError, match="min_p"):
        cli.chat_sampling(cli.build_parser().parse_args(["chat", "--min-p", "2"]), card)


def test_sigint_in_a_reply_and_undecodable_stdin(tiny_model_dir, tmp_path: Path) -> None:
    """The real signal, in the real process: Ctrl-C stops the reply, the chat goes on."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    args = ["--model", str(tiny_model_dir("gqa")), "--block-size", "4", "--num-blocks", "512"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv", "chat", *args, "--max-tokens", "1000"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=sigint_restored,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"w10 \xff\nw10 w11\n/stats\n")
    proc.stdin.close()
    seen = b""
    while b"assistant> w" not in seen:  # the greedy tiny model runs to max_tokens: seconds
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, seen
        seen += chunk
    proc.send_signal(signal.SIGINT)
    proc.stdin = None  # closed above: communicate() must not flush it
    out, err = proc.communicate(timeout=300)
    out = (seen + out).decode()
    assert proc.returncode == 0, err
    assert err.decode().splitlines() == [
        "radixkv: message is not valid UTF-8 text (undecodable byte at position 4)"
    ]
    assert "(reply interrupted; this turn is not kept" in out
    assert re.search(r"blocks\s+512 x 4 tokens: \d+ free, \d+ cached, 0 in use", out)


def test_the_chat_entry_point_refuses_serve_as_a_usage_error(capsys) -> None:
    # `radixkv serve` is dispatched before the chat's parser, which lists serve only for --help.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve"])
    assert exit_info.value.code == 2
    assert "radixkv serve" in capsys.readouterr().err


def test_a_chat_restarted_over_its_kv_directory_picks_up_its_prefixes(
    tiny_model_dir, tmp_path, capsys
):
    """The first chat's pool (11 blocks of 4) is small enough that its first conversation leaves
    the device for the second and is loaded back for the third; /stats and /tree show the tiers;
    at exit the rest is written, so the restarted chat's first reply is served from disk."""
    model, kv_dir = tiny_model_dir("gqa"), tmp_path / "kv"
    tiers = ("--host-cache", "12KiB", "--kv-cache-dir", str(kv_dir), "--temperature", "0")
    first = ["w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21", "w30 w31 w32", "/reset"]
    first += ["w40 w41 w42 w43 w44 w45 w46 w47 w48 w49", "/reset", first[0], "/stats", "/tree"]
    code, out, err = _chat_in_process(model, first, tmp_path, capsys, *tiers, "--num-blocks", "11")
    assert code == 0 and err == ""
    assert "host tier     " in out and "disk tier     " in out and " on host)" in out
    code, out, err = _chat_in_process(model, first[:1], tmp_path, capsys, *tiers)
    assert code == 0 and err == ""
    ((prompt, cached),) = [m.groups()[:2] for line in out.splitlines() if (m := STATUS.match(line))]
    assert int(cached) >= int(prompt) // 4 * 4 - 4  # all but the partial tail and its block


def test_a_script_under_home_is_the_users(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "chat.txt").write_text("hello\nbye\n")
    assert cli._message_source("~/chat.txt") == ["hello", "bye"]
