//! KV compression on the data lanes (capability `kv_compress`, KV_PAGES_Z): real
//! endpoints on plain, TLS-record and sealed lanes land every page exactly; a sender
//! without it sends plain frames; a scripted sender shows what the receiver refuses
//! (KV_PAGES_Z without the capability, inconsistent lengths, pages that do not decode
//! to their CRC).

use std::sync::Arc;
use std::time::Duration;

use pdd_core::codec::{PageEncoder, CODEC_PLANE_ZSTD, DEFAULT_LEVEL};
use pdd_core::kv::KvBlock;
use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, Frame, KvPagesZ, Role};
use pdd_io::compress::CompressMode;
use pdd_io::lane::{self, LaneKey, SocketTuning};
use pdd_io::metrics::Metrics;
use pdd_io::pool::{MemoryRegion, PagePool};
use pdd_io::receiver::{KvReceiver, ReceiverConfig};
use pdd_io::sender::{KvSender, SenderConfig};
use pdd_io::tls::{TestPki, TlsConfig};

const BOUND: Duration = Duration::from_secs(30);
const LAYERS: u16 = 2;
const PAGES: u32 = 6;
const PAGE: u32 = 64 << 10;
const SENDER: u64 = 42;

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("bounded wait ran out")
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// bf16-like pages (a few exponents, random mantissas), except page 4 of each layer:
/// random bytes, which the codec cannot shrink (sent as they are inside KV_PAGES_Z).
fn kv_pool(seed: u64) -> Arc<PagePool> {
    let layers = (0..LAYERS)
        .map(|l| {
            let mut x = seed ^ (u64::from(l) << 32) | 1;
            let mut bytes = Vec::with_capacity((PAGES * PAGE) as usize);
            for page in 0..PAGES {
                for _ in 0..PAGE / 2 {
                    let r = xorshift(&mut x);
                    let v = if page == 4 {
                        r as u16
                    } else {
                        ((r >> 20) as u16 & 0x8000)
                            | ((120 + (r % 6) as u16) << 7)
                            | (r >> 40) as u16 & 0x7F
                    };
                    bytes.extend(v.to_le_bytes());
                }
            }
            MemoryRegion::from_vec(bytes)
        })
        .collect();
    Arc::new(PagePool::new(layers, PAGE).unwrap())
}

fn zero_pool() -> Arc<PagePool> {
    let layers = (0..LAYERS)
        .map(|_| MemoryRegion::from_vec(vec![0; (PAGES * PAGE) as usize]))
        .collect();
    Arc::new(PagePool::new(layers, PAGE).unwrap())
}

fn metric(m: &Metrics, name: &str) -> u64 {
    m.snapshot()
        .into_iter()
        .find(|(n, ..)| *n == name)
        .map(|(_, v, ..)| v)
        .unwrap_or_else(|| panic!("no metric {name}"))
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Lanes {
    Plain,
    TlsRecords,
    Sealed,
}

fn pki() -> TestPki {
    TestPki::generate(&["md.example".to_string(), "p1.example".to_string()]).unwrap()
}

async fn pair(lanes: Lanes, compress: CompressMode, src: Arc<PagePool>) -> (KvReceiver, KvSender) {
    let pki = pki();
    let mut rcfg = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        LocalHello::new(Role::MainDecode, capability::KV_STREAM),
    );
    let tls = |name: &str, peers: &[String]| -> TlsConfig {
        pki.config(name, "md.example", peers).unwrap()
    };
    if lanes != Lanes::Plain {
        rcfg.tls = Some(tls("md.example", &["p1.example".to_string()]));
        rcfg.sealed_lanes = lanes == Lanes::Sealed;
    }
    let rx = KvReceiver::start(zero_pool(), rcfg).await.unwrap();
    let mut cfg = SenderConfig::new(
        rx.local_addr(),
        SENDER,
        LocalHello::new(Role::Prefill, capability::KV_STREAM),
    );
    cfg.lanes = 2;
    // Blocks of two pages, one of them sometimes the random page.
    cfg.max_block_bytes = 2 * PAGE;
    cfg.compress = compress;
    if lanes != Lanes::Plain {
        cfg.tls = Some(tls("p1.example", &[]));
        cfg.sealed_lanes = lanes == Lanes::Sealed;
    }
    let tx = KvSender::connect(src, cfg).await.unwrap();
    bounded(rx.wait_peer(Some(SENDER))).await;
    (rx, tx)
}

/// Pages 0..6 of every layer into pages 5..0 (reversed), checked byte by byte.
/// Returns the transfer's own compression figures (blocks, bytes before, after).
async fn transfer(rx: &KvReceiver, tx: &KvSender, src: &PagePool, request: u64) -> (u64, u64, u64) {
    let dst: Vec<u32> = (0..PAGES).rev().collect();
    let from: Vec<u32> = (0..PAGES).collect();
    let inbound = rx.grant(request, &dst, None, Some(SENDER), None).unwrap();
    let out = bounded(tx.wait_grant(request)).await.unwrap();
    for layer in 0..LAYERS {
        out.send_layer(layer, layer, &from).await.unwrap();
    }
    out.finish().await.unwrap();
    bounded(inbound.wait()).await.unwrap();
    bounded(out.wait()).await.unwrap();
    for layer in 0..LAYERS {
        for (d, s) in dst.iter().zip(&from) {
            assert_eq!(
                rx.pool().copy_page(layer, *d).unwrap(),
                src.copy_page(layer, *s).unwrap(),
                "layer {layer} page {d}"
            );
        }
    }
    let c = out.compression();
    let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    (get(&c.blocks), get(&c.bytes_before), get(&c.bytes_after))
}

async fn compressed_pages_land_exactly(lanes: Lanes) {
    let src = kv_pool(7);
    let (rx, tx) = pair(lanes, CompressMode::On, src.clone()).await;
    let mut per_transfer = Vec::new();
    for request in 1..=2 {
        per_transfer.push(transfer(&rx, &tx, &src, request).await);
    }
    let (m, r) = (tx.metrics(), rx.metrics());
    // Each transfer's own figures: its blocks and all its page bytes; together, what
    // the endpoint counted.
    for (blocks, before, _) in &per_transfer {
        let want = (
            u64::from(LAYERS) * u64::from(PAGES) / 2,
            u64::from(LAYERS) * u64::from(PAGES * PAGE),
        );
        assert_eq!((*blocks, *before), want);
    }
    let after: u64 = per_transfer.iter().map(|t| t.2).sum();
    assert_eq!(after, metric(m, "compress_out_bytes_total"));
    let blocks = u64::from(LAYERS) * u64::from(PAGES) / 2 * 2;
    assert_eq!(metric(m, "blocks_compressed_total"), blocks, "{lanes:?}");
    let (before, after) = (
        metric(m, "compress_in_bytes_total"),
        metric(m, "compress_out_bytes_total"),
    );
    assert_eq!(before, blocks * 2 * u64::from(PAGE));
    // Five of six pages shrink by about a third; the random one does not.
    assert!(after * 10 < before * 9, "{after} of {before}");
    assert!(metric(m, "codec_ns_total") > 0 && metric(r, "codec_ns_total") > 0);
    assert_eq!(metric(r, "bytes_received_total"), before);
    assert_eq!(metric(r, "checksum_failures_total"), 0);
    let sealed = metric(r, "lanes_sealed_total");
    assert_eq!(
        sealed > 0,
        lanes == Lanes::Sealed,
        "{lanes:?}: {sealed} sealed lanes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_pages_land_exactly_on_plain_lanes() {
    compressed_pages_land_exactly(Lanes::Plain).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_pages_land_exactly_on_tls_record_lanes() {
    compressed_pages_land_exactly(Lanes::TlsRecords).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_pages_land_exactly_on_sealed_lanes() {
    compressed_pages_land_exactly(Lanes::Sealed).await;
}

/// `off` does not offer the capability: plain KV_PAGES, as between older peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_without_compression_sends_plain_frames() {
    let src = kv_pool(9);
    let (rx, tx) = pair(Lanes::Plain, CompressMode::Off, src.clone()).await;
    assert_eq!(transfer(&rx, &tx, &src, 1).await, (0, 0, 0));
    assert_eq!(metric(tx.metrics(), "blocks_compressed_total"), 0);
    assert_eq!(metric(tx.metrics(), "codec_ns_total"), 0);
    assert_eq!(metric(rx.metrics(), "codec_ns_total"), 0);
}

/// A scripted sender offering `caps`, with one one-page grant open: (control lane,
/// data lane, the grant's transfer id, the receiver's wait).
async fn scripted(
    rx: &KvReceiver,
    caps: u64,
) -> (
    lane::LaneStream,
    lane::LaneStream,
    u64,
    pdd_io::receiver::InboundTransfer,
) {
    let hello = LocalHello::new(Role::Prefill, capability::KV_STREAM | caps);
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
    let data = lane::connect(rx.local_addr(), &hello, 77, 1, &key, &tuning, None, BOUND)
        .await
        .unwrap()
        .stream;
    bounded(rx.wait_peer(Some(77))).await;
    let inbound = rx.grant(3, &[4], Some(1), None, None).unwrap();
    let grant = loop {
        match bounded(lane::read_frame_exact(&mut control, 1 << 20))
            .await
            .unwrap()
            .unwrap()
        {
            Frame::KvGrant(g) => break g,
            _ => continue,
        }
    };
    (control, data, grant.transfer_id, inbound)
}

/// A KV_PAGES_Z of page 0 of the one-page grant, holding `page` encoded.
fn z_frame(transfer_id: u64, page: &[u8]) -> KvPagesZ {
    let mut data = Vec::new();
    let n = PageEncoder::new(DEFAULT_LEVEL)
        .unwrap()
        .encode(page, &mut data)
        .expect("compressible");
    KvPagesZ {
        block: KvBlock {
            transfer_id,
            layer_start: 0,
            layer_count: 1,
            page_start: 0,
            page_count: 1,
            page_bytes: PAGE,
        },
        codec: CODEC_PLANE_ZSTD,
        raw_crc32c: crc32c::crc32c(page),
        lengths: vec![n as u32],
        data: data.into(),
        resent: false,
    }
}

fn page_of(pool: &PagePool) -> Vec<u8> {
    pool.copy_page(0, 0).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_compressed_block_lands_and_one_without_the_capability_ends_the_session() {
    let src = kv_pool(3);
    let page = page_of(&src);
    // Negotiated: it lands, decoded, in the granted page.
    let rx = KvReceiver::start(
        zero_pool(),
        ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::MainDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let (_control, mut data, id, inbound) = scripted(&rx, capability::KV_COMPRESS).await;
    lane::write_frame(&mut data, &Frame::KvPagesZ(z_frame(id, &page)), 1 << 24)
        .await
        .unwrap();
    pdd_io_wait_landed(&rx, 4, &page).await;
    drop(inbound);

    // Not negotiated: a protocol error, nothing written.
    let rx = KvReceiver::start(
        zero_pool(),
        ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::MainDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let (_control, mut data, id, inbound) = scripted(&rx, 0).await;
    lane::write_frame(&mut data, &Frame::KvPagesZ(z_frame(id, &page)), 1 << 24)
        .await
        .unwrap();
    let err = bounded(inbound.wait()).await.unwrap_err();
    assert_eq!(err.reason(), "invalid_field", "{err:?}");
    assert!(rx.pool().copy_page(0, 4).unwrap().iter().all(|&b| b == 0));
}

/// Until the page holds `want` (the block landed), within the bound.
async fn pdd_io_wait_landed(rx: &KvReceiver, page: u32, want: &[u8]) {
    bounded(async {
        while rx.pool().copy_page(0, page).unwrap() != want
            || metric(rx.metrics(), "blocks_received_total") == 0
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_that_do_not_decode_to_their_crc_fail_the_transfer() {
    let src = kv_pool(5);
    let page = page_of(&src);
    let rx = KvReceiver::start(
        zero_pool(),
        ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::MainDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let (_control, mut data, id, inbound) = scripted(&rx, capability::KV_COMPRESS).await;
    let mut frame = z_frame(id, &page);
    frame.raw_crc32c ^= 1;
    lane::write_frame(&mut data, &Frame::KvPagesZ(frame), 1 << 24)
        .await
        .unwrap();
    let err = bounded(inbound.wait()).await.unwrap_err();
    assert_eq!(err.reason(), "checksum_mismatch", "{err:?}");
    assert_eq!(metric(rx.metrics(), "checksum_failures_total"), 1);
    assert_eq!(metric(rx.metrics(), "blocks_received_total"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_page_that_does_not_decode_fails_the_transfer_inside_its_page() {
    let src = kv_pool(6);
    let page = page_of(&src);
    let rx = KvReceiver::start(
        zero_pool(),
        ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::MainDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let (_control, mut data, id, inbound) = scripted(&rx, capability::KV_COMPRESS).await;
    let mut frame = z_frame(id, &page);
    // The high plane's zstd frame broken (its magic): the frame is consistent, the page is not.
    let mut bytes = frame.data.to_vec();
    bytes[4] ^= 0xFF;
    frame.data = bytes.into();
    lane::write_frame(&mut data, &Frame::KvPagesZ(frame), 1 << 24)
        .await
        .unwrap();
    let err = bounded(inbound.wait()).await.unwrap_err();
    assert_eq!(err.reason(), "invalid_field", "{err:?}");
    // Pages next to the granted one are untouched.
    for p in [3, 5] {
        assert!(rx.pool().copy_page(0, p).unwrap().iter().all(|&b| b == 0));
    }
}

/// A byte flipped on the wire inside a KV_PAGES_Z's stored pages: the frame's CRC
/// over the wire bytes fails the transfer before anything is decoded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_compressed_block_fails_its_crc_and_never_lands() {
    use tokio::io::AsyncWriteExt;
    let src = kv_pool(8);
    let page = page_of(&src);
    let rx = KvReceiver::start(
        zero_pool(),
        ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::MainDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let (_control, mut data, id, inbound) = scripted(&rx, capability::KV_COMPRESS).await;
    let mut bytes =
        pdd_core::wire::encode_frame_to_vec(&Frame::KvPagesZ(z_frame(id, &page)), 1 << 24).unwrap();
    let at = bytes.len() - 100; // inside the encoded page (its low plane)
    bytes[at] ^= 0x40;
    data.write_all(&bytes).await.unwrap();
    let err = bounded(inbound.wait()).await.unwrap_err();
    assert_eq!(err.reason(), "checksum_mismatch", "{err:?}");
    assert_eq!(metric(rx.metrics(), "checksum_failures_total"), 1);
    assert_eq!(
        metric(rx.metrics(), "codec_ns_total"),
        0,
        "nothing was decoded"
    );
}
