"""Child processes that receive Ctrl-C as one started from an interactive shell does.

A test suite started in the background of a non-interactive shell (`make test &`, nohup, a CI
runner) inherits SIGINT ignored, its children inherit that too, and Python then leaves it ignored
(as a program started that way should). A test that sends a child SIGINT gives it SIGINT's
default disposition first, so that Python installs its own handler there.
"""

from __future__ import annotations

import signal


def sigint_restored() -> None:
    """`preexec_fn` for `subprocess.Popen`: SIGINT back to its default in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
