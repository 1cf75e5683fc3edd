"""The ``kv_transfer_params`` contract between a PDD proxy or router and vLLM engines
running ``PddConnector`` (docs/vllm.md). Standard library only, so that a proxy that
imports neither vLLM nor torch speaks it too."""

from __future__ import annotations

from typing import Any

from pdd_transport.errors import InvalidArgument

__all__ = ["DEBUG_CORRUPT", "DECODE_ADDRESS", "DO_REMOTE_DECODE", "DO_REMOTE_PREFILL", "ENDED", "KEY", "MAX_RANKS",
           "PREFILL_NODE", "PREFILL_RANKS", "RELAY_ADDRESS", "decode_params", "destinations", "key_of", "prefill_node",
           "prefill_params", "prefill_ranks", "rank_key"]

KEY = "pdd_key"  # str: the transfer key both sides derive the wire request id from
DO_REMOTE_PREFILL = "do_remote_prefill"  # D: load the prompt's KV from a prefill instance
DO_REMOTE_DECODE = "do_remote_decode"  # P: push the prompt's KV to a decode instance
DECODE_ADDRESS = "pdd_decode_address"  # P: "host:port" of D's receiver, as P reaches it
RELAY_ADDRESS = "pdd_relay_address"  # P (optional): "local://host:port" of a RelayDecode: a dual-path push
PREFILL_NODE = "pdd_prefill_node"  # D (optional): P's sender node id, to grant to it only
#: D (optional, default 1): P's tensor-parallel degree. Each P rank pushes its heads
#: from its own sender (node id ``PREFILL_NODE + rank``) under its own key
#: (:func:`rank_key`); D grants each rank the units of its heads and loads the request
#: once every rank's KV landed. More than one rank needs ``PREFILL_NODE``.
PREFILL_RANKS = "pdd_prefill_ranks"
MAX_RANKS = 64
DEBUG_CORRUPT = "pdd_debug_corrupt"  # D: zero the received KV (negative control; needs pdd_allow_debug)
MAX_KEY_CHARS = 256
#: What D tells P of a decode request that ended before its KV arrived (a refusal).
ENDED = "the decode request ended before its KV arrived"


def decode_params(key: str, prefill_node: int | None = None, prefill_ranks: int = 1) -> dict[str, Any]:
    """``kv_transfer_params`` for the decode instance's copy of a request (``prefill_ranks``:
    the prefill instance's tensor-parallel degree, its ranks' node ids
    ``prefill_node .. prefill_node + prefill_ranks - 1``)."""
    params: dict[str, Any] = {DO_REMOTE_PREFILL: True, KEY: key}
    if prefill_node is not None:
        params[PREFILL_NODE] = int(prefill_node)
    if prefill_ranks != 1:
        params[PREFILL_RANKS] = int(prefill_ranks)
    return params


def prefill_params(key: str, decode_address: str, relay_address: str | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` for the prefill instance's copy (send it with
    ``max_tokens=1``): where D's receiver listens, as P reaches it; with
    ``relay_address`` (a RelayDecode's ``local://host:port``) P pushes the KV to both
    at once, each getting the blocks it lacks (the dual-path send)."""
    params: dict[str, Any] = {DO_REMOTE_DECODE: True, KEY: key, DECODE_ADDRESS: decode_address}
    if relay_address:
        params[RELAY_ADDRESS] = relay_address
    return params


def destinations(params: dict[str, Any]) -> list[str]:
    """The addresses P pushes a request's KV to, from its ``kv_transfer_params``."""
    return [str(a) for a in (params.get(DECODE_ADDRESS), params.get(RELAY_ADDRESS)) if a]


def prefill_node(params: dict[str, Any]) -> int | None:
    """The prefill sender's node id D grants to, from D's ``kv_transfer_params`` (None:
    any). Raises :class:`InvalidArgument` for anything but an integer in ``0..2**64-1``."""
    raw = params.get(PREFILL_NODE)
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < 2**64:
        raise InvalidArgument(f"kv_transfer_params[{PREFILL_NODE!r}] must be a node id (an integer in 0..2**64-1), "
                              f"got {raw!r}", "invalid_argument")
    return raw


def prefill_ranks(params: dict[str, Any]) -> int:
    """P's tensor-parallel degree from D's ``kv_transfer_params`` (default 1). Raises
    :class:`InvalidArgument` for a value outside ``1..MAX_RANKS``, for several ranks
    without ``PREFILL_NODE`` (D could not tell the ranks' senders apart), or for a
    malformed ``PREFILL_NODE`` (so one call checks both)."""
    raw = params.get(PREFILL_RANKS, 1)
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= MAX_RANKS:
        raise InvalidArgument(f"kv_transfer_params[{PREFILL_RANKS!r}] must be an integer in 1..{MAX_RANKS}, got {raw!r}",
                              "invalid_argument")
    node = prefill_node(params)
    if raw > 1 and node is None:
        raise InvalidArgument(f"kv_transfer_params[{PREFILL_RANKS!r}]={raw} needs {PREFILL_NODE!r} (rank r's sender is "
                              f"node {PREFILL_NODE} + r)", "invalid_argument")
    return raw


def rank_key(key: str, rank: int, ranks: int) -> str:
    """The transfer key of prefill rank ``rank`` of ``ranks`` for request ``key``: the
    key itself for one rank (unchanged from a prefill instance without tensor
    parallelism), else ``key#tp<rank>/<ranks>``."""
    return key if ranks == 1 else f"{key}#tp{rank}/{ranks}"


def key_of(params: dict[str, Any] | None, flag: str, strict: bool = False) -> str | None:
    """The transfer key when ``params`` asks for ``flag``, else None; a request that
    asks but names no usable key raises InvalidArgument when ``strict``, else None."""
    if not params or not params.get(flag):
        return None
    key = params.get(KEY)
    if isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS:
        return key
    if strict:
        raise InvalidArgument(
            f"kv_transfer_params[{KEY!r}] must be a non-empty string of at most {MAX_KEY_CHARS} characters",
            "invalid_argument",
        )
    return None
