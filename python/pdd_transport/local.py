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
    # Each side waits for its own grant: one late grant holds nothing of the other.
    dual = local.DualSender(to_rld, wan, pages, request_key=rid)
    for layer in range(layers):           # as each layer is computed
        dual.send_layer(layer)
    dual.finish()
    outcome = dual.wait(timeout=60)       # each side's own result
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdd_transport import _native
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
from pdd_transport.errors import PddError

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


def _side_outcome(d: dict[str, Any] | None) -> SideOutcome | None:
    if d is None:
        return None
    return SideOutcome(bool(d["ok"]), int(d["bytes"]), float(d["seconds"]), d.get("reason"), d.get("message"))


class DualSender:
    """Fan each layer out to RelayDecode over the local path and to MainDecode over
    the WAN at once (the dual-path send).

    ``local`` (RelayDecode's side) and ``wan`` (MainDecode's) are each a grant's
    handle (``LocalOutbound``, ``OutboundTransfer``), a sender (``LocalSender``,
    ``KvSender``; RelayDecode's side may run on TCP lanes where UCX is missing), or
    ``None``. A side given as
    its sender waits for the grant of ``request_key`` itself, so that one side's grant
    arriving late or never does not hold the other. Each side sends the prompt's last
    ``page_count`` pages of ``pages`` its grant covers: every page for RelayDecode,
    only the pages MainDecode lacks for MainDecode (its grant follows the prefix
    handshake). Each side is a task of the library's runtime (``_native.DualSender``,
    no Python thread): a failure of one (a WAN reset, a dead RelayDecode) never
    stops, slows or fails the other, a failed side aborts its own transfer with the
    reason (its receiver frees the pages at once), and :meth:`wait` reports each
    side's own outcome. ``timeout`` bounds each of a side's waits (its grant, each
    layer, the receiver's confirmation)."""

    def __init__(
        self,
        local: Any,
        wan: Any,
        pages: Sequence[int],
        *,
        request_key: int | str | bytes | None = None,
        timeout: float = 120.0,
    ) -> None:
        self._native = _native.DualSender(local, wan, list(pages), request_key=request_key, timeout=timeout)

    def send_layer(self, layer: int) -> None:
        """Queue ``layer`` on both sides; returns at once. A side whose grant has
        fewer layers skips the ones past it."""
        self._native.send_layer(layer)

    def finish(self) -> None:
        """Every layer was queued."""
        self._native.finish()

    def wait(self, timeout: float | None = None) -> DualOutcome:
        """Wait (GIL released) for both sides and report each; a side still running
        when ``timeout`` passes (by default: the sides' own bounds) is reported as
        ``deadline_exceeded``."""
        local_side, wan_side = self._native.wait(timeout)
        return DualOutcome(_side_outcome(local_side), _side_outcome(wan_side))

    def poll(self) -> DualOutcome:
        """Each side's outcome if it ended, without waiting (``None``: not asked for,
        or still running)."""
        local_side, wan_side = self._native.poll()
        return DualOutcome(_side_outcome(local_side), _side_outcome(wan_side))
