//! One TCP connection of a session ("lane"): socket tuning, the HELLO exchange, and
//! small-frame I/O. Lane 0 is the control lane (TCP_NODELAY, small frames only); lanes
//! 1.. carry KV_PAGES.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use pdd_core::wire::handshake::{self, negotiate, AuthBytes, LocalHello, Negotiated};
use pdd_core::wire::{encode_frame, Abort, Frame, FrameHeader, Hello, HEADER_LEN};
use pdd_core::Error;
use socket2::SockRef;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

pub use crate::tls::{LaneStream, PeerIdentity, TlsConfig};

/// `local`, offering AEAD integrity when the lane runs inside TLS; sealed lanes (if
/// `local` offers them) only there too.
pub fn with_aead(local: &LocalHello, tls: bool) -> LocalHello {
    use pdd_core::wire::capability::{AEAD, SEALED_LANES};
    let mut h = local.clone();
    if tls {
        h.capabilities |= AEAD;
    } else {
        h.capabilities &= !(AEAD | SEALED_LANES);
    }
    h
}

/// Offer `kv_layout` exactly when this endpoint has a layout to send: the bit
/// promises a KV_LAYOUT first, and where both offer it each side waits for the
/// other's before the session counts as up (a side without one would hold the
/// other forever).
pub fn offer_layout(local: &mut LocalHello, has_layout: bool) {
    use pdd_core::wire::capability::KV_LAYOUT;
    if has_layout {
        local.capabilities |= KV_LAYOUT;
    } else {
        local.capabilities &= !KV_LAYOUT;
    }
}

/// Whether a lane's ends agreed to seal its KV (see [`crate::sealed`]).
pub fn sealed(agreed: &Negotiated) -> bool {
    use pdd_core::wire::capability::{AEAD, SEALED_LANES};
    agreed.capabilities & (AEAD | SEALED_LANES) == AEAD | SEALED_LANES
}

/// Socket settings for every lane.
#[derive(Debug, Clone)]
pub struct SocketTuning {
    /// SO_SNDBUF / SO_RCVBUF request (the kernel caps it at net.core.[rw]mem_max).
    pub buffer_bytes: Option<usize>,
    /// TCP congestion control (`"bbr"`, `"cubic"`); ignored with a warning counter when
    /// the kernel refuses it.
    pub congestion: Option<String>,
    /// TCP_NOTSENT_LOWAT: the most bytes a lane keeps written but not yet sent. Without
    /// it a write fills the whole send buffer at once (here 2 x 4 MiB per lane), so a
    /// sender behind a slow line copies and checksums (or seals) tens of MiB in one
    /// burst when a transfer starts, on the cores a local transfer running at the same
    /// moment needs; with it the copies follow the line's pace. Bytes in flight (sent,
    /// not yet acknowledged) are not limited by it.
    pub unsent_limit: Option<usize>,
}

impl Default for SocketTuning {
    fn default() -> Self {
        SocketTuning {
            buffer_bytes: Some(8 << 20),
            congestion: None,
            unsent_limit: Some(DEFAULT_UNSENT_LIMIT),
        }
    }
}

/// The default [`SocketTuning::unsent_limit`]: 1 MiB per lane, 0.3 ms of a 100 Gbit/s
/// line shared by 4 lanes, far longer than a lane's writer takes to wake.
pub const DEFAULT_UNSENT_LIMIT: usize = 1 << 20;

/// Apply tuning to a connected stream. Returns whether the congestion control
/// requested was applied (false if none was requested or the kernel refused).
pub fn tune(stream: &TcpStream, tuning: &SocketTuning, nodelay: bool) -> bool {
    let sock = SockRef::from(stream);
    // Best effort: a refused buffer size or CC leaves the kernel default, which works.
    let _ = stream.set_nodelay(nodelay);
    if let Some(n) = tuning.buffer_bytes {
        let _ = sock.set_send_buffer_size(n);
        let _ = sock.set_recv_buffer_size(n);
    }
    if let Some(n) = tuning.unsent_limit {
        set_unsent_limit(stream, n);
    }
    match &tuning.congestion {
        Some(cc) => sock.set_tcp_congestion(cc.as_bytes()).is_ok(),
        None => false,
    }
}

/// Best effort, as the buffer sizes: a kernel without TCP_NOTSENT_LOWAT (Linux < 3.12)
/// leaves the whole send buffer writable, which works, only in bursts.
fn set_unsent_limit(stream: &TcpStream, n: usize) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let v = libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
        // SAFETY: a socket descriptor this stream owns, and an option value of the
        // c_int size given.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_NOTSENT_LOWAT,
                std::ptr::addr_of!(v).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (stream, n);
}

fn lost(e: std::io::Error, what: &str) -> Error {
    Error::ConnectionLost {
        detail: format!("{what}: {e}"),
    }
}

/// Read one whole frame with exact reads (never past its end), bounded by
/// `max_payload`. `Ok(None)` on a clean EOF before the first byte.
pub async fn read_frame_exact<S: AsyncRead + Unpin>(
    stream: &mut S,
    max_payload: u32,
) -> Result<Option<Frame>, Error> {
    let mut head = [0u8; HEADER_LEN];
    match stream.read(&mut head[..1]).await {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(lost(e, "read")),
    }
    stream
        .read_exact(&mut head[1..])
        .await
        .map_err(|e| lost(e, "read"))?;
    let header = FrameHeader::parse(&head, max_payload)?;
    let mut buf = BytesMut::with_capacity(HEADER_LEN + header.payload_len as usize);
    buf.extend_from_slice(&head);
    buf.resize(HEADER_LEN + header.payload_len as usize, 0);
    stream
        .read_exact(&mut buf[HEADER_LEN..])
        .await
        .map_err(|e| lost(e, "read"))?;
    match pdd_core::wire::decode_frame(&buf, max_payload)? {
        Some((frame, _)) => Ok(Some(frame)),
        None => Err(Error::ConnectionLost {
            detail: "frame ended early".into(),
        }),
    }
}

/// Encode and write one frame.
pub async fn write_frame<S: AsyncWrite + Unpin>(
    stream: &mut S,
    frame: &Frame,
    max_payload: u32,
) -> Result<(), Error> {
    let mut buf = BytesMut::new();
    encode_frame(frame, max_payload, &mut buf)?;
    stream.write_all(&buf).await.map_err(|e| lost(e, "write"))?;
    // On TLS, bytes a write accepted may still sit in rustls's record buffer (the
    // socket would have blocked): flush, or they wait for the next write. A no-op on
    // plain TCP.
    stream.flush().await.map_err(|e| lost(e, "write"))
}

/// Refuse to listen on a non-loopback address without a root secret, unless
/// `allow_insecure`: without one, anyone who can reach the port can open a session,
/// be granted pages and stream into them.
pub fn check_exposure(
    addr: SocketAddr,
    local: &LocalHello,
    allow_insecure: bool,
) -> Result<(), Error> {
    if addr.ip().is_loopback() || local.secret.is_some() || allow_insecure {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "refusing to listen on {addr} without authentication: anyone who reaches it could \
         open a session; give a secret (both ends), or allow insecure explicitly"
    )))
}

/// What a connecting lane proves it holds.
#[derive(Clone)]
pub enum LaneKey {
    /// The root secret (`LocalHello::secret`): the lane opens session `session_id`
    /// (a control lane that is not resuming).
    Root,
    /// The secret of a live session: the lane joins it (every data lane, a control
    /// lane that resumes). HELLO carries the RESUME flag.
    Session(AuthBytes),
}

impl std::fmt::Debug for LaneKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LaneKey::Root => "LaneKey::Root",
            LaneKey::Session(_) => "LaneKey::Session(<secret>)",
        })
    }
}

/// A lane connected and admitted.
#[derive(Debug)]
pub struct Connected {
    /// The byte stream (TLS over the socket where configured).
    pub stream: LaneStream,
    /// The acceptor's TLS identity, on a TLS lane.
    pub peer: Option<PeerIdentity>,
    /// What both sides agreed.
    pub agreed: Negotiated,
    /// The session's secret: derived by this exchange for a [`LaneKey::Root`] lane,
    /// the one given for a [`LaneKey::Session`] lane. Keys the session's other lanes
    /// and its reconnects; never sent.
    pub session_secret: AuthBytes,
}

fn unexpected(frame: &Frame, wanted: &str) -> Error {
    match frame {
        Frame::Abort(a) => Error::PeerAborted {
            reason: a.reason,
            message: a.message.clone(),
        },
        other => Error::InvalidField {
            kind: other.kind(),
            field: "kind",
            detail: format!("expected {wanted}"),
        },
    }
}

/// Connect lane `lane` of session `session_id`, exchange HELLO and AUTH (both sides
/// prove `key`), all within `timeout`. Fails with `auth_failed` before sending our
/// proof if the acceptor cannot prove the key: we never talk on to an impostor.
#[allow(clippy::too_many_arguments)]
pub async fn connect(
    addr: SocketAddr,
    local: &LocalHello,
    session_id: u64,
    lane: u16,
    key: &LaneKey,
    tuning: &SocketTuning,
    tls: Option<&TlsConfig>,
    timeout: Duration,
) -> Result<Connected, Error> {
    connect_noting_refusal(
        addr, local, session_id, lane, key, tuning, tls, timeout, None,
    )
    .await
}

/// [`connect`], and sets `refused` when the TCP connect itself was refused (nothing
/// listens at `addr`: a receiver's process is gone, unlike a line that is down,
/// where the connect hangs until `timeout`).
#[allow(clippy::too_many_arguments)]
pub async fn connect_noting_refusal(
    addr: SocketAddr,
    local: &LocalHello,
    session_id: u64,
    lane: u16,
    key: &LaneKey,
    tuning: &SocketTuning,
    tls: Option<&TlsConfig>,
    timeout: Duration,
    refused: Option<&std::sync::atomic::AtomicBool>,
) -> Result<Connected, Error> {
    let attempt = async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| {
            if let (Some(r), std::io::ErrorKind::ConnectionRefused) = (refused, e.kind()) {
                r.store(true, std::sync::atomic::Ordering::Release);
            }
            lost(e, &format!("connect to {addr}"))
        })?;
        tune(&tcp, tuning, true);
        // On TLS the acceptor proves its certificate first, then both prove the
        // secret inside it; AEAD is offered only there.
        let (mut stream, peer) = match tls {
            Some(t) => {
                let (s, id) = t.connect(tcp).await?;
                (s, Some(id))
            }
            None => (LaneStream::Plain(tcp), None),
        };
        let local = &with_aead(local, stream.is_tls());
        let offer = local.offer(
            session_id,
            lane,
            rand::random(),
            matches!(key, LaneKey::Session(_)),
        );
        write_frame(&mut stream, &Frame::Hello(offer.clone()), local.max_payload).await?;
        let closed = || Error::ConnectionLost {
            detail: format!("{addr} closed during HELLO"),
        };
        let challenge = match read_frame_exact(&mut stream, opening_max(local))
            .await?
            .ok_or_else(closed)?
        {
            Frame::Auth(a) => a,
            other => return Err(unexpected(&other, "AUTH after our HELLO")),
        };
        let key_bytes: &[u8] = match key {
            LaneKey::Root => local.root_key(),
            LaneKey::Session(s) => s,
        };
        let answer = match handshake::answer_challenge(key_bytes, &offer, &challenge) {
            Ok(a) => a,
            Err(e) => {
                let _ = write_frame(&mut stream, &abort_for(&e), local.max_payload).await;
                return Err(e);
            }
        };
        write_frame(&mut stream, &Frame::Auth(answer), local.max_payload).await?;
        let agreed = match read_frame_exact(&mut stream, opening_max(local))
            .await?
            .ok_or_else(closed)?
        {
            Frame::Hello(h) => handshake::check_reply(local, &offer, &h)?,
            other => return Err(unexpected(&other, "HELLO as the answer to our AUTH")),
        };
        if lane > 0 {
            stream
                .tcp()
                .set_nodelay(false)
                .map_err(|e| lost(e, "setsockopt"))?;
        }
        let session_secret = match key {
            LaneKey::Root => handshake::session_secret(local.root_key(), &offer, &challenge.nonce),
            LaneKey::Session(s) => *s,
        };
        Ok(Connected {
            stream,
            peer,
            agreed,
            session_secret,
        })
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| Error::DeadlineExceeded {
            what: format!("connecting lane {lane} to {addr}"),
        })?
}

/// A connecting peer's HELLO, read and agreed with (not yet authenticated).
#[derive(Debug, Clone)]
pub struct Offered {
    /// What both sides agree on.
    pub agreed: Negotiated,
    /// The peer's HELLO itself: the transcript its proofs cover.
    pub offer: Hello,
}

/// Accept side of a whole lane opening, within `timeout`: [`read_hello`], then
/// [`authenticate`] (a session-opening lane with the root secret, a RESUME lane with
/// `session`'s secret, refused when `session` is `None`), then [`answer_hello`].
/// Returns what was agreed and the session secret (derived, or `session`'s).
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    local: &LocalHello,
    session: Option<&AuthBytes>,
    timeout: Duration,
) -> Result<(Negotiated, AuthBytes), Error> {
    let offered = read_hello(stream, local, timeout).await?;
    let key: Result<&[u8], Error> = match (offered.agreed.resume, session) {
        (false, _) => Ok(local.root_key()),
        (true, Some(secret)) => Ok(secret),
        (true, None) => Err(Error::AuthFailed {
            detail: "no session to resume",
        }),
    };
    let derived = authenticate(stream, local, &offered, key, timeout).await?;
    answer_hello(stream, local, &offered.agreed, Ok(()), timeout).await?;
    let secret = match (offered.agreed.resume, session) {
        (true, Some(s)) => *s,
        _ => derived,
    };
    Ok((offered.agreed, secret))
}

/// First step of the accept side, within `timeout`: read the peer's HELLO and
/// negotiate. A HELLO we cannot agree with, a frame we cannot decode (an unknown
/// header version included) or another frame is answered with an ABORT saying why.
/// An agreeable one is not answered yet: the caller picks the key the lane must
/// prove (root, or the session's secret for a RESUME lane) and calls
/// [`authenticate`], then admits the lane and calls [`answer_hello`]. A connector
/// must never get a HELLO reply for a lane the acceptor is not ready to serve: it
/// starts using the lane as soon as the reply arrives.
pub async fn read_hello<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    local: &LocalHello,
    timeout: Duration,
) -> Result<Offered, Error> {
    let exchange = async {
        let first = match read_frame_exact(stream, opening_max(local)).await {
            Ok(Some(f)) => f,
            Ok(None) => {
                return Err(Error::ConnectionLost {
                    detail: "peer closed before HELLO".into(),
                })
            }
            Err(err) => {
                if !matches!(err, Error::ConnectionLost { .. }) {
                    // Undecodable (bad version, kind, length...): say why, then close.
                    abort_gracefully(stream, &err, local.max_payload).await;
                }
                return Err(err);
            }
        };
        let Frame::Hello(peer) = first else {
            let err = Error::InvalidField {
                kind: first.kind(),
                field: "kind",
                detail: "expected HELLO first".into(),
            };
            let _ = write_frame(stream, &abort_for(&err), local.max_payload).await;
            return Err(err);
        };
        match negotiate(local, &peer) {
            Ok(agreed) => Ok(Offered {
                agreed,
                offer: peer,
            }),
            Err(err) => {
                let _ = write_frame(stream, &abort_for(&err), local.max_payload).await;
                Err(err)
            }
        }
    };
    within(timeout, "HELLO from a connecting peer", exchange).await
}

/// Second step of the accept side, within `timeout`: challenge the peer to prove
/// `key` (after proving it ourselves) and check its answer. `key` is `Err` when the
/// lane names no session we could key it with: the peer gets an ABORT saying why.
/// Returns the session secret this exchange derives from the root secret (what a
/// session-opening lane's session is keyed with from now on).
pub async fn authenticate<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    local: &LocalHello,
    offered: &Offered,
    key: Result<&[u8], Error>,
    timeout: Duration,
) -> Result<AuthBytes, Error> {
    let max = offered.agreed.peer_max_payload;
    let exchange = async {
        let key = match key {
            Ok(k) => k,
            Err(err) => {
                let _ = write_frame(stream, &abort_for(&err), max).await;
                return Err(err);
            }
        };
        let nonce: AuthBytes = rand::random();
        let challenge = handshake::challenge(key, &offered.offer, nonce);
        write_frame(stream, &Frame::Auth(challenge), max).await?;
        // Whatever comes in place of the answer is refused with an ABORT saying why,
        // as a bad HELLO is: a malformed frame, another kind. Only a peer that closed
        // or aborted itself hears nothing more.
        let answer = match read_frame_exact(stream, opening_max(local)).await {
            Ok(Some(Frame::Auth(a))) => a,
            Ok(Some(other)) => {
                let err = unexpected(&other, "AUTH");
                if !matches!(err, Error::PeerAborted { .. }) {
                    abort_gracefully(stream, &err, max).await;
                }
                return Err(err);
            }
            Ok(None) => {
                return Err(Error::ConnectionLost {
                    detail: "peer closed during AUTH".into(),
                })
            }
            Err(err) => {
                if !matches!(err, Error::ConnectionLost { .. }) {
                    abort_gracefully(stream, &err, max).await;
                }
                return Err(err);
            }
        };
        if let Err(err) = handshake::verify_answer(key, &offered.offer, &nonce, &answer) {
            let _ = write_frame(stream, &abort_for(&err), max).await;
            return Err(err);
        }
        Ok(handshake::session_secret(
            local.root_key(),
            &offered.offer,
            &nonce,
        ))
    };
    within(timeout, "AUTH from a connecting peer", exchange).await
}

/// Last step of the accept side, within `timeout`: answer a negotiated,
/// authenticated HELLO with our HELLO when `admitted` is `Ok`, else with an ABORT
/// saying why (and return that error).
pub async fn answer_hello<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    local: &LocalHello,
    agreed: &Negotiated,
    admitted: Result<(), Error>,
    timeout: Duration,
) -> Result<(), Error> {
    let exchange = async {
        match admitted {
            Ok(()) => {
                write_frame(
                    stream,
                    &Frame::Hello(local.reply(agreed)),
                    agreed.peer_max_payload,
                )
                .await?;
                Ok(())
            }
            Err(err) => {
                let _ = write_frame(stream, &abort_for(&err), agreed.peer_max_payload).await;
                Err(err)
            }
        }
    };
    within(timeout, "answering a connecting peer's HELLO", exchange).await
}

/// The bound on a frame's payload while a lane opens (HELLO, AUTH, an ABORT):
/// `pdd_core::wire::handshake::MAX_OPENING_PAYLOAD`, or our own `max_payload` if
/// that is smaller.
fn opening_max(local: &LocalHello) -> u32 {
    local.max_payload.min(handshake::MAX_OPENING_PAYLOAD)
}

/// Send the ABORT for `err` and close so that the peer reads it: the write side
/// is shut down and whatever the peer had already sent is drained for a moment
/// (closing with unread bytes would make the kernel send a reset, which can
/// overtake the ABORT).
async fn abort_gracefully<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    err: &Error,
    max_payload: u32,
) {
    let _ = write_frame(stream, &abort_for(err), max_payload).await;
    let _ = stream.shutdown().await;
    let drain = async {
        let mut sink = [0u8; 4096];
        let mut left = 1usize << 20;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(200), drain).await;
}

/// `step`, or `DeadlineExceeded { what }` once `timeout` passed.
async fn within<T>(
    timeout: Duration,
    what: &str,
    step: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(timeout, step)
        .await
        .unwrap_or_else(|_| Err(Error::DeadlineExceeded { what: what.into() }))
}

/// The ABORT that tells a peer why we are closing (connection-wide).
pub fn abort_for(err: &Error) -> Frame {
    Frame::Abort(Abort::new(0, err.abort_reason(), err.to_string()))
}

/// Frames a control lane may hold queued but not yet taken by the socket. A peer
/// that keeps sending (PINGs, queries) but stops reading would otherwise grow our
/// memory without bound; past this the session ends with `limit_exceeded`.
pub const MAX_UNWRITTEN_CONTROL_FRAMES: usize = 4096;

/// The sending end of a control lane's queue, bounded by frames not yet written.
#[derive(Clone)]
pub struct ControlTx {
    tx: tokio::sync::mpsc::UnboundedSender<Frame>,
    unwritten: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    limit: usize,
    overflowed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    on_overflow: tokio_util::sync::CancellationToken,
}

/// The writer's end of a control lane's queue.
pub struct ControlRx {
    rx: tokio::sync::mpsc::UnboundedReceiver<Frame>,
    unwritten: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl ControlRx {
    fn take(&mut self) -> Option<Frame> {
        self.rx.try_recv().ok()
    }

    fn written(&self) {
        self.unwritten
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A control-lane queue of at most `limit` unwritten frames; a send past it cancels
/// `on_overflow` (the session) and fails with `limit_exceeded`.
pub fn control_queue(
    limit: usize,
    on_overflow: tokio_util::sync::CancellationToken,
) -> (ControlTx, ControlRx) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let unwritten = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    (
        ControlTx {
            tx,
            unwritten: unwritten.clone(),
            limit,
            overflowed: Default::default(),
            on_overflow,
        },
        ControlRx { rx, unwritten },
    )
}

impl ControlTx {
    /// Queue a frame for the writer.
    pub fn send(&self, frame: Frame) -> Result<(), Error> {
        use std::sync::atomic::Ordering;
        if self.unwritten.fetch_add(1, Ordering::AcqRel) >= self.limit {
            self.unwritten.fetch_sub(1, Ordering::AcqRel);
            self.overflowed.store(true, Ordering::Release);
            self.on_overflow.cancel();
            return Err(self.overflow_error());
        }
        self.tx.send(frame).map_err(|_| {
            self.unwritten.fetch_sub(1, Ordering::AcqRel);
            Error::ConnectionLost {
                detail: "control lane closed".into(),
            }
        })
    }

    /// Whether a send ever found the queue full (the session then ended).
    pub fn overflowed(&self) -> bool {
        self.overflowed.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The error a full queue ends the session with.
    pub fn overflow_error(&self) -> Error {
        Error::LimitExceeded {
            what: "control frames queued for a peer that does not read them".into(),
            limit: self.limit as u64,
        }
    }
}

/// The writer half of a control lane: sends queued frames as they come and, with a
/// `heartbeat`, a PING of its own every interval (a lane whose session machine
/// sends its own PINGs passes `None`), until `cancel` (then it flushes what is
/// queued, an ABORT saying why included, for at most 200 ms) or the queue closes.
/// Every PING written, whoever made it, is counted and samples the kernel's RTT
/// into `metrics`. `Err` carries why a write failed.
pub async fn control_writer<W: AsyncWrite + Unpin>(
    mut writer: tokio_util::codec::FramedWrite<W, crate::codec::WireCodec>,
    socket: std::os::fd::RawFd,
    mut outgoing: ControlRx,
    cancel: tokio_util::sync::CancellationToken,
    heartbeat: Option<Duration>,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    now_ns: fn() -> u64,
) -> Result<(), String> {
    use futures_util::SinkExt;

    let mut tick = heartbeat.map(|h| {
        let mut t = tokio::time::interval(h);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    let mut nonce = 0u64;
    loop {
        let ticked = async {
            match tick.as_mut() {
                Some(t) => {
                    t.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        let (frame, queued) = tokio::select! {
            // Queued frames first: an ABORT queued with the cancel is still sent.
            biased;
            f = outgoing.rx.recv() => match f {
                Some(f) => (f, true),
                None => return Ok(()),
            },
            _ = cancel.cancelled() => {
                // Last words (an ABORT saying why), bounded as a whole: a peer that
                // does not read must not hold the session's teardown.
                let last_words = async {
                    while let Some(f) = outgoing.take() {
                        if writer.feed(&f).await.is_err() {
                            return;
                        }
                        outgoing.written();
                    }
                    let _ = writer.flush().await;
                };
                let _ = tokio::time::timeout(Duration::from_millis(200), last_words).await;
                return Ok(());
            }
            _ = ticked => {
                nonce += 1;
                (Frame::Ping(pdd_core::wire::Ping { nonce, sent_at_ns: now_ns() }), false)
            }
        };
        if matches!(frame, Frame::Ping(_)) {
            crate::metrics::Metrics::add(&metrics.pings_sent_total, 1);
            if let Some(s) = tcp_stats_fd(socket) {
                crate::metrics::Metrics::set(&metrics.tcp_rtt_us, u64::from(s.rtt_us));
            }
        }
        // A write blocked by a peer that stops reading still ends at `cancel`; one
        // that can go through (an ABORT queued just before the cancel) goes first.
        let sent = tokio::select! {
            biased;
            r = writer.send(&frame) => r,
            _ = cancel.cancelled() => return Ok(()),
        };
        if queued {
            outgoing.written();
        }
        if let Err(e) = sent {
            return Err(format!("control lane write: {e}"));
        }
    }
}

/// Kernel TCP statistics of a socket (Linux TCP_INFO): smoothed RTT, its variance,
/// retransmissions and the congestion window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Smoothed RTT, microseconds.
    pub rtt_us: u32,
    /// RTT variance, microseconds.
    pub rtt_var_us: u32,
    /// Segments retransmitted over the connection's life.
    pub total_retrans: u32,
    /// Congestion window, segments.
    pub snd_cwnd: u32,
}

/// Read TCP_INFO for a socket; `None` where the kernel does not provide it.
#[cfg(target_os = "linux")]
pub fn tcp_stats(stream: &TcpStream) -> Option<TcpStats> {
    use std::os::fd::AsRawFd;
    tcp_stats_fd(stream.as_raw_fd())
}

/// [`tcp_stats`] of a socket by its descriptor (which must stay open meanwhile).
#[cfg(target_os = "linux")]
pub fn tcp_stats_fd(fd: std::os::fd::RawFd) -> Option<TcpStats> {
    // SAFETY: tcp_info is plain old data; all-zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: fd is a live socket owned by `stream` for the duration of the call;
    // `info` and `len` point to writable memory of the size passed.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    Some(TcpStats {
        rtt_us: info.tcpi_rtt,
        rtt_var_us: info.tcpi_rttvar,
        total_retrans: info.tcpi_total_retrans,
        snd_cwnd: info.tcpi_snd_cwnd,
    })
}

/// Read TCP_INFO for a socket; `None` where the kernel does not provide it.
#[cfg(not(target_os = "linux"))]
pub fn tcp_stats(_stream: &TcpStream) -> Option<TcpStats> {
    None
}

/// [`tcp_stats`] of a socket by its descriptor; `None` off Linux.
#[cfg(not(target_os = "linux"))]
pub fn tcp_stats_fd(_fd: std::os::fd::RawFd) -> Option<TcpStats> {
    None
}

/// CRC32C of KV_PAGES payloads, continuing from `crc`: the same value as
/// `crc32c::crc32c_append(crc, data)`, computed by the `crc-fast` crate, whose
/// folding with carry-less multiplies (AVX-512 VPCLMULQDQ where the CPU has it) is
/// about 1.7x faster than the SSE4.2 CRC instruction loop of `crc32c` here. The
/// sender checksums every source page before writing a block and the receiver every
/// landed page, so this was a third of the sender's CPU in `bench stream` profiles.
/// Small frames keep `crc32c` (`pdd_core::wire`), where setup cost dominates.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    if data.len() < 4096 {
        return crc32c::crc32c_append(crc, data);
    }
    // crc-fast takes the raw register; a finished CRC32C is the register xor !0.
    let mut digest =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(data);
    digest.finalize() as u32
}

#[cfg(test)]
mod crc_tests {
    use super::crc32c_append;

    #[test]
    fn crc32c_append_matches_the_crate() {
        // Lengths around the 256-byte block, offsets that misalign, any prior state.
        let data: Vec<u8> = (0..(3usize << 20))
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for round in 0..4000 {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let off = (seed >> 40) as usize % 512;
            let len = match round % 4 {
                0 => (seed >> 20) as usize % 1024,
                1 => 256 * ((seed >> 20) as usize % 64),
                2 => (seed >> 20) as usize % 70_000,
                _ => (1 << 20) + (seed >> 20) as usize % 1000,
            };
            let init = (seed >> 3) as u32;
            let piece = &data[off..off + len];
            assert_eq!(
                crc32c_append(init, piece),
                crc32c::crc32c_append(init, piece),
                "off {off} len {len}"
            );
        }
        assert_eq!(crc32c_append(0, b"123456789"), 0xE306_9283);
        assert_eq!(
            crc32c_append(0, &data[..3 << 20]),
            crc32c::crc32c(&data[..3 << 20])
        );
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tuning_tests {
    use super::{tune, SocketTuning};
    use std::os::fd::AsRawFd;

    fn notsent_lowat(stream: &tokio::net::TcpStream) -> u32 {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: a live socket and an out-parameter of the size given.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_NOTSENT_LOWAT,
                std::ptr::addr_of_mut!(v).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "getsockopt: {}", std::io::Error::last_os_error());
        v as u32
    }

    #[tokio::test]
    async fn tune_sets_the_unsent_limit_and_none_leaves_the_kernels() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let a = tokio::net::TcpStream::connect(addr).await.unwrap();
        let b = tokio::net::TcpStream::connect(addr).await.unwrap();
        let kernel_default = notsent_lowat(&b);
        tune(&a, &SocketTuning::default(), true);
        assert_eq!(notsent_lowat(&a), 1 << 20);
        let small = SocketTuning {
            unsent_limit: Some(64 << 10),
            ..SocketTuning::default()
        };
        tune(&a, &small, true);
        assert_eq!(notsent_lowat(&a), 64 << 10);
        let off = SocketTuning {
            unsent_limit: None,
            ..SocketTuning::default()
        };
        tune(&b, &off, true);
        assert_eq!(notsent_lowat(&b), kernel_default);
    }
}
