"""The `radixkv` command (`python -m radixkv`): `radixkv chat` (the default) and `radixkv serve`.

`radixkv chat --web` is the chat in a browser: `radixkv serve --ui --open` (the live page of the
cache with its chat panel, on 127.0.0.1 unless `--host` says otherwise). It is dispatched here,
so that the terminal chat and the server stay two front doors that never import each other.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from radixkv.serve.cli import main as serve_main

        return serve_main(argv[1:])
    if "--web" in argv:
        from radixkv.serve.cli import main as serve_main

        rest = [a for a in argv if a != "--web"]
        if rest[:1] == ["chat"]:
            rest = rest[1:]
        return serve_main([*rest, "--ui", "--open"], prog="radixkv chat --web")
    from radixkv.chat.cli import main as chat_main

    return chat_main(argv)


if __name__ == "__main__":
    sys.exit(main())
