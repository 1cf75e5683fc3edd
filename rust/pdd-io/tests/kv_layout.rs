//! The KV layout exchange over real lanes (capability `kv_layout`): a scripted peer
//! on a raw control lane checks what the receiver sends first and how it answers
//! hostile KV_LAYOUT frames (a second one, one never negotiated): each ends the
//! session with ABORT `protocol_error` naming why. And the session is up
//! (`wait_peer`, `peers`) only once the peer's KV_LAYOUT came.

#[path = "common/bounds.rs"]
mod bounds;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, AbortReason, Frame, KvLayout, Role};
use pdd_io::lane::{self, LaneKey, LaneStream, SocketTuning};
use pdd_io::pool::{MemoryRegion, PagePool};
use pdd_io::receiver::{KvReceiver, ReceiverConfig};
use pdd_io::sender::{KvSender, SenderConfig};

const PAGE: u32 = 4096;
const BOUND: Duration = Duration::from_secs(20);

fn pool() -> Arc<PagePool> {
    let layers = (0..2)
        .map(|_| MemoryRegion::from_vec(vec![0; (8 * PAGE) as usize]))
        .collect();
    Arc::new(PagePool::new(layers, PAGE).unwrap())
}

async fn receiver(layout: Option<&[u8]>) -> KvReceiver {
    let hello = LocalHello::new(Role::MainDecode, capability::KV_STREAM);
    let mut cfg = ReceiverConfig::new("127.0.0.1:0".parse().unwrap(), hello);
    cfg.layout = layout.map(<[u8]>::to_vec);
    KvReceiver::start(pool(), cfg).await.unwrap()
}

fn layout(bytes: &[u8]) -> Frame {
    Frame::KvLayout(KvLayout {
        layout: Bytes::copy_from_slice(bytes),
    })
}

/// A raw control lane offering `caps`.
async fn raw_peer(rx: &KvReceiver, id: u64, caps: u64) -> LaneStream {
    let h = LocalHello::new(Role::Prefill, capability::KV_STREAM | caps);
    lane::connect(
        rx.local_addr(),
        &h,
        id,
        0,
        &LaneKey::Root,
        &SocketTuning::default(),
        None,
        BOUND,
    )
    .await
    .unwrap()
    .stream
}

/// The connection-wide ABORT the receiver ends the session with (skipping PINGs).
async fn session_abort(c: &mut LaneStream) -> (AbortReason, String) {
    loop {
        let f = tokio::time::timeout(BOUND, lane::read_frame_exact(c, 1 << 20))
            .await
            .expect("bounded")
            .expect("a frame")
            .expect("not closed before the ABORT");
        if let Frame::Abort(a) = f {
            if a.request_id == 0 {
                return (a.reason, a.message);
            }
        }
    }
}

async fn first_frame(c: &mut LaneStream) -> Frame {
    tokio::time::timeout(BOUND, lane::read_frame_exact(c, 1 << 20))
        .await
        .expect("bounded")
        .expect("a frame")
        .expect("open")
}

#[tokio::test]
async fn the_receivers_layout_comes_first_and_the_peer_is_up_only_with_its_own() {
    let rx = receiver(Some(b"decoder")).await;
    let mut c = raw_peer(&rx, 7, capability::KV_LAYOUT).await;
    assert_eq!(first_frame(&mut c).await, layout(b"decoder"));
    // Connected, not up: no layout yet.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(rx.peers().is_empty());
    assert_eq!(rx.peer_layout(Some(7)).unwrap(), None);
    assert!(rx.grant(1, &[0], None, Some(7), None).is_err());
    lane::write_frame(&mut c, &layout(b"prefill"), 1 << 20)
        .await
        .unwrap();
    assert_eq!(
        tokio::time::timeout(BOUND, rx.wait_peer(Some(7))).await,
        Ok(7)
    );
    assert_eq!(
        rx.peer_layout(None).unwrap().as_deref(),
        Some(&b"prefill"[..])
    );
    // A second one ends the session, the peer told why.
    lane::write_frame(&mut c, &layout(b"prefill again"), 1 << 20)
        .await
        .unwrap();
    let (reason, message) = session_abort(&mut c).await;
    assert_eq!(reason, AbortReason::ProtocolError);
    assert!(message.contains("a second KV_LAYOUT"), "{message}");
    bounds::until(|| rx.peers().is_empty()).await;
    rx.close(BOUND).await.unwrap();
}

#[tokio::test]
async fn a_layout_from_a_peer_that_did_not_negotiate_it_ends_the_session() {
    // The receiver has no layout: kv_layout is not agreed whatever the peer offers.
    let rx = receiver(None).await;
    let mut c = raw_peer(&rx, 8, capability::KV_LAYOUT).await;
    assert_eq!(
        tokio::time::timeout(BOUND, rx.wait_peer(Some(8))).await,
        Ok(8)
    );
    lane::write_frame(&mut c, &layout(b"prefill"), 1 << 20)
        .await
        .unwrap();
    let (reason, message) = session_abort(&mut c).await;
    assert_eq!(reason, AbortReason::ProtocolError);
    assert!(
        message.contains("kv_layout was not negotiated"),
        "{message}"
    );
    rx.close(BOUND).await.unwrap();
}

#[tokio::test]
async fn a_sender_connects_only_once_the_receivers_layout_came() {
    let rx = receiver(Some(b"decoder")).await;
    let hello = LocalHello::new(Role::Prefill, capability::KV_STREAM);
    let mut cfg = SenderConfig::new(rx.local_addr(), 11, hello);
    cfg.lanes = 1;
    cfg.layout = Some(b"prefill".to_vec());
    let tx = KvSender::connect(pool(), cfg).await.unwrap();
    assert_eq!(tx.peer_layout().as_deref(), Some(&b"decoder"[..]));
    assert_eq!(
        tokio::time::timeout(BOUND, rx.wait_peer(Some(11))).await,
        Ok(11)
    );
    assert_eq!(
        rx.peer_layout(Some(11)).unwrap().as_deref(),
        Some(&b"prefill"[..])
    );
    tx.close().await;
    rx.close(BOUND).await.unwrap();
}
