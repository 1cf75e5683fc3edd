//! Transfer resume (capability `kv_resume`) through the user-space WAN emulator: a
//! session whose connections are all reset mid-transfer goes on after the sender
//! reconnects, from what had landed; every byte arrives right; only what was in
//! flight crosses again. Without resume, or past the window, the transfer fails on
//! both ends and the receiver's pages are freed.

#[path = "common/bounds.rs"]
mod bounds;
mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, Role};
use pdd_io::pool::PagePool;
use pdd_io::receiver::{InboundTransfer, KvReceiver, ReceiverConfig};
use pdd_io::sender::{KvSender, OutboundTransfer, SenderConfig};
use pdd_io::wanem::{Direction, LinkProfile, Wanem, WanemConfig, WanemHandle};

const LAYERS: u16 = 4;
const PAGES: u32 = 64;
const PAGE: u32 = 64 << 10;
/// 16 MiB at 100 Mbit/s: about 1.3 s on the line.
const RATE_BPS: u64 = 100_000_000;
const BOUND: Duration = Duration::from_secs(30);

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("bounded wait ran out")
}

struct Setup {
    src: Arc<PagePool>,
    dst: Arc<PagePool>,
    rx: KvReceiver,
    wan: WanemHandle,
    tx: KvSender,
}

async fn setup(rx_window: Option<Duration>, tx_window: Option<Duration>) -> Setup {
    let src = common::pattern_pool(LAYERS, PAGES, PAGE, 11, 1);
    let dst = common::zero_pool(LAYERS, PAGES, PAGE);
    let mut rcfg = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        LocalHello::new(Role::MainDecode, capability::KV_STREAM),
    );
    rcfg.heartbeat = Duration::from_millis(200);
    rcfg.dead_after = Duration::from_secs(2);
    rcfg.resume_window = rx_window;
    let rx = KvReceiver::start(dst.clone(), rcfg).await.unwrap();
    let line = LinkProfile {
        rate_bps: Some(RATE_BPS),
        ..LinkProfile::with_delay(Duration::from_millis(5))
    };
    let wan = Wanem::start(
        WanemConfig::new("127.0.0.1:0".parse().unwrap(), rx.local_addr()).symmetric(line),
    )
    .await
    .unwrap();
    let mut cfg = SenderConfig::new(
        wan.local_addr(),
        77,
        LocalHello::new(Role::Prefill, capability::KV_STREAM),
    );
    cfg.lanes = 2;
    cfg.max_block_bytes = 2 * PAGE;
    cfg.heartbeat = Duration::from_millis(200);
    cfg.dead_after = Duration::from_secs(2);
    cfg.resume_window = tx_window;
    // The bytes on the wire are the subject: no compression (pattern pages shrink).
    cfg.compress = pdd_io::compress::CompressMode::Off;
    let tx = KvSender::connect(src.clone(), cfg).await.unwrap();
    bounded(rx.wait_peer(None)).await;
    Setup {
        src,
        dst,
        rx,
        wan,
        tx,
    }
}

/// Send every page of every layer, layer by layer, then KV_DONE.
async fn send_all(out: &OutboundTransfer) -> Result<(), pdd_core::Error> {
    let pages: Vec<u32> = (0..PAGES).collect();
    for layer in 0..LAYERS {
        out.send_layer(layer, layer, &pages).await?;
    }
    out.finish().await
}

/// Grant every page as transfer 1, send them all, and run `cut` once a quarter of
/// the payload landed; returns both ends of the transfer.
async fn send_and_cut_at_a_quarter<F: std::future::Future<Output = ()>>(
    s: &Setup,
    cut: impl FnOnce() -> F,
) -> (InboundTransfer, OutboundTransfer) {
    let pages: Vec<u32> = (0..PAGES).collect();
    let inbound = s.rx.grant(1, &pages, None, Some(77), None).unwrap();
    let out = bounded(s.tx.wait_grant(1)).await.unwrap();
    let sending = async {
        let _ = send_all(&out).await;
    };
    let cutting = async {
        until_received(&s.rx, payload() / 4).await;
        cut().await;
    };
    bounded(async { tokio::join!(sending, cutting) }).await;
    (inbound, out)
}

fn payload() -> u64 {
    u64::from(LAYERS) * u64::from(PAGES) * u64::from(PAGE)
}

fn same_bytes(a: &PagePool, b: &PagePool) -> bool {
    (0..LAYERS)
        .all(|l| (0..PAGES).all(|p| a.copy_page(l, p).unwrap() == b.copy_page(l, p).unwrap()))
}

/// Wait until the receiver has `bytes` of page data verified (the transfer is
/// under way), within the bound.
async fn until_received(rx: &KvReceiver, bytes: u64) {
    bounded(bounds::until(|| {
        rx.metrics().bytes_received_total.load(Ordering::Relaxed) >= bytes
    }))
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_mid_transfer_resumes_and_every_byte_lands_once() {
    let s = setup(Some(Duration::from_secs(10)), Some(Duration::from_secs(10))).await;
    let pages: Vec<u32> = (0..PAGES).collect();
    let inbound = s.rx.grant(1, &pages, None, Some(77), None).unwrap();
    let out = bounded(s.tx.wait_grant(1)).await.unwrap();
    let sending = async {
        send_all(&out).await.unwrap();
    };
    let cut = async {
        until_received(&s.rx, payload() * 2 / 5).await;
        s.wan.reset_all();
    };
    bounded(async { tokio::join!(sending, cut) }).await;
    let got = bounded(inbound.wait())
        .await
        .expect("completes after the resume");
    assert_eq!(got, payload());
    assert_eq!(bounded(out.wait()).await.unwrap(), payload());
    assert!(same_bytes(&s.src, &s.dst), "a page landed wrong");

    let (rm, tm) = (s.rx.metrics(), s.tx.metrics());
    assert_eq!(rm.sessions_resumed_total.load(Ordering::Relaxed), 1);
    assert_eq!(rm.transfers_resumed_total.load(Ordering::Relaxed), 1);
    assert_eq!(tm.transfers_resumed_total.load(Ordering::Relaxed), 1);
    let held = tm.resume_held_bytes_total.load(Ordering::Relaxed);
    assert!(held >= payload() * 2 / 5, "held {held}");
    // What crossed again is what was in flight or queued at the reset, never a page
    // that had landed: the page bytes sent are at most the payload plus the lanes'
    // pipes (socket buffers and queues), far from twice.
    let sent = tm.bytes_sent_total.load(Ordering::Relaxed);
    let wire = s
        .wan
        .stats()
        .link(Direction::ClientToUpstream)
        .bytes_received;
    assert!(
        (sent as f64) < payload() as f64 * 1.3,
        "{sent} page bytes sent for {} (held {held})",
        payload()
    );
    assert!(wire >= payload(), "{wire} bytes on the line");
    // Everything is freed on both ends.
    assert_eq!(rm.pool_pages_held.load(Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_resume_on_either_side_the_reset_fails_the_transfer() {
    for (rx_window, tx_window) in [
        (None, Some(Duration::from_secs(10))),
        (Some(Duration::from_secs(10)), None),
    ] {
        let s = setup(rx_window, tx_window).await;
        let (inbound, out) = send_and_cut_at_a_quarter(&s, || async { s.wan.reset_all() }).await;
        let e = bounded(inbound.wait()).await.unwrap_err();
        assert_eq!(e.reason(), "connection_lost", "{e}");
        assert!(bounded(out.wait()).await.is_err());
        assert_eq!(
            s.rx.metrics()
                .sessions_resumed_total
                .load(Ordering::Relaxed),
            0
        );
    }
}

/// Nothing listens at the receiver's address any more (its process is gone): the
/// sender's first reconnect is refused, and the suspended transfer fails then, not
/// at the end of a 30 s window (a line that is down hangs the connect instead: the
/// next test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_reconnect_fails_the_suspended_transfer_at_once() {
    let window = Duration::from_secs(30);
    let s = setup(Some(window), Some(window)).await;
    let (_inbound, out) = send_and_cut_at_a_quarter(&s, || async {
        s.wan.reset_all();
        s.wan.shutdown().await.unwrap();
    })
    .await;
    let cut_at = std::time::Instant::now();
    let e = tokio::time::timeout(Duration::from_secs(8), out.wait())
        .await
        .expect("the transfer waited on after a refused reconnect")
        .unwrap_err();
    assert_eq!(e.reason(), "connection_lost", "{e}");
    assert!(e.to_string().contains("refused the connection"), "{e}");
    // The first reconnect comes 100 ms after the loss and is refused at once: far
    // inside the 30 s window, not at its end.
    assert!(
        cut_at.elapsed() < Duration::from_secs(5),
        "{:?}",
        cut_at.elapsed()
    );
    let m = s.tx.metrics();
    assert_eq!(m.resumes_refused_total.load(Ordering::Relaxed), 1);
    assert_eq!(m.sessions_suspended_total.load(Ordering::Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_not_resumed_within_the_window_fails_on_both_ends() {
    let window = Duration::from_millis(800);
    let s = setup(Some(window), Some(window)).await;
    let (inbound, out) = send_and_cut_at_a_quarter(&s, || async {
        // Nothing gets through any more: every reconnect hangs in the emulator.
        s.wan.blackhole(true);
        s.wan.reset_all();
    })
    .await;
    let e = bounded(inbound.wait()).await.unwrap_err();
    assert_eq!(e.reason(), "connection_lost", "{e}");
    assert!(e.to_string().contains("did not resume"), "{e}");
    let e = bounded(out.wait()).await.unwrap_err();
    assert!(e.to_string().contains("not resumed"), "{e}");
    // Its pages are the pool's again.
    bounded(bounds::until(|| {
        s.rx.metrics().pool_pages_held.load(Ordering::Relaxed) == 0
    }))
    .await;
}

/// One data lane reset mid-transfer (the control lane and the other lane stay up):
/// without a stall to revoke it for, the sender ends the connection after the
/// receiver's grace, suspends the transfer and resumes the session; it completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_data_lane_reset_mid_transfer_resumes_too() {
    let s = setup(Some(Duration::from_secs(10)), Some(Duration::from_secs(10))).await;
    let pages: Vec<u32> = (0..PAGES).collect();
    let inbound = s.rx.grant(1, &pages, None, Some(77), None).unwrap();
    let out = bounded(s.tx.wait_grant(1)).await.unwrap();
    let sending = async {
        send_all(&out).await.unwrap();
    };
    let cut = async {
        until_received(&s.rx, payload() / 3).await;
        // Connections in accept order: the control lane, then data lanes 1 and 2.
        let conns = s.wan.connections();
        assert_eq!(conns.len(), 3, "{conns:?}");
        assert!(s.wan.reset_connection(conns[2]));
    };
    bounded(async { tokio::join!(sending, cut) }).await;
    let got = bounded(inbound.wait())
        .await
        .expect("completes after the resume");
    assert_eq!(got, payload());
    assert_eq!(bounded(out.wait()).await.unwrap(), payload());
    assert!(same_bytes(&s.src, &s.dst), "a page landed wrong");
    assert_eq!(
        s.rx.metrics()
            .sessions_resumed_total
            .load(Ordering::Relaxed),
        1
    );
    assert_eq!(s.rx.metrics().pool_pages_held.load(Ordering::Relaxed), 0);
}
