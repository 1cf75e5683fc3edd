//! Endpoint counters: cheap atomics on the data path, read as a snapshot for Python
//! dicts and Prometheus text.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

macro_rules! counters {
    ($( $(#[$doc:meta])* $name:ident : $kind:literal, $help:literal; )*) => {
        /// Counters and gauges of one endpoint, and its transfer-time histogram.
        #[derive(Debug, Default)]
        pub struct Metrics {
            $( $(#[$doc])* pub $name: AtomicU64, )*
            /// Seconds from grant to the receiver's confirmation, per completed
            /// transfer (receiver: grant to last page verified; sender: grant
            /// received to KV_DONE confirmed).
            pub transfer_seconds: Histogram,
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
    /// Blocks whose CRC32C did not match, or whose sealed record failed its AEAD
    /// check (their transfer failed; never accepted).
    checksum_failures_total: "counter", "KV blocks refused for a CRC32C or AEAD mismatch";
    /// Data lanes that left TLS's record layer for sealed records (capability
    /// `sealed_lanes`): their KV is decrypted inside the pages.
    lanes_sealed_total: "counter", "TLS data lanes switched to sealed page-aligned records";
    /// Local sender: page bytes copied straight into a receiver's shared pool
    /// (one copy; the rest of `bytes_sent_total` went by UCX puts).
    local_direct_bytes_total: "counter", "local path: page bytes copied straight into the receiver's mapped pool";
    /// Blocks of ended transfers read and discarded.
    blocks_drained_total: "counter", "late KV blocks of ended transfers, discarded";
    /// Sender: data lanes given up for a stall and revoked (their blocks moved to
    /// the other lanes; capability `lane_failover`).
    lanes_revoked_total: "counter", "data lanes revoked after a stall, their blocks moved";
    /// Sender: blocks queued again, flagged RESENT, after their lane was revoked or
    /// their session resumed (only those whose pages had not all landed).
    blocks_resent_total: "counter", "KV blocks sent again after a lane revocation or a resume";
    /// Receiver: RESENT blocks whose pages had all landed already, discarded.
    blocks_duplicate_total: "counter", "resent KV blocks that had landed already, discarded";
    /// Receiver: blocks being read from a lane when it was revoked; their pages went
    /// back to pending for the resend.
    blocks_abandoned_total: "counter", "KV blocks cut off by a lane revocation, pages reopened";
    /// Sessions (re)connected by a sender after the first.
    reconnects_total: "counter", "sessions re-established after a loss";
    /// Sessions lost (peer dead, reset, protocol error).
    sessions_lost_total: "counter", "sessions lost";
    /// Receiver: sessions whose connections dropped and whose transfers were kept
    /// for a resume (capability `kv_resume`). Sender: losses it set out to resume.
    sessions_suspended_total: "counter", "sessions whose connections dropped, kept for a resume";
    /// Sessions resumed after a loss, their transfers taken over (`kv_resume`).
    sessions_resumed_total: "counter", "sessions resumed after a loss";
    /// Transfers that went on after a resume from the pages that had landed.
    transfers_resumed_total: "counter", "transfers resumed from what had landed";
    /// Sender: resumes given up because nothing listened at the receiver's address
    /// (the connect was refused): the suspended transfers failed at once.
    resumes_refused_total: "counter", "resumes given up at once: the receiver's address refused the connection";
    /// Sender: page bytes the receiver said it held at a resume (not sent again).
    resume_held_bytes_total: "counter", "page bytes held by the receiver at a resume, not sent again";
    /// Connections refused before admission (version, authentication, role, no
    /// session to join).
    lanes_refused_total: "counter", "connections refused at HELLO or AUTH";
    /// Opening connections (TLS, HELLO, AUTH not finished) closed unanswered to make
    /// room for a newer one (`pdd_io::admission`): a flood of idle connections shows
    /// here.
    half_open_evicted_total: "counter", "opening connections closed to make room for newer ones";
    /// Protocol violations that ended a peer's session (a block or KV_DONE for a
    /// transfer that session was not granted included).
    violations_total: "counter", "sessions ended for a protocol or grant violation";
    /// Sender: blocks sent as KV_PAGES_Z (capability `kv_compress`).
    blocks_compressed_total: "counter", "KV blocks sent compressed (KV_PAGES_Z)";
    /// Sender: page bytes of the blocks sent compressed (before).
    compress_in_bytes_total: "counter", "page bytes of KV blocks sent compressed";
    /// Sender: what those pages took on the wire (after; pages that did not shrink
    /// count as they are).
    compress_out_bytes_total: "counter", "stored bytes of the KV blocks sent compressed";
    /// Codec time, nanoseconds: the sender's encoding (probes included), the
    /// receiver's decoding.
    codec_ns_total: "counter", "KV codec time in nanoseconds (encode on senders, decode on receivers)";
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
    /// Connections still opening (TLS, HELLO, AUTH), at most
    /// `pdd_io::admission::MAX_OPENING_CONNECTIONS`.
    half_open: "gauge", "connections in their opening handshake";
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
        let mut out = prometheus_text("pdd_transport_", endpoint, self.snapshot());
        self.transfer_seconds.prometheus_into(
            &mut out,
            "pdd_transport_transfer_seconds",
            "seconds from grant to confirmed completion, per transfer",
            endpoint,
        );
        out
    }
}

/// Upper bounds (seconds) of the latency histograms' buckets: 0.5 ms to 10 s, about
/// 2.5x apart, wide enough for a loopback transfer and a WAN one alike.
pub const SECONDS_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A latency histogram with fixed buckets ([`SECONDS_BUCKETS`]): one atomic add per
/// bucket hit, so it can sit on the data path.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Observations per bucket (not cumulative); the last one is +Inf.
    buckets: [AtomicU64; SECONDS_BUCKETS.len() + 1],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Record one observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = SECONDS_BUCKETS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(SECONDS_BUCKETS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The current figures.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut cumulative = 0;
        let mut out = Vec::with_capacity(self.buckets.len());
        for (i, b) in self.buckets.iter().enumerate() {
            cumulative += b.load(Ordering::Relaxed);
            let bound = SECONDS_BUCKETS.get(i).copied().unwrap_or(f64::INFINITY);
            out.push((bound, cumulative));
        }
        HistogramSnapshot {
            buckets: out,
            count: self.count.load(Ordering::Relaxed),
            sum_seconds: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }

    /// Append this histogram as Prometheus text, named `name`, labelled `endpoint`.
    pub fn prometheus_into(&self, out: &mut String, name: &str, help: &str, endpoint: &str) {
        self.snapshot().prometheus_into(out, name, help, endpoint);
    }
}

/// A histogram's figures at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// `(upper bound in seconds, observations <= it)`, cumulative; the last bound is
    /// `f64::INFINITY`.
    pub buckets: Vec<(f64, u64)>,
    /// Observations.
    pub count: u64,
    /// Their sum, in seconds.
    pub sum_seconds: f64,
}

impl HistogramSnapshot {
    /// Append as Prometheus text, named `name`, labelled `endpoint`.
    pub fn prometheus_into(&self, out: &mut String, name: &str, help: &str, endpoint: &str) {
        let label = endpoint.replace('\\', "\\\\").replace('"', "\\\"");
        let (buckets, count, sum) = (&self.buckets, self.count, self.sum_seconds);
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        for &(bound, n) in buckets {
            let le = if bound.is_infinite() {
                "+Inf".to_string()
            } else {
                format!("{bound}")
            };
            let _ = writeln!(out, "{name}_bucket{{endpoint=\"{label}\",le=\"{le}\"}} {n}");
        }
        let _ = writeln!(out, "{name}_sum{{endpoint=\"{label}\"}} {sum}");
        let _ = writeln!(out, "{name}_count{{endpoint=\"{label}\"}} {count}");
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
        let histogram_lines = 2 + SECONDS_BUCKETS.len() + 1 + 2;
        assert_eq!(
            text.lines().count(),
            3 * m.snapshot().len() + histogram_lines
        );
    }

    #[test]
    fn histogram_buckets_are_cumulative_with_sum_and_count() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(300)); // <= 0.5 ms
        h.observe(Duration::from_millis(30)); // <= 50 ms
        h.observe(Duration::from_secs(60)); // +Inf
        let HistogramSnapshot {
            buckets,
            count,
            sum_seconds: sum,
        } = h.snapshot();
        assert_eq!(count, 3);
        assert!((sum - 60.0303).abs() < 1e-9);
        assert_eq!(buckets[0], (0.0005, 1));
        assert_eq!(buckets[6], (0.05, 2));
        assert_eq!(buckets[13], (10.0, 2));
        assert_eq!(buckets[14].1, 3);
        let mut text = String::new();
        h.prometheus_into(&mut text, "x_seconds", "help", "e");
        assert!(text.contains("x_seconds_bucket{endpoint=\"e\",le=\"0.05\"} 2\n"));
        assert!(text.contains("x_seconds_bucket{endpoint=\"e\",le=\"+Inf\"} 3\n"));
        assert!(text.contains("x_seconds_count{endpoint=\"e\"} 3\n"));
    }
}
