"""The `radixkv` command (`python -m radixkv`): `radixkv chat` (the default) and `radixkv serve`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from radixkv.serve.cli import main as serve_main

        return serve_main(argv[1:])
    from radixkv.chat.cli import main as chat_main

    return chat_main(argv)


if __name__ == "__main__":
    sys.exit(main())
