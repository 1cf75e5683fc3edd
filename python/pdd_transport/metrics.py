"""Metrics for Prometheus: a ``prometheus_client`` collector over the endpoints'
Rust counters, gauges and latency histograms.

Every endpoint (``KvReceiver``, ``KvSender``, ``RelayLink``, ``MainLink``) renders
its own figures as Prometheus text with ``prometheus(endpoint)``: counters and gauges
(``pdd_transport_*``), the transfer-time histogram
``pdd_transport_transfer_seconds`` (KV endpoints: grant to confirmed completion) and
the handoff round-trip histogram ``pdd_transport_handoff_round_trip_seconds`` (links:
a HANDOFF's first send to the HANDOFF_ACK covering it). :class:`PddCollector` hands
those to a ``prometheus_client`` registry, so an engine that already serves
``/metrics`` with ``prometheus_client`` adds pdd_transport in one line::

    from prometheus_client import REGISTRY
    from pdd_transport.metrics import PddCollector

    REGISTRY.register(PddCollector({"md_kv": receiver, "md_handoff": main_link}))

``prometheus_client`` is an optional dependency (``pip install
pdd_transport[metrics]``); importing this module without it raises ``ImportError``
naming the extra. An engine that does not use ``prometheus_client`` can serve the
``prometheus()`` text itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Protocol

try:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "pdd_transport.metrics needs prometheus_client: pip install 'pdd_transport[metrics]'"
    ) from exc

__all__ = ["PddCollector", "PrometheusEndpoint"]


class PrometheusEndpoint(Protocol):
    """Anything with ``prometheus(endpoint) -> str`` (every pdd_transport endpoint)."""

    def prometheus(self, endpoint: str) -> str: ...


class PddCollector:
    """A ``prometheus_client`` collector over named endpoints.

    Each scrape asks every endpoint for its figures, labelled ``endpoint=<name>``,
    and merges the samples of one metric from several endpoints into one family (the
    exposition format allows each name once). Endpoints may be added and removed while
    a registry scrapes (``add`` / ``remove``)."""

    def __init__(self, endpoints: Mapping[str, PrometheusEndpoint] | None = None) -> None:
        self._lock = threading.Lock()
        self._endpoints: dict[str, PrometheusEndpoint] = dict(endpoints or {})

    def add(self, name: str, endpoint: PrometheusEndpoint) -> None:
        """Scrape ``endpoint`` too, labelled ``endpoint=name`` (replacing one so named)."""
        with self._lock:
            self._endpoints[name] = endpoint

    def remove(self, name: str) -> None:
        """Stop scraping the endpoint named ``name`` (no error if absent)."""
        with self._lock:
            self._endpoints.pop(name, None)

    def describe(self) -> list[Metric]:
        # Registering must not scrape the endpoints (they may be closing); with no
        # description, registries do not check names for collisions, which the
        # pdd_transport_ prefix avoids.
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            endpoints = list(self._endpoints.items())
        families: dict[str, Metric] = {}
        for name, endpoint in endpoints:
            for family in text_string_to_metric_families(endpoint.prometheus(name)):
                merged = families.setdefault(family.name, family)
                if merged is not family:
                    merged.samples.extend(family.samples)
        yield from families.values()
