"""One logging configuration point per process.

Runs in: every process. `setup_logging(role)` is called once at each process entry, and adds the
role and pid to every line, so interleaved output from the three kinds of process stays legible.
"""

from __future__ import annotations

import logging
import os

from vx import envs

_FORMAT = "%(asctime)s %(levelname)s [{role} {pid}] %(name)s: %(message)s"


def setup_logging(role: str, level: str | int | None = None) -> None:
    """Configure the root logger for this process; `level` defaults to $VX_LOG_LEVEL or INFO."""
    if level is None:
        level = envs.VX_LOG_LEVEL
    if isinstance(level, str):
        level = level.upper()
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(_FORMAT.format(role=role, pid=os.getpid()), datefmt="%H:%M:%S")
    )
    root.addHandler(handler)
    root.setLevel(level)
    # Children inherit the level through the environment, so one --log-level rules the tree.
    os.environ["VX_LOG_LEVEL"] = logging.getLevelName(root.level)
