//! KV endpoints on loopback: pages land where granted and nowhere else, every wait is
//! bounded, and failures (corruption, dead peers, resets, deadlines, hostile blocks)
//! end transfers with a typed error instead of a hang or wrong data.

#[path = "common/bounds.rs"]
mod bounds;
mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, Role};
use pdd_core::Error;
use pdd_io::lane::{self, LaneKey, SocketTuning};
use pdd_io::pool::PagePool;
use pdd_io::receiver::{KvReceiver, ReceiverConfig, ReceiverEvent, TransferStatus};
use pdd_io::sender::{KvSender, SenderConfig};
use pdd_io::wanem::{Direction, LinkProfile, Wanem, WanemConfig};

const LAYERS: u16 = 3;
const PAGES: u32 = 16;
const PAGE: u32 = 4096;
const BOUND: Duration = Duration::from_secs(20);

fn pattern_pool(seed: u8) -> Arc<PagePool> {
    common::pattern_pool(LAYERS, PAGES, PAGE, seed, 1)
}

fn zero_pool() -> Arc<PagePool> {
    common::zero_pool(LAYERS, PAGES, PAGE)
}

async fn receiver(tweak: impl FnOnce(&mut ReceiverConfig)) -> KvReceiver {
    let mut cfg = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        LocalHello::new(Role::MainDecode, capability::KV_STREAM),
    );
    tweak(&mut cfg);
    KvReceiver::start(zero_pool(), cfg).await.unwrap()
}

fn sender_cfg(addr: SocketAddr, lanes: u16) -> SenderConfig {
    let mut cfg = SenderConfig::new(
        addr,
        42,
        LocalHello::new(Role::Prefill, capability::KV_STREAM),
    );
    cfg.lanes = lanes;
    cfg.max_block_bytes = 3 * PAGE; // several blocks per layer, striped over lanes
    cfg
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("bounded wait ran out")
}

/// Grant `dst`, send from `src`, check both sides agree and the bytes landed.
async fn transfer(
    rx: &KvReceiver,
    tx: &KvSender,
    request: u64,
    dst: &[u32],
    src: &[u32],
) -> Result<u64, Error> {
    let inbound = rx.grant(request, dst, None, Some(tx.session_id()), None)?;
    let out = bounded(tx.wait_grant(request)).await?;
    for layer in 0..LAYERS {
        out.send_layer(layer, layer, src).await?;
    }
    out.finish().await?;
    let got = bounded(inbound.wait()).await;
    let confirmed = bounded(out.wait()).await;
    assert_eq!(got.is_ok(), confirmed.is_ok(), "{got:?} vs {confirmed:?}");
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_land_in_their_granted_slots_in_shuffled_order() {
    let rx = receiver(|_| {}).await;
    let src_pool = pattern_pool(3);
    let tx = KvSender::connect(src_pool.clone(), sender_cfg(rx.local_addr(), 3))
        .await
        .unwrap();
    assert_eq!(bounded(rx.wait_peer(None)).await, 42);
    let dst = [11, 2, 7, 15, 0];
    let src = [1, 9, 4, 3, 12];
    let bytes = transfer(&rx, &tx, 5, &dst, &src).await.unwrap();
    assert_eq!(bytes, u64::from(LAYERS) * 5 * u64::from(PAGE));
    for layer in 0..LAYERS {
        for (d, s) in dst.iter().zip(src) {
            assert_eq!(
                rx.pool().copy_page(layer, *d).unwrap(),
                src_pool.copy_page(layer, s).unwrap()
            );
        }
        // Pages outside the grant are untouched.
        for p in (0..PAGES).filter(|p| !dst.contains(p)) {
            assert!(rx
                .pool()
                .copy_page(layer, p)
                .unwrap()
                .iter()
                .all(|&b| b == 0));
        }
    }
    let events = rx.poll_events(100);
    let layer_events = events
        .iter()
        .filter(|e| {
            matches!(
                e,
                ReceiverEvent::Transfer(pdd_core::kv::TransferEvent::LayerComplete { .. })
            )
        })
        .count();
    assert_eq!(layer_events, usize::from(LAYERS));
    assert!(matches!(
        events.last(),
        Some(ReceiverEvent::Transfer(
            pdd_core::kv::TransferEvent::Complete { .. }
        ))
    ));
    // The pages are free for the next grant, and a second transfer works.
    transfer(&rx, &tx, 6, &dst, &[0, 1, 2, 3, 4]).await.unwrap();
    let m = rx.metrics().snapshot();
    let get = |n: &str| m.iter().find(|(k, ..)| *k == n).unwrap().1;
    assert_eq!(get("transfers_completed_total"), 2);
    assert_eq!(
        get("bytes_received_total"),
        2 * u64::from(LAYERS) * 5 * u64::from(PAGE)
    );
    rx.close(BOUND).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_fails_the_transfer_on_both_sides() {
    let rx = receiver(|_| {}).await;
    let tx = KvSender::connect(pattern_pool(1), sender_cfg(rx.local_addr(), 1))
        .await
        .unwrap();
    bounded(rx.wait_peer(Some(42))).await;
    let granted = std::time::Instant::now();
    let inbound = rx
        .grant(9, &[1, 2], None, None, Some(Duration::from_millis(100)))
        .unwrap();
    let out = bounded(tx.wait_grant(9)).await.unwrap();
    // Ended by the grant's deadline (0.1 s), not by the test's bound.
    let (got, _) = bounds::within(
        "the grant's deadline (0.1 s) fails the transfer",
        granted,
        Duration::from_millis(80),
        Duration::from_secs(2),
        inbound.wait(),
    )
    .await;
    let err = got.unwrap_err();
    assert_eq!(err.reason(), "deadline_exceeded", "{err}");
    let err = bounded(out.wait()).await.unwrap_err();
    assert!(
        matches!(&err, Error::PeerAborted { reason, .. } if reason.name() == "deadline_exceeded"),
        "{err:?}"
    );
    // The pages are free again.
    assert!(rx.grant(10, &[1, 2], None, None, None).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_grants_are_refused_and_change_nothing() {
    let rx = receiver(|_| {}).await;
    assert_eq!(
        rx.grant(1, &[0], None, None, None).unwrap_err().reason(),
        "connection_lost"
    );
    let _tx = KvSender::connect(pattern_pool(1), sender_cfg(rx.local_addr(), 1))
        .await
        .unwrap();
    bounded(rx.wait_peer(None)).await;
    assert_eq!(
        rx.grant(1, &[PAGES], None, None, None)
            .unwrap_err()
            .reason(),
        "invalid_argument"
    );
    assert_eq!(
        rx.grant(1, &[0], None, Some(7), None).unwrap_err().reason(),
        "connection_lost"
    );
    rx.grant(1, &[0, 1], None, None, None).unwrap();
    assert_eq!(
        rx.grant(2, &[1], None, None, None).unwrap_err().reason(),
        "pages_busy"
    );
}

/// An empty grant ("I hold all of it"): the sender finishes at once, the transfer
/// completes with no data and no layer events, nothing is held, and the same sender
/// then carries a normal transfer. A peer that did not offer `empty_grant` (an older
/// build, which would take a 0-page KV_GRANT as a protocol error) is never sent one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_grant_completes_with_nothing_sent() {
    let rx = receiver(|_| {}).await;
    let tx = KvSender::connect(pattern_pool(5), sender_cfg(rx.local_addr(), 2))
        .await
        .unwrap();
    bounded(rx.wait_peer(None)).await;
    let inbound = rx.grant(7, &[], None, None, None).unwrap();
    assert_eq!(inbound.grant.page_count, 0);
    let out = bounded(tx.wait_grant(7)).await.unwrap();
    assert_eq!(
        (out.grant().page_count, out.grant().layer_count),
        (0, LAYERS)
    );
    for layer in 0..LAYERS {
        out.send_layer(layer, layer, &[]).await.unwrap();
    }
    out.finish().await.unwrap();
    assert_eq!(bounded(inbound.wait()).await.unwrap(), 0);
    assert_eq!(bounded(out.wait()).await.unwrap(), 0);
    let events = rx.poll_events(16);
    assert!(
        matches!(
            events.as_slice(),
            [ReceiverEvent::Transfer(
                pdd_core::kv::TransferEvent::Complete {
                    request_id: 7,
                    bytes: 0,
                    blocks: 0,
                    ..
                }
            )]
        ),
        "{events:?}"
    );
    transfer(&rx, &tx, 8, &[0, 1], &[2, 3]).await.unwrap();

    // An older sender: HELLO without `empty_grant`.
    let hello = LocalHello::new(Role::Prefill, capability::KV_STREAM);
    let _old = lane::connect(
        rx.local_addr(),
        &hello,
        77,
        0,
        &LaneKey::Root,
        &SocketTuning::default(),
        None,
        BOUND,
    )
    .await
    .unwrap();
    bounded(rx.wait_peer(Some(77))).await;
    let err = rx.grant(9, &[], None, Some(77), None).unwrap_err();
    assert_eq!(err.reason(), "invalid_argument");
    assert!(err.to_string().contains("empty_grant"), "{err}");
    rx.grant(9, &[4], None, Some(77), None).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_outside_the_grant_aborts_the_session() {
    let rx = receiver(|_| {}).await;
    let hello = LocalHello::new(Role::Prefill, capability::KV_STREAM);
    let tuning = SocketTuning::default();
    let opened = lane::connect(
        rx.local_addr(),
        &hello,
        77,
        0,
        &LaneKey::Root,
        &tuning,
        None,
        BOUND,
    )
    .await
    .unwrap();
    let mut control = opened.stream;
    let key = LaneKey::Session(opened.session_secret);
    let mut data = lane::connect(rx.local_addr(), &hello, 77, 1, &key, &tuning, None, BOUND)
        .await
        .unwrap()
        .stream;
    bounded(rx.wait_peer(Some(77))).await;
    let inbound = rx.grant(3, &[4], Some(1), None, None).unwrap();
    // The honest first frame on the control lane is the grant.
    let grant = loop {
        match bounded(lane::read_frame_exact(&mut control, 1 << 20))
            .await
            .unwrap()
            .unwrap()
        {
            pdd_core::wire::Frame::KvGrant(g) => break g,
            _ => continue,
        }
    };
    // Page 1 of a one-page grant: outside it.
    let frame = pdd_core::wire::Frame::KvPages(pdd_core::wire::KvPages {
        transfer_id: grant.transfer_id,
        layer_start: 0,
        layer_count: 1,
        page_start: 1,
        page_count: 1,
        page_bytes: PAGE,
        data: vec![0xAB; PAGE as usize].into(),
        resent: false,
    });
    lane::write_frame(&mut data, &frame, 1 << 24).await.unwrap();
    let err = bounded(inbound.wait()).await.unwrap_err();
    assert_eq!(err.reason(), "grant_violation");
    // The receiver tells the peer why on the control lane, then closes it.
    let mut saw_abort = false;
    while let Ok(Some(f)) = bounded(lane::read_frame_exact(&mut control, 1 << 20)).await {
        if let pdd_core::wire::Frame::Abort(a) = f {
            saw_abort |= a.reason.name() == "grant_violation";
        }
    }
    assert!(saw_abort);
    // Nothing was written anywhere.
    assert!(rx.pool().copy_page(0, 4).unwrap().iter().all(|&b| b == 0));
    assert!(rx.pool().copy_page(0, 1).unwrap().iter().all(|&b| b == 0));
}

async fn through_wanem(rx: &KvReceiver) -> pdd_io::wanem::WanemHandle {
    let cfg = WanemConfig::new("127.0.0.1:0".parse().unwrap(), rx.local_addr())
        .symmetric(LinkProfile::default());
    Wanem::start(cfg).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_byte_fails_the_transfer_never_lands_silently() {
    let rx = receiver(|_| {}).await;
    let wan = through_wanem(&rx).await;
    let tx = KvSender::connect(pattern_pool(5), sender_cfg(wan.local_addr(), 1))
        .await
        .unwrap();
    bounded(rx.wait_peer(None)).await;
    // Let the HELLOs and first heartbeats pass, then flip one byte of the next chunk
    // towards the receiver: a data block (or a control frame) is damaged.
    let inbound = rx
        .grant(1, &(0..PAGES).collect::<Vec<_>>(), None, None, None)
        .unwrap();
    let out = bounded(tx.wait_grant(1)).await.unwrap();
    wan.corrupt_next(Direction::ClientToUpstream);
    let mut sent = Ok(());
    for layer in 0..LAYERS {
        sent = sent.and(
            out.send_layer(layer, layer, &(0..PAGES).collect::<Vec<_>>())
                .await,
        );
    }
    let _ = out.finish().await;
    let got = bounded(inbound.wait()).await;
    match got {
        Err(e) => assert!(
            [
                "checksum_mismatch",
                "connection_lost",
                "bad_magic",
                "invalid_field",
                "frame_too_large",
                "unknown_kind",
                "invalid_flags",
                "reserved_nonzero",
                "unsupported_version",
                "grant_violation",
                "truncated",
                "peer_aborted"
            ]
            .contains(&e.reason()),
            "{e:?}"
        ),
        Ok(_) => panic!("a corrupted transfer completed"),
    }
    assert!(bounded(out.wait()).await.is_err());
    assert_eq!(wan.stats().client_to_upstream.chunks_corrupted, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_declared_dead_within_the_bound() {
    let rx = receiver(|c| {
        c.heartbeat = Duration::from_millis(100);
        c.dead_after = Duration::from_millis(600);
        // Without transfer resume the dead peer's transfers fail at once (with it,
        // once the resume window has passed too: tests/kv_resume.rs).
        c.resume_window = None;
    })
    .await;
    let wan = through_wanem(&rx).await;
    let mut cfg = sender_cfg(wan.local_addr(), 1);
    cfg.heartbeat = Duration::from_millis(100);
    cfg.dead_after = Duration::from_millis(600);
    let tx = KvSender::connect(pattern_pool(5), cfg).await.unwrap();
    bounded(rx.wait_peer(None)).await;
    let inbound = rx.grant(1, &[0], None, None, None).unwrap();
    let out = bounded(tx.wait_grant(1)).await.unwrap();
    wan.blackhole(true);
    let started = std::time::Instant::now();
    // Detected by the receiver's dead-peer bound (0.6 s after the last PING, which
    // came at most a heartbeat before the blackhole), not by the 20 s test bound.
    let (got, _) = bounds::within(
        "the receiver declares the silent sender dead (dead_after 0.6 s)",
        started,
        Duration::from_millis(450),
        Duration::from_secs(3),
        inbound.wait(),
    )
    .await;
    let err = got.unwrap_err();
    assert_eq!(err.reason(), "connection_lost", "{err:?}");
    assert!(err.to_string().contains("silent"), "{err}");
    assert!(bounded(out.wait()).await.is_err());
    assert!(matches!(inbound.status(), TransferStatus::Failed(_)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reset_the_next_transfer_reconnects_transparently() {
    let rx = receiver(|_| {}).await;
    let wan = through_wanem(&rx).await;
    let tx = KvSender::connect(pattern_pool(8), sender_cfg(wan.local_addr(), 2))
        .await
        .unwrap();
    bounded(rx.wait_peer(None)).await;
    transfer(&rx, &tx, 1, &[3, 4], &[5, 6]).await.unwrap();
    // A middlebox drops every connection while the session is idle.
    wan.reset_all();
    // The sender notices (reset/EOF) and the next use reconnects the same session.
    bounded(async {
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if tx
                .metrics()
                .sessions_lost_total
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0
            {
                break;
            }
        }
    })
    .await;
    bounded(tx.ensure_connected()).await.unwrap();
    bounded(rx.wait_peer(Some(42))).await;
    // The receiver may still be dropping the old session; retry the grant briefly.
    let bytes = bounded(async {
        loop {
            match transfer(&rx, &tx, 2, &[3, 4], &[7, 8]).await {
                Ok(b) => break b,
                Err(e) if e.reason() == "connection_lost" => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(e) => panic!("{e:?}"),
            }
        }
    })
    .await;
    assert_eq!(bytes, u64::from(LAYERS) * 2 * u64::from(PAGE));
    assert_eq!(
        tx.metrics()
            .reconnects_total
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_transfers_share_the_lanes() {
    let rx = Arc::new(receiver(|_| {}).await);
    let src = pattern_pool(9);
    let tx = Arc::new(
        KvSender::connect(src.clone(), sender_cfg(rx.local_addr(), 3))
            .await
            .unwrap(),
    );
    bounded(rx.wait_peer(None)).await;
    for round in 0..3u64 {
        let mut tasks = Vec::new();
        for i in 0..8u32 {
            let (rx, tx) = (rx.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let request = round * 100 + u64::from(i);
                let dst = [2 * i, 2 * i + 1];
                let srcp = [(i + round as u32) % PAGES, (i + 5) % PAGES];
                transfer(&rx, &tx, request, &dst, &srcp).await.unwrap();
                (dst, srcp)
            }));
        }
        for t in tasks {
            let (dst, srcp) = bounded(t).await.unwrap();
            for layer in 0..LAYERS {
                for (d, s) in dst.iter().zip(srcp) {
                    assert_eq!(
                        rx.pool().copy_page(layer, *d).unwrap(),
                        src.copy_page(layer, s).unwrap()
                    );
                }
            }
        }
    }
}

mod prefix_handshake {
    use super::*;
    use pdd_core::radix::RadixCache;
    use std::sync::Mutex;

    const PS: usize = 4;

    async fn receiver_with_cache(
        lease_check: impl FnOnce(&mut RadixCache),
    ) -> (KvReceiver, Arc<Mutex<RadixCache>>) {
        let mut cache = RadixCache::new(PS).unwrap();
        lease_check(&mut cache);
        let cache = Arc::new(Mutex::new(cache));
        let c = cache.clone();
        let rx = receiver(move |cfg| cfg.prefix_cache = Some(c)).await;
        (rx, cache)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_the_missing_suffix_is_granted_and_sent() {
        let prompt: Vec<u32> = (1..=20).collect(); // 5 pages of 4 tokens
        let (rx, cache) = receiver_with_cache(|c| {
            c.insert(0, &prompt[..12], &[10, 11, 12]).unwrap();
        })
        .await;
        let tx = KvSender::connect(pattern_pool(4), sender_cfg(rx.local_addr(), 2))
            .await
            .unwrap();
        bounded(rx.wait_peer(None)).await;
        let answer =
            bounded(tx.query_prefix(3, 0, PS as u16, Duration::from_secs(30), prompt.clone()))
                .await
                .unwrap();
        assert_eq!(answer.verified.matched_tokens, 12);
        assert!(answer.verified.hash_ok && answer.reply.lease_id != 0);
        // The decoder's engine sees the query, and the pinned prefix cannot be evicted.
        let ev = rx.poll_events(10);
        assert!(matches!(
            ev[..],
            [ReceiverEvent::PrefixQuery {
                request_id: 3,
                matched_tokens: 12,
                ..
            }]
        ));
        assert!(cache.lock().unwrap().evict(10).is_empty());
        // It grants only the two missing pages; the sender sends its last two pages.
        let inbound = rx.grant(3, &[5, 6], None, None, None).unwrap();
        let out = bounded(tx.wait_grant(3)).await.unwrap();
        assert_eq!(out.grant().page_count, 2);
        for layer in 0..LAYERS {
            out.send_layer(layer, layer, &[3, 4]).await.unwrap();
        }
        out.finish().await.unwrap();
        assert_eq!(
            bounded(inbound.wait()).await.unwrap(),
            u64::from(LAYERS) * 2 * u64::from(PAGE)
        );
        // The engine takes over the pin and releases the lease.
        assert!(rx.release_lease(answer.reply.lease_id));
        assert!(!rx.release_lease(answer.reply.lease_id));
        assert_eq!(cache.lock().unwrap().evict(10).len(), 3);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unused_lease_expires_and_unpins() {
        let prompt: Vec<u32> = (1..=8).collect();
        let (rx, cache) = receiver_with_cache(|c| {
            c.insert(0, &prompt, &[1, 2]).unwrap();
        })
        .await;
        let tx = KvSender::connect(pattern_pool(4), sender_cfg(rx.local_addr(), 1))
            .await
            .unwrap();
        bounded(rx.wait_peer(None)).await;
        let a = bounded(tx.query_prefix(1, 0, PS as u16, Duration::from_millis(100), prompt))
            .await
            .unwrap();
        assert_eq!(a.verified.matched_tokens, 8);
        assert!(cache.lock().unwrap().evict(10).is_empty());
        bounded(async {
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                if cache.lock().unwrap().stats().locked_pages == 0 {
                    break;
                }
            }
        })
        .await;
        assert!(
            !rx.release_lease(a.reply.lease_id),
            "the lease lapsed by itself"
        );
        assert_eq!(cache.lock().unwrap().evict(10).len(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_diverged_prefix_is_never_trusted() {
        let prompt: Vec<u32> = (1..=8).collect();
        let (rx, _cache) = receiver_with_cache(|c| {
            // The decoder cached these tokens under namespace 0 ...
            c.insert(0, &prompt, &[1, 2]).unwrap();
        })
        .await;
        let tx = KvSender::connect(pattern_pool(4), sender_cfg(rx.local_addr(), 1))
            .await
            .unwrap();
        bounded(rx.wait_peer(None)).await;
        // ... and a prefill whose hash of the same tokens differs (here: it claims
        // namespace 0 but verifies under 7, standing in for any disagreement) gets 0.
        let a = bounded(tx.query_prefix(1, 0, PS as u16, Duration::ZERO, prompt.clone()))
            .await
            .unwrap();
        assert!(a.verified.hash_ok);
        let reply = a.reply.clone();
        let v = pdd_core::prefix::verify_reply(7, PS, &prompt, &reply);
        assert_eq!((v.matched_tokens, v.hash_ok), (0, false));
        // A page-size disagreement is refused outright, and the session lives on.
        let err = bounded(tx.query_prefix(2, 0, 8, Duration::ZERO, prompt))
            .await
            .unwrap_err();
        assert!(matches!(&err, Error::PeerAborted { .. }), "{err:?}");
        assert_eq!(rx.peers().len(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leases_die_with_their_session() {
        let prompt: Vec<u32> = (1..=8).collect();
        let (rx, cache) = receiver_with_cache(|c| {
            c.insert(0, &prompt, &[1, 2]).unwrap();
        })
        .await;
        let tx = KvSender::connect(pattern_pool(4), sender_cfg(rx.local_addr(), 1))
            .await
            .unwrap();
        bounded(rx.wait_peer(None)).await;
        bounded(tx.query_prefix(1, 0, PS as u16, Duration::from_secs(600), prompt))
            .await
            .unwrap();
        assert_eq!(cache.lock().unwrap().stats().locked_pages, 2);
        tx.close().await;
        bounded(async {
            while cache.lock().unwrap().stats().locked_pages != 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_a_cache_nothing_matches() {
        let rx = receiver(|_| {}).await;
        let tx = KvSender::connect(pattern_pool(4), sender_cfg(rx.local_addr(), 1))
            .await
            .unwrap();
        bounded(rx.wait_peer(None)).await;
        let a =
            bounded(tx.query_prefix(1, 9, PS as u16, Duration::from_secs(1), (1..=8).collect()))
                .await
                .unwrap();
        assert_eq!(
            (
                a.verified.matched_tokens,
                a.verified.hash_ok,
                a.reply.lease_id
            ),
            (0, true, 0)
        );
    }
}

/// The race behind a rare "broken pipe" in CI: a sender opens its data lanes as soon
/// as the control lane's HELLO reply arrives. The receiver used to reply before it
/// registered the session, so a quick data lane could find no session, be closed,
/// and the sender only learned it at its first block write. Now the session exists
/// before the reply, and a data lane that has no session is refused at HELLO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_lane_right_after_its_control_lane_is_always_admitted() {
    let rx = receiver(|_| {}).await;
    let hello = LocalHello::new(Role::Prefill, capability::KV_STREAM);
    let tuning = SocketTuning::default();
    let mut lanes = Vec::new();
    for session in 1..=100u64 {
        let root = LaneKey::Root;
        let opened = lane::connect(
            rx.local_addr(),
            &hello,
            session,
            0,
            &root,
            &tuning,
            None,
            BOUND,
        )
        .await
        .unwrap();
        let (control, key) = (opened.stream, LaneKey::Session(opened.session_secret));
        let data = lane::connect(
            rx.local_addr(),
            &hello,
            session,
            1,
            &key,
            &tuning,
            None,
            BOUND,
        )
        .await;
        let data = data
            .unwrap_or_else(|e| panic!("session {session}: {e:?}"))
            .stream;
        lanes.push((session, control, data));
    }
    bounded(rx.wait_peer(Some(100))).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    // An admitted data lane hears nothing from the receiver: no ABORT, no close.
    for (session, _control, data) in &lanes {
        let mut byte = [0u8; 1];
        match data.tcp().try_read(&mut byte) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("session {session}: data lane got {other:?} after HELLO"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_lane_without_a_session_is_refused_at_hello() {
    let rx = receiver(|_| {}).await;
    let hello = LocalHello::new(Role::Prefill, capability::KV_STREAM);
    let err = lane::connect(
        rx.local_addr(),
        &hello,
        99,
        1,
        &LaneKey::Session([7; 32]),
        &SocketTuning::default(),
        None,
        BOUND,
    )
    .await
    .unwrap_err();
    match &err {
        Error::PeerAborted { message, .. } => {
            assert!(message.contains("no control lane"), "{err:?}")
        }
        other => panic!("expected an ABORT in place of HELLO, got {other:?}"),
    }
    // The refusal changed nothing: a proper session still works.
    let tx = KvSender::connect(pattern_pool(3), sender_cfg(rx.local_addr(), 2))
        .await
        .unwrap();
    bounded(rx.wait_peer(None)).await;
    transfer(&rx, &tx, 1, &[0, 1], &[2, 3]).await.unwrap();
}

/// A receiver that ends the session resets its data lanes and then says why on the
/// control lane: the sender reports the receiver's reason, not the reset it hit first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_reports_the_receivers_reason_over_its_own_write_error() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut cfg = sender_cfg(listener.local_addr().unwrap(), 1);
    cfg.max_block_bytes = PAGE;
    let connecting = tokio::spawn(KvSender::connect(pattern_pool(4), cfg));
    // A scripted receiver, lane by lane.
    let hello = LocalHello::new(Role::MainDecode, capability::KV_STREAM);
    let (mut control, _) = bounded(listener.accept()).await.unwrap();
    let (_, secret) = bounded(lane::accept(&mut control, &hello, None, BOUND))
        .await
        .unwrap();
    let (mut data, _) = bounded(listener.accept()).await.unwrap();
    bounded(lane::accept(&mut data, &hello, Some(&secret), BOUND))
        .await
        .unwrap();
    let tx = bounded(connecting).await.unwrap().unwrap();
    let grant = pdd_core::wire::KvGrant {
        transfer_id: 5,
        request_id: 8,
        layer_count: 2,
        page_count: 4,
        page_bytes: PAGE,
        deadline_ms: 0,
    };
    lane::write_frame(
        &mut control,
        &pdd_core::wire::Frame::KvGrant(grant),
        1 << 20,
    )
    .await
    .unwrap();
    let out = bounded(tx.wait_grant(8)).await.unwrap();
    let pages = [0, 1, 2, 3];
    out.send_layer(0, 0, &pages).await.unwrap();
    for _ in 0..4 {
        bounded(lane::read_frame_exact(&mut data, 1 << 24))
            .await
            .unwrap()
            .unwrap();
    }
    // Reset the data lane (SO_LINGER 0), let the sender's next write hit the reset,
    // and only then send the ABORT.
    socket2::SockRef::from(&data)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(data);
    tokio::time::sleep(Duration::from_millis(10)).await;
    let _ = out.send_layer(1, 1, &pages).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let why = Error::GrantViolation {
        transfer_id: 5,
        detail: "scripted".into(),
    };
    lane::write_frame(&mut control, &lane::abort_for(&why), 1 << 20)
        .await
        .unwrap();
    let err = bounded(out.wait()).await.unwrap_err();
    assert!(
        matches!(&err, Error::PeerAborted { reason, .. } if reason.name() == "grant_violation"),
        "{err:?}"
    );
}
