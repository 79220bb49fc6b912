"""The process-wide Prometheus registry every actor exports to (``/metrics`` serves it), and the
logging setup every process of a root shares."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

__all__ = ["LOG_FORMATS", "REGISTRY", "configure_logging", "log_settings"]

REGISTRY = CollectorRegistry(auto_describe=True)

LOG_FORMATS = ("console", "json")
"""``console``: one human-readable line per event; ``json``: one JSON object per line."""

# The level and format the last configure_logging() set, which child processes are started with.
_settings: tuple[str, str] | None = None
# The handler configure_logging() put on the standard library's root logger (replaced by the next).
_handler: logging.Handler | None = None


class _Stderr:
    """Whatever ``sys.stderr`` is when a line is written (a test runner may swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_STDERR = _Stderr()


class _Logger(structlog.PrintLogger):
    """structlog's own output, named (for the ``logger`` field): not through the standard
    library's root handler, which a library may replace (SGLang's engine configures logging)."""

    def __init__(self, name: str) -> None:
        super().__init__(_STDERR)  # type: ignore[arg-type]
        self.name = name


def _logger(*args: Any) -> _Logger:
    return _Logger(args[0] if args else "")


def configure_logging(level: str = "warning", fmt: str = "console") -> None:
    """structlog and the standard library's logging at ``level``, to standard error, in ``fmt``
    (one of :data:`LOG_FORMATS`).

    Every line carries a timestamp (ISO 8601, UTC), the level, the event and the logger's name,
    and whatever ``structlog.contextvars`` binds in the task that logs it (a request's
    ``request_id``). Standard-library loggers (the HTTP servers', the frontend's) go through the
    same renderer, so a JSON log has no line of another shape.
    """
    global _settings, _handler
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"log level {level!r}: expected debug, info, warning, error or critical")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected {' or '.join(LOG_FORMATS)}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: list[Any]
    if fmt == "json":
        renderer = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        renderer = [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    name = structlog.stdlib.add_logger_name
    handler = logging.StreamHandler(_STDERR)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                name,
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *renderer,
            ],
        )
    )
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    root.addHandler(handler)
    root.setLevel(numeric)
    _handler = handler
    structlog.configure(
        processors=[*shared, name, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=_logger,
        # No cache_logger_on_first_use: a cached module logger ignores any later configure()
        # (capture_logs in tests, an embedding app's own setup) for the rest of the process.
    )
    _settings = (level, fmt)


def log_settings() -> tuple[str, str] | None:
    """The level and format :func:`configure_logging` last set in this process (``None``: it
    was never called, logging is the embedding application's)."""
    return _settings
