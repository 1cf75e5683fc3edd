//! Attacks from a peer on the same network (loopback), against the KV receiver and
//! the handoff link: every test scripts the attacker with raw lanes and checks that
//! the victim's state is untouched. Each of these passed against protocol v1 (the
//! attack worked) before protocol v2.

#[path = "common/bounds.rs"]
mod bounds;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, Auth, Frame, Hello, KvDone, KvPages, Role, HEADER_LEN};
use pdd_core::Error;
use pdd_io::lane::{self, LaneKey, LaneStream, SocketTuning};
use pdd_io::pool::{MemoryRegion, PagePool};
use pdd_io::receiver::{KvReceiver, ReceiverConfig};
use pdd_io::sender::{KvSender, SenderConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[path = "common/flood.rs"]
mod flood;
use flood::Flood;

const LAYERS: u16 = 2;
const PAGES: u32 = 8;
const PAGE: u32 = 4096;
const BOUND: Duration = Duration::from_secs(20);

fn pool(fill: u8) -> Arc<PagePool> {
    let layers = (0..LAYERS)
        .map(|_| MemoryRegion::from_vec(vec![fill; (PAGES * PAGE) as usize]))
        .collect();
    Arc::new(PagePool::new(layers, PAGE).unwrap())
}

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, f)
        .await
        .expect("bounded wait ran out")
}

fn hello(role: Role, secret: Option<&'static [u8]>) -> LocalHello {
    let mut h = LocalHello::new(role, capability::KV_STREAM);
    h.secret = secret.map(Bytes::from_static);
    h
}

async fn receiver(secret: Option<&'static [u8]>) -> KvReceiver {
    let cfg = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        hello(Role::MainDecode, secret),
    );
    KvReceiver::start(pool(0), cfg).await.unwrap()
}

async fn sender(rx: &KvReceiver, id: u64, secret: Option<&'static [u8]>) -> KvSender {
    let mut cfg = SenderConfig::new(rx.local_addr(), id, hello(Role::Prefill, secret));
    cfg.lanes = 2;
    KvSender::connect(pool(0xAA), cfg).await.unwrap()
}

/// An attacker's own session: control lane and one data lane, opened with `secret`.
async fn intruder(
    rx: &KvReceiver,
    id: u64,
    secret: Option<&'static [u8]>,
) -> (LaneStream, LaneStream) {
    let h = hello(Role::Prefill, secret);
    let t = SocketTuning::default();
    let c = lane::connect(rx.local_addr(), &h, id, 0, &LaneKey::Root, &t, None, BOUND)
        .await
        .unwrap();
    let key = LaneKey::Session(c.session_secret);
    let d = lane::connect(rx.local_addr(), &h, id, 1, &key, &t, None, BOUND)
        .await
        .unwrap();
    (c.stream, d.stream)
}

fn pages_frame(transfer_id: u64, layer: u16, fill: u8) -> Frame {
    Frame::KvPages(KvPages {
        transfer_id,
        layer_start: layer,
        layer_count: 1,
        page_start: 0,
        page_count: 2,
        page_bytes: PAGE,
        data: vec![fill; 2 * PAGE as usize].into(),
        resent: false,
    })
}

/// Even knowing the victim's transfer id (ids are random; here it is handed to the
/// attacker), and even holding the shared secret, an intruder's blocks and KV_DONE
/// are refused on its own session and never touch the victim's grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_session_cannot_fill_or_finish_a_grant() {
    for secret in [None, Some(&b"shared by every prefill"[..])] {
        let rx = receiver(secret).await;
        let victim = sender(&rx, 1, secret).await;
        bounded(rx.wait_peer(Some(1))).await;
        let inbound = rx.grant(9, &[3, 4], None, Some(1), None).unwrap();
        let tid = inbound.grant.transfer_id;
        assert!(tid > 1 << 20, "transfer ids are random, got {tid}");

        let (mut control, mut data) = intruder(&rx, 2, secret).await;
        lane::write_frame(&mut data, &pages_frame(tid, 0, 0xEE), 1 << 24)
            .await
            .unwrap();
        let done = Frame::KvDone(KvDone {
            transfer_id: tid,
            chunk_count: 1,
            byte_count: u64::from(2 * PAGE),
        });
        let _ = lane::write_frame(&mut control, &done, 1 << 20).await;
        // The intruder's session ends with a violation of its own...
        let mut reason = None;
        while let Ok(Some(f)) = bounded(lane::read_frame_exact(&mut control, 1 << 20)).await {
            if let Frame::Abort(a) = f {
                reason = Some(a.reason.name());
            }
        }
        assert_eq!(reason, Some("grant_violation"));
        // ...and the victim's grant is untouched: nothing landed, and its own
        // transfer completes with its own bytes.
        assert!(rx.pool().copy_page(0, 3).unwrap().iter().all(|&b| b == 0));
        let out = bounded(victim.wait_grant(9)).await.unwrap();
        for layer in 0..LAYERS {
            out.send_layer(layer, layer, &[0, 1]).await.unwrap();
        }
        out.finish().await.unwrap();
        bounded(inbound.wait()).await.unwrap();
        for layer in 0..LAYERS {
            for page in [3, 4] {
                let p = rx.pool().copy_page(layer, page).unwrap();
                assert!(p.iter().all(|&b| b == 0xAA), "layer {layer} page {page}");
            }
        }
        assert!(
            rx.metrics()
                .violations_total
                .load(std::sync::atomic::Ordering::Relaxed)
                >= 1
        );
    }
}

/// A HELLO naming a live session's id cannot take it over, resume it without its
/// secret, or slip a data lane into it; the session goes on serving its owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_session_cannot_be_taken_over_or_joined() {
    let rx = receiver(None).await;
    let victim = sender(&rx, 5, None).await;
    bounded(rx.wait_peer(Some(5))).await;
    let h = hello(Role::Prefill, None);
    let t = SocketTuning::default();
    let attempts = [
        (0, LaneKey::Root),
        (0, LaneKey::Session([0; 32])),
        (1, LaneKey::Session([1; 32])),
    ];
    for (lane_no, key) in attempts {
        let err = lane::connect(rx.local_addr(), &h, 5, lane_no, &key, &t, None, BOUND)
            .await
            .unwrap_err();
        // Refused by the receiver (an ABORT), or the receiver's proof did not match
        // the key we guessed (we stop first): either way, not admitted.
        assert!(
            matches!(&err, Error::PeerAborted { .. } | Error::AuthFailed { .. }),
            "lane {lane_no} {key:?}: {err:?}"
        );
    }
    assert_eq!(rx.peers().len(), 1);
    let inbound = rx.grant(1, &[0], None, Some(5), None).unwrap();
    let out = bounded(victim.wait_grant(1)).await.unwrap();
    for layer in 0..LAYERS {
        out.send_layer(layer, layer, &[2]).await.unwrap();
    }
    out.finish().await.unwrap();
    bounded(inbound.wait()).await.unwrap();
}

/// With a secret configured, a peer without it gets no session, and a sender never
/// streams to a receiver that cannot prove the secret (an impostor).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_ends_must_prove_the_secret() {
    let rx = receiver(Some(b"s3cret")).await;
    for wrong in [None, Some(&b"guess"[..])] {
        let mut cfg = SenderConfig::new(rx.local_addr(), 3, hello(Role::Prefill, wrong));
        cfg.connect_timeout = Duration::from_secs(5);
        let err = KvSender::connect(pool(1), cfg)
            .await
            .err()
            .expect("refused");
        assert_eq!(err.reason(), "auth_failed", "{err:?}");
    }
    assert!(rx.peers().is_empty());
    // The impostor: a receiver without the secret (or another one).
    for impostor_secret in [None, Some(&b"other"[..])] {
        let impostor = receiver(impostor_secret).await;
        let cfg = SenderConfig::new(
            impostor.local_addr(),
            3,
            hello(Role::Prefill, Some(b"s3cret")),
        );
        let err = KvSender::connect(pool(1), cfg)
            .await
            .err()
            .expect("refused");
        assert_eq!(err.reason(), "auth_failed", "{err:?}");
        assert!(err.to_string().contains("accepting peer"), "{err}");
        assert!(impostor.peers().is_empty());
    }
    // The right secret works.
    let tx = sender(&rx, 3, Some(b"s3cret")).await;
    bounded(rx.wait_peer(Some(tx.session_id()))).await;
}

/// Undecodable openings are answered with an ABORT saying why, never a bare close:
/// a frame of another header version, and HELLO with version range 0..0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_openings_get_an_abort() {
    let rx = receiver(None).await;
    let offer = hello(Role::Prefill, None).offer(1, 0, [0; 32], false);
    let good = pdd_core::wire::encode_frame_to_vec(&Frame::Hello(offer), 1 << 20).unwrap();
    let mut other_version = good.clone();
    other_version[2] = 9;
    let mut zero_range = good.clone();
    zero_range[16..20].copy_from_slice(&[0, 0, 0, 0]);
    // Fix the CRC so that only the range is wrong.
    let crc = {
        let c = crc32c::crc32c(&zero_range[..12]);
        crc32c::crc32c_append(c, &zero_range[16..])
    };
    zero_range[12..16].copy_from_slice(&crc.to_le_bytes());
    for (bytes, want) in [
        (other_version, "unsupported_version"),
        (zero_range, "protocol_error"),
    ] {
        let mut s = tokio::net::TcpStream::connect(rx.local_addr())
            .await
            .unwrap();
        s.write_all(&bytes).await.unwrap();
        let mut reply = Vec::new();
        bounded(s.read_to_end(&mut reply)).await.unwrap();
        let (frame, _) = pdd_core::wire::decode_frame(&reply, 1 << 20)
            .unwrap()
            .expect("an ABORT");
        match frame {
            Frame::Abort(a) => assert_eq!(a.reason.name(), want),
            other => panic!("expected ABORT, got {other:?}"),
        }
    }
}

/// A listener beyond loopback without a secret refuses to start unless told to run
/// insecure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_listener_needs_a_secret_or_an_explicit_insecure() {
    let cfg = ReceiverConfig::new("0.0.0.0:0".parse().unwrap(), hello(Role::MainDecode, None));
    let err = KvReceiver::start(pool(0), cfg.clone()).await.err().unwrap();
    assert_eq!(err.reason(), "invalid_argument");
    assert!(err.to_string().contains("without authentication"), "{err}");
    let mut insecure = cfg.clone();
    insecure.allow_insecure = true;
    let rx = KvReceiver::start(pool(0), insecure).await.unwrap();
    rx.close(BOUND).await.unwrap();
    let mut with_secret = cfg;
    with_secret.hello.secret = Some(Bytes::from_static(b"k"));
    let rx = KvReceiver::start(pool(0), with_secret).await.unwrap();
    rx.close(BOUND).await.unwrap();
}

/// Write PINGs and never read: until the peer drops us (a write fails) or `max`
/// frames went out, each write bounded. Returns (frames written, dropped).
async fn flood_pings(stream: &mut LaneStream, max: usize) -> (usize, bool) {
    let ping = pdd_core::wire::encode_frame_to_vec(
        &Frame::Ping(pdd_core::wire::Ping {
            nonce: 1,
            sent_at_ns: 2,
        }),
        1 << 20,
    )
    .unwrap();
    let batch: Vec<u8> = ping
        .iter()
        .copied()
        .cycle()
        .take(ping.len() * 8192)
        .collect();
    let mut sent = 0;
    while sent < max {
        match tokio::time::timeout(Duration::from_secs(2), stream.write_all(&batch)).await {
            Ok(Ok(())) => sent += 8192,
            // Refused by a reset, or the peer stopped reading too (its buffers are
            // full because it dropped the session's reader).
            Ok(Err(_)) => return (sent, true),
            Err(_) => return (sent, true),
        }
    }
    (sent, false)
}

/// A peer that sends PINGs and never reads its PONGs is dropped by the bound on
/// unwritten control frames, with that bound's reason, long before any dead-peer
/// bound could end it (here two minutes: the peer never goes silent anyway); the
/// receiver's memory does not follow it, and close() still meets its bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_reads_its_replies_is_dropped_by_the_cap() {
    let mut cfg = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        hello(Role::MainDecode, None),
    );
    cfg.dead_after = Duration::from_secs(120);
    // Small kernel buffers: a few thousand PONGs fill them, then the queue fills.
    let small = SocketTuning {
        buffer_bytes: Some(64 << 10),
        ..SocketTuning::default()
    };
    cfg.tuning = small.clone();
    let rx = KvReceiver::start(pool(0), cfg).await.unwrap();
    let h = hello(Role::Prefill, None);
    let mut c = lane::connect(
        rx.local_addr(),
        &h,
        9,
        0,
        &LaneKey::Root,
        &small,
        None,
        BOUND,
    )
    .await
    .unwrap()
    .stream;
    bounded(rx.wait_peer(Some(9))).await;
    // A grant to that session: the session's end fails it with the end's reason.
    let inbound = rx.grant(1, &[0], None, Some(9), None).unwrap();
    let started = std::time::Instant::now();
    // At most 1M PINGs (32 MB): a few MB of kernel buffers and the 4096 queued
    // frames are far below that.
    let flood = tokio::spawn(async move {
        let outcome = flood_pings(&mut c, 1 << 20).await;
        (outcome, c)
    });
    let ended = tokio::time::timeout(Duration::from_secs(5), inbound.wait()).await;
    let err = ended
        .expect("the session of a peer that never reads outlived 5 s of its PINGs")
        .unwrap_err();
    let took = started.elapsed();
    assert_eq!(err.reason(), "limit_exceeded", "{err}");
    assert!(err.to_string().contains("control frames queued"), "{err}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    eprintln!("the cap ended the session after {took:?}");
    let ((sent, _), c) = bounded(flood).await.unwrap();
    assert!(
        sent < 1 << 20,
        "the flood ran its whole course: {sent} PINGs"
    );
    drop(c);
    bounded(async {
        while !rx.peers().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let lost = rx
        .metrics()
        .sessions_lost_total
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(lost, 1);
    let started = std::time::Instant::now();
    rx.close(Duration::from_secs(2)).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// The same on MD's handoff link: an RLD that floods PINGs and never reads is
/// dropped by the cap on unwritten bytes (`MAX_UNWRITTEN_BYTES`), for that reason
/// and long before the dead-peer bound (set to a minute here, so that only the cap
/// can end the connection within the test's bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_peer_that_never_reads_is_dropped() {
    use pdd_io::handoff_link::{LinkConfig, MainLink};
    let rt = tokio::runtime::Handle::current();
    let cfg = LinkConfig {
        dead_after: Duration::from_secs(60),
        ..LinkConfig::default()
    };
    let md = MainLink::listen(&rt, "127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let mut h = LocalHello::new(Role::RelayDecode, capability::HANDOFF);
    h.accepted_roles = vec![Role::MainDecode];
    let t = SocketTuning {
        buffer_bytes: Some(64 << 10),
        ..SocketTuning::default()
    };
    let mut c = lane::connect(
        md.local_addr().unwrap(),
        &h,
        4,
        0,
        &LaneKey::Root,
        &t,
        None,
        BOUND,
    )
    .await
    .unwrap()
    .stream;
    // MD drops us; our writes may go on succeeding a little longer (its graceful
    // close drains a bounded amount), so what counts is MD's side. 1M PINGs ask for
    // 32 MB of PONGs: far past the kernel's buffers and the 4 MiB cap.
    let started = Instant::now();
    bounds::within(
        "MD drops a peer that does not read (cap on unwritten bytes; dead_after is 60 s)",
        started,
        Duration::ZERO,
        Duration::from_secs(10),
        async {
            let _ = flood_pings(&mut c, 1 << 20).await;
            bounds::until(|| md.stats().connections_lost > 0).await;
        },
    )
    .await;
    let s = md.stats();
    assert_eq!(s.unread_overflows, 1, "dropped for not reading: {s:?}");
    assert_eq!(s.dead_peer, 0, "not by the dead-peer bound: {s:?}");
    let why = md.last_error().expect("MD keeps why");
    assert_eq!(why.reason(), "limit_exceeded", "{why}");
    drop(c);
    assert!(!md.is_connected());
    assert!(md
        .prometheus("md")
        .contains("pdd_transport_handoff_unread_overflows_total{endpoint=\"md\"} 1"));
    md.close();
}

/// A scripted second RelayDecode on MD's handoff link: a session of its own (opened
/// with the root secret while the real RLD was away), a task that answers MD's PINGs
/// and records every other frame MD sends it.
struct Intruder {
    write: Arc<tokio::sync::Mutex<tokio::io::WriteHalf<LaneStream>>>,
    seen: tokio::sync::mpsc::UnboundedReceiver<Frame>,
    reader: tokio::task::JoinHandle<()>,
}

impl Intruder {
    async fn connect(
        addr: std::net::SocketAddr,
        session_id: u64,
        secret: Option<&'static [u8]>,
    ) -> Result<Intruder, Error> {
        let mut h = LocalHello::new(Role::RelayDecode, capability::HANDOFF);
        h.accepted_roles = vec![Role::MainDecode];
        h.secret = secret.map(Bytes::from_static);
        let c = lane::connect(
            addr,
            &h,
            session_id,
            0,
            &LaneKey::Root,
            &SocketTuning::default(),
            None,
            Duration::from_secs(5),
        )
        .await?;
        let (mut rd, wr) = tokio::io::split(c.stream);
        let write = Arc::new(tokio::sync::Mutex::new(wr));
        let (tx, seen) = tokio::sync::mpsc::unbounded_channel();
        let w = Arc::clone(&write);
        let reader = tokio::spawn(async move {
            while let Ok(Some(f)) = lane::read_frame_exact(&mut rd, 1 << 20).await {
                match f {
                    Frame::Ping(p) => {
                        let mut w = w.lock().await;
                        if lane::write_frame(&mut *w, &Frame::Pong(p), 1 << 20)
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                    Frame::Pong(_) => {}
                    other => {
                        if tx.send(other).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Ok(Intruder {
            write,
            seen,
            reader,
        })
    }

    async fn send(&self, frame: Frame) {
        let mut w = self.write.lock().await;
        lane::write_frame(&mut *w, &frame, 1 << 20).await.unwrap();
    }

    /// What MD sent it so far.
    fn seen(&mut self) -> Vec<Frame> {
        let mut got = Vec::new();
        while let Ok(f) = self.seen.try_recv() {
            got.push(f);
        }
        got
    }
}

/// A request's handoff belongs to the RelayDecode session that opened it. While that
/// RLD is reconnecting, another peer that opens a session on MD (holding the root
/// secret, or with none configured) is sent neither the request's PROGRESS nor
/// anything else of it, and its forged final HANDOFF, its ABORTs for the request and
/// for the connection are refused (ABORT `grant_violation`, counted): MD's engine
/// never sees them. The RLD then resumes its session, pushing the other aside, and
/// MD extends exactly the RLD's tokens. (Before: the forged final was MD's request
/// and RLD's tokens were lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_session_cannot_read_or_hand_off_a_relays_request() {
    use pdd_core::handoff::{HandoffPolicy, HandoffTimers, MainEvent, RelayDecision, RelayEvent};
    use pdd_core::wire::{Abort, AbortReason, Handoff};
    use pdd_io::handoff_link::{LinkConfig, MainLink, RelayLink};
    use pdd_io::wanem::{LinkProfile, Wanem, WanemConfig};
    const REQ: u64 = 77;
    const PROMPT: u32 = 300;
    for secret in [None, Some(&b"every relay holds this"[..])] {
        let cfg = LinkConfig {
            policy: HandoffPolicy {
                catch_up_threshold_tokens: 64,
                level_tokens: 8,
                chunk_tokens: 64,
                one_shot_load: 0.85,
                max_eager_tokens: 100,
            },
            timers: HandoffTimers {
                rto_initial: Duration::from_millis(50),
                rto_max: Duration::from_millis(200),
                max_attempts: 1000,
                give_up_after: Duration::from_secs(30),
                kv_wait_timeout: Duration::from_secs(30),
                linger: Duration::from_secs(30),
            },
            heartbeat_interval: Duration::from_millis(100),
            dead_after: Duration::from_secs(2),
            connect_timeout: Duration::from_millis(300),
            reconnect_initial: Duration::from_millis(10),
            reconnect_max: Duration::from_millis(100),
            secret: secret.map(Bytes::from_static),
            ..LinkConfig::default()
        };
        let rt = tokio::runtime::Handle::current();
        let md = MainLink::listen(&rt, "127.0.0.1:0".parse().unwrap(), cfg.clone()).unwrap();
        let md_addr = md.local_addr().unwrap();
        // RLD reaches MD through a proxy the test can cut.
        let wan = Wanem::start(
            WanemConfig::new("127.0.0.1:0".parse().unwrap(), md_addr)
                .symmetric(LinkProfile::default()),
        )
        .await
        .unwrap();
        let rld = RelayLink::connect(&rt, wan.local_addr(), cfg).unwrap();
        bounded(rld.wait_connected(Duration::from_secs(5)))
            .await
            .unwrap();
        bounded(md.wait_connected(Duration::from_secs(5)))
            .await
            .unwrap();
        rld.open(REQ, PROMPT).unwrap();
        let mut tokens = Vec::new();
        for t in 0..12 {
            assert_eq!(
                rld.offer(REQ, 1000 + t).unwrap(),
                RelayDecision::KeepDecoding
            );
            tokens.push(1000 + t);
        }
        md.open(REQ, PROMPT).unwrap();
        // RLD's connection is cut, and its reconnects hang in the proxy for now.
        wan.blackhole(true);
        wan.reset_all();
        bounded(bounds::until(|| !md.is_connected())).await;
        // MD's KV lands while RLD is away: its PROGRESS waits for RLD.
        md.report_progress(REQ, PROMPT, true).unwrap();
        let mut intruder = bounded(Intruder::connect(md_addr, 0xBAD, secret))
            .await
            .expect("another peer may open a session while none is connected");
        bounded(bounds::until(|| md.is_connected())).await;
        // Long enough for MD's PROGRESS to be retransmitted several times (RTO 50 ms).
        tokio::time::sleep(Duration::from_millis(600)).await;
        let leaked = intruder.seen();
        assert!(
            leaked.is_empty(),
            "the other session was sent the request's frames: {leaked:?}"
        );
        // The attack: a final handoff of its own tokens, then ABORTs.
        intruder
            .send(Frame::Handoff(Handoff {
                request_id: REQ,
                seq: 0,
                first_position: PROMPT,
                token_ids: vec![666, 667, 668],
                final_: true,
            }))
            .await;
        for request_id in [REQ, 0] {
            intruder
                .send(Frame::Abort(Abort {
                    request_id,
                    reason: AbortReason::Cancelled,
                    message: "mine now".into(),
                }))
                .await;
        }
        // MD answers at once; its engine must never see the forged handoff.
        let (refusal, _) = bounds::within(
            "MD refuses the other session's forged final handoff (ABORT grant_violation)",
            Instant::now(),
            Duration::ZERO,
            Duration::from_secs(3),
            async {
                loop {
                    if let Ok(f) = intruder.seen.try_recv() {
                        break f;
                    }
                    if let Some(ev) = md.events().try_pop() {
                        panic!("MD's engine was handed the other session's frame: {ev:?}");
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            },
        )
        .await;
        match &refusal {
            Frame::Abort(a) => {
                assert_eq!((a.request_id, a.reason), (REQ, AbortReason::GrantViolation));
                assert!(a.message.contains("another session"), "{}", a.message);
            }
            other => panic!("expected ABORT grant_violation, got {other:?}"),
        }
        bounded(bounds::until(|| md.stats().frames_foreign >= 3)).await;
        let s = md.stats();
        assert_eq!(s.frames_foreign, 3, "{s:?}");
        assert!(s.frames_withheld >= 1, "{s:?}");
        assert!(md
            .prometheus("md")
            .contains("pdd_transport_handoff_frames_foreign_total{endpoint=\"md\"} 3"));
        assert!(
            md.events().try_pop().is_none(),
            "MD's engine saw the other session's frames"
        );
        assert_eq!(
            md.with_machine(REQ, |m| (m.state().name(), m.next_position()))
                .unwrap(),
            ("receiving", PROMPT)
        );
        // RLD comes back and resumes its session while the other is still connected.
        wan.blackhole(false);
        let (ev, _) = bounds::within(
            "RLD resumes its session (the other one still connected) and hands off",
            Instant::now(),
            Duration::ZERO,
            Duration::from_secs(5),
            md.events().pop(),
        )
        .await;
        let ev = ev.expect("MD's handoff");
        match ev.event {
            MainEvent::Handoff {
                token_ids, final_, ..
            } => {
                assert_eq!(ev.request_id, REQ);
                assert!(final_);
                assert_eq!(token_ids, tokens, "MD extends exactly RLD's tokens");
            }
            MainEvent::Failed(e) => panic!("MD's handoff failed: {e}"),
        }
        loop {
            let ev = bounded(rld.events().pop()).await.expect("RLD's event");
            match ev.event {
                RelayEvent::Finished => break,
                RelayEvent::StopDecoding => {}
                RelayEvent::Failed(e) => panic!("RLD's handoff failed: {e}"),
            }
        }
        assert_eq!(md.with_machine(REQ, |m| m.state().name()).unwrap(), "owned");
        // Nothing of the request reached the other session; MD closed it for RLD.
        let seen = intruder.seen();
        assert!(seen.is_empty(), "{seen:?}");
        bounded(intruder.reader).await.unwrap();
        // While RLD is connected nobody else opens a session.
        assert!(Intruder::connect(md_addr, 0xBAD2, secret).await.is_err());
        rld.close();
        md.close();
    }
}

/// A receiver with a short dead-peer bound, for the stall tests.
async fn quick_receiver() -> KvReceiver {
    let mut cfg = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        hello(Role::MainDecode, None),
    );
    cfg.heartbeat = Duration::from_millis(100);
    cfg.dead_after = Duration::from_millis(600);
    KvReceiver::start(pool(0), cfg).await.unwrap()
}

/// Keep a scripted peer's control lane alive (PINGs) and drain what the receiver
/// sends, until dropped.
fn keep_alive(control: LaneStream) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let (mut rd, mut wr) = tokio::io::split(control);
        let drain = async move {
            let mut sink = [0u8; 4096];
            while matches!(rd.read(&mut sink).await, Ok(n) if n > 0) {}
        };
        let ping = async move {
            for i in 0..600u64 {
                let f = Frame::Ping(pdd_core::wire::Ping {
                    nonce: i,
                    sent_at_ns: 0,
                });
                let bytes = pdd_core::wire::encode_frame_to_vec(&f, 1 << 20).unwrap();
                if wr.write_all(&bytes).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        tokio::join!(drain, ping);
    })
}

/// A data lane that stops mid-block (half a block sent, then silence) while the
/// control lane stays healthy: the transfer fails within the dead-peer bound, its
/// pages are released, and nothing partial is reported complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_stalled_mid_block_fails_its_transfer() {
    let rx = quick_receiver().await;
    let (control, mut data) = intruder(&rx, 3, None).await;
    let _alive = keep_alive(control);
    bounded(rx.wait_peer(Some(3))).await;
    let inbound = rx.grant(1, &[0, 1], Some(1), Some(3), None).unwrap();
    let bytes =
        pdd_core::wire::encode_frame_to_vec(&pages_frame(inbound.grant.transfer_id, 0, 7), 1 << 24)
            .unwrap();
    data.write_all(&bytes[..bytes.len() / 2]).await.unwrap();
    // The data lane's read inside a block must bring bytes within dead_after (0.6 s):
    // the only check that can end this (the control lane is kept alive).
    let (got, _) = bounds::within(
        "a data lane silent mid-block is lost (dead_after 0.6 s)",
        Instant::now(),
        Duration::from_millis(450),
        Duration::from_secs(3),
        inbound.wait(),
    )
    .await;
    let err = got.unwrap_err();
    assert_eq!(err.reason(), "connection_lost", "{err}");
    // Its pages are free again.
    rx.grant(2, &[0, 1], Some(1), Some(3), None).unwrap();
    drop(data);
}

/// The sender said KV_DONE, but the blocks never come (its data lane went silent
/// between blocks): the transfer fails within the dead-peer bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_whose_blocks_never_come_after_kv_done_fails() {
    let rx = quick_receiver().await;
    let (mut control, data) = intruder(&rx, 3, None).await;
    bounded(rx.wait_peer(Some(3))).await;
    let inbound = rx.grant(1, &[0, 1], Some(1), Some(3), None).unwrap();
    let done = Frame::KvDone(KvDone {
        transfer_id: inbound.grant.transfer_id,
        chunk_count: 1,
        byte_count: u64::from(2 * PAGE),
    });
    lane::write_frame(&mut control, &done, 1 << 20)
        .await
        .unwrap();
    let _alive = keep_alive(control);
    // No page moves for dead_after (0.6 s) after KV_DONE: checked once per bound,
    // so 0.6 to 1.2 s; the only check that can end this (the control lane is alive).
    let (got, _) = bounds::within(
        "a transfer whose blocks never come after KV_DONE fails (dead_after 0.6 s)",
        Instant::now(),
        Duration::from_millis(450),
        Duration::from_secs(3),
        inbound.wait(),
    )
    .await;
    let err = got.unwrap_err();
    assert_eq!(err.reason(), "deadline_exceeded", "{err}");
    drop(data);
}

/// One session may hold at most MAX_LEASES_PER_SESSION prefix leases; the next
/// query is refused for its request (ABORT resource_exhausted), the session goes on,
/// and a released lease makes room again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_leases_per_session_are_bounded() {
    use pdd_core::radix::RadixCache;
    use pdd_io::receiver::MAX_LEASES_PER_SESSION;
    let prompt: Vec<u32> = (1..=16).collect();
    let mut cache = RadixCache::new(4).unwrap();
    cache.insert(0, &prompt, &[1, 2, 3, 4]).unwrap();
    let cache = Arc::new(std::sync::Mutex::new(cache));
    let mut cfg = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        hello(Role::MainDecode, None),
    );
    cfg.prefix_cache = Some(cache);
    let rx = KvReceiver::start(pool(0), cfg).await.unwrap();
    let tx = sender(&rx, 8, None).await;
    let lease = Duration::from_secs(60);
    let mut first = 0;
    for request in 1..=MAX_LEASES_PER_SESSION as u64 {
        let a = bounded(tx.query_prefix(request, 0, 4, lease, prompt.clone()))
            .await
            .unwrap();
        assert_ne!(a.reply.lease_id, 0);
        if request == 1 {
            first = a.reply.lease_id;
        }
    }
    let err = bounded(tx.query_prefix(99_999, 0, 4, lease, prompt.clone()))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::PeerAborted { reason, .. } if reason.name() == "resource_exhausted"),
        "{err:?}"
    );
    assert!(rx.release_lease(first));
    let a = bounded(tx.query_prefix(100_000, 0, 4, lease, prompt))
        .await
        .unwrap();
    assert_ne!(a.reply.lease_id, 0);
    assert_eq!(rx.peers().len(), 1, "the session goes on");
}

/// A session may not open more than MAX_LANES_PER_SESSION data lanes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_lanes_per_session_are_bounded() {
    use pdd_io::receiver::MAX_LANES_PER_SESSION;
    let rx = receiver(None).await;
    let h = hello(Role::Prefill, None);
    let t = SocketTuning::default();
    let c = lane::connect(rx.local_addr(), &h, 6, 0, &LaneKey::Root, &t, None, BOUND)
        .await
        .unwrap();
    let key = LaneKey::Session(c.session_secret);
    let mut lanes = Vec::new();
    for n in 1..=MAX_LANES_PER_SESSION as u16 {
        let l = lane::connect(rx.local_addr(), &h, 6, n, &key, &t, None, BOUND)
            .await
            .unwrap();
        lanes.push(l.stream);
    }
    let err = lane::connect(rx.local_addr(), &h, 6, 65, &key, &t, None, BOUND)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::PeerAborted { reason, .. } if reason.name() == "resource_exhausted"),
        "{err:?}"
    );
    // Closing one makes room.
    drop(lanes.pop());
    bounded(async {
        loop {
            match lane::connect(rx.local_addr(), &h, 6, 66, &key, &t, None, BOUND).await {
                Ok(l) => return l,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    })
    .await;
}

/// Sources of the connection floods: the honest peers' own address (127.0.0.1) and
/// four others.
fn flood_sources() -> Vec<std::net::Ipv4Addr> {
    (1..=5)
        .map(|i| std::net::Ipv4Addr::new(127, 0, 0, i))
        .collect()
}

/// How long an honest peer may take to get in and be served during a flood.
const HONEST_BOUND: Duration = Duration::from_secs(5);

/// A flood of connections that never finish their opening (idle, stopped inside a
/// HELLO header, or a HELLO and no answer to the AUTH challenge), from the honest
/// sender's own address and four others, more than the receiver holds opening at
/// once and kept up (what the receiver closes is reopened): an honest sender with
/// the secret still opens its session and completes a transfer promptly, and the
/// receiver holds no more opening connections than its bound, in its bookkeeping
/// and in sockets. (Before the shared admission, the 257th connection was closed
/// unanswered, so such a flood kept every new sender out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_does_not_keep_a_sender_out() {
    use pdd_io::admission::{MAX_OPENING_CONNECTIONS, MAX_OPENING_PER_SOURCE};
    let secret = Some(&b"deployment secret"[..]);
    let mut cfg = ReceiverConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        hello(Role::MainDecode, secret),
    );
    // No flood connection ends by its own timeout during the test.
    cfg.hello_timeout = Duration::from_secs(30);
    let rx = KvReceiver::start(pool(0), cfg).await.unwrap();
    let sources = flood_sources();
    assert!(sources.len() * MAX_OPENING_PER_SOURCE > MAX_OPENING_CONNECTIONS);
    let flood = Flood::start(
        rx.local_addr(),
        &sources,
        MAX_OPENING_PER_SOURCE,
        Role::Prefill,
    )
    .await;
    tokio::time::sleep(flood::REFRESH * 2).await;
    let started = std::time::Instant::now();
    let honest = async {
        let tx = loop {
            let mut c = SenderConfig::new(rx.local_addr(), 7, hello(Role::Prefill, secret));
            c.lanes = 2;
            c.connect_timeout = Duration::from_secs(2);
            match KvSender::connect(pool(0xAA), c).await {
                Ok(tx) => break tx,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        rx.wait_peer(Some(7)).await;
        let inbound = rx.grant(1, &[1, 2], None, Some(7), None).unwrap();
        let out = tx.wait_grant(1).await.unwrap();
        for layer in 0..LAYERS {
            out.send_layer(layer, layer, &[3, 4]).await.unwrap();
        }
        out.finish().await.unwrap();
        inbound.wait().await.unwrap();
        tx
    };
    let tx = tokio::time::timeout(HONEST_BOUND, honest)
        .await
        .expect("no session and transfer for an honest sender during the flood");
    eprintln!(
        "session and transfer in {:?} during a flood that opened {} connections",
        started.elapsed(),
        flood.opened()
    );
    assert!(rx
        .pool()
        .copy_page(1, 2)
        .unwrap()
        .iter()
        .all(|&b| b == 0xAA));
    // Bounded: with the flood's reopening held and the receiver settled, it holds
    // at most its bound of flood connections, and so many sockets (besides the
    // sender's three lanes).
    let (held, sockets) = flood
        .settle(Duration::from_millis(500), rx.local_addr())
        .await;
    assert!(
        held <= MAX_OPENING_CONNECTIONS,
        "{held} flood connections held"
    );
    assert!(
        sockets <= MAX_OPENING_CONNECTIONS + 3,
        "the receiver holds {sockets} sockets"
    );
    let m = rx.metrics();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert!(get(&m.half_open) as usize <= MAX_OPENING_CONNECTIONS);
    assert!(get(&m.half_open_evicted_total) > 0);
    assert_eq!(rx.peers().len(), 1);
    drop(tx);
    flood.stop().await;
}

/// The same on MD's handoff link: RLD (with the secret) connects and the link
/// carries a round trip during the flood, and MD holds no more opening connections
/// than its bound (it once held every one, each for `connect_timeout`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_idle_connections_does_not_keep_rld_out() {
    use pdd_io::admission::{MAX_OPENING_CONNECTIONS, MAX_OPENING_PER_SOURCE};
    use pdd_io::handoff_link::{LinkConfig, MainLink, RelayLink};
    let rt = tokio::runtime::Handle::current();
    let secret = Bytes::from_static(b"deployment secret");
    let md_cfg = LinkConfig {
        secret: Some(secret.clone()),
        connect_timeout: Duration::from_secs(30),
        ..LinkConfig::default()
    };
    let md = MainLink::listen(&rt, "127.0.0.1:0".parse().unwrap(), md_cfg).unwrap();
    let md_addr = md.local_addr().unwrap();
    let flood = Flood::start(
        md_addr,
        &flood_sources(),
        MAX_OPENING_PER_SOURCE,
        Role::RelayDecode,
    )
    .await;
    tokio::time::sleep(flood::REFRESH * 2).await;
    let started = std::time::Instant::now();
    let rld_cfg = LinkConfig {
        secret: Some(secret),
        connect_timeout: Duration::from_secs(2),
        ..LinkConfig::default()
    };
    let rld = RelayLink::connect(&rt, md_addr, rld_cfg).unwrap();
    rld.wait_connected(HONEST_BOUND)
        .await
        .expect("RLD kept out of MD by the flood");
    let rtt = rld.ping(HONEST_BOUND).await.unwrap();
    eprintln!(
        "RLD connected and pinged in {:?} (rtt {rtt:?})",
        started.elapsed()
    );
    assert!(started.elapsed() < HONEST_BOUND);
    let (held, sockets) = flood.settle(Duration::from_millis(500), md_addr).await;
    assert!(
        held <= MAX_OPENING_CONNECTIONS,
        "{held} flood connections held"
    );
    assert!(
        sockets <= MAX_OPENING_CONNECTIONS + 1,
        "MD holds {sockets} sockets"
    );
    let stats = md.stats();
    assert!(stats.half_open as usize <= MAX_OPENING_CONNECTIONS);
    assert!(stats.half_open_evicted > 0);
    assert!(md.is_connected());
    rld.close();
    md.close();
    flood.stop().await;
}

/// The whole opening exchange a connector sends, up to the acceptor's AUTH.
async fn raw_hello(addr: std::net::SocketAddr, offer: &Hello) -> (TcpStream, Auth) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let bytes = pdd_core::wire::encode_frame_to_vec(&Frame::Hello(offer.clone()), 1 << 20).unwrap();
    s.write_all(&bytes).await.unwrap();
    match bounded(lane::read_frame_exact(&mut s, 1 << 20)).await {
        Ok(Some(Frame::Auth(a))) => (s, a),
        other => panic!("expected the acceptor's AUTH, got {other:?}"),
    }
}

/// How long a refusal may take.
const QUICK: Duration = Duration::from_secs(2);

/// Send `bytes` where the connector's AUTH belongs; the acceptor must answer with
/// an ABORT within [`QUICK`], then close. Returns the ABORT's reason.
async fn refusal_of(s: &mut TcpStream, bytes: &[u8]) -> &'static str {
    let started = std::time::Instant::now();
    s.write_all(bytes).await.unwrap();
    let first = tokio::time::timeout(QUICK, lane::read_frame_exact(s, 1 << 20))
        .await
        .expect("neither an answer nor a close within 2 s");
    let reason = match first {
        Ok(Some(Frame::Abort(a))) => a.reason.name(),
        other => panic!("expected an ABORT saying why, got {other:?}"),
    };
    let mut rest = Vec::new();
    tokio::time::timeout(QUICK, s.read_to_end(&mut rest))
        .await
        .expect("not closed after the ABORT")
        .unwrap();
    assert!(rest.is_empty(), "{} bytes after the ABORT", rest.len());
    assert!(started.elapsed() < QUICK, "{:?}", started.elapsed());
    reason
}

fn auth_bytes(a: &Auth) -> Vec<u8> {
    pdd_core::wire::encode_frame_to_vec(&Frame::Auth(a.clone()), 1 << 20).unwrap()
}

/// A frame that is not an AUTH where the connector's AUTH belongs (malformed: a
/// bad magic, a bad CRC, a kind nobody knows, another kind) is answered with an
/// ABORT naming what was wrong, then the close, as a bad HELLO is; never a bare
/// close. No session results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_frame_in_place_of_auth_gets_an_abort() {
    let rx = receiver(Some(b"s3cret")).await;
    let h = hello(Role::Prefill, Some(b"s3cret"));
    let answer = auth_bytes(&Auth {
        nonce: [1; 32],
        proof: [2; 32],
    });
    let mut bad_magic = answer.clone();
    bad_magic[0] = b'X';
    let mut bad_crc = answer.clone();
    bad_crc[HEADER_LEN + 5] ^= 0x40;
    let mut unknown_kind = answer.clone();
    unknown_kind[3] = 0x7F;
    let ping = pdd_core::wire::encode_frame_to_vec(
        &Frame::Ping(pdd_core::wire::Ping {
            nonce: 1,
            sent_at_ns: 2,
        }),
        1 << 20,
    )
    .unwrap();
    for (n, (bytes, want)) in [
        (bad_magic, "protocol_error"),
        (bad_crc, "checksum_mismatch"),
        (unknown_kind, "unknown_kind"),
        (ping, "protocol_error"),
    ]
    .into_iter()
    .enumerate()
    {
        let offer = h.offer(40 + n as u64, 0, rand::random(), false);
        let (mut s, _) = raw_hello(rx.local_addr(), &offer).await;
        assert_eq!(refusal_of(&mut s, &bytes).await, want, "case {n}");
    }
    assert!(rx.peers().is_empty());
}

/// A frame announced larger than any frame of the opening (HELLO, AUTH, ABORT) is
/// refused from its header, before its payload is waited for or buffered: a
/// connection that has proved nothing cannot make the acceptor hold `max_payload`
/// bytes (16 MiB by default) by sending 16 and stalling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_frame_announced_in_the_opening_is_refused_from_its_header() {
    let rx = receiver(Some(b"s3cret")).await;
    let h = hello(Role::Prefill, Some(b"s3cret"));
    let announce = |kind: u8| {
        let mut head = [0u8; HEADER_LEN];
        head[..4].copy_from_slice(&[b'P', b'D', 1, kind]);
        head[8..12].copy_from_slice(&(8u32 << 20).to_le_bytes());
        head
    };
    // In place of HELLO.
    let mut s = TcpStream::connect(rx.local_addr()).await.unwrap();
    assert_eq!(refusal_of(&mut s, &announce(0x01)).await, "frame_too_large");
    // In place of AUTH.
    let (mut s, _) = raw_hello(rx.local_addr(), &h.offer(50, 0, rand::random(), false)).await;
    assert_eq!(refusal_of(&mut s, &announce(0x0E)).await, "frame_too_large");
    assert!(rx.peers().is_empty());
}

/// Forging connectors, one per way to fake the connector's proof, against a
/// receiver with a secret: each speaks HELLO correctly, gets the receiver's AUTH,
/// and answers with a proof that must not pass. Each is refused with ABORT
/// `auth_failed` within 2 s and gets no session; a live session it aimed at goes on
/// untouched. (Every client with a wrong secret in the other tests gives up before
/// answering, so none of them would notice the receiver skipping this check.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_connector_proofs_are_refused() {
    use pdd_core::wire::handshake::{answer_challenge, challenge};
    const SECRET: &[u8] = b"s3cret";
    let rx = receiver(Some(SECRET)).await;
    let addr = rx.local_addr();
    let h = hello(Role::Prefill, Some(SECRET));
    let refused = || {
        rx.metrics()
            .lanes_refused_total
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let mut expect_refused = 0;
    let mut check = |what: &str, reason: &str| {
        expect_refused += 1;
        assert_eq!(reason, "auth_failed", "{what}");
        assert!(rx.peers().is_empty(), "{what}: a session was opened");
    };

    // 1. No secret: a made-up proof.
    let offer = h.offer(60, 0, rand::random(), false);
    let (mut s, _) = raw_hello(addr, &offer).await;
    let forged = Auth {
        nonce: offer.auth[..].try_into().unwrap(),
        proof: rand::random(),
    };
    check(
        "made-up proof",
        refusal_of(&mut s, &auth_bytes(&forged)).await,
    );

    // 2. Reflection: the receiver's own proof sent back as ours.
    let offer = h.offer(61, 0, rand::random(), false);
    let (mut s, theirs) = raw_hello(addr, &offer).await;
    let reflected = Auth {
        nonce: offer.auth[..].try_into().unwrap(),
        proof: theirs.proof,
    };
    check(
        "reflected proof",
        refusal_of(&mut s, &auth_bytes(&reflected)).await,
    );

    // 3. Replay: an honest exchange recorded on the wire (HELLO and answer), played
    // again once that session ended; the receiver's fresh nonce makes it stale.
    let offer = h.offer(62, 0, rand::random(), false);
    let (mut s, ch) = raw_hello(addr, &offer).await;
    let recorded = answer_challenge(SECRET, &offer, &ch).unwrap();
    s.write_all(&auth_bytes(&recorded)).await.unwrap();
    match bounded(lane::read_frame_exact(&mut s, 1 << 20)).await {
        Ok(Some(Frame::Hello(_))) => {}
        other => panic!("the honest exchange was not admitted: {other:?}"),
    }
    bounded(rx.wait_peer(Some(62))).await;
    drop(s);
    bounded(async {
        while !rx.peers().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let (mut s, _) = raw_hello(addr, &offer).await;
    check(
        "replayed answer",
        refusal_of(&mut s, &auth_bytes(&recorded)).await,
    );

    // 4. A proof made with the secret, but for another HELLO than the one sent (a
    // man in the middle that changed the HELLO, here its capabilities).
    let offer = h.offer(63, 0, rand::random(), false);
    let mut altered = offer.clone();
    altered.capabilities = 0;
    let (mut s, ch) = raw_hello(addr, &altered).await;
    let for_original = challenge(SECRET, &offer, ch.nonce);
    let lifted = answer_challenge(SECRET, &offer, &for_original).unwrap();
    check(
        "proof over another HELLO",
        refusal_of(&mut s, &auth_bytes(&lifted)).await,
    );

    // 5. A right proof whose nonce is not the HELLO's.
    let offer = h.offer(64, 0, rand::random(), false);
    let (mut s, ch) = raw_hello(addr, &offer).await;
    let mut wrong_nonce = answer_challenge(SECRET, &offer, &ch).unwrap();
    wrong_nonce.nonce[0] ^= 1;
    check(
        "nonce not the HELLO's",
        refusal_of(&mut s, &auth_bytes(&wrong_nonce)).await,
    );
    assert_eq!(refused(), expect_refused, "each counted as refused");

    // 6 and 7. A holder of the root secret (any peer of the deployment) resuming a
    // live session it did not open, as a data lane or as its control lane: it
    // cannot check the receiver's proof (session secret) and answers with a proof
    // of the root secret.
    let victim = sender(&rx, 5, Some(SECRET)).await;
    bounded(rx.wait_peer(Some(5))).await;
    for lane_no in [1u16, 0] {
        let offer = h.offer(5, lane_no, rand::random(), true);
        let (mut s, ch) = raw_hello(addr, &offer).await;
        let as_root = challenge(SECRET, &offer, ch.nonce);
        let root_proof = answer_challenge(SECRET, &offer, &as_root).unwrap();
        let reason = refusal_of(&mut s, &auth_bytes(&root_proof)).await;
        assert_eq!(reason, "auth_failed", "lane {lane_no}");
    }
    assert_eq!(rx.peers().len(), 1);
    let inbound = rx.grant(1, &[6], None, Some(5), None).unwrap();
    let out = bounded(victim.wait_grant(1)).await.unwrap();
    for layer in 0..LAYERS {
        out.send_layer(layer, layer, &[0]).await.unwrap();
    }
    out.finish().await.unwrap();
    bounded(inbound.wait()).await.unwrap();
}

/// A forging acceptor: accepts one connection, reads the connector's HELLO,
/// answers with `forge(offer)` as its AUTH, and returns every frame the connector
/// sends after that, until it closes (bounded).
async fn forging_acceptor(
    forge: impl FnOnce(Hello) -> std::pin::Pin<Box<dyn std::future::Future<Output = Auth> + Send>>
        + Send
        + 'static,
) -> (std::net::SocketAddr, tokio::task::JoinHandle<Vec<Frame>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let offer = match lane::read_frame_exact(&mut s, 1 << 20).await {
            Ok(Some(Frame::Hello(h))) => h,
            other => panic!("expected HELLO, got {other:?}"),
        };
        let forged = forge(offer).await;
        s.write_all(&auth_bytes(&forged)).await.unwrap();
        let mut after = Vec::new();
        let deadline = tokio::time::Instant::now() + QUICK;
        while let Ok(Ok(Some(f))) =
            tokio::time::timeout_at(deadline, lane::read_frame_exact(&mut s, 1 << 20)).await
        {
            // A connector that answers with its own proof has lost: stop there.
            let proved = matches!(f, Frame::Auth(_));
            after.push(f);
            if proved {
                break;
            }
        }
        after
    });
    (addr, task)
}

/// What a connector must send after a forged acceptor proof: only the ABORT that
/// says `auth_failed`, never its own proof.
fn assert_only_refused(after: &[Frame]) {
    match after {
        [Frame::Abort(a)] => assert_eq!(a.reason.name(), "auth_failed"),
        other => panic!("expected only ABORT auth_failed, got {other:?}"),
    }
}

/// Forging acceptors, one per way to fake the acceptor's proof: a sender with the
/// secret refuses each with `auth_failed` within 2 s, tells it so (ABORT), never
/// sends its own proof, and has no session (nothing is granted to it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_acceptor_proofs_are_refused() {
    use pdd_core::wire::handshake::challenge;
    const SECRET: &[u8] = b"s3cret";
    let connect = |addr: std::net::SocketAddr| async move {
        let mut cfg = SenderConfig::new(addr, 3, hello(Role::Prefill, Some(SECRET)));
        cfg.connect_timeout = Duration::from_secs(5);
        let started = std::time::Instant::now();
        let err = KvSender::connect(pool(1), cfg)
            .await
            .err()
            .expect("a sender talked to an impostor");
        assert_eq!(err.reason(), "auth_failed", "{err:?}");
        assert!(err.to_string().contains("accepting peer"), "{err}");
        assert!(started.elapsed() < QUICK, "{:?}", started.elapsed());
    };

    // 1. No secret: a made-up proof.
    let (addr, seen) = forging_acceptor(|_| {
        Box::pin(async {
            Auth {
                nonce: rand::random(),
                proof: rand::random(),
            }
        })
    })
    .await;
    connect(addr).await;
    assert_only_refused(&bounded(seen).await.unwrap());

    // 2. Replay: the real receiver's AUTH from an earlier exchange (recorded on the
    // wire), played to a new connection, whose nonce differs.
    let real = receiver(Some(SECRET)).await;
    let earlier = hello(Role::Prefill, Some(SECRET)).offer(3, 0, rand::random(), false);
    let (_s, recorded) = raw_hello(real.local_addr(), &earlier).await;
    let (addr, seen) = forging_acceptor(move |_| Box::pin(async move { recorded })).await;
    connect(addr).await;
    assert_only_refused(&bounded(seen).await.unwrap());

    // 3. A man in the middle that relays to the real receiver but changes the
    // HELLO on the way (strips its capabilities): the receiver's proof covers the
    // HELLO it got, not the one the sender sent.
    let real_addr = real.local_addr();
    let (addr, seen) = forging_acceptor(move |offer| {
        Box::pin(async move {
            let mut altered = offer;
            altered.capabilities = 0;
            raw_hello(real_addr, &altered).await.1
        })
    })
    .await;
    connect(addr).await;
    assert_only_refused(&bounded(seen).await.unwrap());
    assert!(real.peers().is_empty());

    // 4. A holder of the root secret (any node of the deployment) posing as the
    // acceptor of a session's data lane: it proves the root secret, not the
    // session's.
    let (addr, seen) = forging_acceptor(|offer| {
        Box::pin(async move { challenge(SECRET, &offer, rand::random()) })
    })
    .await;
    let h = hello(Role::Prefill, Some(SECRET));
    let started = std::time::Instant::now();
    let key = LaneKey::Session(rand::random());
    let t = SocketTuning::default();
    let err = lane::connect(addr, &h, 3, 1, &key, &t, None, BOUND)
        .await
        .unwrap_err();
    assert_eq!(err.reason(), "auth_failed", "{err:?}");
    assert!(started.elapsed() < QUICK);
    assert_only_refused(&bounded(seen).await.unwrap());
}

/// The other acceptors run the same check: MD's handoff link refuses a forging
/// RLD's made-up proof with `auth_failed` and stays unconnected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn md_refuses_a_forged_rld_proof() {
    use pdd_io::handoff_link::{LinkConfig, MainLink};
    let rt = tokio::runtime::Handle::current();
    let cfg = LinkConfig {
        secret: Some(Bytes::from_static(b"s3cret")),
        ..LinkConfig::default()
    };
    let md = MainLink::listen(&rt, "127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let mut h = LocalHello::new(Role::RelayDecode, capability::HANDOFF);
    h.accepted_roles = vec![Role::MainDecode];
    let offer = h.offer(8, 0, rand::random(), false);
    let (mut s, _) = raw_hello(md.local_addr().unwrap(), &offer).await;
    let forged = Auth {
        nonce: offer.auth[..].try_into().unwrap(),
        proof: rand::random(),
    };
    assert_eq!(
        refusal_of(&mut s, &auth_bytes(&forged)).await,
        "auth_failed"
    );
    assert!(!md.is_connected());
    assert_eq!(md.stats().connects, 0);
    md.close();
}

mod tls {
    use super::*;
    use pdd_io::tls::{TestPki, TlsConfig};

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    async fn tls_receiver(cfg: TlsConfig) -> KvReceiver {
        let mut rc = ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            hello(Role::MainDecode, None),
        );
        rc.tls = Some(cfg);
        KvReceiver::start(pool(0), rc).await.unwrap()
    }

    async fn tls_sender(rx: &KvReceiver, cfg: TlsConfig) -> Result<KvSender, Error> {
        let mut sc = SenderConfig::new(rx.local_addr(), 21, hello(Role::Prefill, None));
        sc.lanes = 2;
        sc.tls = Some(cfg);
        KvSender::connect(pool(0x5A), sc).await
    }

    /// Mutual TLS: the transfer lands byte for byte, without CRCs (AEAD), and the
    /// peer was checked against the allow-list.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transfer_over_mutual_tls_lands_verified() {
        let pki = TestPki::generate(&names(&["md.example", "p1.example"])).unwrap();
        let rx = tls_receiver(
            pki.config("md.example", "md.example", &names(&["p1.example"]))
                .unwrap(),
        )
        .await;
        let tx = tls_sender(&rx, pki.config("p1.example", "md.example", &[]).unwrap())
            .await
            .unwrap();
        bounded(rx.wait_peer(Some(21))).await;
        let inbound = rx.grant(4, &[2, 5], None, Some(21), None).unwrap();
        let out = bounded(tx.wait_grant(4)).await.unwrap();
        for layer in 0..LAYERS {
            out.send_layer(layer, layer, &[0, 1]).await.unwrap();
        }
        out.finish().await.unwrap();
        bounded(inbound.wait()).await.unwrap();
        for layer in 0..LAYERS {
            for page in [2, 5] {
                assert!(rx
                    .pool()
                    .copy_page(layer, page)
                    .unwrap()
                    .iter()
                    .all(|&b| b == 0x5A));
            }
        }
        let m = rx.metrics();
        assert_eq!(
            m.checksum_failures_total
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    }

    /// A certificate from the CA that is not on the allow-list, one from another CA,
    /// and a plain-TCP sender are all refused before any session exists.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_allowed_certificates_get_in() {
        let pki =
            TestPki::generate(&names(&["md.example", "p1.example", "other.example"])).unwrap();
        let rogue = TestPki::generate(&names(&["p1.example"])).unwrap();
        let rx = tls_receiver(
            pki.config("md.example", "md.example", &names(&["p1.example"]))
                .unwrap(),
        )
        .await;
        let not_allowed = pki.config("other.example", "md.example", &[]).unwrap();
        let err = tls_sender(&rx, not_allowed).await.err().expect("refused");
        assert!(
            matches!(
                err.reason(),
                "connection_lost" | "auth_failed" | "peer_aborted"
            ),
            "{err:?}"
        );
        // Another CA: the receiver's certificate does not verify for the rogue, and
        // the rogue's does not for the receiver.
        let err = tls_sender(&rx, rogue.config("p1.example", "md.example", &[]).unwrap())
            .await
            .err()
            .expect("refused");
        assert_eq!(err.reason(), "auth_failed", "{err:?}");
        let mut plain = SenderConfig::new(rx.local_addr(), 22, hello(Role::Prefill, None));
        plain.connect_timeout = Duration::from_secs(2);
        assert!(KvSender::connect(pool(1), plain).await.is_err());
        assert!(rx.peers().is_empty());
    }

    /// A sender that expects `md.example` refuses an acceptor that proves another name
    /// (an impostor with a certificate from the same CA).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sender_refuses_an_acceptor_with_the_wrong_name() {
        let pki = TestPki::generate(&names(&["md.example", "p1.example", "evil.example"])).unwrap();
        let impostor = tls_receiver(pki.config("evil.example", "evil.example", &[]).unwrap()).await;
        let err = tls_sender(
            &impostor,
            pki.config("p1.example", "md.example", &[]).unwrap(),
        )
        .await
        .err()
        .expect("refused");
        assert_eq!(err.reason(), "auth_failed", "{err:?}");
        assert!(impostor.peers().is_empty());
    }

    /// Small socket buffers make TLS writes find the socket full often, the case where
    /// the tail of a lane's last block can sit in rustls's record buffer unless the
    /// sender flushes. (This stress did not reproduce that stall on demand here; the
    /// TLS bench did, about once in ten runs, before the flush.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tls_blocks_are_flushed_even_when_the_socket_is_full() {
        let pki = TestPki::generate(&names(&["md.example", "p1.example"])).unwrap();
        let tight = SocketTuning {
            buffer_bytes: Some(16 << 10),
            ..SocketTuning::default()
        };
        let mut rc = ReceiverConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            hello(Role::MainDecode, None),
        );
        rc.tls = Some(pki.config("md.example", "md.example", &[]).unwrap());
        rc.tuning = tight.clone();
        rc.dead_after = Duration::from_secs(2);
        let rx = KvReceiver::start(pool(0), rc).await.unwrap();
        let mut sc = SenderConfig::new(rx.local_addr(), 21, hello(Role::Prefill, None));
        sc.lanes = 2;
        sc.tuning = tight;
        sc.max_block_bytes = 2 * PAGE;
        sc.tls = Some(pki.config("p1.example", "md.example", &[]).unwrap());
        let tx = KvSender::connect(pool(0x33), sc).await.unwrap();
        bounded(rx.wait_peer(Some(21))).await;
        for request in 1..=5u64 {
            let inbound = rx
                .grant(request, &[0, 1, 2, 3, 4, 5, 6, 7], None, Some(21), None)
                .unwrap();
            let out = bounded(tx.wait_grant(request)).await.unwrap();
            for layer in 0..LAYERS {
                out.send_layer(layer, layer, &[7, 6, 5, 4, 3, 2, 1, 0])
                    .await
                    .unwrap();
            }
            out.finish().await.unwrap();
            bounded(inbound.wait()).await.unwrap();
        }
        assert!(rx
            .pool()
            .copy_page(1, 5)
            .unwrap()
            .iter()
            .all(|&b| b == 0x33));
    }

    #[test]
    fn bad_pem_is_a_clear_invalid_argument() {
        let err = TlsConfig::from_pem(b"nope", b"nope", b"nope", "md", &[]).unwrap_err();
        assert_eq!(err.reason(), "invalid_argument");
        assert!(err.to_string().contains("TLS configuration"), "{err}");
        let pki = TestPki::generate(&names(&["a"])).unwrap();
        let err = pki.config("b", "a", &[]).unwrap_err();
        assert!(err.to_string().contains("no leaf"), "{err}");
    }
}
