"""One logging configuration point per process: role, pid, request id; text or JSON lines.

Runs in: every process. `setup_logging(role)` is called once at each process entry and adds the
role and pid to every line, so interleaved output from the three kinds of process stays legible.
The front's choices (`--log-level`, `--log-format`, `--enable-log-requests`) reach its children
through the environment (`VX_LOG_LEVEL`, `VX_LOG_FORMAT`, `VX_LOG_REQUESTS`), so one flag rules
the tree.

Request ids: a line about one request carries it as the record attribute `request_id`, given
with `extra=request_extra(id)` or taken from the `REQUEST_ID` context variable (the front sets
it for the task that serves the request, and every task it starts inherits it). In the front it
is the HTTP request's id (its X-Request-Id); the EngineCore knows the engine request ids built
from it (`cmpl-<id>-<choice>`). JSON lines show it as a field; text lines name it in the message.

Format: the standard library's `logging` with a small formatter. No formatter library is added:
a JSON line is six fields, `json.dumps` writes it, and every process (the EngineCore included,
which imports little) would otherwise load another dependency for it.

Request lifecycle lines (admit, first token, finish or abort with the cause) go through
`log_request`: INFO with `--enable-log-requests`, DEBUG otherwise, so a busy server does not
write three lines a request unless asked. Prompts are never logged unless that flag is given.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time
from typing import Any

from vx import envs

_TEXT_FORMAT = "%(asctime)s %(levelname)s [{role} {pid}] %(name)s: %(message)s"

#: The id of the request the current task serves (the front; "" outside a request).
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("vx_request_id", default="")

_request_level = logging.DEBUG


class _RequestIdFilter(logging.Filter):
    """Gives every record a `request_id`: its own (`extra`), else the context's, else ""."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (RFC 3339, UTC, ms), level, role, pid, request_id,
    logger, message (and `exc` with the traceback text, when there is one).

    Invariant: the output holds no raw newline, so a line reader gets whole objects.
    """

    def __init__(self, role: str) -> None:
        super().__init__()
        self._role = role
        self._pid = os.getpid()

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        body: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "role": self._role,
            "pid": self._pid,
            "request_id": getattr(record, "request_id", "") or None,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False)


def setup_logging(
    role: str,
    level: str | int | None = None,
    *,
    log_format: str | None = None,
    log_requests: bool | None = None,
) -> None:
    """Configure the root logger for this process.

    `level` defaults to $VX_LOG_LEVEL (INFO), `log_format` ("text" or "json") to $VX_LOG_FORMAT,
    `log_requests` to $VX_LOG_REQUESTS; what is given is written back to the environment for
    the children this process spawns.
    """
    global _request_level
    if level is None:
        level = envs.VX_LOG_LEVEL
    if isinstance(level, str):
        level = level.upper()
    if log_format is None:
        log_format = envs.VX_LOG_FORMAT
    if log_format not in ("text", "json"):
        raise ValueError(f"unknown log format {log_format!r} (text or json)")
    if log_requests is None:
        log_requests = envs.VX_LOG_REQUESTS
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(
            logging.Formatter(_TEXT_FORMAT.format(role=role, pid=os.getpid()), datefmt="%H:%M:%S")
        )
    handler.addFilter(_RequestIdFilter())
    root.addHandler(handler)
    root.setLevel(level)
    # Python's warnings go through the same handler (one format, JSON included).
    logging.captureWarnings(True)
    _request_level = logging.INFO if log_requests else logging.DEBUG
    # Children inherit these through the environment, so one flag rules the tree.
    envs.export("VX_LOG_LEVEL", logging.getLevelName(root.level))
    envs.export("VX_LOG_FORMAT", log_format)
    envs.export("VX_LOG_REQUESTS", "1" if log_requests else "0")


def request_extra(request_id: str) -> dict[str, str]:
    """`extra=` for a log call about one request (where no context variable is set)."""
    return {"request_id": request_id}


def log_request(
    logger: logging.Logger, request_id: str, msg: str, *args: object, level: int | None = None
) -> None:
    """Log a request's lifecycle line (see the module docstring for its level)."""
    level = _request_level if level is None else level
    if logger.isEnabledFor(level):
        logger.log(level, msg, *args, extra={"request_id": request_id})


def requests_logged(logger: logging.Logger) -> bool:
    """Whether `log_request` on `logger` writes anything (guards loops that gather lines)."""
    return logger.isEnabledFor(_request_level)


def log_requests_enabled() -> bool:
    """True with --enable-log-requests (prompts may then be logged)."""
    return _request_level == logging.INFO
