"""KV streaming: register page pools, grant pages, stream KV into them.

A receiver (RelayDecode or MainDecode) owns a :class:`KvPool` and grants a sender
pages of it per transfer; the sender (Prefill) streams pages from its own pool into
the grant over a control lane plus ``lanes`` data lanes. Pages are addressed relative
to the grant on the wire, so a sender can only write pages it was granted.

Receiver::

    pool = kv.pool_from_buffers([np.zeros(pages * page_bytes, np.uint8) for _ in range(layers)], page_bytes)
    rx = kv.KvReceiver(pool, "0.0.0.0:7100")
    peer = rx.wait_peer(timeout=30)
    transfer = rx.grant(request_id, pages=[17, 3, 42], deadline_s=10)
    transfer.wait(timeout=10)           # or: await transfer.wait_async()

Sender::

    tx = kv.KvSender(src_pool, "10.0.0.2:7100", lanes=4)
    out = tx.wait_grant(request_id, timeout=10)
    for layer in range(out.layer_count):   # as each layer's KV is computed
        out.send_layer(layer, src_pages)
    out.finish()
    out.wait(timeout=10)

Engines with their own request names pass a ``str`` (or ``bytes``) key wherever a
request id goes; both ends map it to the same 64-bit wire id (:func:`request_id_of`).
A sender may also send any subset of a grant's pages per call (``send_pages``, e.g. the
pages one chunk of a chunked prefill filled), abort a transfer (``abort``), and either
side can ``poll()`` a transfer without waiting (:class:`KvPoll`). A decode instance
tells a prefill instance where and what to send with ``transfer.ticket()``, a small
JSON-safe dict that rides in the engine's own request metadata
(:class:`GrantTicket` reads one back).

Buffers are registered, not copied: the transport writes received pages straight into
the receiver's arrays and sends straight from the sender's. Do not modify a sender's
pages until its transfer completes, nor read a receiver's pages before theirs does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

from pdd_transport._native import (
    InboundTransfer,
    KvPoll,
    KvPool,
    KvReceiver,
    KvSender,
    LayerComplete,
    OutboundTransfer,
    PrefixQueried,
    TransferComplete,
    TransferFailed,
    request_id_of,
    transfer_activity,
    wait_transfer_activity,
)
from pdd_transport.errors import InvalidArgument
from pdd_transport.local import LOCAL_SCHEME, DualSender

__all__ = [
    "DualSender",
    "GrantTicket",
    "InboundTransfer",
    "KvEvent",
    "KvPoll",
    "KvPool",
    "KvReceiver",
    "KvSender",
    "LayerComplete",
    "OutboundTransfer",
    "PrefixQueried",
    "TransferComplete",
    "TransferFailed",
    "as_bytes_view",
    "pool_from_block_tensors",
    "pool_from_buffers",
    "request_id_of",
    "transfer_activity",
    "wait_transfer_activity",
]

#: What ``KvReceiver.poll_events()`` returns, one of these per event.
KvEvent: TypeAlias = LayerComplete | TransferComplete | TransferFailed | PrefixQueried

_U64 = 1 << 64


@dataclass(frozen=True)
class GrantTicket:
    """What a sender needs to find and fill one grant (``InboundTransfer.ticket()``,
    ``LocalInbound.ticket()``): the receiver's address, the request's wire id (and its
    str key, if it had one), the peer the grant is for (the sender's node id on the
    WAN path, the local receiver's number for its sender on the local path), and the
    grant's shape. The address names the path: ``"host:port"`` a ``KvReceiver``
    (fill it with a ``KvSender``), ``"local://host:port"`` a ``LocalReceiver`` (a
    ``LocalSender``); :attr:`path` and :attr:`connect` read it. Carried as a dict in
    an engine's request metadata; :meth:`from_dict` checks one that came from a
    peer."""

    address: str
    request_id: int
    peer: int
    layers: int
    pages: int
    page_bytes: int
    request_key: str | None = None
    version: int = 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GrantTicket:
        """Parse and check a ticket dict; :class:`InvalidArgument` names what is wrong."""
        if not isinstance(d, Mapping):
            raise InvalidArgument(f"a grant ticket is a dict, got {type(d).__name__}", "invalid_argument")
        if d.get("version") != 1:
            raise InvalidArgument(f"grant ticket version {d.get('version')!r} is not 1", "invalid_argument")
        address = d.get("address")
        if not isinstance(address, str):
            raise InvalidArgument(f"grant ticket address {address!r} is not host:port", "invalid_argument")
        host, _, port = address.removeprefix(LOCAL_SCHEME).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"grant ticket address {address!r} is not host:port or {LOCAL_SCHEME}host:port",
                                  "invalid_argument")
        limits = {"request_id": _U64, "peer": _U64, "layers": 1 << 16, "pages": 1 << 32, "page_bytes": 1 << 32}
        ints: dict[str, int] = {}
        for name, bound in limits.items():
            v = d.get(name)
            if type(v) is not int or not 0 <= v < bound:
                raise InvalidArgument(f"grant ticket {name} {v!r} is not an int in 0..{bound - 1}", "invalid_argument")
            ints[name] = v
        key = d.get("request_key")
        if key is not None:
            if not isinstance(key, str):
                raise InvalidArgument(f"grant ticket request_key {key!r} is not a str", "invalid_argument")
            if request_id_of(key) != ints["request_id"]:
                raise InvalidArgument("grant ticket request_key does not match its request_id", "invalid_argument")
        return cls(address=address, request_key=key, **ints)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-safe dict form (what ``InboundTransfer.ticket()`` returns)."""
        d: dict[str, Any] = {
            "version": self.version,
            "address": self.address,
            "request_id": self.request_id,
            "peer": self.peer,
            "layers": self.layers,
            "pages": self.pages,
            "page_bytes": self.page_bytes,
        }
        if self.request_key is not None:
            d["request_key"] = self.request_key
        return d

    @property
    def key(self) -> int | str:
        """What to pass to the sender's ``wait_grant``: the str key, else the wire id."""
        return self.request_key if self.request_key is not None else self.request_id

    @property
    def path(self) -> str:
        """``"local"`` for a local-path grant (``local://`` address), else ``"wan"``."""
        return "local" if self.address.startswith(LOCAL_SCHEME) else "wan"

    @property
    def connect(self) -> str:
        """The ``host:port`` to connect the path's sender to (``KvSender`` or
        ``LocalSender``), the address without its ``local://``."""
        return self.address.removeprefix(LOCAL_SCHEME)


def as_bytes_view(buffer: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A flat, writable uint8 view of ``buffer`` without copying.

    Accepts numpy arrays of any dtype, CPU torch tensors (any dtype, bf16 included),
    and objects exposing the writable buffer protocol (``bytearray``, ``mmap``...).
    Raises :class:`InvalidArgument` for anything that would need a copy.
    """
    if type(buffer).__module__.startswith("torch"):
        tensor = buffer
        if tensor.device.type == "cuda":
            raise InvalidArgument(
                f"tensor on {tensor.device}: memory kind 'cuda' is not registered by this build "
                "(untested without a GPU); stage the KV in host memory",
                "unsupported_memory_kind",
            )
        if tensor.device.type != "cpu":
            raise InvalidArgument(f"tensor on {tensor.device}: only CPU memory can be registered", "invalid_argument")
        if not tensor.is_contiguous():
            raise InvalidArgument("tensor is not contiguous", "invalid_argument")
        import torch

        buffer = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    if hasattr(buffer, "__cuda_array_interface__"):
        raise InvalidArgument(
            f"{type(buffer).__name__} exposes __cuda_array_interface__: memory kind 'cuda' is not registered "
            "by this build (untested without a GPU); stage the KV in host memory",
            "unsupported_memory_kind",
        )
    array = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(memoryview(buffer), dtype=np.uint8)
    if not array.flags.c_contiguous:
        raise InvalidArgument("buffer is not C-contiguous; registering it would need a copy", "invalid_argument")
    if not array.flags.writeable:
        raise InvalidArgument("buffer is read-only", "invalid_argument")
    return array.reshape(-1).view(np.uint8)


def pool_from_buffers(layers: Sequence[Any] | Any, page_bytes: int, num_layers: int | None = None) -> KvPool:
    """A :class:`KvPool` over per-layer buffers, or one buffer split into ``num_layers``
    equal layers (layer-major, as a ``[layers, pages, page_bytes]`` array is)."""
    if num_layers is not None:
        flat = as_bytes_view(layers)
        if num_layers < 1 or flat.size % num_layers:
            raise InvalidArgument(f"{flat.size} bytes do not split into {num_layers} equal layers", "invalid_argument")
        views = list(flat.reshape(num_layers, -1))
    else:
        if not isinstance(layers, Sequence) or isinstance(layers, (bytes, bytearray)):
            raise InvalidArgument("pass a sequence of per-layer buffers, or num_layers", "invalid_argument")
        views = [as_bytes_view(b) for b in layers]
    return KvPool(views, page_bytes)


def pool_from_block_tensors(tensors: Sequence[Any], names: Sequence[str] | None = None) -> Any:
    """An engine's KV cache as a pool, without a copy: one tensor (torch or numpy) per
    layer, each ``[num_blocks, ...]`` in CPU memory, contiguous, all of one shape and
    dtype, so that one block of one layer is one page. Anything else raises
    :class:`InvalidArgument` naming the layer."""
    if not tensors:
        raise InvalidArgument("no KV cache tensors to register", "invalid_argument")
    labels = list(names) if names is not None else [f"layer {i}" for i in range(len(tensors))]
    first = tensors[0]
    for name, t in zip(labels, tensors):
        device = getattr(getattr(t, "device", None), "type", "cpu")
        if device != "cpu":
            raise InvalidArgument(f"{name}: KV cache on {t.device}; only CPU memory is registered", "invalid_argument")
        contiguous = t.is_contiguous() if hasattr(t, "is_contiguous") else bool(t.flags["C_CONTIGUOUS"])
        if t.shape != first.shape or t.dtype != first.dtype or not contiguous or len(t.shape) < 1:
            raise InvalidArgument(
                f"{name}: KV cache {tuple(t.shape)} {t.dtype} (contiguous={contiguous}); every layer must be "
                f"one contiguous [num_blocks, ...] tensor like {tuple(first.shape)} {first.dtype}",
                "invalid_argument",
            )
    blocks = int(first.shape[0])
    total = first.numel() * first.element_size() if hasattr(first, "numel") else int(first.nbytes)
    if blocks == 0 or total % blocks:
        raise InvalidArgument(f"KV cache {tuple(first.shape)} has no whole blocks", "invalid_argument")
    return pool_from_buffers(list(tensors), total // blocks)
