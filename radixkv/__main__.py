"""The `radixkv` command (`python -m radixkv`): `radixkv chat` (the default)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from radixkv.chat.cli import main as chat_main

    return chat_main(argv)


if __name__ == "__main__":
    sys.exit(main())
