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

Buffers are registered, not copied: the transport writes received pages straight into
the receiver's arrays and sends straight from the sender's. Do not modify a sender's
pages until its transfer completes, nor read a receiver's pages before theirs does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pdd_transport._native import InboundTransfer, KvPool, KvReceiver, KvSender, OutboundTransfer
from pdd_transport.errors import InvalidArgument
from pdd_transport.local import DualSender

__all__ = [
    "DualSender",
    "InboundTransfer",
    "KvPool",
    "KvReceiver",
    "KvSender",
    "OutboundTransfer",
    "as_bytes_view",
    "pool_from_buffers",
]


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
