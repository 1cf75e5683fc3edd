//! Lane failover end to end: one data lane stops moving bytes (the user-space WAN
//! proxy holds that one connection's sender-to-receiver bytes for far longer than
//! `dead_after`) while the control lane and the other data lanes stay healthy. With
//! failover the sender revokes the lane and moves its blocks: the transfer completes
//! with every byte right, and the same sender goes on to the next transfer. Without
//! it (a peer of an older build, or `lane_failover` off) the stall ends the session
//! and fails the transfer, as it always did.

#[path = "common/bounds.rs"]
mod bounds;
mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, Role};
use pdd_core::Error;
use pdd_io::lane::SocketTuning;
use pdd_io::pool::{MemoryRegion, PagePool};
use pdd_io::receiver::{KvReceiver, ReceiverConfig};
use pdd_io::sender::{KvSender, SenderConfig};
use pdd_io::wanem::{Direction, Wanem, WanemConfig, WanemHandle};

const LAYERS: u16 = 3;
const PAGES: u32 = 64;
const PAGE: u32 = 16 << 10;
const LANES: u16 = 4;
/// The stalled lane: data lanes are connections 1..=LANES of the proxy (the
/// control lane is connection 0, accepted first).
const STALLED: u64 = 2;
const DEAD_AFTER: Duration = Duration::from_secs(3);
/// Far longer than `DEAD_AFTER`: without failover the session cannot survive it.
const STALL: Duration = Duration::from_secs(60);
const BOUND: Duration = Duration::from_secs(30);

/// Small socket buffers everywhere, so the stalled lane's unacknowledged bytes back
/// up to the sender (the proxy acknowledges what fits its buffers).
const BUFFER: usize = 64 << 10;

fn pattern_pool(seed: u8) -> Arc<PagePool> {
    common::pattern_pool(LAYERS, PAGES, PAGE, seed, 7)
}

fn zero_pool() -> Arc<PagePool> {
    common::zero_pool(LAYERS, PAGES, PAGE)
}

fn tuning() -> SocketTuning {
    SocketTuning {
        buffer_bytes: Some(BUFFER),
        ..SocketTuning::default()
    }
}

async fn receiver() -> KvReceiver {
    receiver_with(None).await
}

async fn receiver_with(tls: Option<pdd_io::tls::TlsConfig>) -> KvReceiver {
    let mut cfg = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        LocalHello::new(Role::MainDecode, capability::KV_STREAM),
    );
    cfg.heartbeat = Duration::from_millis(200);
    cfg.dead_after = DEAD_AFTER;
    cfg.tuning = tuning();
    cfg.tls = tls;
    KvReceiver::start(zero_pool(), cfg).await.unwrap()
}

async fn proxy(rx: &KvReceiver) -> WanemHandle {
    proxy_at(rx, None).await
}

/// The proxy, its sender-to-receiver direction capped at `rate_bps` if given (per
/// connection).
async fn proxy_at(rx: &KvReceiver, rate_bps: Option<u64>) -> WanemHandle {
    let mut cfg = WanemConfig::new("127.0.0.1:0".parse().unwrap(), rx.local_addr());
    cfg.client_to_upstream.rate_bps = rate_bps;
    cfg.max_in_flight = Some(BUFFER);
    cfg.socket_buffer = Some(BUFFER);
    Wanem::start(cfg).await.unwrap()
}

fn sender_cfg(addr: SocketAddr, failover: bool) -> SenderConfig {
    let mut cfg = SenderConfig::new(
        addr,
        42,
        LocalHello::new(Role::Prefill, capability::KV_STREAM),
    );
    cfg.lanes = LANES;
    cfg.max_block_bytes = 2 * PAGE;
    cfg.heartbeat = Duration::from_millis(200);
    cfg.dead_after = DEAD_AFTER;
    cfg.lane_stall = Some(Duration::from_millis(600));
    cfg.tuning = tuning();
    cfg.lane_failover = failover;
    if !failover {
        // As a peer of an older build: no transfer resume either (with it, the
        // lost session resumes on fresh connections: tests/kv_resume.rs).
        cfg.resume_window = None;
    }
    cfg
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("bounded wait ran out")
}

fn metric(m: &pdd_io::metrics::Metrics, name: &str) -> u64 {
    m.snapshot()
        .into_iter()
        .find(|x| x.0 == name)
        .map(|x| x.1)
        .unwrap_or_else(|| panic!("no metric {name}"))
}

/// Every page of every layer: destination pages, and the source page of each
/// (reversed for odd requests, shifted by 5 for even ones, so that each transfer
/// leaves different bytes behind).
fn pages(request: u64) -> (Vec<u32>, Vec<u32>) {
    let dst: Vec<u32> = (0..PAGES).collect();
    let src: Vec<u32> = if request % 2 == 1 {
        (0..PAGES).rev().collect()
    } else {
        (0..PAGES).map(|p| (p + 5) % PAGES).collect()
    };
    (dst, src)
}

/// Grant every page, send layer 0, stall lane `STALLED` (if `stall`), send the
/// other layers, finish; returns what the receiver reported.
async fn transfer(
    rx: &KvReceiver,
    tx: &KvSender,
    wan: &WanemHandle,
    request: u64,
    stall: bool,
) -> Result<u64, Error> {
    let (dst, src) = pages(request);
    let inbound = rx.grant(request, &dst, None, Some(tx.session_id()), None)?;
    let out = bounded(tx.wait_grant(request)).await?;
    out.send_layer(0, 0, &src).await?;
    if stall {
        assert!(wan.stall_connection(STALLED, Direction::ClientToUpstream, STALL));
    }
    for layer in 1..LAYERS {
        out.send_layer(layer, layer, &src).await?;
    }
    out.finish().await?;
    let got = bounded(inbound.wait()).await;
    let confirmed = bounded(out.wait()).await;
    assert_eq!(got.is_ok(), confirmed.is_ok(), "{got:?} vs {confirmed:?}");
    got
}

fn verify(rx: &KvReceiver, src_pool: &PagePool, request: u64) {
    let (dst, src) = pages(request);
    for layer in 0..LAYERS {
        for (d, s) in dst.iter().zip(&src) {
            assert!(
                rx.pool().copy_page(layer, *d).unwrap() == src_pool.copy_page(layer, *s).unwrap(),
                "layer {layer} page {d} differs from its source page {s}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_lane_is_revoked_and_its_blocks_move_to_the_other_lanes() {
    let rx = receiver().await;
    let wan = proxy(&rx).await;
    let src_pool = pattern_pool(9);
    let tx = KvSender::connect(src_pool.clone(), sender_cfg(wan.local_addr(), true))
        .await
        .unwrap();
    bounded(rx.wait_peer(Some(42))).await;
    assert_eq!(wan.connections().len(), 1 + usize::from(LANES));

    let started = Instant::now();
    let bytes = transfer(&rx, &tx, &wan, 1, true).await.unwrap();
    let took = started.elapsed();
    assert_eq!(
        bytes,
        u64::from(LAYERS) * u64::from(PAGES) * u64::from(PAGE)
    );
    verify(&rx, &src_pool, 1);
    let (revoked, resent) = (
        metric(tx.metrics(), "lanes_revoked_total"),
        metric(tx.metrics(), "blocks_resent_total"),
    );
    let (dup, abandoned) = (
        metric(rx.metrics(), "blocks_duplicate_total"),
        metric(rx.metrics(), "blocks_abandoned_total"),
    );
    eprintln!(
        "stalled lane: transfer took {took:?}; lanes revoked {revoked}, blocks resent {resent}, \
         duplicates {dup}, abandoned {abandoned}"
    );
    assert_eq!(revoked, 1);
    assert!(resent > 0);
    assert_eq!(metric(tx.metrics(), "sessions_lost_total"), 0);
    assert!(took < STALL, "the transfer waited for the stall to end");

    // The same session carries the next transfer on the lanes left.
    let bytes = transfer(&rx, &tx, &wan, 2, false).await.unwrap();
    assert_eq!(
        bytes,
        u64::from(LAYERS) * u64::from(PAGES) * u64::from(PAGE)
    );
    verify(&rx, &src_pool, 2);
    assert_eq!(metric(tx.metrics(), "lanes_revoked_total"), 1);
    assert_eq!(metric(tx.metrics(), "sessions_lost_total"), 0);
    assert_eq!(metric(tx.metrics(), "reconnects_total"), 0);
    bounded(async {
        while metric(rx.metrics(), "pool_pages_held") != 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    wan.stall_connection(STALLED, Direction::ClientToUpstream, Duration::ZERO);
}

/// Compressed blocks (KV_PAGES_Z, `compress` on) of a revoked lane are resent as
/// compressed blocks flagged RESENT, and land exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_lanes_compressed_blocks_are_resent_and_land() {
    let rx = receiver().await;
    let wan = proxy(&rx).await;
    let src_pool = pattern_pool(11);
    let mut cfg = sender_cfg(wan.local_addr(), true);
    cfg.compress = pdd_io::compress::CompressMode::On;
    let tx = KvSender::connect(src_pool.clone(), cfg).await.unwrap();
    bounded(rx.wait_peer(Some(42))).await;
    let bytes = transfer(&rx, &tx, &wan, 1, true).await.unwrap();
    assert_eq!(
        bytes,
        u64::from(LAYERS) * u64::from(PAGES) * u64::from(PAGE)
    );
    verify(&rx, &src_pool, 1);
    assert_eq!(metric(tx.metrics(), "lanes_revoked_total"), 1);
    assert!(metric(tx.metrics(), "blocks_resent_total") > 0);
    // Every block went compressed, the resent ones included: each block was built
    // (and counted) as KV_PAGES_Z at least once, every copy written was compressed,
    // and no more copies were built than the blocks and their resends (a first copy
    // queued on the stalled lane may never have been built; one built may never have
    // been written: the count is taken when the frame is built).
    let blocks = u64::from(LAYERS) * u64::from(PAGES) / 2;
    let compressed = metric(tx.metrics(), "blocks_compressed_total");
    let resent = metric(tx.metrics(), "blocks_resent_total");
    assert!(
        (blocks..=blocks + resent).contains(&compressed),
        "{compressed} compressed for {blocks} blocks and {resent} resent"
    );
    assert!(metric(tx.metrics(), "blocks_sent_total") <= compressed);
    assert_eq!(metric(tx.metrics(), "sessions_lost_total"), 0);
    wan.stall_connection(STALLED, Direction::ClientToUpstream, Duration::ZERO);
}

/// The line is the bottleneck (every lane's queue full, `send_layer` waiting for
/// room on all of them, the stalled one included) when the lane is revoked: the
/// wait moves on to the other lanes instead of failing when the revoked lane's
/// queue closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_revoked_while_the_sender_waits_for_room_does_not_fail_it() {
    let rx = receiver().await;
    let wan = proxy_at(&rx, Some(8_000_000)).await;
    let src_pool = pattern_pool(4);
    let tx = KvSender::connect(src_pool.clone(), sender_cfg(wan.local_addr(), true))
        .await
        .unwrap();
    bounded(rx.wait_peer(Some(42))).await;
    let bytes = transfer(&rx, &tx, &wan, 1, true).await.unwrap();
    assert_eq!(
        bytes,
        u64::from(LAYERS) * u64::from(PAGES) * u64::from(PAGE)
    );
    verify(&rx, &src_pool, 1);
    assert_eq!(metric(tx.metrics(), "lanes_revoked_total"), 1);
    assert!(metric(tx.metrics(), "blocks_resent_total") > 0);
    wan.stall_connection(STALLED, Direction::ClientToUpstream, Duration::ZERO);
}

/// The same over mutual TLS: the stall is read from the TCP socket under the TLS
/// stream, a write given up mid-record is never resumed, and the receiver's TLS
/// reader is cut off as cleanly as a plain one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_tls_lane_is_revoked_too() {
    use pdd_io::tls::TestPki;
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let pki = TestPki::generate(&names(&["md.example", "p1.example"])).unwrap();
    let rx = receiver_with(Some(
        pki.config("md.example", "md.example", &names(&["p1.example"]))
            .unwrap(),
    ))
    .await;
    let wan = proxy(&rx).await;
    let src_pool = pattern_pool(6);
    let mut cfg = sender_cfg(wan.local_addr(), true);
    cfg.tls = Some(pki.config("p1.example", "md.example", &[]).unwrap());
    let tx = KvSender::connect(src_pool.clone(), cfg).await.unwrap();
    bounded(rx.wait_peer(Some(42))).await;
    let bytes = transfer(&rx, &tx, &wan, 1, true).await.unwrap();
    assert_eq!(
        bytes,
        u64::from(LAYERS) * u64::from(PAGES) * u64::from(PAGE)
    );
    verify(&rx, &src_pool, 1);
    assert_eq!(metric(tx.metrics(), "lanes_revoked_total"), 1);
    assert!(metric(tx.metrics(), "blocks_resent_total") > 0);
    let bytes = transfer(&rx, &tx, &wan, 2, false).await.unwrap();
    assert_eq!(
        bytes,
        u64::from(LAYERS) * u64::from(PAGES) * u64::from(PAGE)
    );
    verify(&rx, &src_pool, 2);
    wan.stall_connection(STALLED, Direction::ClientToUpstream, Duration::ZERO);
}

/// The same stall without failover (what an older peer gets): the session ends and
/// the transfer fails, within the dead-peer bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_failover_a_stalled_lane_still_ends_the_session() {
    let rx = receiver().await;
    let wan = proxy(&rx).await;
    let tx = KvSender::connect(pattern_pool(9), sender_cfg(wan.local_addr(), false))
        .await
        .unwrap();
    bounded(rx.wait_peer(Some(42))).await;
    // Layer 0 goes through, then the lane stalls: the session ends by the stall
    // bounds (the sender's write and the receiver's read inside a block, both
    // dead_after = 3 s), not by the 60 s stall or the test's bound.
    let (got, _) = bounds::within(
        "a stalled lane without failover ends the session (dead_after 3 s)",
        Instant::now(),
        DEAD_AFTER * 3 / 4,
        DEAD_AFTER + Duration::from_secs(5),
        transfer(&rx, &tx, &wan, 1, true),
    )
    .await;
    let err = got.unwrap_err();
    // Two bounds of dead_after race here: the stalled read inside a block ends the
    // session (connection_lost), and the receiver's "no page moved for dead_after
    // since the sender's KV_DONE" fails the transfer (deadline_exceeded). Which fires
    // first is scheduling (a loaded CI host got the second); either ends it in time.
    assert!(
        matches!(err.reason(), "connection_lost" | "deadline_exceeded"),
        "{err:?}"
    );
    assert_eq!(metric(tx.metrics(), "lanes_revoked_total"), 0);
    wan.stall_connection(STALLED, Direction::ClientToUpstream, Duration::ZERO);
}

/// A middlebox acknowledges one data lane's bytes and drops them (the proxy reads
/// them at once, so the sender's socket drains and TCP_INFO shows every byte
/// acknowledged): only the receiver's LANE_DELIVERED shows the lane delivers
/// nothing. The lane is revoked, its blocks land on the others, the transfer
/// completes in time, and the same sender carries the next transfers on the lanes
/// left, with no reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_whose_bytes_are_acknowledged_but_never_delivered_is_revoked() {
    let rx = receiver().await;
    let wan = proxy(&rx).await;
    let src_pool = pattern_pool(9);
    let tx = KvSender::connect(src_pool.clone(), sender_cfg(wan.local_addr(), true))
        .await
        .unwrap();
    bounded(rx.wait_peer(Some(42))).await;
    assert_eq!(wan.connections().len(), 1 + usize::from(LANES));
    assert!(wan.swallow_connection(STALLED, Direction::ClientToUpstream, true));

    let started = Instant::now();
    let (dst, src) = pages(1);
    let inbound = rx
        .grant(1, &dst, None, Some(tx.session_id()), None)
        .unwrap();
    let out = bounded(tx.wait_grant(1)).await.unwrap();
    for layer in 0..LAYERS {
        out.send_layer(layer, layer, &src).await.unwrap();
    }
    out.finish().await.unwrap();
    let bytes = bounded(inbound.wait()).await.unwrap();
    bounded(out.wait()).await.unwrap();
    let took = started.elapsed();
    assert_eq!(
        bytes,
        u64::from(LAYERS) * u64::from(PAGES) * u64::from(PAGE)
    );
    verify(&rx, &src_pool, 1);
    let swallowed = wan.stats().client_to_upstream.bytes_blackholed;
    eprintln!(
        "swallowed lane: transfer took {took:?}, {swallowed} bytes dropped by the middlebox, \
         lanes revoked {}, blocks resent {}",
        metric(tx.metrics(), "lanes_revoked_total"),
        metric(tx.metrics(), "blocks_resent_total")
    );
    assert!(
        swallowed > 0,
        "the middlebox dropped nothing: the test proves nothing"
    );
    assert_eq!(metric(tx.metrics(), "lanes_revoked_total"), 1);
    assert!(metric(tx.metrics(), "blocks_resent_total") > 0);
    // Within the stall bound and a few heartbeats, not by the receiver's bound after
    // KV_DONE (dead_after), which would fail the transfer instead.
    assert!(took < DEAD_AFTER, "took {took:?}");

    for request in 2..=3 {
        let bytes = transfer(&rx, &tx, &wan, request, false).await.unwrap();
        assert_eq!(
            bytes,
            u64::from(LAYERS) * u64::from(PAGES) * u64::from(PAGE)
        );
        verify(&rx, &src_pool, request);
    }
    assert_eq!(metric(tx.metrics(), "lanes_revoked_total"), 1);
    assert_eq!(metric(tx.metrics(), "sessions_lost_total"), 0);
    assert_eq!(metric(tx.metrics(), "reconnects_total"), 0);
}

mod scripted {
    //! The receiver's half of the handshake, driven by a scripted sender on raw
    //! lanes (deterministic: the block is cut off mid-way on purpose).

    use super::*;
    use pdd_core::wire::{encode_frame_to_vec, Frame, KvGrant, KvPages, LaneRevoke};
    use pdd_io::lane::{self, LaneKey, LaneStream};
    use tokio::io::AsyncWriteExt;

    const SMALL: u32 = 1024;

    async fn small_receiver() -> KvReceiver {
        let pool = PagePool::new(
            vec![MemoryRegion::from_vec(vec![0; 8 * SMALL as usize])],
            SMALL,
        )
        .unwrap();
        let mut cfg = ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::MainDecode, capability::KV_STREAM),
        );
        cfg.dead_after = DEAD_AFTER;
        KvReceiver::start(Arc::new(pool), cfg).await.unwrap()
    }

    /// Control lane and data lanes 1 and 2 of session 9, offering `caps`, and the
    /// grant of pages 0..2 of layer 0.
    async fn open(
        rx: &KvReceiver,
        caps: u64,
    ) -> (
        LaneStream,
        [LaneStream; 2],
        KvGrant,
        pdd_io::receiver::InboundTransfer,
    ) {
        let hello = LocalHello::new(Role::Prefill, caps);
        let tuning = SocketTuning::default();
        let addr = rx.local_addr();
        let opened = lane::connect(addr, &hello, 9, 0, &LaneKey::Root, &tuning, None, BOUND)
            .await
            .unwrap();
        let mut control = opened.stream;
        let key = LaneKey::Session(opened.session_secret);
        let mut data = Vec::new();
        for n in 1..=2 {
            data.push(
                lane::connect(addr, &hello, 9, n, &key, &tuning, None, BOUND)
                    .await
                    .unwrap()
                    .stream,
            );
        }
        bounded(rx.wait_peer(Some(9))).await;
        let inbound = rx.grant(1, &[0, 1], Some(1), None, None).unwrap();
        let grant = loop {
            if let Some(Frame::KvGrant(g)) = next(&mut control).await {
                break g;
            }
        };
        let data: [LaneStream; 2] = data.try_into().ok().unwrap();
        (control, data, grant, inbound)
    }

    async fn next(control: &mut LaneStream) -> Option<Frame> {
        bounded(lane::read_frame_exact(control, 1 << 20))
            .await
            .unwrap()
    }

    fn block(grant: &KvGrant, page: u32, fill: u8, resent: bool) -> Vec<u8> {
        let f = Frame::KvPages(KvPages {
            transfer_id: grant.transfer_id,
            layer_start: 0,
            layer_count: 1,
            page_start: page,
            page_count: 1,
            page_bytes: SMALL,
            data: vec![fill; SMALL as usize].into(),
            resent,
        });
        encode_frame_to_vec(&f, 1 << 24).unwrap()
    }

    /// Lane 1 carries block 0 whole and half of block 1, then is revoked: the
    /// receiver answers LANE_REVOKED only after its reader ended, block 1 is
    /// abandoned (not failed), and both blocks resent on lane 2 complete the
    /// transfer: block 0 as a duplicate, block 1 landing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_revoked_lanes_cut_block_is_abandoned_and_its_resend_lands() {
        let rx = small_receiver().await;
        let caps = capability::KV_STREAM | capability::LANE_FAILOVER;
        let (mut control, [mut one, mut two], grant, inbound) = open(&rx, caps).await;
        one.write_all(&block(&grant, 0, 0x11, false)).await.unwrap();
        let cut = block(&grant, 1, 0x22, false);
        one.write_all(&cut[..cut.len() / 2]).await.unwrap();
        one.flush().await.unwrap();
        // Block 0 landed and block 1 is being read.
        bounded(async {
            while rx.pool().copy_page(0, 0).unwrap()[0] != 0x11 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let revoke = Frame::LaneRevoke(LaneRevoke { lane: 1 });
        lane::write_frame(&mut control, &revoke, 1 << 20)
            .await
            .unwrap();
        loop {
            match next(&mut control).await {
                Some(Frame::LaneRevoked(r)) => {
                    assert_eq!(r.lane, 1);
                    break;
                }
                Some(_) => continue,
                None => panic!("control lane closed"),
            }
        }
        assert_eq!(metric(rx.metrics(), "blocks_abandoned_total"), 1);
        // The revoked lane is closed: the rest of the cut block lands nowhere.
        let _ = one.write_all(&cut[cut.len() / 2..]).await;
        // Revoking again (or an unknown lane) is answered too.
        lane::write_frame(&mut control, &revoke, 1 << 20)
            .await
            .unwrap();
        assert!(matches!(
            next(&mut control).await,
            Some(Frame::LaneRevoked(_))
        ));
        two.write_all(&block(&grant, 0, 0x33, true)).await.unwrap();
        two.write_all(&block(&grant, 1, 0x44, true)).await.unwrap();
        let done = Frame::KvDone(pdd_core::wire::KvDone {
            transfer_id: grant.transfer_id,
            chunk_count: 2,
            byte_count: 2 * u64::from(SMALL),
        });
        lane::write_frame(&mut control, &done, 1 << 20)
            .await
            .unwrap();
        let bytes = bounded(inbound.wait()).await.unwrap();
        assert_eq!(bytes, 2 * u64::from(SMALL));
        assert_eq!(metric(rx.metrics(), "blocks_duplicate_total"), 1);
        // The duplicate changed nothing; the resend landed.
        assert!(rx
            .pool()
            .copy_page(0, 0)
            .unwrap()
            .iter()
            .all(|&b| b == 0x11));
        assert!(rx
            .pool()
            .copy_page(0, 1)
            .unwrap()
            .iter()
            .all(|&b| b == 0x44));
        // Published just after the completion is: wait for it.
        bounded(async {
            while metric(rx.metrics(), "pool_pages_held") != 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await;
    }

    /// A peer that did not offer lane failover: a RESENT block is refused
    /// (`invalid_flags`), the session ends and the transfer fails.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_the_capability_resent_blocks_are_refused() {
        let rx = small_receiver().await;
        let (_control, [mut one, _two], grant, inbound) = open(&rx, capability::KV_STREAM).await;
        one.write_all(&block(&grant, 0, 0x11, true)).await.unwrap();
        let err = bounded(inbound.wait()).await.unwrap_err();
        assert_eq!(err.reason(), "invalid_flags", "{err:?}");
        assert_eq!(metric(rx.metrics(), "violations_total"), 1);
    }
}
