"""One grpcio server on one Unix socket, for every stand-in (kubelet, pod-resources, CRI, plugins).

``start`` serves (a no-op when serving), ``stop`` cuts every call in flight and takes the socket
away, ``restart`` is the two, as a restarted process does. A stand-in adds its servicers in
``add_servicers``, called on each start, so each server generation gets fresh ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import grpc

__all__ = ["StandInServer", "StartStop", "UnixGrpcServer"]

STOP_TIMEOUT_S = 5.0
"""How long ``stop`` waits for grpcio to cancel the calls in flight."""


class StartStop:
    """``with x:`` starts ``x`` and stops it afterwards."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class UnixGrpcServer(StartStop):
    """A grpcio server on ``socket_path``.

    ``leave_socket``: ``stop`` leaves the socket file behind, as a killed process does (the
    kubelet's stand-in); otherwise it is removed, as a process that exits cleanly does.
    """

    def __init__(
        self,
        socket_path: Path,
        add_servicers: Callable[[grpc.Server], None],
        *,
        name: str,
        max_workers: int = 4,
        options: Sequence[tuple[str, Any]] = (),
        leave_socket: bool = False,
    ) -> None:
        self.socket_path = Path(socket_path)
        self._add_servicers = add_servicers
        self._name = name
        self._max_workers = max_workers
        self._options = tuple(options)
        self._leave_socket = leave_socket
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def running(self) -> bool:
        with self._lock:
            return self._server is not None

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            self.socket_path.parent.mkdir(parents=True, exist_ok=True)
            self.socket_path.unlink(missing_ok=True)
            executor = ThreadPoolExecutor(self._max_workers, thread_name_prefix=self._name)
            server = grpc.server(executor, options=self._options)
            try:
                self._add_servicers(server)
                server.add_insecure_port(f"unix:{self.socket_path}")
                server.start()
            except BaseException:
                server.stop(None)
                executor.shutdown(wait=False, cancel_futures=True)
                raise
            self._server, self._executor = server, executor

    def stop(self) -> None:
        """Stop serving at once: calls in flight are cut, not finished. Idempotent."""
        with self._lock:
            server, executor = self._server, self._executor
            self._server = self._executor = None
        if server is not None:
            server.stop(None).wait(STOP_TIMEOUT_S)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        if not self._leave_socket:
            self.socket_path.unlink(missing_ok=True)

    def restart(self) -> None:
        """A restarted process: the old socket is deleted and a new one created."""
        self.stop()
        self.start()


class StandInServer(UnixGrpcServer):
    """A stand-in's server that counts the calls it answers and can be told to fail them.

    A servicer method calls :meth:`answering` first: it records the call and aborts it with the
    status given to :meth:`fail_with`, if any.
    """

    def __init__(
        self, socket_path: Path, add_servicers: Callable[[grpc.Server], None], **kw: Any
    ) -> None:
        super().__init__(socket_path, add_servicers, **kw)
        self._calls: list[float] = []
        self._fail: grpc.StatusCode | None = None

    def fail_with(self, code: grpc.StatusCode | None) -> None:
        """Answer with an error status from now on (None: answer normally again)."""
        with self._lock:
            self._fail = code

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self._calls)

    def calls_since(self, t: float) -> int:
        with self._lock:
            return sum(1 for c in self._calls if c >= t)

    def answering(self, context: grpc.ServicerContext) -> None:
        with self._lock:
            self._calls.append(time.monotonic())
            fail = self._fail
        if fail is not None:
            context.abort(fail, "stand-in told to fail")
