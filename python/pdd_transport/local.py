"""The local path (Prefill -> RelayDecode in one datacenter) and the dual-path send.

The local path moves KV by one-sided UCX puts straight into the receiver's pool,
over whatever UCX finds (shared memory / CMA on one host, TCP across hosts, verbs
where an RDMA NIC exists), with the WAN path's grant rules: the receiver exposes
exactly the pages it granted, and revokes them when the transfer ends. Control
(grants, completion notices) runs on one authenticated control lane, as on the WAN.
A receiver's pool in memory UCX allocated (:func:`shared_buffers`) takes the KV by one
copy that a sender on the same host makes itself, with no work on the receiver's side
(``docs/kv.md``, "Shared pools"). UCX is loaded when first asked for: the
system's ``libucp.so.0`` (Debian's ``libucx0``), else the one in PyPI's ``libucx-cu12``
wheel (``pip install 'pdd_transport[ucx]'``; found in site-packages at import, see
:func:`wheel_ucx_library`), else :func:`available` is False and the constructors raise
``TransportError`` (``local_path_unavailable``, naming the libraries tried).
``PDD_UCX_LIBRARY`` names another library to load instead.

The transfer handles and the receiver's events are the WAN path's
(``docs/kv.md``): partial sends (``send_pages``), empty grants, ``abort(reason)``,
``poll()``, ``request_key``, ``LocalReceiver.wait_event`` and grant tickets
(``LocalInbound.ticket()``), so an engine picks a path by the receiver's address
and nothing else.

Receiver (RelayDecode)::

    rx = local.LocalReceiver(pool, "0.0.0.0:7200", secret=deployment_secret)
    rx.wait_peer(timeout=30)
    inbound = rx.grant(request_id, pages, deadline_s=20)
    inbound.wait(timeout=20)              # or: rx.wait_event(timeout); rx.poll_events()

Sender (Prefill), with the WAN transfer to MainDecode at the same time::

    to_rld = local.LocalSender(src_pool, "10.0.0.5:7200", secret=deployment_secret)
    dual = local.DualSender(to_rld.wait_grant(rid), wan.wait_grant(rid), pages)
    for layer in range(layers):           # as each layer is computed
        dual.send_layer(layer)
    dual.finish()
    outcome = dual.wait(timeout=60)       # each side's own result
"""

from __future__ import annotations

import importlib.util
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdd_transport._native import (
    LocalInbound,
    LocalOutbound,
    LocalReceiver,
    LocalSender,
    add_ucx_fallback,
    shared_buffers,
    ucx_library,
    ucx_version,
)
from pdd_transport.errors import InvalidArgument, PddError

__all__ = [
    "LOCAL_SCHEME",
    "DualOutcome",
    "DualSender",
    "LocalInbound",
    "LocalOutbound",
    "LocalReceiver",
    "LocalSender",
    "SideOutcome",
    "available",
    "shared_buffers",
    "ucx_library",
    "ucx_version",
    "wheel_ucx_library",
]


def wheel_ucx_library() -> str | None:
    """The ``libucp.so.0`` of PyPI's UCX wheel (``libucx-cu12`` or ``-cu13``, both
    install the package ``libucx``) where one is installed, else None. Found without
    importing the package (which would load its libraries into this process)."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    for directory in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(directory, "lib", "libucp.so.0")
        if os.path.isfile(path):
            return path
    return None


# The wheel's UCX is the fallback for a system without one: read at the first load.
_WHEEL_UCX = wheel_ucx_library()
if _WHEEL_UCX is not None:
    add_ucx_fallback(_WHEEL_UCX)


#: The address prefix that names the local path: a local grant's ticket carries
#: ``"local://host:port"`` (``LocalInbound.ticket()``), so that an engine picks the
#: path (``LocalSender`` or ``KvSender``) by the address alone.
LOCAL_SCHEME = "local://"


def available() -> bool:
    """Whether UCX can be loaded here (the local path can run)."""
    try:
        ucx_version()
    except PddError:
        return False
    return True


class _Outbound(Protocol):
    """What both paths' sender handles offer (``LocalOutbound``, ``OutboundTransfer``)."""

    @property
    def page_count(self) -> int: ...
    @property
    def layer_count(self) -> int: ...
    def send_layer(self, layer: int, src_pages: Any, src_layer: int | None = None, timeout: float = 60.0) -> None: ...
    def finish(self) -> None: ...
    def wait(self, timeout: float = 60.0) -> int: ...


@dataclass
class SideOutcome:
    """How one side of a dual send ended."""

    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    reason: str | None = None
    message: str | None = None


@dataclass
class DualOutcome:
    """Both sides of a dual send; either may be ``None`` (not asked for)."""

    local: SideOutcome | None
    wan: SideOutcome | None


_FINISH = -1


class _Side:
    """One path of a dual send: its own thread, queue and outcome, so that nothing
    that happens to it (its grant late or refused, its line lost) touches the other
    side."""

    def __init__(self, name: str, out: _Outbound | Callable[[], _Outbound], pages: Sequence[int],
                 timeout: float) -> None:
        self.name = name
        self.out = out
        self.pages = list(pages)
        self.timeout = timeout
        self.layers: queue.Queue[int] = queue.Queue()
        self.outcome: SideOutcome | None = None
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name=f"pdd-dual-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        out: Any = None
        try:
            out = self.out() if callable(self.out) else self.out
            if out.page_count > len(self.pages):
                raise InvalidArgument(f"the {self.name} grant covers {out.page_count} pages, the request has "
                                      f"{len(self.pages)}", "invalid_argument")
            # The grant covers the prompt's last page_count pages (all of them for a
            # receiver without a prefix cache; after the prefix handshake, the ones
            # MainDecode lacks).
            src = self.pages[len(self.pages) - out.page_count :]
            while True:
                layer = self.layers.get()
                if layer == _FINISH:
                    break
                if layer < out.layer_count:  # a grant of fewer layers than the other side's
                    out.send_layer(layer, src, timeout=self.timeout)
            out.finish()
            moved = out.wait(timeout=self.timeout)
            self.outcome = SideOutcome(True, moved, time.perf_counter() - self.started)
        except PddError as exc:
            abort = getattr(out, "abort", None)
            if abort is not None:
                try:
                    abort()
                except PddError:
                    pass
            self.outcome = SideOutcome(False, 0, time.perf_counter() - self.started, exc.reason, str(exc))


class DualSender:
    """Fan each layer out to RelayDecode over the local path and to MainDecode over
    the WAN at once.

    ``local`` and ``wan`` are the two sides' sender handles (``LocalOutbound``,
    ``OutboundTransfer``), or callables that wait for them (``lambda:
    tx.wait_grant(rid)``), so that one side's grant arriving late or never does not
    hold the other; either may be ``None``. Each side gets the prompt's last
    ``page_count`` pages of ``pages`` its grant covers: every page for RelayDecode,
    only the pages MainDecode lacks for MainDecode (its grant follows the prefix
    handshake). Each side runs on its own thread: a failure of one (a WAN reset, a
    dead RelayDecode) never stops, slows or fails the other, and :meth:`wait` reports
    each side's own outcome."""

    def __init__(
        self,
        local: _Outbound | Callable[[], _Outbound] | None,
        wan: _Outbound | Callable[[], _Outbound] | None,
        pages: Sequence[int],
        *,
        timeout: float = 120.0,
    ) -> None:
        if local is None and wan is None:
            raise InvalidArgument("a dual send needs at least one side", "invalid_argument")
        self._sides: dict[str, _Side] = {}
        if local is not None:
            self._sides["local"] = _Side("local", local, pages, timeout)
        if wan is not None:
            self._sides["wan"] = _Side("wan", wan, pages, timeout)
        self._timeout = timeout

    def send_layer(self, layer: int) -> None:
        """Queue ``layer`` on both sides; returns at once. A side whose grant has
        fewer layers skips the ones past it."""
        for side in self._sides.values():
            side.layers.put(layer)

    def finish(self) -> None:
        """Every layer was queued."""
        for side in self._sides.values():
            side.layers.put(_FINISH)

    def wait(self, timeout: float | None = None) -> DualOutcome:
        """Wait for both sides and report each (a side still running when
        ``timeout``, by default its grant wait plus its transfer's bound, passes is
        reported as ``deadline_exceeded``)."""
        deadline = time.monotonic() + (3 * self._timeout + 5.0 if timeout is None else timeout)
        for side in self._sides.values():
            side.thread.join(max(0.0, deadline - time.monotonic()))
        out: dict[str, SideOutcome | None] = {"local": None, "wan": None}
        for name, side in self._sides.items():
            out[name] = side.outcome or SideOutcome(False, 0, time.perf_counter() - side.started, "deadline_exceeded",
                                                    f"the {name} side did not end within the wait")
        return DualOutcome(out["local"], out["wan"])
