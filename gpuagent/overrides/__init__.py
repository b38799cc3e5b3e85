"""Every use the agent makes of a library's private API, in one place: this package, a module
per library (:mod:`~gpuagent.overrides.grpc` for grpclib and betterproto2, imported only where gRPC
is spoken; :mod:`~gpuagent.overrides.protoversion` for betterproto2's version;
:mod:`~gpuagent.overrides.nvml` for pynvml), so a part that needs one library's does not import the
others (the simulated driver, which starts before the kubelet side, imports no gRPC).

A library may change what it does not document in any release; each use below says what it
reaches, why, and the version it was written against (:data:`PINS`, the requirements of
``pyproject.toml``). ``tests/overrides/test_libraries.py`` fails when a requirement changes or
an attribute is gone or takes other arguments (:data:`PRIVATE`): an upgrade starts here.

grpclib 0.4.9 (``grpclib==0.4.9``)

* ``grpclib._typing.IServable``: the type of the service handlers a ``Server`` takes, which
  grpclib names only in a private module (:data:`IServable`).
* ``Server._protocol_factory()``, overridden by :class:`TrackedServer`: each client connection's
  protocol is made again as ``protocol_class``, from the ``handler``, ``config`` and
  ``h2_config`` that ``H2Protocol.__init__()`` keeps, and remembered, so that the agent's
  servers can cork their writes (:mod:`gpuagent.sockets.grpcserver`) and drop their connections.
* ``H2Protocol.connection``: closed by :meth:`TrackedServer.drop_connections`. ``Server.close()``
  stops listening and cancels handlers but leaves HTTP/2 connections open (grpclib#107: a
  proper fix needs GOAWAY); a dead kubelet's connections, or ours at shutdown, would linger.

betterproto2 0.10.0 (``betterproto2[grpclib]==0.10.0``)

* ``ServiceBase._call_rpc_handler_server_stream()``, overridden by :class:`ClosingServerStreams`:
  its own loop leaves a stream suspended at ``yield`` (when grpclib cancels the handler while a
  message is being sent, e.g. the kubelet went away) to the garbage collector, so the stream's
  ``finally`` — its count of open streams, its waiter's cancellation — would run at some later
  collection, not then.
* ``betterproto2._version``, its ``__version__`` and ``check_compiler_version()``: the module is
  put in place before betterproto2 is first imported (:mod:`~gpuagent.overrides.protoversion`,
  by the command line), the version read from the distribution's ``METADATA`` file, because
  betterproto2's own reads it with :mod:`importlib.metadata`, whose imports cost ~11 ms of the
  start the kubelet waits for; the compiler check is betterproto2's rule.

nvidia-ml-py 13.615 (``nvidia-ml-py>=13.615,<14``)

* ``pynvml.nvmlLib`` and ``libLoadLock``, ``_nvmlGetFunctionPointer_cache`` and
  ``_nvmlLib_refcount`` (:func:`use_nvml_library`): the simulated driver is installed below
  pynvml as its library, so that the production NVML code runs against it; pynvml's cache of
  function pointers must forget the other library's, and its count of users start again.
* ``NVMLError._errcode_to_string`` (:func:`nvml_error_text`): the simulated driver's
  ``nvmlErrorString`` answers with pynvml's own texts.
* ``_nvmlGetFunctionPointer()`` (:func:`nvml_function`) and ``_nvmlLib_refcount``
  (:func:`nvml_library_users`): the tests call a C symbol as pynvml finds it, and check that
  the backend let go of the library. The backend calls ``nvmlDeviceGetProcessesUtilizationInfo``
  through it with a buffer sized beforehand (:func:`gpuagent.gpu.processes.utilization_info`):
  pynvml's wrapper always makes a sizing call first, which costs as much as the read.

lightkube 1.0.1 (``lightkube>=1.0.1,<2``)

* ``AsyncClient._client`` (its ``GenericAsyncClient``) and that one's ``_client``, the HTTP client
  it sends every request with (:func:`lightkube_http`): lightkube has no discovery call, and the
  node-health writer asks once whether the server offers ``events.k8s.io/v1``
  (:meth:`gpuagent.kube.client.KubeApi.serves`) with the same connection, credentials and TLS.
  The tests of the writer make that GET against the API-server stand-in, both ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["PINS", "PRIVATE", "lightkube_http"]

# The requirements (pyproject.toml) the uses below were written against, by distribution.
PINS = {
    "grpclib": "==0.4.9",
    "betterproto2": "==0.10.0",
    "nvidia-ml-py": ">=13.615,<14",
    "lightkube": ">=1.0.1,<2",
}
# Each private name used, as (module, attribute, its parameters or None for a value).
PRIVATE: Sequence[tuple[str, str, tuple[str, ...] | None]] = (
    ("grpclib._typing", "IServable", None),
    ("grpclib.server", "Server._protocol_factory", ("self",)),
    ("grpclib.protocol", "H2Protocol.__init__", ("self", "handler", "config", "h2_config")),
    ("grpclib.protocol", "H2Protocol.connection", None),
    (
        "betterproto2.grpclib.grpclib_server",
        "ServiceBase._call_rpc_handler_server_stream",
        ("self", "handler", "stream", "request"),
    ),
    ("betterproto2._version", "__version__", None),
    ("betterproto2._version", "check_compiler_version", ("compiler_version",)),
    ("pynvml", "nvmlLib", None),
    ("pynvml", "libLoadLock", None),
    ("pynvml", "_nvmlGetFunctionPointer_cache", None),
    ("pynvml", "_nvmlLib_refcount", None),
    ("pynvml", "NVMLError._errcode_to_string", None),
    ("pynvml", "_nvmlGetFunctionPointer", ("name",)),
    ("lightkube.core.generic_client", "GenericAsyncClient._client", None),
)


def lightkube_http(client: Any) -> Any:
    """The HTTP client a lightkube ``AsyncClient`` sends its requests with (an
    ``httpx2.AsyncClient`` with the server's base URL, credentials and TLS)."""
    return client._client._client
