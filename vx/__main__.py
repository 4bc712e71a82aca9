"""`python -m vx` runs the same entry point as the `vx` console script."""

from vx.cli import main

raise SystemExit(main())
