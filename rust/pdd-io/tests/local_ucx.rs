//! The local (UCX) path end to end: a receiver here and a sender in a second
//! process restricted to shared memory / CMA (`UCX_TLS=sm,self`) or to TCP over
//! loopback (`UCX_TLS=tcp,self`), and the grant rules with both ends in this process
//! (UCX's worker is per process and reads `UCX_TLS` once, so this process leaves it
//! unset). Skipped, loudly, only where libucp cannot be loaded; CI installs it
//! (`scripts/test-all.sh`) and sets `PDD_REQUIRE_UCX=1`, which turns the skip into a
//! failure.

use std::sync::Arc;
use std::time::Duration;

use pdd_core::kv::TransferEvent;
use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, Frame, LocalDone, Role};
use pdd_core::Error;
use pdd_io::lane::{self, LaneKey, SocketTuning};
use pdd_io::local::receiver::{LocalReceiver, LocalReceiverConfig};
use pdd_io::local::sender::{LocalSender, LocalSenderConfig};
use pdd_io::local::shared::SharedAllocation;
use pdd_io::local::LocalStatus;
use pdd_io::pool::{MemoryRegion, PagePool};

#[path = "common/flood.rs"]
mod flood;
use flood::Flood;

/// Tests that set environment variables (PDD_UCX_LIBRARY) run one at a time.
static ENV: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const LAYERS: u16 = 3;
const PAGES: u32 = 32;
const PB: u32 = 4096;

fn ucx_here() -> bool {
    match pdd_io::local::ucx_available() {
        Ok(_) => true,
        Err(e) => {
            assert!(
                std::env::var("PDD_REQUIRE_UCX").is_err(),
                "PDD_REQUIRE_UCX is set but UCX is missing: {e}"
            );
            eprintln!("SKIPPED: {e}");
            false
        }
    }
}

fn pool(fill: impl Fn(u16, usize) -> u8) -> Arc<PagePool> {
    let layers = (0..LAYERS)
        .map(|l| MemoryRegion::from_vec((0..(PAGES * PB) as usize).map(|i| fill(l, i)).collect()))
        .collect();
    Arc::new(PagePool::new(layers, PB).unwrap())
}

/// A zeroed pool inside memory UCX allocated (`SharedAllocation`): granted without
/// registration, and a sender on this host copies into it directly.
fn shared_pool() -> Arc<PagePool> {
    let len = (PAGES * PB) as usize;
    let alloc = Arc::new(SharedAllocation::new(usize::from(LAYERS) * len).unwrap());
    let layers = (0..usize::from(LAYERS))
        .map(|l| {
            // SAFETY: layer l lies inside the allocation, which the region's owner
            // (a clone of the Arc) keeps mapped.
            unsafe {
                MemoryRegion::from_raw(alloc.as_ptr().add(l * len), len, Box::new(alloc.clone()))
            }
            .unwrap()
        })
        .collect();
    Arc::new(PagePool::new(layers, PB).unwrap())
}

fn source() -> Arc<PagePool> {
    pool(|l, i| (i / PB as usize * 7 + usize::from(l) * 31 + i % 251) as u8 | 1)
}

async fn pair() -> (LocalReceiver, LocalSender) {
    let rx = LocalReceiver::start(
        pool(|_, _| 0),
        LocalReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::RelayDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let tx = LocalSender::connect(
        source(),
        LocalSenderConfig::new(
            rx.local_addr(),
            42,
            LocalHello::new(Role::Prefill, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    (rx, tx)
}

const DEST: [u32; 9] = [5, 6, 7, 30, 2, 19, 20, 11, 0];
const SRC: [u32; 9] = [9, 10, 11, 3, 31, 1, 2, 25, 16];
const CHILD_ENV: &str = "PDD_TEST_LOCAL_CHILD_ADDR";
/// "1": the child sender must have copied every byte directly; "0": none.
const CHILD_DIRECT_ENV: &str = "PDD_TEST_LOCAL_CHILD_DIRECT";

/// The sender's half of the round trip: grant for request 7, every layer from the
/// shuffled SRC pages.
async fn send_all(addr: std::net::SocketAddr) {
    let tx = LocalSender::connect(
        source(),
        LocalSenderConfig::new(
            addr,
            42,
            LocalHello::new(Role::Prefill, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(10), tx.wait_grant(7))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(out.grant().page_count, DEST.len() as u32);
    for layer in 0..LAYERS {
        out.send_layer(layer, layer, &SRC).await.unwrap();
    }
    out.finish().await.unwrap();
    let want = u64::from(LAYERS) * DEST.len() as u64 * u64::from(PB);
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(10), out.wait())
            .await
            .unwrap()
            .unwrap(),
        want
    );
    let direct = tx
        .metrics()
        .local_direct_bytes_total
        .load(std::sync::atomic::Ordering::Relaxed);
    match std::env::var(CHILD_DIRECT_ENV).as_deref() {
        Ok("1") => assert_eq!(direct, want, "every byte copied into the mapped pool"),
        Ok("0") => assert_eq!(direct, 0, "no mapped pool: every byte by UCX puts"),
        _ => {}
    }
    // The keys are revoked with the grant: the handle refuses to put again.
    let again = out.send_layer(0, 0, &SRC).await.unwrap_err();
    assert!(
        matches!(
            again,
            Error::InvalidArgument(_) | Error::GrantViolation { .. }
        ),
        "{again:?}"
    );
    tx.close().await;
}

/// The sender process of the two-process round trip (does nothing unless the
/// parent test started it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_sender_process() {
    if let Ok(addr) = std::env::var(CHILD_ENV) {
        send_all(addr.parse().unwrap()).await;
    }
}

/// Receiver here, sender in a second process restricted to the transports `tls`
/// allows (shared memory and CMA only reach another process).
async fn roundtrip(tls: &str, shared: bool, direct: bool) {
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let rx = LocalReceiver::start(
        if shared {
            shared_pool()
        } else {
            pool(|_, _| 0)
        },
        LocalReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::RelayDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let addr = rx.local_addr();
    let child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "child_sender_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, addr.to_string())
        .env(CHILD_DIRECT_ENV, if direct { "1" } else { "0" })
        .env("UCX_TLS", tls)
        .kill_on_drop(true)
        .output();
    let sender = tokio::spawn(async move {
        let out = child.await.unwrap();
        assert!(
            out.status.success(),
            "sender process failed: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    });
    let peer = tokio::time::timeout(Duration::from_secs(10), rx.wait_peer())
        .await
        .unwrap();
    let inbound = rx
        .grant(7, &DEST, Some(peer), Some(Duration::from_secs(20)))
        .await
        .unwrap();
    let want = u64::from(LAYERS) * DEST.len() as u64 * u64::from(PB);
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(15), inbound.wait())
            .await
            .unwrap()
            .unwrap(),
        want
    );
    tokio::time::timeout(Duration::from_secs(15), sender)
        .await
        .unwrap()
        .unwrap();
    let s = source();
    for layer in 0..LAYERS {
        for (d, p) in DEST.iter().zip(&SRC) {
            assert_eq!(
                rx.pool().copy_page(layer, *d).unwrap(),
                s.copy_page(layer, *p).unwrap(),
                "{tls}: layer {layer} page {d}"
            );
        }
        // Pages outside the grant were never written.
        for p in (0..PAGES).filter(|p| !DEST.contains(p)) {
            assert!(
                rx.pool()
                    .copy_page(layer, p)
                    .unwrap()
                    .iter()
                    .all(|&b| b == 0),
                "{tls}: page {p} outside the grant was written"
            );
        }
    }
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_roundtrip_between_two_processes() {
    roundtrip("sm,self", false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_roundtrip_between_two_processes() {
    roundtrip("tcp,self", false, false).await;
}

/// A pool in memory UCX allocated: the sender process maps it and copies every page
/// itself (one copy), the receiver registers nothing and does not poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_pool_is_copied_into_directly_by_the_sender_process() {
    roundtrip("sm,self", true, true).await;
}

/// The same pool, the sender restricted to TCP (`UCX_TLS=tcp,self` leaves out the
/// shared-memory components, so the key cannot be mapped there): the sender falls
/// back to UCX puts over TCP, which land while the receiver's worker keeps spinning
/// after each event (a shared pool's grant holds no busy guard).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_pool_with_a_tcp_only_sender() {
    roundtrip("tcp,self", true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_grant_revokes_the_keys_and_refuses_puts() {
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let (rx, tx) = pair().await;
    let peer = rx.wait_peer().await;
    let inbound = rx.grant(9, &[1, 2, 3], Some(peer), None).await.unwrap();
    let out = tx.wait_grant(9).await.unwrap();
    out.send_layer(0, 0, &[4, 5, 6]).await.unwrap();
    assert!(rx.cancel(inbound.grant.transfer_id));
    assert_eq!(inbound.wait().await.unwrap_err().reason(), "cancelled");
    // The sender hears the ABORT, destroys its keys and fails the transfer.
    let e = tokio::time::timeout(Duration::from_secs(5), out.wait())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.reason(), "peer_aborted");
    let put = out.send_layer(1, 1, &[4, 5, 6]).await.unwrap_err();
    assert!(
        matches!(
            put,
            Error::PeerAborted { .. } | Error::GrantViolation { .. }
        ),
        "{put:?}"
    );
    assert!(matches!(out.status(), LocalStatus::Failed(_)));
    tx.close().await;
    rx.close().await;
}

/// A hand-driven sender on the control lane: what a buggy or hostile peer can send.
async fn raw_peer(rx: &LocalReceiver) -> (pdd_io::lane::Connected, Frame) {
    let hello = LocalHello::new(Role::Prefill, capability::KV_STREAM | capability::LOCAL_UCX);
    let mut c = lane::connect(
        rx.local_addr(),
        &hello,
        77,
        0,
        &LaneKey::Root,
        &SocketTuning::default(),
        None,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let addr = lane::read_frame_exact(&mut c.stream, 1 << 24)
        .await
        .unwrap()
        .unwrap();
    (c, addr)
}

async fn next_non_ping(c: &mut pdd_io::lane::Connected) -> Frame {
    loop {
        match lane::read_frame_exact(&mut c.stream, 1 << 24)
            .await
            .unwrap()
            .unwrap()
        {
            Frame::Ping(_) => continue,
            f => return f,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_notice_with_wrong_counts_fails_the_transfer() {
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let rx = LocalReceiver::start(
        pool(|_, _| 0),
        LocalReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::RelayDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let (mut c, first) = raw_peer(&rx).await;
    assert!(matches!(first, Frame::LocalAddr(_)), "{first:?}");
    let peer = rx.wait_peer().await;
    let inbound = rx.grant(3, &[8, 9, 4], Some(peer), None).await.unwrap();
    let Frame::KvGrant(g) = next_non_ping(&mut c).await else {
        panic!("KV_GRANT first")
    };
    let Frame::LocalGrant(l) = next_non_ping(&mut c).await else {
        panic!("then LOCAL_GRANT")
    };
    // Pages 8, 9 are one region and 4 another, on each of the 3 layers.
    assert_eq!(l.regions.len(), 2 * usize::from(LAYERS));
    // One page short on layer 0.
    let short = Frame::LocalDone(LocalDone {
        transfer_id: g.transfer_id,
        layer_start: 0,
        layer_count: 1,
        page_count: 2,
        byte_count: 2 * u64::from(PB),
    });
    lane::write_frame(&mut c.stream, &short, 1 << 24)
        .await
        .unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), inbound.wait())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.reason(), "transfer_incomplete", "{e}");
    match next_non_ping(&mut c).await {
        Frame::Abort(a) => assert_eq!(a.request_id, 3),
        f => panic!("expected ABORT for the request, got {f:?}"),
    }
    rx.close().await;
}

/// A sender aborts a request in the longest message the wire carries, all in
/// multi-byte characters: the receiver fails the transfer with the peer's words
/// intact, answers with its own ABORT (quoting them behind its own words, cut at a
/// character, so it decodes), and serves the next grant. It used to cut that answer
/// by byte count and panic its control task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_longest_non_ascii_abort_is_reported_not_a_panic() {
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let rx = LocalReceiver::start(
        pool(|_, _| 0),
        LocalReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::RelayDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let (mut c, first) = raw_peer(&rx).await;
    assert!(matches!(first, Frame::LocalAddr(_)), "{first:?}");
    let peer = rx.wait_peer().await;
    let max = pdd_core::wire::MAX_ABORT_MESSAGE_LEN;
    for (i, unit) in ["é", "€", "😀"].into_iter().enumerate() {
        for prefix in ["", "x", "xy", "xyz"] {
            let long = format!("{prefix}{}", unit.repeat(max));
            let words = pdd_core::wire::text::cut(&long, max).to_owned();
            let request = 10 + i as u64 * 4 + prefix.len() as u64;
            let inbound = rx.grant(request, &[1, 2], Some(peer), None).await.unwrap();
            let Frame::KvGrant(_) = next_non_ping(&mut c).await else {
                panic!("KV_GRANT first")
            };
            let Frame::LocalGrant(_) = next_non_ping(&mut c).await else {
                panic!("then LOCAL_GRANT")
            };
            let abort = Frame::Abort(pdd_core::wire::Abort {
                request_id: request,
                reason: pdd_core::wire::AbortReason::Cancelled,
                message: words.clone(),
            });
            lane::write_frame(&mut c.stream, &abort, 1 << 24)
                .await
                .unwrap();
            let e = tokio::time::timeout(Duration::from_secs(5), inbound.wait())
                .await
                .expect("the receiver reports the peer's ABORT")
                .unwrap_err();
            match &e {
                Error::PeerAborted { message, .. } => assert_eq!(message, &words),
                other => panic!("expected the peer's ABORT, got {other:?}"),
            }
            // The receiver's control task lived through it (no panic): the next grant
            // of the loop reaches this peer. (Since both paths drive one session
            // machine, a peer's ABORT is not answered with an ABORT, as on the WAN.)
            assert!(e.to_string().contains(&words));
        }
    }
    let last = rx.grant(99, &[1, 2], Some(peer), None).await.unwrap();
    let Frame::KvGrant(g) = next_non_ping(&mut c).await else {
        panic!("the session still grants after every ABORT")
    };
    assert_eq!(g.request_id, 99);
    drop(last);
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_notice_outside_the_grant_ends_the_session() {
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let rx = LocalReceiver::start(
        pool(|_, _| 0),
        LocalReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::RelayDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let (mut c, _) = raw_peer(&rx).await;
    let peer = rx.wait_peer().await;
    let inbound = rx.grant(4, &[1], Some(peer), None).await.unwrap();
    let Frame::KvGrant(g) = next_non_ping(&mut c).await else {
        panic!()
    };
    let _ = next_non_ping(&mut c).await;
    // Layer 3 of a 3-layer grant.
    let outside = Frame::LocalDone(LocalDone {
        transfer_id: g.transfer_id,
        layer_start: LAYERS,
        layer_count: 1,
        page_count: 1,
        byte_count: u64::from(PB),
    });
    lane::write_frame(&mut c.stream, &outside, 1 << 24)
        .await
        .unwrap();
    let e = tokio::time::timeout(Duration::from_secs(5), inbound.wait())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.reason(), "grant_violation", "{e}");
    // Another session's transfer id is refused the same way.
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_local_ucx_is_refused() {
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let rx = LocalReceiver::start(
        pool(|_, _| 0),
        LocalReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::RelayDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let plain = LocalHello::new(Role::Prefill, capability::KV_STREAM);
    let e = lane::connect(
        rx.local_addr(),
        &plain,
        5,
        0,
        &LaneKey::Root,
        &SocketTuning::default(),
        None,
        Duration::from_secs(5),
    )
    .await
    .unwrap_err();
    assert_eq!(e.reason(), "peer_aborted", "{e}");
    assert!(e.to_string().contains("local_ucx"), "{e}");
    rx.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_library_is_a_clear_error_naming_it() {
    let _g = ENV.lock().await;
    std::env::set_var(
        pdd_io::local::ucx_ffi::ENV_UCP_LIBRARY,
        "libucp-nonexistent.so.9",
    );
    let r = LocalReceiver::start(
        pool(|_, _| 0),
        LocalReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::RelayDecode, capability::KV_STREAM),
        ),
    )
    .await;
    std::env::remove_var(pdd_io::local::ucx_ffi::ENV_UCP_LIBRARY);
    let e = r
        .err()
        .expect("a missing libucp must refuse the local path");
    assert_eq!(e.reason(), "local_path_unavailable");
    assert!(e.to_string().contains("libucp-nonexistent.so.9"), "{e}");
}

/// `max_connections` bounds sessions and opening connections together. Places held
/// by sessions are kept: with every place in session, a new connection is closed at
/// once, unanswered. Places held by connections still opening are not: a new
/// connection displaces the oldest of them (`pdd_io::admission`) instead of being
/// kept out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_bound_are_closed_unanswered() {
    use tokio::io::AsyncReadExt;
    if !ucx_here() {
        return;
    }
    let _env = ENV.lock().await;
    let mut cfg = LocalReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        LocalHello::new(Role::RelayDecode, capability::KV_STREAM),
    );
    cfg.max_connections = 2;
    cfg.hello_timeout = Duration::from_secs(30);
    let rx = LocalReceiver::start(pool(|_, _| 0), cfg).await.unwrap();
    let mut byte = [0u8; 1];
    // Two silent peers (never a HELLO) hold the two places.
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(
            tokio::net::TcpStream::connect(rx.local_addr())
                .await
                .unwrap(),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A third displaces the oldest of them, which is closed (EOF); the newer one
    // and the third stay open.
    let mut third = tokio::net::TcpStream::connect(rx.local_addr())
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), silent[0].read(&mut byte))
        .await
        .expect("the oldest opening connection was kept")
        .unwrap_or(0);
    assert_eq!(n, 0);
    for s in [&mut silent[1], &mut third] {
        assert!(
            tokio::time::timeout(Duration::from_millis(200), s.read(&mut byte))
                .await
                .is_err()
        );
    }
    drop(silent);
    drop(third);
    // Two sessions hold the two places: a third connection is closed at once.
    let (_a, _) = raw_peer(&rx).await;
    let (_b, _) = raw_peer(&rx).await;
    let mut past = tokio::net::TcpStream::connect(rx.local_addr())
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), past.read(&mut byte))
        .await
        .expect("the connection past the bound was left open")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert_eq!(rx.peers().len(), 2);
    // Once a session leaves, a new connection gets its place.
    drop(_b);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut fourth = tokio::net::TcpStream::connect(rx.local_addr())
        .await
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), fourth.read(&mut byte))
            .await
            .is_err()
    );
    rx.close().await;
}

/// A flood of connections that never finish their opening, from the sender's own
/// address and four others, more than the receiver's `max_connections` and kept
/// up: a sender still opens its session and completes a transfer promptly, and the
/// receiver holds no more connections than its bound. (Before the shared
/// admission, the flood held every place and each new connection was closed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_does_not_keep_a_sender_out() {
    if !ucx_here() {
        return;
    }
    let _env = ENV.lock().await;
    const BOUND: u64 = 64;
    let mut cfg = LocalReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        LocalHello::new(Role::RelayDecode, capability::KV_STREAM),
    );
    cfg.max_connections = BOUND;
    cfg.hello_timeout = Duration::from_secs(30);
    let rx = LocalReceiver::start(pool(|_, _| 0), cfg).await.unwrap();
    let sources: Vec<std::net::Ipv4Addr> = (1..=5)
        .map(|i| std::net::Ipv4Addr::new(127, 0, 0, i))
        .collect();
    let flood = Flood::start(rx.local_addr(), &sources, 16, Role::Prefill).await;
    tokio::time::sleep(flood::REFRESH * 2).await;
    let started = std::time::Instant::now();
    let honest = async {
        let tx = loop {
            let mut c = LocalSenderConfig::new(
                rx.local_addr(),
                42,
                LocalHello::new(Role::Prefill, capability::KV_STREAM),
            );
            c.connect_timeout = Duration::from_secs(2);
            match LocalSender::connect(source(), c).await {
                Ok(tx) => break tx,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        let peer = rx.wait_peer().await;
        let inbound = rx.grant(7, &DEST, Some(peer), None).await.unwrap();
        let out = tx.wait_grant(7).await.unwrap();
        for layer in 0..LAYERS {
            out.send_layer(layer, layer, &SRC).await.unwrap();
        }
        out.finish().await.unwrap();
        inbound.wait().await.unwrap();
        tx
    };
    let tx = tokio::time::timeout(Duration::from_secs(5), honest)
        .await
        .expect("no session and transfer for a sender during the flood");
    eprintln!(
        "session and transfer in {:?} during a flood that opened {} connections",
        started.elapsed(),
        flood.opened()
    );
    let (held, sockets) = flood
        .settle(Duration::from_millis(500), rx.local_addr())
        .await;
    assert!(held < BOUND as usize, "{held} flood connections held");
    assert!(
        sockets <= BOUND as usize,
        "the receiver holds {sockets} sockets"
    );
    let evicted = rx
        .metrics()
        .half_open_evicted_total
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(evicted > 0);
    tx.close().await;
    rx.close().await;
    flood.stop().await;
}

/// The local path's receiver runs the same check of the connector's proof: a
/// forging sender's made-up proof is refused with ABORT `auth_failed` within 2 s
/// and gets no session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_sender_proof_is_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if !ucx_here() {
        return;
    }
    let _env = ENV.lock().await;
    let mut hello = LocalHello::new(Role::RelayDecode, capability::KV_STREAM);
    hello.secret = Some(bytes::Bytes::from_static(b"s3cret"));
    let cfg = LocalReceiverConfig::new("127.0.0.1:0".parse().unwrap(), hello);
    let rx = LocalReceiver::start(pool(|_, _| 0), cfg).await.unwrap();
    let offer = LocalHello::new(Role::Prefill, capability::KV_STREAM | capability::LOCAL_UCX)
        .offer(9, 0, [7; 32], false);
    let mut s = tokio::net::TcpStream::connect(rx.local_addr())
        .await
        .unwrap();
    let hello_bytes = pdd_core::wire::encode_frame_to_vec(&Frame::Hello(offer), 1 << 20).unwrap();
    s.write_all(&hello_bytes).await.unwrap();
    let Ok(Some(Frame::Auth(_))) = lane::read_frame_exact(&mut s, 1 << 20).await else {
        panic!("expected the receiver's AUTH")
    };
    let forged = Frame::Auth(pdd_core::wire::Auth {
        nonce: [7; 32],
        proof: [0x5A; 32],
    });
    let started = std::time::Instant::now();
    s.write_all(&pdd_core::wire::encode_frame_to_vec(&forged, 1 << 20).unwrap())
        .await
        .unwrap();
    let quick = Duration::from_secs(2);
    match tokio::time::timeout(quick, lane::read_frame_exact(&mut s, 1 << 20)).await {
        Ok(Ok(Some(Frame::Abort(a)))) => assert_eq!(a.reason.name(), "auth_failed"),
        other => panic!("expected ABORT auth_failed, got {other:?}"),
    }
    let mut rest = Vec::new();
    tokio::time::timeout(quick, s.read_to_end(&mut rest))
        .await
        .expect("not closed after the ABORT")
        .unwrap();
    assert!(started.elapsed() < quick);
    assert!(rx.peers().is_empty());
    rx.close().await;
}

/// A key the sender maps is used only inside the mapping its unpack attached: a
/// region address (from the receiver) that points past it is refused before any
/// byte is copied, so a receiver cannot aim the copies at the sender's own memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_key_never_copies_outside_its_mapping() {
    use pdd_io::local::shared::shared_key;
    use pdd_io::local::ucx::{PutOp, UcxEndpoint};
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let len = 1 << 16;
    let alloc = SharedAllocation::new(len).unwrap();
    let base = alloc.as_ptr() as u64;
    let key = shared_key(base as usize, len).unwrap().to_vec();
    assert!(shared_key(base as usize, len + 1).is_none());
    let ep = UcxEndpoint::start().unwrap();
    ep.connect(ep.worker_address().to_vec()).await.unwrap();
    let ids = ep.unpack(vec![(key.clone(), base)]).await.unwrap();
    // Unpacked again (the next grant): the kept key, not a second mapping.
    assert_eq!(ep.unpack(vec![(key, base)]).await.unwrap(), ids);
    let src = vec![0xabu8; 4096];
    let op = |remote: u64, len: usize| PutOp {
        src: src.as_ptr() as usize,
        len,
        remote,
        rkey: ids[0],
    };
    let inside = op(base + 4096, 4096);
    // SAFETY: `src` outlives the calls.
    let direct = unsafe { ep.put_all(vec![inside], Duration::from_secs(5)) }
        .await
        .unwrap();
    assert_eq!(direct, 4096);
    // SAFETY: the allocation is alive; the copy above completed.
    let landed = unsafe { std::slice::from_raw_parts(alloc.as_ptr().add(4096), 4096) };
    assert!(landed.iter().all(|&b| b == 0xab));
    // The grant ends: its keys are destroyed, but a kept key stays for the session.
    ep.destroy(ids.clone());
    // SAFETY: as above.
    let again = unsafe { ep.put_all(vec![op(base, 4096)], Duration::from_secs(5)) }.await;
    assert_eq!(again.unwrap(), 4096, "a kept key survives the grant's end");
    let here = src.as_ptr() as u64;
    for bad in [
        op(base + len as u64 - 8, 16),
        op(base + (1 << 40), 8),
        op(here, 8),
    ] {
        // SAFETY: as above.
        let e = unsafe { ep.put_all(vec![bad], Duration::from_secs(5)) }
            .await
            .unwrap_err();
        assert_eq!(e.reason(), "grant_violation", "{e}");
    }
    // SAFETY: as above.
    let tail = unsafe { std::slice::from_raw_parts(alloc.as_ptr().add(len - 8), 8) };
    assert!(
        tail.iter().all(|&b| b == 0),
        "nothing copied by a refused op"
    );
}

/// An endpoint keeps at most MAX_SESSION_KEYS mapped keys for its life; past that a
/// mapped key is unpacked per grant (a new id each time) and destroyed with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_keys_are_bounded_per_endpoint() {
    use pdd_io::local::shared::shared_key;
    use pdd_io::local::ucx::{UcxEndpoint, MAX_SESSION_KEYS};
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let allocs: Vec<SharedAllocation> = (0..=MAX_SESSION_KEYS)
        .map(|_| SharedAllocation::new(4096).unwrap())
        .collect();
    let keys: Vec<(Vec<u8>, u64)> = allocs
        .iter()
        .map(|a| {
            let base = a.as_ptr() as usize;
            (shared_key(base, 4096).unwrap().to_vec(), base as u64)
        })
        .collect();
    let ep = UcxEndpoint::start().unwrap();
    ep.connect(ep.worker_address().to_vec()).await.unwrap();
    let first = ep.unpack(keys.clone()).await.unwrap();
    let again = ep.unpack(keys).await.unwrap();
    assert_eq!(
        again[..MAX_SESSION_KEYS],
        first[..MAX_SESSION_KEYS],
        "kept: the same ids"
    );
    assert_ne!(
        again[MAX_SESSION_KEYS], first[MAX_SESSION_KEYS],
        "past the bound: unpacked anew"
    );
}

/// Events queued at the receiver, waiting (bounded) until `n` are there.
async fn events(rx: &LocalReceiver, n: usize) -> Vec<TransferEvent> {
    let mut got = Vec::new();
    while got.len() < n {
        tokio::time::timeout(Duration::from_secs(5), rx.wait_event())
            .await
            .expect("an event within 5 s");
        got.extend(rx.poll_events(n - got.len()));
    }
    got
}

/// Partial sends as on the WAN path: any subset of the grant's pages per call, in
/// any order, each (layer, page) once; a refused call puts nothing and changes
/// nothing; a layer is announced (LayerComplete at the receiver) only once every
/// page of it is in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_in_chunks_any_order_each_once_fill_the_grant() {
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let (rx, tx) = pair().await;
    let peer = rx.wait_peer().await;
    let inbound = rx.grant(12, &DEST, Some(peer), None).await.unwrap();
    let out = tx.wait_grant(12).await.unwrap();
    let id = inbound.grant.transfer_id;
    assert!(!out.started());
    assert_eq!(rx.transfer_started(id), Some(false));
    // Chunk 1 filled grant pages 4, 0, 1 (out of order), on every layer.
    let first = [4u32, 0, 1];
    let src = |gp: &[u32]| gp.iter().map(|&g| SRC[g as usize]).collect::<Vec<_>>();
    out.send_pages(0..LAYERS, None, &first, &src(&first))
        .await
        .unwrap();
    assert!(out.started());
    // Refused, and nothing changes: a page again, twice in one call, outside the
    // grant, a source page outside the pool.
    for (layers, pages, srcs) in [
        (0..1, vec![1u32, 2], vec![1u32, 2]),
        (1..2, vec![3, 3], vec![3, 3]),
        (0..1, vec![9], vec![1]),
        (0..1, vec![2], vec![PAGES]),
    ] {
        let e = out
            .send_pages(layers.clone(), None, &pages, &srcs)
            .await
            .unwrap_err();
        assert_eq!(e.reason(), "invalid_argument", "{layers:?} {pages:?}: {e}");
    }
    assert_eq!(
        out.finish().await.unwrap_err().reason(),
        "invalid_argument",
        "finish before every page went"
    );
    // No layer is whole yet: nothing announced, nothing at the receiver.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(rx.poll_events(16).is_empty());
    assert_eq!(rx.transfer_started(id), Some(false));
    // Layer 2 whole (its last pages, shuffled, from source layer 0): announced alone.
    let rest = [8u32, 2, 7, 3, 6, 5];
    out.send_pages(2..3, Some(0), &rest, &src(&rest))
        .await
        .unwrap();
    let ev = events(&rx, 1).await;
    assert!(
        matches!(ev[..], [TransferEvent::LayerComplete { layer: 2, transfer_id, .. }] if transfer_id == id),
        "{ev:?}"
    );
    assert_eq!(rx.transfer_started(id), Some(true));
    assert!(matches!(inbound.status(), LocalStatus::InProgress));
    // The refused pages are still sendable: the rest of layers 0 and 1.
    out.send_pages(0..2, None, &rest, &src(&rest))
        .await
        .unwrap();
    out.finish().await.unwrap();
    let want = u64::from(LAYERS) * DEST.len() as u64 * u64::from(PB);
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), inbound.wait())
            .await
            .unwrap()
            .unwrap(),
        want
    );
    assert_eq!(out.wait().await.unwrap(), want);
    let ev = events(&rx, 3).await;
    assert!(
        matches!(
            ev[..],
            [
                TransferEvent::LayerComplete { layer: 0, .. },
                TransferEvent::LayerComplete { layer: 1, .. },
                TransferEvent::Complete { bytes, .. }
            ] if bytes == want
        ),
        "{ev:?}"
    );
    let s = source();
    for layer in 0..LAYERS {
        for (g, (d, p)) in DEST.iter().zip(&SRC).enumerate() {
            // Layer 2's later pages came from source layer 0.
            let from = if layer == 2 && rest.contains(&(g as u32)) {
                0
            } else {
                layer
            };
            assert_eq!(
                rx.pool().copy_page(layer, *d).unwrap(),
                s.copy_page(from, *p).unwrap(),
                "layer {layer} page {d}"
            );
        }
    }
    tx.close().await;
    rx.close().await;
}

/// An empty grant (no pages) is accepted as on the WAN path: nothing is registered
/// or put, and it completes with 0 bytes when the sender finishes; a sender that did
/// not offer empty_grant is never sent one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_grant_completes_when_the_sender_finishes() {
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let (rx, tx) = pair().await;
    let peer = rx.wait_peer().await;
    let inbound = rx.grant(13, &[], Some(peer), None).await.unwrap();
    assert_eq!(inbound.grant.page_count, 0);
    let out = tx.wait_grant(13).await.unwrap();
    assert_eq!(
        (out.grant().page_count, out.grant().layer_count),
        (0, LAYERS)
    );
    // Nothing to send: a layer of it is no pages, and nothing happens yet.
    out.send_layer(0, 0, &[]).await.unwrap();
    out.send_pages(0..LAYERS, None, &[], &[]).await.unwrap();
    assert!(!out.started());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(matches!(inbound.status(), LocalStatus::InProgress));
    out.finish().await.unwrap();
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), inbound.wait())
            .await
            .unwrap()
            .unwrap(),
        0
    );
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), out.wait())
            .await
            .unwrap()
            .unwrap(),
        0
    );
    let ev = events(&rx, 1).await;
    assert!(
        matches!(
            ev[..],
            [TransferEvent::Complete {
                bytes: 0,
                blocks: 0,
                ..
            }]
        ),
        "{ev:?}"
    );
    // A grant of pages goes on after it, on the same session.
    let inbound = rx.grant(14, &[3], Some(peer), None).await.unwrap();
    let out = tx.wait_grant(14).await.unwrap();
    out.send_pages(0..LAYERS, None, &[0], &[5]).await.unwrap();
    out.finish().await.unwrap();
    assert_eq!(
        inbound.wait().await.unwrap(),
        u64::from(LAYERS) * u64::from(PB)
    );
    tx.close().await;
    // A peer that did not offer empty_grant (an older sender) is refused one.
    let (_c, _) = raw_peer(&rx).await;
    let mut old = None;
    for _ in 0..100 {
        old = rx.peers().into_iter().find(|&p| p != peer);
        if old.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let e = rx.grant(15, &[], old, None).await.err().unwrap();
    assert_eq!(e.reason(), "invalid_argument", "{e}");
    assert!(e.to_string().contains("empty_grant"), "{e}");
    rx.close().await;
}

/// The sender's abort reason reaches the receiver in its failure (ABORT for the
/// request, as on the WAN path); the pages come back; a second abort is false.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_abort_carries_its_reason_to_the_receiver() {
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let (rx, tx) = pair().await;
    let peer = rx.wait_peer().await;
    let inbound = rx.grant(16, &[1, 2, 3], Some(peer), None).await.unwrap();
    let out = tx.wait_grant(16).await.unwrap();
    out.send_pages(0..1, None, &[0], &[4]).await.unwrap();
    assert!(out.abort("engine preempted the request"));
    assert!(!out.abort("again"), "already ended");
    let e = tokio::time::timeout(Duration::from_secs(5), inbound.wait())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.reason(), "peer_aborted");
    assert!(
        e.to_string().contains("engine preempted the request"),
        "{e}"
    );
    match out.status() {
        LocalStatus::Failed(e) => {
            assert_eq!(e.reason(), "cancelled");
            assert!(e.to_string().contains("engine preempted"), "{e}");
        }
        s => panic!("{s:?}"),
    }
    let ev = events(&rx, 1).await;
    assert!(
        matches!(&ev[..], [TransferEvent::Failed { error, request_id: 16, .. }] if error.to_string().contains("engine preempted the request")),
        "{ev:?}"
    );
    // The pages are free again; a reason past the frame's bound (multi-byte
    // characters across the cut) is shortened, not refused.
    let inbound = rx.grant(17, &[1, 2, 3], Some(peer), None).await.unwrap();
    let out = tx.wait_grant(17).await.unwrap();
    assert!(out.abort(&"é".repeat(2000)));
    let e = tokio::time::timeout(Duration::from_secs(5), inbound.wait())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(e.reason(), "peer_aborted");
    assert!(e.to_string().contains("éé"), "{e}");
    tx.close().await;
    rx.close().await;
}

/// wait_event sleeps until an event is queued (no event: it does not return), and
/// an event wakes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_event_is_woken_by_an_event() {
    let _g = ENV.lock().await;
    if !ucx_here() {
        return;
    }
    let (rx, tx) = pair().await;
    let rx = Arc::new(rx);
    let peer = rx.wait_peer().await;
    let inbound = rx.grant(18, &[1], Some(peer), None).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(200), rx.wait_event())
            .await
            .is_err(),
        "no event yet"
    );
    let waiter = {
        let rx = rx.clone();
        tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(10), rx.wait_event())
                .await
                .is_ok()
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let t0 = std::time::Instant::now();
    assert!(rx.cancel(inbound.grant.transfer_id));
    assert!(waiter.await.unwrap(), "woken by the cancellation's event");
    assert!(t0.elapsed() < Duration::from_secs(5));
    // Queued and not taken: returns at once; taken: waits again.
    tokio::time::timeout(Duration::from_millis(100), rx.wait_event())
        .await
        .unwrap();
    assert_eq!(rx.poll_events(16).len(), 1);
    assert!(
        tokio::time::timeout(Duration::from_millis(100), rx.wait_event())
            .await
            .is_err()
    );
    tx.close().await;
    rx.close().await;
}
