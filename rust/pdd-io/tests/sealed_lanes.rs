//! Sealed data lanes (capability `sealed_lanes`): TLS data lanes whose KV leaves
//! TLS's record layer after the HELLO and is decrypted inside the pages. Real
//! endpoints over mutual TLS on loopback, and a scripted sender that writes sealed
//! records itself (so the receiver's reading of the format is pinned down, and forged
//! records can be tried).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use pdd_core::kv::KvBlock;
use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, Frame, FrameHeader, FrameKind, KvDone, Role, KV_PAGES_FIXED_LEN};
use pdd_io::lane::{self, LaneKey, SocketTuning};
use pdd_io::metrics::Metrics;
use pdd_io::pool::{MemoryRegion, PagePool};
use pdd_io::receiver::{KvReceiver, ReceiverConfig};
use pdd_io::sealed::{self, LaneKeys};
use pdd_io::sender::{KvSender, SenderConfig};
use pdd_io::tls::{TestPki, TlsConfig};
use tokio::io::AsyncWriteExt;

const BOUND: Duration = Duration::from_secs(30);
const LAYERS: u16 = 2;
const PAGES: u32 = 4;
const SENDER: u64 = 42;

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("bounded wait ran out")
}

fn pki() -> TestPki {
    TestPki::generate(&["md.example".to_string(), "p1.example".to_string()]).unwrap()
}

fn receiver_tls(pki: &TestPki) -> TlsConfig {
    pki.config("md.example", "md.example", &["p1.example".to_string()])
        .unwrap()
}

fn sender_tls(pki: &TestPki) -> TlsConfig {
    pki.config("p1.example", "md.example", &[]).unwrap()
}

/// Every byte differs from its neighbours and from the same offset of other pages.
fn pattern_pool(page: u32, seed: u8) -> Arc<PagePool> {
    let layers = (0..LAYERS)
        .map(|l| {
            MemoryRegion::from_vec(
                (0..(PAGES * page) as usize)
                    .map(|i| {
                        (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed ^ l as u8
                    })
                    .collect(),
            )
        })
        .collect();
    Arc::new(PagePool::new(layers, page).unwrap())
}

fn zero_pool(page: u32) -> Arc<PagePool> {
    let layers = (0..LAYERS)
        .map(|_| MemoryRegion::from_vec(vec![0; (PAGES * page) as usize]))
        .collect();
    Arc::new(PagePool::new(layers, page).unwrap())
}

fn metric(m: &Metrics, name: &str) -> u64 {
    m.snapshot()
        .into_iter()
        .find(|(n, ..)| *n == name)
        .map(|(_, v, ..)| v)
        .unwrap_or_else(|| panic!("no metric {name}"))
}

async fn receiver(page: u32, pki: &TestPki, sealed: bool) -> KvReceiver {
    // The bit set by hand too: `sealed_lanes = false` must clear it, not only not add it.
    let mut cfg = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        LocalHello::new(
            Role::MainDecode,
            capability::KV_STREAM | capability::SEALED_LANES,
        ),
    );
    cfg.tls = Some(receiver_tls(pki));
    cfg.sealed_lanes = sealed;
    KvReceiver::start(zero_pool(page), cfg).await.unwrap()
}

/// One transfer of pages 1 and 3 of every layer (into pages 0 and 2), checked byte by
/// byte against the source.
async fn transfer(rx: &KvReceiver, tx: &KvSender, src: &PagePool, request: u64) {
    let inbound = rx
        .grant(request, &[0, 2], None, Some(SENDER), None)
        .unwrap();
    let out = bounded(tx.wait_grant(request)).await.unwrap();
    for layer in 0..LAYERS {
        out.send_layer(layer, layer, &[1, 3]).await.unwrap();
    }
    out.finish().await.unwrap();
    bounded(inbound.wait()).await.unwrap();
    for layer in 0..LAYERS {
        for (dst, from) in [(0, 1), (2, 3)] {
            assert_eq!(
                rx.pool().copy_page(layer, dst).unwrap(),
                src.copy_page(layer, from).unwrap(),
                "request {request} layer {layer} page {dst}"
            );
        }
    }
}

/// Pages below, at and above a record's chunk, sealed end to end: every byte lands,
/// and both ends say their lanes left TLS's record layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_lanes_carry_pages_of_every_size() {
    let pki = pki();
    for page in [
        4096,
        sealed::SEAL_CHUNK as u32,
        sealed::SEAL_CHUNK as u32 + 4100,
        1 << 20,
    ] {
        let rx = receiver(page, &pki, true).await;
        let src = pattern_pool(page, page as u8);
        let mut cfg = SenderConfig::new(
            rx.local_addr(),
            SENDER,
            LocalHello::new(Role::Prefill, capability::KV_STREAM),
        );
        cfg.tls = Some(sender_tls(&pki));
        cfg.lanes = 2;
        // Blocks of several pages, and of one page, on the same lanes.
        cfg.max_block_bytes = if page < 1 << 20 { 3 * page } else { page };
        let tx = KvSender::connect(src.clone(), cfg).await.unwrap();
        bounded(rx.wait_peer(Some(SENDER))).await;
        for request in 1..=3 {
            transfer(&rx, &tx, &src, request).await;
        }
        assert_eq!(metric(tx.metrics(), "lanes_sealed_total"), 2, "page {page}");
        assert_eq!(metric(rx.metrics(), "lanes_sealed_total"), 2, "page {page}");
        assert_eq!(metric(rx.metrics(), "checksum_failures_total"), 0);
    }
}

/// Either end without sealed lanes (a peer of an older build): the lanes stay in TLS
/// records and the bytes still land. Both ends' HELLOs carry the sealed-lanes bit set
/// by hand: `sealed_lanes = false` clears it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_sealed_lanes_on_either_end_tls_records_carry_the_kv() {
    let pki = pki();
    let page = 64 << 10;
    for (rx_sealed, tx_sealed) in [(true, false), (false, true)] {
        let rx = receiver(page, &pki, rx_sealed).await;
        let src = pattern_pool(page, 7);
        let mut cfg = SenderConfig::new(
            rx.local_addr(),
            SENDER,
            LocalHello::new(
                Role::Prefill,
                capability::KV_STREAM | capability::SEALED_LANES,
            ),
        );
        cfg.tls = Some(sender_tls(&pki));
        cfg.sealed_lanes = tx_sealed;
        let tx = KvSender::connect(src.clone(), cfg).await.unwrap();
        bounded(rx.wait_peer(Some(SENDER))).await;
        transfer(&rx, &tx, &src, 1).await;
        assert_eq!(metric(tx.metrics(), "lanes_sealed_total"), 0);
        assert_eq!(metric(rx.metrics(), "lanes_sealed_total"), 0);
    }
}

/// A scripted sender: a control lane and one sealed data lane, over TLS.
struct Scripted {
    control: lane::LaneStream,
    data: tokio::net::TcpStream,
    keys: LaneKeys,
    /// What a further data lane of this session authenticates with.
    key: LaneKey,
    hello: LocalHello,
}

async fn scripted(rx: &KvReceiver, pki: &TestPki) -> Scripted {
    let mut h = LocalHello::new(
        Role::Prefill,
        capability::KV_STREAM | capability::SEALED_LANES,
    );
    h.secret = None;
    let t = SocketTuning::default();
    let tls = sender_tls(pki);
    let c = lane::connect(
        rx.local_addr(),
        &h,
        SENDER,
        0,
        &LaneKey::Root,
        &t,
        Some(&tls),
        BOUND,
    )
    .await
    .unwrap();
    let key = LaneKey::Session(c.session_secret);
    let d = lane::connect(rx.local_addr(), &h, SENDER, 1, &key, &t, Some(&tls), BOUND)
        .await
        .unwrap();
    assert!(lane::sealed(&d.agreed), "both ends offered sealed lanes");
    let (data, keys) = d.stream.into_sealed().unwrap();
    Scripted {
        control: c.stream,
        data,
        keys,
        key,
        hello: h,
    }
}

/// The sealed records of one block: its head, then its pages chunk by chunk.
fn sealed_block(keys: &mut LaneKeys, block: &KvBlock, pages: &[Vec<u8>]) -> Vec<u8> {
    let data: u64 = pages.iter().map(|p| p.len() as u64).sum();
    let header = FrameHeader {
        kind: FrameKind::KvPages,
        flags: 0,
        payload_len: (KV_PAGES_FIXED_LEN as u64 + data) as u32,
        crc: 0,
    };
    let mut head = header.to_bytes().to_vec();
    head.extend_from_slice(&block.to_fixed());
    let mut out = Vec::new();
    keys.push_record(&mut out, &head);
    for page in pages {
        for chunk in sealed::page_chunks(page) {
            keys.push_record(&mut out, chunk);
        }
    }
    out
}

/// The KV_DONE, on the scripted sender's control lane, of a transfer sent as one
/// [`block`] of two pages.
async fn send_done(s: &mut Scripted, transfer_id: u64, page_bytes: u32) {
    let done = Frame::KvDone(KvDone {
        transfer_id,
        chunk_count: 1,
        byte_count: 2 * u64::from(page_bytes),
    });
    lane::write_frame(&mut s.control, &done, 1 << 20)
        .await
        .unwrap();
}

fn block(transfer_id: u64, page_bytes: u32) -> KvBlock {
    KvBlock {
        transfer_id,
        layer_start: 0,
        layer_count: 1,
        page_start: 0,
        page_count: 2,
        page_bytes,
    }
}

/// The receiver reads the sealed format as `sealed.rs` documents it: a block of
/// sealed records lands byte for byte; a block drained past (its transfer cancelled)
/// still counts its records, so the next block opens; a record with one flipped byte
/// fails its transfer and ends the lane, never landing as data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_receiver_opens_sealed_records_in_the_pages_and_refuses_forged_ones() {
    let pki = pki();
    let page = sealed::SEAL_CHUNK as u32 + 512;
    let rx = receiver(page, &pki, true).await;
    let mut s = scripted(&rx, &pki).await;
    let bytes = |fill: u8| -> Vec<Vec<u8>> {
        (0..2)
            .map(|p| (0..page as usize).map(|i| (i as u8) ^ fill ^ p).collect())
            .collect()
    };

    // A cancelled transfer's block is drained: read past, not opened.
    let cancelled = rx.grant(1, &[0, 1], Some(1), Some(SENDER), None).unwrap();
    assert!(rx.cancel(cancelled.grant.transfer_id));
    let wire = sealed_block(
        &mut s.keys,
        &block(cancelled.grant.transfer_id, page),
        &bytes(9),
    );
    s.data.write_all(&wire).await.unwrap();

    // The next block opens under the record count that skipped the drained one.
    let inbound = rx.grant(2, &[2, 3], Some(1), Some(SENDER), None).unwrap();
    let tid = inbound.grant.transfer_id;
    let wire = sealed_block(&mut s.keys, &block(tid, page), &bytes(0x3c));
    s.data.write_all(&wire).await.unwrap();
    send_done(&mut s, tid, page).await;
    bounded(inbound.wait()).await.unwrap();
    assert_eq!(rx.pool().copy_page(0, 2).unwrap(), bytes(0x3c)[0]);
    assert_eq!(rx.pool().copy_page(0, 3).unwrap(), bytes(0x3c)[1]);
    assert_eq!(metric(rx.metrics(), "blocks_drained_total"), 1);
    assert_eq!(metric(rx.metrics(), "lanes_sealed_total"), 1);

    // One byte flipped in the second page's second record: refused, nothing counts.
    let forged = rx.grant(3, &[0, 1], Some(1), Some(SENDER), None).unwrap();
    let mut wire = sealed_block(
        &mut s.keys,
        &block(forged.grant.transfer_id, page),
        &bytes(0x55),
    );
    let last = wire.len() - 100;
    wire[last] ^= 0x01;
    let _ = s.data.write_all(&wire).await;
    let err = bounded(forged.wait()).await.unwrap_err();
    assert!(err.to_string().contains("AEAD"), "{err}");
    assert_eq!(metric(rx.metrics(), "checksum_failures_total"), 1);
    assert_eq!(
        rx.metrics().bytes_received_total.load(Ordering::Relaxed),
        2 * u64::from(page)
    );
}

/// A head record with one flipped byte ends the lane (its header cannot be trusted, so
/// it names no transfer to fail) and is counted; the grant is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_head_record_ends_the_lane_and_touches_no_grant() {
    use tokio::io::AsyncReadExt;
    let pki = pki();
    let page = 4096;
    let rx = receiver(page, &pki, true).await;
    let mut s = scripted(&rx, &pki).await;
    let inbound = rx.grant(1, &[0, 1], Some(1), Some(SENDER), None).unwrap();
    let pages = [vec![0xAB; 4096], vec![0xCD; 4096]];
    let mut wire = sealed_block(&mut s.keys, &block(inbound.grant.transfer_id, page), &pages);
    wire[sealed::TAG_LEN + 3] ^= 0x80; // inside the head record's ciphertext
    let _ = s.data.write_all(&wire).await;
    // The receiver closes the lane: a close or a reset, never a byte.
    let mut byte = [0u8; 1];
    let end = bounded(s.data.read(&mut byte)).await;
    assert!(!matches!(end, Ok(1)), "{end:?}");
    assert_eq!(metric(rx.metrics(), "checksum_failures_total"), 1);
    assert_eq!(metric(rx.metrics(), "blocks_received_total"), 0);
    for p in [0, 1] {
        assert!(rx.pool().copy_page(0, p).unwrap().iter().all(|&b| b == 0));
    }
}

/// A data lane whose sender goes away right after its HELLO (a TCP close, no TLS
/// close_notify, so the receiver switches to sealed records and then reads the end)
/// ends alone: no violation, and the session and its other data lane carry transfers
/// on. (A close_notify that reached rustls before the switch takes the switch's own
/// quiet path; its timing cannot be forced from here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_lane_closed_right_after_its_hello_ends_alone() {
    let pki = pki();
    let page = 4096;
    let rx = receiver(page, &pki, true).await;
    let mut s = scripted(&rx, &pki).await;
    let tls = sender_tls(&pki);
    let t = SocketTuning::default();
    for lane_no in [2u16, 3] {
        let d = lane::connect(
            rx.local_addr(),
            &s.hello,
            SENDER,
            lane_no,
            &s.key,
            &t,
            Some(&tls),
            BOUND,
        )
        .await
        .unwrap();
        drop(d.stream);
    }
    for request in 1..=2u64 {
        // Give the receiver time to see the closes before (and between) the transfers;
        // correctness does not depend on it, only what the test exercises.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let inbound = rx
            .grant(request, &[0, 1], Some(1), Some(SENDER), None)
            .unwrap();
        let tid = inbound.grant.transfer_id;
        let pages: Vec<Vec<u8>> = (0..2u8)
            .map(|p| vec![p ^ request as u8 ^ 0x5a; page as usize])
            .collect();
        let wire = sealed_block(&mut s.keys, &block(tid, page), &pages);
        s.data.write_all(&wire).await.unwrap();
        send_done(&mut s, tid, page).await;
        bounded(inbound.wait()).await.unwrap();
        assert_eq!(rx.pool().copy_page(0, 1).unwrap(), pages[1]);
    }
    assert_eq!(metric(rx.metrics(), "violations_total"), 0);
    assert_eq!(metric(rx.metrics(), "sessions_lost_total"), 0);
    assert_eq!(metric(rx.metrics(), "checksum_failures_total"), 0);
    assert_eq!(metric(rx.metrics(), "transfers_completed_total"), 2);
}
