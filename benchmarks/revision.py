"""Another git revision of this repository, exported for a benchmark that times it against this
tree in one run (alternating runs, so both face the same machine load).

`exported(rev)` extracts `rev` with `git archive` into a temporary folder and links its top-level
kernels/ and scheduler/ into its radixkv/ (as the installed package has them): with that folder
first on PYTHONPATH, `import radixkv` is the revision's (this tree's editable install is found
only after PYTHONPATH).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def exported(rev: str) -> Iterator[Path]:
    """The folder holding revision `rev`, removed on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        for name in ("scheduler", "kernels"):  # packaged under radixkv: make them importable
            os.symlink(os.path.join(tmp, name), os.path.join(tmp, "radixkv", name))
        yield Path(tmp)
