"""A MainDecode's cache as its own KV cache events say (``md_cache_source="events"``).

vLLM publishes, with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:PORT", "topic": "kv-events"}'`` and prefix
caching on, one ZMQ message per scheduler step that changed its prefix cache:
``[topic, seq (8 bytes, big-endian), payload]``, the payload a msgpack ``KVEventBatch``
``[ts, [event, ...], data_parallel_rank]`` whose events are maps tagged by ``type``:
``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
``block_size``, ...), ``BlockRemoved`` (``block_hashes``), ``AllBlocksCleared``.

:class:`MainDecodeEventView` subscribes (pyzmq, a thread of its own), decodes each
payload with the explicit, bounded msgpack decoder below (no pickle, no code from the
wire: only nil, booleans, integers, floats, strings, bytes, arrays and maps), checks
every field it uses, and counts and drops a malformed message. Blocks are kept as
vLLM names them (hash -> parent, tokens); the token prefix of each stored chain goes
into a shadow :class:`~pdd_transport.radix.RadixCache` whose CACHE_EVENTS frames feed
the fleet's :class:`~pdd_transport.radix.PrefixMirror` (this MD's ``instance``), so the
router asks the same mirror whatever the source. A removal rebuilds the shadow from the
blocks left (at the next query, once per batch of removals).

Limits: a message lost (a sequence gap: the publisher's high-water mark, a subscriber
that joined late) clears the view, which then under-reports until MD stores again (a
larger transfer, never a wrong answer: MD's connector asks P for exactly what it
lacks); a block whose parent the view never saw (stored before the subscription) is not
reachable from the root and counts as not held. Events from other media (an offloading
tier's ``CPU``) and other KV cache groups are ignored.
"""

from __future__ import annotations

import collections
import struct
import threading
from typing import Any

from pdd_transport import radix
from pdd_transport.integrations.vllm_pipelines import MainDecodeCacheView

__all__ = ["MainDecodeEventView", "MsgpackError", "decode_msgpack", "parse_batch"]

#: Bounds of one message: its bytes, nesting, and blocks the view keeps per MD.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_DEPTH = 8
MAX_BLOCKS = 1 << 20
#: Parsed batches waiting for the router's next query.
MAX_PENDING = 4096


class MsgpackError(ValueError):
    """A payload that is not the msgpack this decoder accepts."""


def decode_msgpack(data: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """Decode one msgpack value that fills ``data`` exactly. Extension types, nesting
    deeper than ``max_depth`` and lengths past the end raise :class:`MsgpackError`."""
    view = memoryview(data)
    value, end = _decode(view, 0, max_depth)
    if end != len(view):
        raise MsgpackError(f"{len(view) - end} bytes after the value")
    return value


def _need(view: memoryview, pos: int, n: int) -> None:
    if n < 0 or pos + n > len(view):
        raise MsgpackError(f"truncated at byte {pos}: {n} more needed")


def _uint(view: memoryview, pos: int, n: int) -> int:
    _need(view, pos, n)
    return int.from_bytes(view[pos:pos + n], "big")


def _decode(view: memoryview, pos: int, depth: int) -> tuple[Any, int]:
    _need(view, pos, 1)
    b = view[pos]
    pos += 1
    if b <= 0x7F:
        return b, pos
    if b >= 0xE0:
        return b - 0x100, pos
    if 0xA0 <= b <= 0xBF:
        return _str(view, pos, b & 0x1F)
    if 0x90 <= b <= 0x9F:
        return _array(view, pos, b & 0x0F, depth)
    if 0x80 <= b <= 0x8F:
        return _map(view, pos, b & 0x0F, depth)
    if b == 0xC0:
        return None, pos
    if b in (0xC2, 0xC3):
        return b == 0xC3, pos
    if b in (0xCC, 0xCD, 0xCE, 0xCF):
        n = 1 << (b - 0xCC)
        return _uint(view, pos, n), pos + n
    if b in (0xD0, 0xD1, 0xD2, 0xD3):
        n = 1 << (b - 0xD0)
        _need(view, pos, n)
        return int.from_bytes(view[pos:pos + n], "big", signed=True), pos + n
    if b == 0xCA:
        _need(view, pos, 4)
        return struct.unpack(">f", view[pos:pos + 4])[0], pos + 4
    if b == 0xCB:
        _need(view, pos, 8)
        return struct.unpack(">d", view[pos:pos + 8])[0], pos + 8
    if b in (0xD9, 0xDA, 0xDB):
        n = 1 << (b - 0xD9)
        return _str(view, pos + n, _uint(view, pos, n))
    if b in (0xC4, 0xC5, 0xC6):
        n = 1 << (b - 0xC4)
        size = _uint(view, pos, n)
        _need(view, pos + n, size)
        return bytes(view[pos + n:pos + n + size]), pos + n + size
    if b in (0xDC, 0xDD):
        n = 2 if b == 0xDC else 4
        return _array(view, pos + n, _uint(view, pos, n), depth)
    if b in (0xDE, 0xDF):
        n = 2 if b == 0xDE else 4
        return _map(view, pos + n, _uint(view, pos, n), depth)
    raise MsgpackError(f"type byte 0x{b:02x} at {pos - 1} is not accepted (extension or reserved)")


def _str(view: memoryview, pos: int, size: int) -> tuple[str, int]:
    _need(view, pos, size)
    try:
        return str(view[pos:pos + size], "utf-8"), pos + size
    except UnicodeDecodeError as e:
        raise MsgpackError(f"a string at {pos} is not UTF-8") from e


def _array(view: memoryview, pos: int, count: int, depth: int) -> tuple[list[Any], int]:
    if depth <= 0:
        raise MsgpackError("nested too deep")
    _need(view, pos, count)  # each element takes at least one byte
    out = []
    for _ in range(count):
        item, pos = _decode(view, pos, depth - 1)
        out.append(item)
    return out, pos


def _map(view: memoryview, pos: int, count: int, depth: int) -> tuple[dict[Any, Any], int]:
    if depth <= 0:
        raise MsgpackError("nested too deep")
    _need(view, pos, 2 * count)
    out: dict[Any, Any] = {}
    for _ in range(count):
        key, pos = _decode(view, pos, depth - 1)
        if not isinstance(key, (str, int)):
            raise MsgpackError("a map key that is not a string or an integer")
        out[key], pos = _decode(view, pos, depth - 1)
    return out, pos


# -- vLLM's events -----------------------------------------------------------------------

Hash = int | bytes


def _hash(value: Any, what: str) -> Hash:
    if isinstance(value, bool) or not isinstance(value, (int, bytes)):
        raise MsgpackError(f"{what}: a block hash must be an integer or bytes, got {type(value).__name__}")
    if isinstance(value, bytes) and len(value) > 64:
        raise MsgpackError(f"{what}: a block hash of {len(value)} bytes")
    return value


def parse_batch(payload: bytes, block_size: int) -> list[tuple[str, Any]]:
    """The events of one ``KVEventBatch`` payload that concern this view, checked:
    ``("stored", (parent, [(hash, tokens), ...]))``, ``("removed", [hash, ...])``,
    ``("cleared", None)``. Raises :class:`MsgpackError` for anything malformed."""
    if len(payload) > MAX_MESSAGE_BYTES:
        raise MsgpackError(f"a payload of {len(payload)} bytes")
    batch = decode_msgpack(payload)
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[0], (int, float)):
        raise MsgpackError("a batch must be [ts, events, ...]")
    events = batch[1]
    if not isinstance(events, list):
        raise MsgpackError("a batch's events must be a list")
    out: list[tuple[str, Any]] = []
    for ev in events:
        if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
            raise MsgpackError("an event must be a map with a type")
        kind = ev["type"]
        if ev.get("medium") not in (None, "GPU") or ev.get("group_idx") not in (None, 0):
            continue  # another tier or KV cache group: not the prefix cache P fills
        if kind == "BlockStored":
            hashes, tokens, size = ev.get("block_hashes"), ev.get("token_ids"), ev.get("block_size")
            if not isinstance(hashes, list) or not hashes or not isinstance(tokens, list):
                raise MsgpackError("BlockStored needs block_hashes and token_ids lists")
            if size != block_size:
                raise MsgpackError(f"BlockStored of block_size {size!r}, the view's is {block_size}")
            if len(tokens) != len(hashes) * block_size:
                raise MsgpackError(f"BlockStored: {len(tokens)} tokens for {len(hashes)} blocks")
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens):
                raise MsgpackError("BlockStored: token ids must be integers in 0..2^32")
            parent = ev.get("parent_block_hash")
            parent = None if parent is None else _hash(parent, "parent_block_hash")
            blocks = [(_hash(h, "block_hashes"), tuple(tokens[i * block_size:(i + 1) * block_size]))
                      for i, h in enumerate(hashes)]
            out.append(("stored", (parent, blocks)))
        elif kind == "BlockRemoved":
            hashes = ev.get("block_hashes")
            if not isinstance(hashes, list):
                raise MsgpackError("BlockRemoved needs a block_hashes list")
            out.append(("removed", [_hash(h, "block_hashes") for h in hashes]))
        elif kind == "AllBlocksCleared":
            out.append(("cleared", None))
        # Other types (a later vLLM's): ignored.
    return out


class MainDecodeEventView(MainDecodeCacheView):
    """One MD's cache from its KV cache events (see the module's docstring). ``feed``
    takes one ZMQ message's frames (the subscriber thread calls it; tests too);
    queries apply what arrived first."""

    def __init__(self, block_size: int, endpoint: str | None = None, *, instance: int = 0,
                 mirror: radix.PrefixMirror | None = None, topic: str = ""):
        super().__init__(block_size, None, instance=instance, mirror=mirror)
        self.endpoint = endpoint
        self.topic = topic
        #: vLLM's blocks: hash -> (parent hash or None, the block's tokens).
        self.blocks: dict[Hash, tuple[Hash | None, tuple[int, ...]]] = {}
        self._pending: collections.deque[tuple[int, list[tuple[str, Any]]] | None] = collections.deque()
        self._lock = threading.Lock()
        self._last_seq: int | None = None
        self._dirty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Messages applied, malformed ones dropped, sequence gaps (the view was cleared).
        self.stats = {"messages": 0, "malformed": 0, "gaps": 0, "stored": 0, "removed": 0, "cleared": 0,
                      "overflow": 0}

    # The events are the truth: what the router sent and what MD reported do not change it.
    def record(self, tokens: list[int]) -> None:
        return None

    def confirm(self, tokens: list[int], cached_tokens: int | None) -> bool:
        return True

    def feed(self, frames: list[bytes]) -> bool:
        """One message ``[topic, seq, payload]``: parsed now, applied at the next
        query. False (and counted) when malformed."""
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise MsgpackError(f"a message of {len(frames)} frames")
            seq = int.from_bytes(frames[1], "big", signed=True)
            events = parse_batch(bytes(frames[2]), self.block_size)
        except (MsgpackError, RecursionError) as e:
            del e
            with self._lock:
                self.stats["malformed"] += 1
            return False
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                self._pending.clear()
                self._pending.append(None)  # lost: clear at the next query
                self.stats["overflow"] += 1
            self._pending.append((seq, events))
        return True

    def refresh(self) -> None:
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        for item in pending:
            if item is None:
                self._clear()
                self._last_seq = None
                continue
            seq, events = item
            if self._last_seq is not None and seq != self._last_seq + 1:
                self.stats["gaps"] += 1
                self._clear()
            self._last_seq = seq
            self.stats["messages"] += 1
            for kind, data in events:
                self._apply(kind, data)
        if self._dirty:
            self._rebuild()

    def reset(self) -> None:
        with self._lock:
            self._pending.clear()
        self._last_seq = None
        self._clear()

    def _clear(self) -> None:
        self.blocks.clear()
        self._dirty = False
        super().reset()

    def _apply(self, kind: str, data: Any) -> None:
        if kind == "cleared":
            self.stats["cleared"] += 1
            self._clear()
            return
        if kind == "removed":
            for h in data:
                if self.blocks.pop(h, None) is not None:
                    self.stats["removed"] += 1
                    self._dirty = True
            return
        parent, blocks = data
        if len(self.blocks) + len(blocks) > MAX_BLOCKS:
            self.stats["overflow"] += 1
            self._clear()
        for h, tokens in blocks:
            self.blocks[h] = (parent, tokens)
            parent = h
            self.stats["stored"] += 1
        if not self._dirty:
            self._insert_chain(parent)

    def _chain(self, h: Hash | None) -> list[int] | None:
        """The tokens from the root to block ``h``'s end; None when a link is unknown."""
        parts: list[tuple[int, ...]] = []
        seen = 0
        while h is not None:
            entry = self.blocks.get(h)
            seen += 1
            if entry is None or seen > len(self.blocks):
                return None
            h, tokens = entry
            parts.append(tokens)
        return [t for part in reversed(parts) for t in part]

    def _insert_chain(self, last: Hash | None) -> None:
        tokens = self._chain(last)
        if tokens:
            pages = len(tokens) // self.block_size
            handles = list(range(self._handles, self._handles + pages))
            self._handles += pages
            self._shadow.insert(tokens, handles)
            self._sync()

    def _rebuild(self) -> None:
        self._dirty = False
        super().reset()
        parents = {p for p, _ in self.blocks.values() if p is not None}
        for h in [h for h in self.blocks if h not in parents]:
            self._insert_chain(h)

    # -- the subscription ---------------------------------------------------------------

    def start(self) -> None:
        if self.endpoint is None or self._thread is not None:
            return
        import zmq  # pyzmq: only for md_cache_source="events"

        ctx: Any = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 4096)
        sock.setsockopt(zmq.RCVTIMEO, 200)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sock.connect(self.endpoint)

        def run() -> None:
            try:
                while not self._stop.is_set():
                    try:
                        frames = sock.recv_multipart()
                    except zmq.Again:
                        continue
                    self.feed(frames)
            finally:
                sock.close(0)

        self._thread = threading.Thread(target=run, name=f"kv-events-md{self.instance}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
            self._thread = None
