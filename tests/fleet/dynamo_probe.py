"""Run inside a network namespace (see test_dynamo_indexer.py): two replicas publishing KV events
on tcp://*, Dynamo's standalone indexer subscribed to both; each conversation is served by one
replica, then the indexer is asked which replica holds its prompt. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "fleet"))

import fleet


def main(model_dir: str, log_dir: str) -> int:
    serve_args = ["--model", model_dir, "--num-blocks", "256"]
    out = []
    start = fleet.start_fleet
    with start("dynamo-indexer", 2, serve_args, model="tiny", log_dir=Path(log_dir)) as f:
        for c in range(4):
            replica = f.replicas[c % 2]
            words = " ".join(f"w{10 + (c * 53 + i * 7) % 240}" for i in range(40))
            messages = [{"role": "user", "content": words}]
            body = {"model": "tiny", "messages": messages, "max_tokens": 4}
            fleet.post_json(f"{replica.url}/v1/chat/completions", body)
            ids = fleet.post_json(f"{replica.url}/tokenize", {"messages": messages})["tokens"]
            out.append({"served_by": c % 2 + 1, "token_ids": ids})
        deadline = time.monotonic() + 30
        for item in out:
            while True:
                query = {"token_ids": item["token_ids"], "model_name": "default"}
                item["answer"] = fleet.post_json(f"{f.indexer_url}/query", query)
                if item["answer"].get("scores") or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
