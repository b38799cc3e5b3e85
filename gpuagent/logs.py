"""structlog set-up: JSON lines off a TTY, readable console output on one (in colour only there);
:class:`ProblemLog`, a failure logged once per change of state."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import orjson
import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}  # fmt: skip


def configure(fmt: str, level: str) -> None:
    """Configure structlog (our own entries) and stdlib logging (grpclib, aiohttp) alike."""
    numeric = _LEVELS[level]
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        structlog.configure(
            processors=[
                *shared,
                structlog.processors.dict_tracebacks,
                structlog.processors.JSONRenderer(serializer=orjson.dumps),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(numeric),
            logger_factory=structlog.BytesLoggerFactory(sys.stderr.buffer),
            cache_logger_on_first_use=True,
        )
        foreign_renderer: structlog.typing.Processor = structlog.processors.JSONRenderer()
    else:
        # Colour codes only for a terminal: in a file, a pipe or `kubectl logs` they are noise.
        colors = sys.stderr.isatty()
        structlog.configure(
            processors=[*shared, structlog.dev.ConsoleRenderer(colors=colors)],
            wrapper_class=structlog.make_filtering_bound_logger(numeric),
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
            cache_logger_on_first_use=True,
        )
        foreign_renderer = structlog.dev.ConsoleRenderer(colors=colors)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        foreign_renderer],
        )
    )  # fmt: skip
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Libraries are chatty at INFO (every cancelled stream); their warnings still come through.
    root.setLevel(max(numeric, logging.WARNING))


class ProblemLog:
    """A failure that repeats, logged once per change of state: a new problem once (at warning
    unless told), the same one again not at all, and the recovery once (at info)."""

    def __init__(self, logger: structlog.typing.FilteringBoundLogger) -> None:
        self._log = logger
        self.problem: str | None = None  # the failure last logged, None while healthy

    def failed(
        self, problem: str, *, level: Literal["info", "warning"] = "warning", **fields: object
    ) -> None:
        if problem != self.problem:
            (self._log.info if level == "info" else self._log.warning)(problem, **fields)
            self.problem = problem

    def recovered(self, event: str, **fields: object) -> None:
        """Log ``event`` if a problem was logged (and forget the problem)."""
        if self.problem is not None:
            self._log.info(event, **fields)
            self.problem = None
