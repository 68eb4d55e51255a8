"""A live server restarted over a disk tier whose block files were damaged behind its back
answers every request, as before the damage, and stays healthy (the real openai client on
127.0.0.1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from block_files import damage_every_other_file
from tiny_llama import random_prompts

# 8 prompts of 33-52 tokens sharing 30, blocks of 4 tokens: the device pool of 24 blocks holds
# about one of them, so the rest goes down to the host tier and from there to disk.
PROMPTS = random_prompts(29, 8, shared_prefix=30, max_len=22)
ENGINE = dict(block_size=4, num_blocks=24, max_num_seqs=2, host_cache_bytes=6 * 3072)


def complete_all(server: Any) -> list[str]:
    client = server.client(max_retries=0)
    replies = [
        client.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0)
        for p in PROMPTS
    ]
    return [r.choices[0].text for r in replies]


def test_a_server_over_damaged_block_files_answers_every_request(
    make_server: Any, tmp_path: Path
) -> None:
    engine = {**ENGINE, "kv_cache_dir": tmp_path}
    first = make_server(engine)
    expected = complete_all(first)
    first.on_engine(lambda llm: llm.save_kv_cache())  # what the server does when it stops
    first.close()
    assert damage_every_other_file(tmp_path) >= 6
    again = make_server(engine)
    for _ in range(2):  # the second time, no damaged file is probed again
        assert complete_all(again) == expected
    disk = again.on_engine(lambda llm: llm.tier_ios[0].disk.stats())
    loaded = again.on_engine(lambda llm: llm.tier_ios[0].totals["disk_read"].num_blocks)
    assert disk.num_unusable > 0 and loaded > 0
    again.on_engine(lambda llm: llm.check_integrity())
    client = again.client(max_retries=0)
    assert client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=2).choices
