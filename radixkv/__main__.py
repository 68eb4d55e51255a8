"""`python -m radixkv` runs the command line (see radixkv.cli)."""

from radixkv.cli import main

raise SystemExit(main())
