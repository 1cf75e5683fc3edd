"""Statistics of engine-neutral transfers (:mod:`pdd_transport.transfers`): what a
:class:`~pdd_transport.transfers.Pusher` or :class:`~pdd_transport.transfers.Puller`
did since it was last asked, as a plain mapping an engine can ship between processes
and hand to its own metrics (vLLM's KV connector stats: ``docs/vllm.md``, "Running a
fleet").

The mapping (a "stats payload") holds only strings, ints, floats and lists of floats,
so that it survives pickle, msgpack and JSON alike. Every series is keyed by its
labels joined with ``/``:

- ``transfers``: ``"side/path/outcome"`` -> count. ``side`` is ``send`` (a push's
  destination) or ``recv`` (a pull); ``path`` is ``wan`` or ``local``; ``outcome`` is
  ``ok`` (pages moved and confirmed), ``empty`` (a zero-page grant: the decoder held
  every block), ``failed`` or ``cancelled`` (the engine gave up on a pull).
- ``bytes``, ``pages``: ``"side/path"`` -> KV bytes / pages of the transfers that ended ``ok``.
- ``failures``: ``"side/path/code"`` -> count, ``code`` a stable snake_case word (the
  library's error reasons, or one of :data:`FAILURE_CODES`), never free text, so that
  a metric labelled by it stays small.
- ``transfer_seconds``: ``"side/path"`` -> observations: grant to confirmed (send),
  grant to landed (recv), of the transfers that ended ``ok``.
- ``grant_wait_seconds``: ``"side/path"`` -> observations: a push's start to its
  grant (send), a claim to its grant reaching the sender's session (recv: the retries
  while the prefill instance had not connected).
- ``late_grants_refused``: ``"path"`` -> grants that arrived after the prefill side
  had given up on their request, refused at once (the decoder is told).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "COUNTER_SERIES",
    "FAILURE_CODES",
    "OBSERVED_SERIES",
    "TransferStats",
    "empty",
    "is_empty",
    "merge",
    "summarize",
]

#: Series whose values are counts, summed when payloads merge.
COUNTER_SERIES = ("transfers", "bytes", "pages", "failures", "late_grants_refused")
#: Series whose values are lists of observations (seconds), concatenated when payloads merge.
OBSERVED_SERIES = ("transfer_seconds", "grant_wait_seconds")

#: Failure codes the transfers give besides the native error reasons.
FAILURE_CODES = {
    "grant_timeout": "no grant within grant_timeout_s",
    "unreachable": "the destination's sender could not be made (connect failed)",
    "destination_not_allowed": "the destination is not on the prefill side's allow list",
    "deadline_exceeded": "pages not computed, or not confirmed, within deadline_s of the grant",
    "request_ended": "the engine finished the request before every granted page was computed",
    "grant_shape": "the grant's layers or page size do not fit the source pool",
    "aborted": "the engine aborted the request (or closed the prefill side)",
    "declined": "the prefill side declined the request (Push.decline): the decoder was told why",
    "unspecified": "the transport gave no reason",
}


def empty() -> dict[str, dict[str, Any]]:
    """A payload with no figure in it."""
    return {name: {} for name in (*COUNTER_SERIES, *OBSERVED_SERIES)}


class TransferStats:
    """An accumulator of one transfer side's figures since :meth:`take` was last
    called (one per :class:`~pdd_transport.transfers.Pusher` or
    :class:`~pdd_transport.transfers.Puller`; not thread-safe, as they are not)."""

    def __init__(self) -> None:
        self._data = empty()

    def ended(self, side: str, path: str, outcome: str, *, nbytes: int = 0, pages: int = 0,
              seconds: float | None = None, grant_wait_s: float | None = None, code: str | None = None) -> None:
        """Count one transfer that ended with ``outcome``; ``code`` names why a failed
        one failed; ``seconds`` and the byte and page counts are kept for ``ok`` ones."""
        self._add("transfers", f"{side}/{path}/{outcome}", 1)
        if outcome == "ok":
            self._add("bytes", f"{side}/{path}", int(nbytes))
            self._add("pages", f"{side}/{path}", int(pages))
            if seconds is not None:
                self._observe("transfer_seconds", f"{side}/{path}", seconds)
        elif outcome == "failed":
            self._add("failures", f"{side}/{path}/{code or 'unspecified'}", 1)
        if grant_wait_s is not None:
            self._observe("grant_wait_seconds", f"{side}/{path}", grant_wait_s)

    def late_grant_refused(self, path: str) -> None:
        """Count a grant refused because its request was already given up."""
        self._add("late_grants_refused", path, 1)

    def take(self) -> dict[str, dict[str, Any]]:
        """The figures gathered since the last call (a payload, see the module), and start
        afresh."""
        data, self._data = self._data, empty()
        return data

    def peek(self) -> dict[str, dict[str, Any]]:
        """The figures gathered so far, without resetting (a copy)."""
        return merge(empty(), self._data)

    def _add(self, series: str, key: str, n: int) -> None:
        table = self._data[series]
        table[key] = table.get(key, 0) + n

    def _observe(self, series: str, key: str, value: float) -> None:
        if math.isfinite(value) and value >= 0:
            self._data[series].setdefault(key, []).append(float(value))


def merge(into: dict[str, dict[str, Any]], other: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Add ``other``'s figures to ``into`` (counts summed, observations concatenated) and
    return ``into``. A series or a key only one of them has is kept as it is; a series
    neither kind knows is ignored (a newer peer's payload still merges)."""
    for series in COUNTER_SERIES:
        table = into.setdefault(series, {})
        for key, n in (other.get(series) or {}).items():
            table[key] = table.get(key, 0) + n
    for series in OBSERVED_SERIES:
        table = into.setdefault(series, {})
        for key, values in (other.get(series) or {}).items():
            table.setdefault(key, []).extend(float(v) for v in values)
    return into


def is_empty(data: Mapping[str, Mapping[str, Any]] | None) -> bool:
    """Whether a payload holds no figure at all."""
    return not data or not any(data.get(series) for series in (*COUNTER_SERIES, *OBSERVED_SERIES))


def _mean(values: Iterable[float]) -> float:
    listed = list(values)
    return sum(listed) / len(listed) if listed else 0.0


def summarize(data: Mapping[str, Mapping[str, Any]]) -> dict[str, int | float]:
    """One flat line of figures for a log: per ``side/path``, the transfers by outcome,
    bytes, and the mean and maximum transfer and grant-wait times (seconds, rounded to
    the microsecond); failures by code; late grants refused."""
    out: dict[str, int | float] = {}
    for series in ("transfers", "bytes", "failures", "late_grants_refused"):
        for key, n in sorted((data.get(series) or {}).items()):
            out[f"{series}:{key}"] = n
    for series in OBSERVED_SERIES:
        for key, values in sorted((data.get(series) or {}).items()):
            if values:
                out[f"{series}_mean:{key}"] = round(_mean(values), 6)
                out[f"{series}_max:{key}"] = round(max(values), 6)
    return out
