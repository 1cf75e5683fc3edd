//! Endpoint counters: cheap atomics on the data path, read as a snapshot for Python
//! dicts and Prometheus text.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($( $(#[$doc:meta])* $name:ident : $kind:literal, $help:literal; )*) => {
        /// Counters and gauges of one endpoint.
        #[derive(Debug, Default)]
        pub struct Metrics {
            $( $(#[$doc])* pub $name: AtomicU64, )*
        }

        impl Metrics {
            /// `(name, value, kind, help)` for every metric, in a fixed order.
            pub fn snapshot(&self) -> Vec<(&'static str, u64, &'static str, &'static str)> {
                vec![$( (stringify!($name), self.$name.load(Ordering::Relaxed), $kind, $help), )*]
            }
        }
    };
}

counters! {
    /// Page bytes sent in KV_PAGES.
    bytes_sent_total: "counter", "KV page bytes sent";
    /// Page bytes landed and verified.
    bytes_received_total: "counter", "KV page bytes received and verified";
    /// KV_PAGES frames sent.
    blocks_sent_total: "counter", "KV_PAGES frames sent";
    /// KV_PAGES frames landed and verified.
    blocks_received_total: "counter", "KV_PAGES frames received and verified";
    /// Transfers completed.
    transfers_completed_total: "counter", "transfers completed";
    /// Transfers failed.
    transfers_failed_total: "counter", "transfers failed";
    /// Blocks whose CRC32C did not match (their transfer failed; never accepted).
    checksum_failures_total: "counter", "KV blocks refused for a CRC32C mismatch";
    /// Blocks of ended transfers read and discarded.
    blocks_drained_total: "counter", "late KV blocks of ended transfers, discarded";
    /// Sessions (re)connected by a sender after the first.
    reconnects_total: "counter", "sessions re-established after a loss";
    /// Sessions lost (peer dead, reset, protocol error).
    sessions_lost_total: "counter", "sessions lost";
    /// Connections refused before admission (version, authentication, role, no
    /// session to join).
    lanes_refused_total: "counter", "connections refused at HELLO or AUTH";
    /// Protocol violations that ended a peer's session (a block or KV_DONE for a
    /// transfer that session was not granted included).
    violations_total: "counter", "sessions ended for a protocol or grant violation";
    /// PINGs sent.
    pings_sent_total: "counter", "heartbeat PINGs sent";
    /// Latest PING/PONG round trip, microseconds.
    rtt_us: "gauge", "last heartbeat round trip in microseconds";
    /// Kernel smoothed RTT of the control lane (TCP_INFO), microseconds.
    tcp_rtt_us: "gauge", "kernel smoothed RTT of the control lane in microseconds";
    /// Kernel-counted retransmissions over all lanes of the current session.
    tcp_retransmits: "gauge", "TCP segments retransmitted on the session's lanes";
    /// Goodput of the last completed transfer, bytes per second.
    last_goodput_bytes_per_s: "gauge", "page bytes per second of the last completed transfer";
    /// PREFIX_QUERY frames answered (receiver) or sent (sender).
    prefix_queries_total: "counter", "prefix queries answered or sent";
    /// PREFIX_REPLY hashes that disagreed with our own tokens (reply not trusted).
    prefix_mismatches_total: "counter", "prefix replies whose hash disagreed with our tokens";
    /// Prefix leases currently pinning a match.
    prefix_leases: "gauge", "prefix leases pinning a match";
    /// Sessions currently connected.
    sessions: "gauge", "sessions connected";
    /// Transfers in progress.
    transfers_in_flight: "gauge", "transfers in progress";
    /// Receiver pool pages held by live grants, or by ended ones whose last blocks
    /// are still landing; back to 0 when nothing is in flight (a leak shows here).
    pool_pages_held: "gauge", "receiver pool pages held by live or draining grants";
}

impl Metrics {
    /// Add to a counter.
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Set a gauge.
    pub fn set(c: &AtomicU64, v: u64) {
        c.store(v, Ordering::Relaxed);
    }

    /// Prometheus text exposition, every metric prefixed `pdd_transport_` and labelled
    /// with `endpoint`.
    pub fn prometheus(&self, endpoint: &str) -> String {
        prometheus_text("pdd_transport_", endpoint, self.snapshot())
    }
}

/// Prometheus text exposition of `(name, value, kind, help)` metrics, each named
/// `{prefix}{name}` and labelled with `endpoint` (escaped).
pub fn prometheus_text(
    prefix: &str,
    endpoint: &str,
    metrics: impl IntoIterator<Item = (&'static str, u64, &'static str, &'static str)>,
) -> String {
    let mut out = String::new();
    let label = endpoint.replace('\\', "\\\\").replace('"', "\\\"");
    for (name, value, kind, help) in metrics {
        let _ = writeln!(out, "# HELP {prefix}{name} {help}");
        let _ = writeln!(out, "# TYPE {prefix}{name} {kind}");
        let _ = writeln!(out, "{prefix}{name}{{endpoint=\"{label}\"}} {value}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_is_well_formed() {
        let m = Metrics::default();
        Metrics::add(&m.bytes_sent_total, 42);
        let text = m.prometheus("rx\"1");
        assert!(text.contains("pdd_transport_bytes_sent_total{endpoint=\"rx\\\"1\"} 42\n"));
        assert!(text.contains("# TYPE pdd_transport_rtt_us gauge\n"));
        assert_eq!(text.lines().count(), 3 * m.snapshot().len());
    }
}
