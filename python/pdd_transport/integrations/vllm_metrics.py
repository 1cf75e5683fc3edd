"""``PddConnector``'s transfer statistics through vLLM's KV connector stats interface,
so they appear on each engine's ``/metrics`` next to vLLM's own (docs/vllm.md,
"Running a fleet").

vLLM's path, as of 0.32: each worker's connector returns what happened since the last
step (``get_kv_connector_stats``); the engine core sums the workers' objects
(``aggregate``) and ships ``to_dict()`` to the API server process, which rebuilds the
object with the connector class's ``build_kv_connector_stats`` for its periodic log
line (``reduce``) and hands the dict to the object ``build_prom_metrics`` made, whose
``observe`` feeds ``prometheus_client`` counters and histograms served on ``/metrics``.
The dict is the library's payload (:mod:`pdd_transport.transfer_stats`): counts and
lists of seconds under string keys, so it crosses the processes unchanged.

This module imports vLLM (and, through it, ``prometheus_client``); ``import
pdd_transport`` never does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from pdd_transport import transfer_stats

__all__ = ["METRICS", "PddKVConnectorStats", "PddPromMetrics", "PddStatsMixin"]

#: Bucket bounds (seconds) of both histograms: a loopback transfer of a few blocks
#: takes under a millisecond, a 100K-token miss over a WAN line tens of seconds.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: Payload series -> (Prometheus name, kind, the labels its keys carry, help).
METRICS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    "transfers": ("vllm:pdd_kv_transfers", "counter", ("side", "path", "outcome"),
                  "KV transfers ended, by side (send: P's push to one decoder; recv: D's load), path "
                  "(wan, local) and outcome (ok, empty: nothing to send, failed, cancelled)"),
    "bytes": ("vllm:pdd_kv_bytes", "counter", ("side", "path"),
              "KV bytes of the transfers that ended ok (send: confirmed by the decoder; recv: landed, verified)"),
    "pages": ("vllm:pdd_kv_pages", "counter", ("side", "path"),
              "KV pages (one block of one layer) of the transfers that ended ok"),
    "failures": ("vllm:pdd_kv_failures", "counter", ("side", "path", "code"),
                 "KV transfers failed, by a stable code (grant_timeout, destination_not_allowed, "
                 "connection_lost, peer_aborted, deadline_exceeded, ...)"),
    "late_grants_refused": ("vllm:pdd_kv_late_grants_refused", "counter", ("path",),
                            "grants that reached P after it gave up on their request, aborted at once"),
    "transfer_seconds": ("vllm:pdd_kv_transfer_seconds", "histogram", ("side", "path"),
                         "grant to confirmed (send) or landed (recv), transfers that ended ok"),
    "grant_wait_seconds": ("vllm:pdd_kv_grant_wait_seconds", "histogram", ("side", "path"),
                           "send: P's push started to its grant arriving; recv: D's claim to its grant "
                           "reaching P's session"),
}


@dataclass
class PddKVConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """``data`` is a :mod:`pdd_transport.transfer_stats` payload."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = transfer_stats.empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        # Workers of one step, or steps of one logging interval: counts add up and
        # observations are pooled either way.
        transfer_stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return transfer_stats.summarize(self.data)

    def is_empty(self) -> bool:
        return transfer_stats.is_empty(self.data)


class PddPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The series of :data:`METRICS`, each labelled with vLLM's own labels (model name,
    engine index) and then the payload key's labels."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        for series, (name, kind, labels, doc) in METRICS.items():
            if kind == "counter":
                self._metrics[series] = self._counter_cls(name=name, documentation=doc,
                                                          labelnames=[*labelnames, *labels])
            else:
                self._metrics[series] = self._histogram_cls(name=name, documentation=doc, buckets=list(_BUCKETS),
                                                            labelnames=[*labelnames, *labels])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine_labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for series, values in transfer_stats_data.items():
            metric, spec = self._metrics.get(series), METRICS.get(series)
            if metric is None or spec is None or not values:
                continue  # a series this build does not know (a newer worker's)
            for key, value in values.items():
                parts = str(key).split("/")
                if len(parts) != len(spec[2]):
                    continue
                child = metric.labels(*engine_labels, *parts)
                if spec[1] == "counter":
                    if value:
                        child.inc(value)
                else:
                    for seconds in value:
                        child.observe(seconds)


class PddStatsMixin:
    """vLLM's stats hooks for ``PddConnector``: the worker's connector reports its
    :class:`~pdd_transport.transfers.Pusher`'s and
    :class:`~pdd_transport.transfers.Puller`'s figures since the last step; the
    scheduler's has none (its attributes are absent: None)."""

    def get_kv_connector_stats(self) -> PddKVConnectorStats | None:
        payload = transfer_stats.empty()
        for end in (getattr(self, "_pusher", None), getattr(self, "_puller", None)):
            if end is not None:
                transfer_stats.merge(payload, end.take_stats())
        return None if transfer_stats.is_empty(payload) else PddKVConnectorStats(data=payload)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PddKVConnectorStats:
        # A copy: aggregate() adds into its own tables, and vLLM hands the same dict to
        # the Prometheus side too.
        return PddKVConnectorStats(data=transfer_stats.merge(transfer_stats.empty(), data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PddPromMetrics:
        return PddPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
