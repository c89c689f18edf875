"""Logging for both processes (`python -m server`, `python -m proxy`): one handler on the root
logger, as text or as JSON lines, and uvicorn's loggers (its access log included) routed through it.

Imports no torch: the proxy sets its logging up with it."""
from __future__ import annotations

import json
import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# What every LogRecord carries (and uvicorn's ANSI-coloured copy of its message); anything else on a
# record came from `extra=` and is logged as a field.
_RECORD_KEYS = (frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None)))
                | {"message", "asctime", "color_message"})
# uvicorn's access lines pass these as the message's arguments: JSON lines name them.
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class JsonLines(logging.Formatter):
    """One JSON object per line: time, level, logger, message, then any extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            out.update(zip(_ACCESS_FIELDS, record.args))
        out.update((k, v) for k, v in vars(record).items() if k not in _RECORD_KEYS)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", format: str = "text") -> None:
    """`level` in LOG_LEVELS, `format` in LOG_FORMATS (the flags checked both)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines() if format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()  # uvicorn's own config is off (log_config=None); the root's handler writes
        logger.propagate = True
    logging.getLogger("uvicorn.access").setLevel(root.level)
    # uvicorn's lifecycle lines ("Started server process", ...) repeat what tandem's own say, and
    # their logger's name would make every one look like an error to a reader (the proxy's included).
    logging.getLogger("uvicorn.error").setLevel(max(root.level, logging.WARNING))
    logging.getLogger("httpx").setLevel(max(root.level, logging.WARNING))  # a line per poll and relayed request


# uvicorn.Config's arguments for logging through setup_logging's handler and levels (a log_level
# given to uvicorn would set its loggers' levels over setup_logging's), access log included.
UVICORN_LOG_OPTIONS = {"log_config": None, "log_level": None, "access_log": True}
