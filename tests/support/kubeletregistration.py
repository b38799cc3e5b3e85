"""A plugin's registration as the kubelet holds it: the ``Register`` request, the plugin's
options, the connection the kubelet dialed, and the ``ListAndWatch`` stream it consumes on a thread
of its own (every update kept, with its time), until the plugin ends the stream or the kubelet
closes the connection (:class:`StreamEnd`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

__all__ = ["Observer", "Registration", "StreamEnd", "short"]

_MAX_MESSAGE_TEXT = 2000


def short(message: object) -> str:
    """``message`` on one line, cut at 2,000 characters (for an assertion's message)."""
    text = str(message).strip().replace("\n", " ")
    return text if len(text) <= _MAX_MESSAGE_TEXT else text[:_MAX_MESSAGE_TEXT] + "..."


@dataclass(frozen=True)
class StreamEnd:
    """How a ``ListAndWatch`` stream ended."""

    code: Any
    """``grpc.StatusCode``; ``OK`` when the plugin finished the stream normally."""
    details: str
    at: float
    """``time.monotonic()``."""
    closed_by_kubelet: bool
    """True when the kubelet (``restart``/``stop``) closed the connection, not the plugin."""

    @property
    def ok(self) -> bool:
        return bool(self.code == grpc.StatusCode.OK)


_END = object()

Observer = Callable[[str, Any], None]
"""What a test gives :class:`FakeKubelet` to look at the node when the kubelet hears of it."""


class Registration:
    """An accepted ``Register``: the request, the plugin's options and its ListAndWatch stream."""

    def __init__(
        self,
        *,
        index: int,
        request: Any,
        received_at: float,
        socket_path: Path,
        channel: Any,
        stub: Any,
        plugin_options: Any,
        empty: Any,
        observe: Observer | None = None,
    ) -> None:
        self.index = index
        """Position in ``FakeKubelet.registrations``."""
        self.request = request
        self.version: str = request.version
        self.endpoint: str = request.endpoint
        self.resource_name: str = request.resource_name
        self.options = request.options
        """``RegisterRequest.options`` (the kubelet itself ignores them)."""
        self.received_at = received_at
        """``time.monotonic()`` when ``Register`` arrived."""
        self.socket_path = socket_path
        self.plugin_options = plugin_options
        """What ``GetDevicePluginOptions`` returned during ``Register``: what the kubelet uses."""
        self.connected_at = time.monotonic()
        self.stub = stub
        """``DevicePluginStub`` on this registration's connection."""
        self._channel = channel
        self._empty = empty
        self._queue: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._history: list[tuple[float, Any]] = []
        self._end: StreamEnd | None = None
        self._ended = threading.Event()
        self._closing_by_kubelet = False
        self._closed = False
        self._call: Any = None
        self._observe = observe
        self._thread = threading.Thread(
            target=self._consume, name=f"fake-kubelet-law-{index}", daemon=True
        )

    def __repr__(self) -> str:
        return (
            f"Registration(#{self.index} {self.resource_name!r} endpoint={self.endpoint!r} "
            f"version={self.version!r} updates={len(self.history)} ended={self.ended})"
        )

    # -- the ListAndWatch consumer ------------------------------------------------------------

    def _start(self) -> None:
        self._thread.start()

    def _consume(self) -> None:
        code: Any = grpc.StatusCode.OK
        details = ""
        try:
            call = self.stub.ListAndWatch(self._empty)
            with self._lock:
                self._call = call
                cancel_now = self._closed
            if cancel_now:
                call.cancel()
            for response in call:
                if self._observe is not None:
                    self._observe("update", response)
                now = time.monotonic()
                with self._lock:
                    self._history.append((now, response))
                self._queue.put(response)
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or ""
        except ValueError as error:  # "Cannot invoke RPC on closed channel!"
            code, details = grpc.StatusCode.CANCELLED, str(error)
        with self._lock:
            self._end = StreamEnd(code, details, time.monotonic(), self._closing_by_kubelet)
        self._ended.set()
        self._queue.put(_END)
        # The kubelet disconnects the client once Run (the Recv loop) returns.
        self._close(by_kubelet=False)

    def _close(self, *, by_kubelet: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if by_kubelet and self._end is None:
                self._closing_by_kubelet = True
            call = self._call
        if call is not None:
            call.cancel()
        self._channel.close()

    def _join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- what tests look at -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """False once the stream ended or the kubelet closed the connection."""
        with self._lock:
            return not self._closed

    @property
    def ended(self) -> StreamEnd | None:
        with self._lock:
            return self._end

    @property
    def history(self) -> list[tuple[float, Any]]:
        """Every ListAndWatchResponse received so far, with its ``time.monotonic()``."""
        with self._lock:
            return list(self._history)

    @property
    def last_update(self) -> Any:
        """The latest ListAndWatchResponse received (consumed or not), or None."""
        with self._lock:
            return self._history[-1][1] if self._history else None

    def next_update(self, timeout: float) -> Any:
        """The next ListAndWatchResponse not yet returned by ``next_update``/``wait_until``."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"no ListAndWatch update within {timeout}s on {self!r}; "
                f"last update: {short(self.last_update)}"
            ) from None
        if item is _END:
            self._queue.put(_END)  # stays visible to later calls
            raise AssertionError(f"ListAndWatch stream already ended: {self.ended} on {self!r}")
        return item

    def wait_until(self, predicate: Callable[[Any], bool], timeout: float) -> Any:
        """Consume updates until one satisfies ``predicate``; return it."""
        deadline = time.monotonic() + timeout
        seen = 0
        last: Any = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"no ListAndWatch update satisfied the predicate within {timeout}s "
                    f"({seen} updates seen) on {self!r}; last seen: {short(last)}"
                )
            try:
                update = self.next_update(remaining)
            except AssertionError as error:
                raise AssertionError(
                    f"no ListAndWatch update satisfied the predicate ({seen} updates seen; "
                    f"last seen: {short(last)}): {error}"
                ) from None
            seen += 1
            last = update
            if predicate(update):
                return update

    def wait_ended(self, timeout: float) -> StreamEnd:
        """How the stream ended; AssertionError if it is still open after ``timeout``."""
        if not self._ended.wait(timeout):
            raise AssertionError(f"ListAndWatch stream still open after {timeout}s on {self!r}")
        end = self.ended
        assert end is not None
        return end
