"""Metrics engines can scrape: the prometheus_client collector over the Rust counters,
and the latency histograms (KV transfer seconds, handoff round trip)."""

from __future__ import annotations

import time

import numpy as np
from pdd_transport import HandoffFinished, HandoffTimers, MainLink, RelayLink, kv
from pdd_transport.metrics import PddCollector
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

LAYERS, PAGES, PAGE = 2, 8, 256


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_kv_endpoints_scrape_through_one_registry_with_transfer_histograms() -> None:
    rx_mem = np.zeros((LAYERS, PAGES, PAGE), np.uint8)
    tx_mem = np.ones((LAYERS, PAGES, PAGE), np.uint8)
    rx = kv.KvReceiver(kv.pool_from_buffers(rx_mem, PAGE, num_layers=LAYERS))
    tx = kv.KvSender(kv.pool_from_buffers(tx_mem, PAGE, num_layers=LAYERS), "%s:%d" % rx.address)
    try:
        rx.wait_peer(timeout=10)
        for i in range(3):
            inbound = rx.grant(f"r{i}", [i])
            out = tx.wait_grant(f"r{i}", timeout=10)
            out.send_pages([0], [i])
            out.finish()
            inbound.wait(timeout=10)
            out.wait(timeout=10)
        registry = CollectorRegistry()
        collector = PddCollector({"md_kv": rx})
        collector.add("p_kv", tx)
        registry.register(collector)
        got = samples(generate_latest(registry).decode())
        md, p = (("endpoint", "md_kv"),), (("endpoint", "p_kv"),)
        assert got[("pdd_transport_transfers_completed_total", md)] == 3
        assert got[("pdd_transport_transfers_completed_total", p)] == 3
        assert got[("pdd_transport_bytes_received_total", md)] == 3 * LAYERS * PAGE
        for ep in (md, p):
            assert got[("pdd_transport_transfer_seconds_count", ep)] == 3
            assert got[("pdd_transport_transfer_seconds_bucket", ep + (("le", "+Inf"),))] == 3
            assert 0 < got[("pdd_transport_transfer_seconds_sum", ep)] < 30
        # Buckets are cumulative.
        bounds = sorted(
            (float(dict(labels)["le"]), v)
            for (name, labels), v in got.items()
            if name == "pdd_transport_transfer_seconds_bucket" and dict(labels)["endpoint"] == "md_kv"
        )
        assert [v for _, v in bounds] == sorted(v for _, v in bounds)
        # A removed endpoint is no longer scraped.
        collector.remove("p_kv")
        assert ("pdd_transport_transfers_completed_total", p) not in samples(generate_latest(registry).decode())
    finally:
        tx.close()
        rx.close()


def test_handoff_round_trips_are_recorded_on_the_relay_side() -> None:
    timers = HandoffTimers(rto_initial=0.05, rto_max=0.4, give_up_after=5.0, kv_wait_timeout=10.0, linger=5.0)
    main = MainLink.listen("127.0.0.1:0", timers=timers)
    relay = RelayLink.connect(main.address, timers=timers)
    try:
        main.wait_connected(5.0)
        relay.open(1, 100)
        for t in (5, 6, 7):
            relay.offer(1, t)
        main.open(1, 100)
        main.report_progress(1, 100, True)
        # The final handoff leaves on MD's PROGRESS; RLD learns the final ack.
        deadline = time.monotonic() + 10
        finished = False
        while not finished and time.monotonic() < deadline:
            finished = any(isinstance(e, HandoffFinished) for e in relay.poll_events())
            main.poll_events()
            time.sleep(0.01)
        assert finished
        got = samples(relay.prometheus("rld"))
        ep = (("endpoint", "rld"),)
        sent = got[("pdd_transport_handoff_round_trip_seconds_count", ep)]
        assert sent >= 1
        assert got[("pdd_transport_handoff_round_trip_seconds_bucket", ep + (("le", "+Inf"),))] == sent
        # MD sends the acks and records no round trip of its own.
        assert samples(main.prometheus("md"))[("pdd_transport_handoff_round_trip_seconds_count", (("endpoint", "md"),))] == 0
    finally:
        relay.close()
        main.close()
