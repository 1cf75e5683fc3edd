//! A peer's words, and ours, on the wire: an ABORT message is bounded in bytes (1024)
//! and may hold any characters. A peer that sends the longest, all in multi-byte
//! characters (so that any cut by byte count falls inside one), is reported with its
//! words intact, and no task of ours panics repeating or quoting them; every ABORT we
//! write decodes. A panic on a runtime thread (an endpoint's task: tokio catches it,
//! and it only prints) fails the tests that check after it (`no_panics`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use pdd_core::handoff::{HandoffPolicy, HandoffTimers, MainEvent, RelayEvent};
use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::text::cut;
use pdd_core::wire::{capability, Abort, AbortReason, Frame, KvGrant, Role, MAX_ABORT_MESSAGE_LEN};
use pdd_core::Error;
use pdd_io::handoff_link::{LinkConfig, MainLink, RelayLink};
use pdd_io::lane::{self, LaneKey, SocketTuning};
use pdd_io::pool::{MemoryRegion, PagePool};
use pdd_io::receiver::{KvReceiver, ReceiverConfig};
use pdd_io::sender::{KvSender, SenderConfig};

const BOUND: Duration = Duration::from_secs(20);
const PAGE: u32 = 4096;

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Count the panics of the runtimes' threads (tokio catches a task's panic; this
/// still sees it). A test's own thread panicking fails that test already.
fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current()
                .name()
                .is_none_or(|n| n.starts_with("tokio"))
            {
                PANICS.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    });
}

fn no_panics() {
    assert_eq!(
        PANICS.load(Ordering::SeqCst),
        0,
        "an endpoint's task panicked (see stderr)"
    );
}

/// The longest message the wire carries, in `unit`s, behind `prefix`: quoted behind
/// any words of ours, a cut by byte count falls inside a character.
fn longest(prefix: &str, unit: &str) -> String {
    let s = format!("{prefix}{}", unit.repeat(MAX_ABORT_MESSAGE_LEN));
    cut(&s, MAX_ABORT_MESSAGE_LEN).to_owned()
}

fn messages() -> Vec<String> {
    let mut out = Vec::new();
    for unit in ["é", "€", "😀"] {
        for prefix in ["", "x", "xy", "xyz"] {
            out.push(longest(prefix, unit));
        }
    }
    out
}

fn pool(layers: u16, pages: u32) -> Arc<PagePool> {
    let regions = (0..layers)
        .map(|_| MemoryRegion::from_vec(vec![0; (pages * PAGE) as usize]))
        .collect();
    Arc::new(PagePool::new(regions, PAGE).unwrap())
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("bounded wait ran out")
}

async fn next_non_ping<S: tokio::io::AsyncRead + Unpin>(stream: &mut S) -> Frame {
    loop {
        match bounded(lane::read_frame_exact(stream, 1 << 24))
            .await
            .unwrap()
            .unwrap()
        {
            Frame::Ping(_) | Frame::Pong(_) => continue,
            f => return f,
        }
    }
}

fn peer_abort(request_id: u64, message: &str) -> Frame {
    Frame::Abort(Abort {
        request_id,
        reason: AbortReason::Cancelled,
        message: message.to_owned(),
    })
}

fn assert_peer_words(e: &Error, words: &str) {
    match e {
        Error::PeerAborted { reason, message } => {
            assert_eq!(*reason, AbortReason::Cancelled);
            assert_eq!(message, words, "the peer's words, intact");
        }
        other => panic!("expected the peer's ABORT, got {other:?}"),
    }
}

/// `lane::abort_for`, which ends every kind of lane: an error quoting a peer's
/// longest message still makes an ABORT that encodes and decodes.
#[test]
fn abort_for_cuts_quoted_peer_words_at_a_character() {
    count_panics();
    for words in messages() {
        let e = Error::PeerAborted {
            reason: AbortReason::Cancelled,
            message: words.clone(),
        };
        let Frame::Abort(a) = lane::abort_for(&e) else {
            panic!("abort_for makes an ABORT")
        };
        assert!(a.message.len() <= MAX_ABORT_MESSAGE_LEN);
        assert!(e.to_string().starts_with(&a.message));
        let bytes = pdd_core::wire::encode_frame_to_vec(&Frame::Abort(a.clone()), 1 << 20).unwrap();
        let (back, _) = pdd_core::wire::decode_frame(&bytes, 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(back, Frame::Abort(a));
    }
    no_panics();
}

/// A hand-driven sender on a KV receiver: it aborts one transfer, then the session,
/// each time with the longest message in multi-byte characters. The receiver reports
/// both, words intact, and serves the next sender.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_receiver_reports_a_peers_longest_abort() {
    count_panics();
    let rx = KvReceiver::start(
        pool(2, 8),
        ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            LocalHello::new(Role::MainDecode, capability::KV_STREAM),
        ),
    )
    .await
    .unwrap();
    let hello = LocalHello::new(Role::Prefill, capability::KV_STREAM);
    for (i, words) in messages().into_iter().enumerate() {
        let session = 100 + i as u64;
        let mut c = bounded(lane::connect(
            rx.local_addr(),
            &hello,
            session,
            0,
            &LaneKey::Root,
            &SocketTuning::default(),
            None,
            BOUND,
        ))
        .await
        .unwrap();
        bounded(rx.wait_peer(Some(session))).await;
        let inbound = rx.grant(7, &[0, 1], None, Some(session), None).unwrap();
        let Frame::KvGrant(g) = next_non_ping(&mut c.stream).await else {
            panic!("KV_GRANT first")
        };
        assert_eq!(g.request_id, 7);
        // One transfer.
        lane::write_frame(&mut c.stream, &peer_abort(7, &words), 1 << 20)
            .await
            .unwrap();
        assert_peer_words(&bounded(inbound.wait()).await.unwrap_err(), &words);
        // Then the session.
        let second = rx.grant(8, &[2], None, Some(session), None).unwrap();
        let _ = next_non_ping(&mut c.stream).await;
        lane::write_frame(&mut c.stream, &peer_abort(0, &words), 1 << 20)
            .await
            .unwrap();
        assert_peer_words(&bounded(second.wait()).await.unwrap_err(), &words);
    }
    // Still serving: a real sender's transfer lands.
    let mut cfg = SenderConfig::new(
        rx.local_addr(),
        42,
        LocalHello::new(Role::Prefill, capability::KV_STREAM),
    );
    cfg.lanes = 1;
    let tx = KvSender::connect(pool(2, 8), cfg).await.unwrap();
    bounded(rx.wait_peer(Some(42))).await;
    let inbound = rx.grant(9, &[3], None, Some(42), None).unwrap();
    let out = bounded(tx.wait_grant(9)).await.unwrap();
    for layer in 0..2 {
        out.send_layer(layer, layer, &[5]).await.unwrap();
    }
    out.finish().await.unwrap();
    assert_eq!(bounded(inbound.wait()).await.unwrap(), 2 * u64::from(PAGE));
    tx.close().await;
    rx.close(BOUND).await.unwrap();
    no_panics();
}

/// A hand-driven receiver aborts a KV sender's transfer, then its session, with the
/// longest message in multi-byte characters: the sender reports both, words intact.
/// In between the sender aborts one in the caller's longest words (it used to cut
/// them by byte count and panic the caller: `OutboundTransfer.abort`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_sender_reports_a_peers_longest_abort() {
    count_panics();
    for words in messages() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut cfg = SenderConfig::new(
            listener.local_addr().unwrap(),
            42,
            LocalHello::new(Role::Prefill, capability::KV_STREAM),
        );
        cfg.lanes = 1;
        let connecting = tokio::spawn(KvSender::connect(pool(1, 4), cfg));
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
        let grant = |transfer_id, request_id| {
            Frame::KvGrant(KvGrant {
                transfer_id,
                request_id,
                layer_count: 1,
                page_count: 1,
                page_bytes: PAGE,
                deadline_ms: 0,
            })
        };
        lane::write_frame(&mut control, &grant(5, 8), 1 << 20)
            .await
            .unwrap();
        let out = bounded(tx.wait_grant(8)).await.unwrap();
        lane::write_frame(&mut control, &peer_abort(8, &words), 1 << 20)
            .await
            .unwrap();
        assert_peer_words(&bounded(out.wait()).await.unwrap_err(), &words);
        // Our own abort in the caller's words (behind ours, so the bound falls
        // inside a character): cut, sent, and it decodes on the peer's side.
        lane::write_frame(&mut control, &grant(7, 10), 1 << 20)
            .await
            .unwrap();
        let out = bounded(tx.wait_grant(10)).await.unwrap();
        assert!(out.abort(&words));
        match next_non_ping(&mut control).await {
            Frame::Abort(a) => {
                assert_eq!(a.request_id, 10);
                assert!(a.message.len() <= MAX_ABORT_MESSAGE_LEN);
                assert!(a.message.len() > MAX_ABORT_MESSAGE_LEN - 4);
                assert!(format!("aborted by the sender: {words}").starts_with(&a.message));
            }
            f => panic!("expected the sender's ABORT, got {f:?}"),
        }
        // Then the receiver ends the session, in the same words.
        lane::write_frame(&mut control, &grant(6, 9), 1 << 20)
            .await
            .unwrap();
        let out = bounded(tx.wait_grant(9)).await.unwrap();
        lane::write_frame(&mut control, &peer_abort(0, &words), 1 << 20)
            .await
            .unwrap();
        assert_peer_words(&bounded(out.wait()).await.unwrap_err(), &words);
        tx.close().await;
    }
    no_panics();
}

fn link_config() -> LinkConfig {
    LinkConfig {
        policy: HandoffPolicy::default(),
        timers: HandoffTimers {
            give_up_after: Duration::from_secs(10),
            ..HandoffTimers::default()
        },
        heartbeat_interval: Duration::from_millis(50),
        dead_after: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(2),
        reconnect_initial: Duration::from_millis(10),
        reconnect_max: Duration::from_millis(100),
        ..LinkConfig::default()
    }
}

/// The handoff link: MD aborts a request in the engine's longest words (cut to the
/// wire's bound, at a character), and a hand-driven RLD aborts one in the peer's; each
/// side reports the other's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handoff_link_carries_and_reports_the_longest_aborts() {
    count_panics();
    let rt = tokio::runtime::Handle::current();
    let md = MainLink::listen(&rt, "127.0.0.1:0".parse().unwrap(), link_config()).unwrap();
    let addr = md.local_addr().unwrap();
    let rld = RelayLink::connect(&rt, addr, link_config()).unwrap();
    bounded(rld.wait_connected(BOUND)).await.unwrap();
    for (i, unit) in ["é", "€", "😀"].into_iter().enumerate() {
        let request = 10 + i as u64;
        let engine_words = format!("x{}", unit.repeat(2 * MAX_ABORT_MESSAGE_LEN));
        rld.open(request, 100).unwrap();
        md.open(request, 100).unwrap();
        assert!(md
            .abort(request, AbortReason::Cancelled, &engine_words)
            .unwrap());
        let ev = bounded(rld.events().pop()).await.unwrap();
        assert_eq!(ev.request_id, request);
        match ev.event {
            RelayEvent::Failed(Error::PeerAborted { message, .. }) => {
                assert!(message.len() <= MAX_ABORT_MESSAGE_LEN);
                assert!(message.len() > MAX_ABORT_MESSAGE_LEN - 4);
                assert!(engine_words.starts_with(&message));
            }
            other => panic!("expected the peer's ABORT, got {other:?}"),
        }
    }
    rld.close();
    bounded(async {
        while md.is_connected() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    // A hand-driven RLD in its place.
    let hello = LocalHello::new(Role::RelayDecode, capability::HANDOFF);
    let mut c = bounded(lane::connect(
        addr,
        &hello,
        1000,
        0,
        &LaneKey::Root,
        &SocketTuning::default(),
        None,
        BOUND,
    ))
    .await
    .unwrap();
    let words = messages();
    for (i, words) in words.iter().enumerate() {
        let request = 100 + i as u64;
        md.open(request, 100).unwrap();
        lane::write_frame(&mut c.stream, &peer_abort(request, words), 1 << 20)
            .await
            .unwrap();
        let ev = bounded(md.events().pop()).await.unwrap();
        assert_eq!(ev.request_id, request);
        match ev.event {
            MainEvent::Failed(e) => assert_peer_words(&e, words),
            other => panic!("expected the peer's ABORT, got {other:?}"),
        }
    }
    // The connection-wide ABORT, in the same words, is taken like a reset.
    lane::write_frame(&mut c.stream, &peer_abort(0, &words[0]), 1 << 20)
        .await
        .unwrap();
    bounded(async {
        while md.is_connected() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    md.close();
    no_panics();
}
