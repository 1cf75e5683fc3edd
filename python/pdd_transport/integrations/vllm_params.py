"""The ``kv_transfer_params`` contract between a PDD proxy or router and vLLM engines
running ``PddConnector`` (docs/vllm.md). Standard library only, so that a proxy that
imports neither vLLM nor torch speaks it too."""

from __future__ import annotations

from typing import Any

from pdd_transport.errors import InvalidArgument

__all__ = ["DEBUG_CORRUPT", "DECODE_ADDRESS", "DO_REMOTE_DECODE", "DO_REMOTE_PREFILL", "ENDED", "KEY", "PREFILL_NODE",
           "RELAY_ADDRESS", "decode_params", "destinations", "key_of", "prefill_node", "prefill_params"]

KEY = "pdd_key"  # str: the transfer key both sides derive the wire request id from
DO_REMOTE_PREFILL = "do_remote_prefill"  # D: load the prompt's KV from a prefill instance
DO_REMOTE_DECODE = "do_remote_decode"  # P: push the prompt's KV to a decode instance
DECODE_ADDRESS = "pdd_decode_address"  # P: "host:port" of D's receiver, as P reaches it
RELAY_ADDRESS = "pdd_relay_address"  # P (optional): "local://host:port" of a RelayDecode: a dual-path push
PREFILL_NODE = "pdd_prefill_node"  # D (optional): P's sender node id, to grant to it only
DEBUG_CORRUPT = "pdd_debug_corrupt"  # D: zero the received KV (negative control; needs pdd_allow_debug)
MAX_KEY_CHARS = 256
#: What D tells P of a decode request that ended before its KV arrived (a refusal).
ENDED = "the decode request ended before its KV arrived"


def decode_params(key: str, prefill_node: int | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` for the decode instance's copy of a request."""
    params: dict[str, Any] = {DO_REMOTE_PREFILL: True, KEY: key}
    if prefill_node is not None:
        params[PREFILL_NODE] = int(prefill_node)
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
    """The prefill sender's node id D grants to, from D's ``kv_transfer_params`` (None: any)."""
    return int(params[PREFILL_NODE]) if params.get(PREFILL_NODE) is not None else None


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
