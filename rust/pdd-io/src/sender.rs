//! The KV sender: connects a session (a control lane and N data lanes) to a receiver,
//! takes its grants, and streams pages from a registered pool into them.
//!
//! Sending copies nothing: each KV_PAGES frame is written with one vectored write of
//! its 40 header bytes and the page slices of the source pool, after the CRC32C was
//! computed over those same slices. Blocks are striped over the data lanes
//! round-robin; small frames (grants, KV_DONE, PING) never queue behind bulk data
//! because they use the control lane.
//!
//! What the session decides (grants arriving, which transfer is in progress, the
//! receiver's confirmation checked against what was sent, ABORT both ways,
//! heartbeats, the dead-peer bound, when a stalled lane is revoked and when its
//! blocks go again, how long a failed data lane waits for the receiver's reason) is
//! `pdd_core::kv::session::SenderSession`'s; every task here feeds it what happened
//! and [`flush`]es what it said, and one timer task sleeps until its
//! `poll_timeout`. The blocks' bytes, the lanes' sockets and which block went on
//! which lane (`failover.rs`) are this crate's.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdd_core::kv::session::{SenderSession, SessionTimers};
use pdd_core::kv::{KvBlock, PlannedBlock};
use pdd_core::prefix::{verify_reply, VerifiedPrefix};
use pdd_core::wire::handshake::{AuthBytes, LocalHello};
use pdd_core::wire::{AbortReason, Frame, KvGrant, KV_PAGES_FIXED_LEN};
use pdd_core::wire::{PrefixQuery, PrefixReply};
use pdd_core::Error;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio_util::sync::CancellationToken;

mod failover;
mod resume;
mod session;
mod writer;

use session::{control_loop, flush, with_machine};
use writer::{lane_writer, Protection};

use crate::clock;
use crate::lane::{self, LaneKey, LaneStream, SocketTuning, TlsConfig};
use crate::metrics::Metrics;
use crate::pool::PagePool;

/// Sender settings.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    /// The receiver.
    pub addr: SocketAddr,
    /// Data lanes (TCP connections carrying KV_PAGES), >= 1.
    pub lanes: u16,
    /// Session id: the receiver grants by it. Stable across reconnects.
    pub session_id: u64,
    /// Our HELLO.
    pub hello: LocalHello,
    /// Socket tuning of every lane.
    pub tuning: SocketTuning,
    /// Connect + HELLO bound per lane.
    pub connect_timeout: Duration,
    /// PING interval on the control lane.
    pub heartbeat: Duration,
    /// Control lane silent this long: the session is dead.
    pub dead_after: Duration,
    /// Largest KV_PAGES data per frame (at least one page is always sent).
    pub max_block_bytes: u32,
    /// Blocks queued per lane before `send_layer` waits.
    pub lane_queue: usize,
    /// TLS 1.3 on every lane (the receiver must prove its certificate).
    pub tls: Option<TlsConfig>,
    /// Offer sealed data lanes on TLS (capability `sealed_lanes`, see `sealed.rs`):
    /// KV leaves TLS's record layer after each data lane's HELLO. Off: data lanes stay
    /// in TLS records, as with a peer of an older build. On by default.
    pub sealed_lanes: bool,
    /// Offer lane failover (capability `lane_failover`): a stalled data lane is
    /// revoked and its blocks move to the other lanes. Off: a stalled lane ends the
    /// session after `dead_after`, as a peer of an older build does.
    pub lane_failover: bool,
    /// A data lane with bytes to deliver whose acknowledged bytes have not moved
    /// for this long is stalled (lane failover). `None`: 2 s, or half of
    /// `dead_after` where that is shorter. Must be non-zero and below `dead_after`.
    pub lane_stall: Option<Duration>,
    /// KV compression on the data lanes (capability `kv_compress`, `compress.rs`):
    /// `Auto` (the default) where the sender's measurements say it pays, `On` for
    /// every block, `Off` never (the capability is not offered).
    pub compress: crate::compress::CompressMode,
    /// Our pool's KV layout (1 ..= 256 opaque bytes), sent to a receiver that has
    /// one too (capability `kv_layout`, offered exactly when this is set).
    pub layout: Option<Vec<u8>>,
    /// Transfer resume (capability `kv_resume`): when the session's connections
    /// drop mid-transfer, its transfers are kept this long while the sender
    /// reconnects and resumes the session; then only the blocks whose pages had
    /// not landed go again. `None`: not offered, a lost session fails its
    /// transfers. Default 10 s.
    pub resume_window: Option<Duration>,
}

impl SenderConfig {
    /// Defaults: 4 lanes, 1 MiB blocks, 1 s heartbeats, dead after 5 s, connect in 5 s.
    pub fn new(addr: SocketAddr, session_id: u64, hello: LocalHello) -> SenderConfig {
        SenderConfig {
            addr,
            lanes: 4,
            session_id,
            hello,
            tuning: SocketTuning::default(),
            connect_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_secs(1),
            dead_after: Duration::from_secs(5),
            max_block_bytes: 1 << 20,
            // Short on purpose: a block waits here only until its lane's socket takes
            // it (the send buffer holds the window), and a lane slowed by loss should
            // not hoard blocks the others could carry (see `queue_on_a_free_lane`).
            lane_queue: 4,
            tls: None,
            sealed_lanes: true,
            lane_failover: true,
            lane_stall: None,
            compress: crate::compress::CompressMode::Auto,
            layout: None,
            resume_window: Some(Duration::from_secs(10)),
        }
    }

    /// The stall bound in force (see [`SenderConfig::lane_stall`]).
    pub fn lane_stall(&self) -> Duration {
        self.lane_stall
            .unwrap_or_else(|| DEFAULT_LANE_STALL.min(self.dead_after / 2))
    }
}

/// The default of [`SenderConfig::lane_stall`].
pub const DEFAULT_LANE_STALL: Duration = Duration::from_secs(2);

/// Where an outbound transfer stands.
#[derive(Debug, Clone, PartialEq)]
pub enum OutboundStatus {
    /// Sending, or waiting for the receiver's confirmation.
    InProgress,
    /// The receiver confirmed every page landed and verified.
    Complete {
        /// Page bytes confirmed.
        bytes: u64,
    },
    /// The transfer failed.
    Failed(Error),
}

#[derive(Clone)]
struct Job {
    block: KvBlock,
    src: Vec<(u16, u32)>,
    /// Sent again after the lane that first carried it was revoked.
    resent: bool,
}

struct Conn {
    /// The machine's connection instance this is (`SenderSession::connects`).
    generation: u64,
    /// Both sides offered `kv_resume`: every block planned is logged for a resume.
    resume: bool,
    control: lane::ControlTx,
    lanes: Vec<mpsc::Sender<Job>>,
    next_lane: AtomicUsize,
    /// Per-lane stop tokens, the log of which block went on which lane
    /// (`failover.rs`).
    lanes_ctl: failover::Lanes,
    cancel: CancellationToken,
    peer_max_payload: u32,
    /// Why the session died, once it did.
    death: Mutex<Option<Error>>,
}

impl Conn {
    fn dead_error(&self) -> Error {
        lock(&self.death).clone().unwrap_or(Error::ConnectionLost {
            detail: "session closed".into(),
        })
    }
}

struct OutboundEntry {
    /// When the grant was taken up (`wait_grant` returned it).
    started: Instant,
    status: watch::Sender<OutboundStatus>,
    /// What compression did for this transfer (its lanes' writers add to it).
    compression: Arc<TransferCompression>,
}

/// One transfer's compression (capability `kv_compress`): counted by the lanes'
/// writers as its blocks go out.
#[derive(Debug, Default)]
pub struct TransferCompression {
    /// Blocks sent as KV_PAGES_Z.
    pub blocks: AtomicU64,
    /// Page bytes of those blocks (before).
    pub bytes_before: AtomicU64,
    /// What those pages took on the wire (after).
    pub bytes_after: AtomicU64,
    /// Encoder time for this transfer's blocks (side probes included), nanoseconds.
    pub codec_ns: AtomicU64,
}

struct Shared {
    pool: Arc<PagePool>,
    /// Whether to compress each block, from what the lanes measure (`compress.rs`).
    adaptive: crate::compress::Adaptive,
    cfg: SenderConfig,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
    /// The session machine. Lock order: machine, then live, outbound, queries.
    machine: Mutex<SenderSession>,
    /// The connection the machine's frames go to (set with `connected`, cleared
    /// when it ends).
    live: Mutex<Option<Arc<Conn>>>,
    /// The machine's next timeout as the timer task last armed it (nanoseconds;
    /// `u64::MAX`: none), and its doorbell when an earlier one appears.
    armed: std::sync::atomic::AtomicU64,
    timer_wake: Notify,
    grants_changed: watch::Sender<u64>,
    outbound: Mutex<HashMap<u64, OutboundEntry>>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
    connected_before: std::sync::atomic::AtomicBool,
    /// PREFIX_QUERY waiting for its reply: query id -> (request, waiter).
    queries: Mutex<HashMap<u64, PendingQuery>>,
    next_query: std::sync::atomic::AtomicU64,
    /// The secret of our session, once one was opened: reconnects resume with it.
    session_secret: Mutex<Option<AuthBytes>>,
    /// Every block planned per transfer in progress while `kv_resume` is
    /// negotiated: what a resume sends again where the receiver does not hold it
    /// (`resume.rs`). Dropped when the transfer ends.
    resume_log: Mutex<HashMap<u64, Vec<Job>>>,
    /// A reconnect loop for suspended transfers is running (`resume.rs`).
    reconnecting: AtomicBool,
    /// The last session connect found nothing listening at the receiver's address
    /// (its control lane's TCP connect was refused; `resume.rs` gives up on it).
    connect_refused: AtomicBool,
}

type PendingQuery = (u64, oneshot::Sender<Result<PrefixReply, Error>>);

/// A checked PREFIX_REPLY.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixAnswer {
    /// The reply as received.
    pub reply: PrefixReply,
    /// What may be relied on: tokens the decoder holds and agrees on (0 if its hash
    /// disagreed with ours).
    pub verified: VerifiedPrefix,
}

/// A KV sender session.
pub struct KvSender {
    shared: Arc<Shared>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn now_ns() -> u64 {
    clock::now().as_nanos()
}

impl KvSender {
    /// Connect to the receiver (control lane, then every data lane).
    pub async fn connect(pool: Arc<PagePool>, mut cfg: SenderConfig) -> Result<KvSender, Error> {
        cfg.validate()?;
        if cfg.lane_failover {
            // Progress measured by what the receiver read too (LANE_DELIVERED), so
            // a lane a middlebox acknowledges and drops is revoked as well.
            cfg.hello.capabilities |= pdd_core::wire::capability::LANE_FAILOVER
                | pdd_core::wire::capability::LANE_DELIVERY;
        }
        // This build finishes an empty grant (nothing to send) at once.
        cfg.hello.capabilities |=
            pdd_core::wire::capability::EMPTY_GRANT | pdd_core::wire::capability::REFUSAL;
        if cfg.sealed_lanes {
            cfg.hello.capabilities |= pdd_core::wire::capability::SEALED_LANES;
        } else {
            cfg.hello.capabilities &= !pdd_core::wire::capability::SEALED_LANES;
        }
        if cfg.compress == crate::compress::CompressMode::Off {
            cfg.hello.capabilities &= !pdd_core::wire::capability::KV_COMPRESS;
        } else {
            cfg.hello.capabilities |= pdd_core::wire::capability::KV_COMPRESS;
        }
        lane::offer_layout(&mut cfg.hello, cfg.layout.is_some());
        let mut timers = SessionTimers::new(cfg.heartbeat, cfg.dead_after);
        if let Some(window) = cfg.resume_window {
            cfg.hello.capabilities |= pdd_core::wire::capability::KV_RESUME;
            timers.resume_window = window;
        } else {
            cfg.hello.capabilities &= !pdd_core::wire::capability::KV_RESUME;
        }
        let machine =
            SenderSession::new(timers, cfg.lane_stall())?.with_layout(cfg.layout.clone())?;
        let shared = Arc::new(Shared {
            adaptive: crate::compress::Adaptive::new(cfg.compress),
            pool,
            cfg,
            conn: tokio::sync::Mutex::new(None),
            machine: Mutex::new(machine),
            live: Mutex::new(None),
            armed: std::sync::atomic::AtomicU64::new(u64::MAX),
            timer_wake: Notify::new(),
            grants_changed: watch::channel(0).0,
            outbound: Mutex::new(HashMap::new()),
            metrics: Arc::new(Metrics::default()),
            cancel: CancellationToken::new(),
            connected_before: false.into(),
            queries: Mutex::new(HashMap::new()),
            next_query: std::sync::atomic::AtomicU64::new(1),
            session_secret: Mutex::new(None),
            resume_log: Mutex::new(HashMap::new()),
            reconnecting: AtomicBool::new(false),
            connect_refused: AtomicBool::new(false),
        });
        // The machine's timers, for the sender's whole life: sleep until its next
        // one, or until a call armed an earlier one.
        let timer_shared = shared.clone();
        tokio::spawn(async move {
            let shared = timer_shared;
            loop {
                let next = {
                    let m = lock(&shared.machine);
                    let next = m.poll_timeout();
                    shared
                        .armed
                        .store(next.map_or(u64::MAX, |t| t.as_nanos()), Ordering::Relaxed);
                    next
                };
                tokio::select! {
                    _ = shared.cancel.cancelled() => break,
                    _ = shared.timer_wake.notified() => {}
                    _ = clock::sleep_until(next) => {
                        with_machine(&shared, |m| m.handle_timeout(clock::now()));
                    }
                }
            }
        });
        let sender = KvSender { shared };
        sender.ensure_connected().await?;
        Ok(sender)
    }

    /// The session id the receiver knows us by.
    pub fn session_id(&self) -> u64 {
        self.shared.cfg.session_id
    }

    /// Counters and gauges.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// The connected session, reconnecting first if it was lost (a peer reset, a dead
    /// control lane, an idle connection a middlebox dropped).
    pub async fn ensure_connected(&self) -> Result<(), Error> {
        self.conn().await.map(|_| ())
    }

    async fn conn(&self) -> Result<Arc<Conn>, Error> {
        conn_of(&self.shared).await
    }

    /// Wait for the receiver's grant for `request_id`.
    pub async fn wait_grant(&self, request_id: u64) -> Result<OutboundTransfer, Error> {
        let conn = self.conn().await?;
        let mut changed = self.shared.grants_changed.subscribe();
        loop {
            if let Some(e) = self.refusal(request_id) {
                return Err(e);
            }
            if let Some(t) = self.take_grant(&conn, request_id) {
                return Ok(t);
            }
            tokio::select! {
                _ = conn.cancel.cancelled() => return Err(conn.dead_error()),
                r = changed.changed() => if r.is_err() {
                    return Err(Error::Cancelled { detail: "sender closed".into() });
                },
            }
        }
    }

    /// The grant for `request_id` if it has arrived, without waiting: what an engine
    /// that polls its transfers from its own step loop calls, instead of one waiting
    /// thread per request. `Ok(None)`: no such grant yet, or no live session right now
    /// (`is_connected` tells which; [`KvSender::ensure_connected`] reconnects). `Err`:
    /// the sender was closed.
    pub fn try_grant(&self, request_id: u64) -> Result<Option<OutboundTransfer>, Error> {
        if self.shared.cancel.is_cancelled() {
            return Err(Error::Cancelled {
                detail: "sender closed".into(),
            });
        }
        if let Some(e) = self.refusal(request_id) {
            return Err(e);
        }
        // A connect in progress holds the slot: no grant can be waiting then.
        let Ok(slot) = self.shared.conn.try_lock() else {
            return Ok(None);
        };
        let Some(conn) = slot.as_ref().filter(|c| !c.cancel.is_cancelled()).cloned() else {
            return Ok(None);
        };
        drop(slot);
        Ok(self.take_grant(&conn, request_id))
    }

    /// The receiver's refusal of `request_id` (`pdd_core::Error::Refused`, naming its
    /// reason), if it refused it: [`KvSender::wait_grant`] and
    /// [`KvSender::try_grant`] fail with it at once.
    pub fn refusal(&self, request_id: u64) -> Option<Error> {
        lock(&self.shared.machine).refusal(request_id)
    }

    /// This sender will not serve `request_id`: its grant not taken is dropped, its
    /// transfer in progress fails, and the receiver is told why (ABORT `refused`)
    /// so it frees its pages at once; a grant of it that comes later is answered the
    /// same way. True if the receiver was told now (false: no live session; a later
    /// grant still is).
    pub fn decline(&self, request_id: u64, reason: &str) -> Result<bool, Error> {
        with_machine(&self.shared, |m| m.decline(request_id, reason))
    }

    /// The receiver's KV layout on the live session (its KV_LAYOUT), known once
    /// `connect` (or a reconnect) returned where both sides have a layout. `None`:
    /// the receiver has none or is older, or no session is live.
    pub fn peer_layout(&self) -> Option<Vec<u8>> {
        lock(&self.shared.machine).peer_layout().map(<[u8]>::to_vec)
    }

    /// Our layout, as given (`SenderConfig::layout`).
    pub fn layout(&self) -> Option<Vec<u8>> {
        self.shared.cfg.layout.clone()
    }

    /// Whether a session is up now (false while one is being opened or after it was
    /// lost, until a reconnect).
    pub fn is_connected(&self) -> bool {
        self.shared
            .conn
            .try_lock()
            .is_ok_and(|slot| slot.as_ref().is_some_and(|c| !c.cancel.is_cancelled()))
    }

    /// Takes `request_id`'s grant out of the arrived ones, as an outbound transfer on
    /// `conn` (only if `conn` is the machine's live connection: a grant belongs to
    /// the connection it came on).
    fn take_grant(&self, conn: &Arc<Conn>, request_id: u64) -> Option<OutboundTransfer> {
        let mut m = lock(&self.shared.machine);
        if m.connects() != conn.generation || !m.is_connected() {
            return None;
        }
        let grant = m.take_grant(request_id)?;
        let (status, rx) = watch::channel(OutboundStatus::InProgress);
        let compression = Arc::new(TransferCompression::default());
        lock(&self.shared.outbound).insert(
            grant.transfer_id,
            OutboundEntry {
                started: Instant::now(),
                status,
                compression: compression.clone(),
            },
        );
        Metrics::set(
            &self.shared.metrics.transfers_in_flight,
            lock(&self.shared.outbound).len() as u64,
        );
        flush(&self.shared, &mut m);
        drop(m);
        Some(OutboundTransfer {
            shared: self.shared.clone(),
            conn: conn.clone(),
            started: AtomicBool::new(false),
            grant,
            status: rx,
            compression,
        })
    }

    /// Ask the receiver how much of `tokens` its radix cache holds (pages of
    /// `page_size` tokens, in `namespace`), pinning the match for `lease` if non-zero
    /// (at most [`crate::config::MAX_LEASE_REQUEST`]).
    /// The reply's prefix hash is checked against our own tokens: on a mismatch the
    /// answer's `verified.matched_tokens` is 0 (send everything).
    pub async fn query_prefix(
        &self,
        request_id: u64,
        namespace: u64,
        page_size: u16,
        lease: Duration,
        tokens: Vec<u32>,
    ) -> Result<PrefixAnswer, Error> {
        let conn = self.conn().await?;
        let query_id = self.shared.next_query.fetch_add(1, Ordering::Relaxed);
        let lease_ms = u32::try_from(lease.min(crate::config::MAX_LEASE_REQUEST).as_millis())
            .unwrap_or(u32::MAX);
        let query = PrefixQuery {
            query_id,
            request_id,
            namespace,
            page_size,
            lease_ms,
            tokens,
        };
        let frame = Frame::PrefixQuery(query);
        frame.validate()?;
        let (tx, rx) = oneshot::channel();
        lock(&self.shared.queries).insert(query_id, (request_id, tx));
        Metrics::add(&self.shared.metrics.prefix_queries_total, 1);
        if conn.control.send(frame.clone()).is_err() {
            lock(&self.shared.queries).remove(&query_id);
            return Err(conn.dead_error());
        }
        let reply = tokio::select! {
            _ = conn.cancel.cancelled() => {
                lock(&self.shared.queries).remove(&query_id);
                return Err(conn.dead_error());
            }
            r = rx => r.map_err(|_| Error::Cancelled { detail: "sender closed".into() })??,
        };
        let Frame::PrefixQuery(q) = frame else {
            unreachable!("built above")
        };
        let verified = verify_reply(namespace, usize::from(page_size), &q.tokens, &reply);
        if !verified.hash_ok {
            Metrics::add(&self.shared.metrics.prefix_mismatches_total, 1);
        }
        Ok(PrefixAnswer { reply, verified })
    }

    /// Close the session (bounded) and fail what is in flight.
    pub async fn close(&self) {
        self.shared.cancel.cancel();
        if let Some(c) = self.shared.conn.lock().await.take() {
            c.cancel.cancel();
        }
        // The session ends and every transfer fails `cancelled`.
        with_machine(&self.shared, |m| m.close());
    }
}

impl Drop for KvSender {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}

/// The connected session, connecting (or resuming) first if there is none.
async fn conn_of(shared: &Arc<Shared>) -> Result<Arc<Conn>, Error> {
    if shared.cancel.is_cancelled() {
        return Err(Error::Cancelled {
            detail: "sender closed".into(),
        });
    }
    let mut slot = shared.conn.lock().await;
    if let Some(c) = slot.as_ref() {
        if !c.cancel.is_cancelled() {
            return Ok(c.clone());
        }
    }
    let conn = connect_session(shared).await?;
    if shared.connected_before.swap(true, Ordering::Relaxed) {
        Metrics::add(&shared.metrics.reconnects_total, 1);
    }
    *slot = Some(conn.clone());
    Ok(conn)
}

/// Whether a connection is up (for the resume loop's last look).
fn has_live_conn(shared: &Shared) -> bool {
    lock(&shared.live)
        .as_ref()
        .is_some_and(|c| !c.cancel.is_cancelled())
}

async fn connect_session(shared: &Arc<Shared>) -> Result<Arc<Conn>, Error> {
    let cfg = &shared.cfg;
    shared.connect_refused.store(false, Ordering::Release);
    let open = |key: LaneKey, lane_no: u16| async move {
        // The control lane's connect tells whether anything listens there at all.
        let refused = (lane_no == 0).then_some(&shared.connect_refused);
        lane::connect_noting_refusal(
            cfg.addr,
            &cfg.hello,
            cfg.session_id,
            lane_no,
            &key,
            &cfg.tuning,
            cfg.tls.as_ref(),
            cfg.connect_timeout,
            refused,
        )
        .await
    };
    // Resume our session if the receiver still holds it (with `kv_resume` its
    // transfers go on from what landed; without, they failed with the loss); if it
    // already ended it, open a new one.
    let prior = *lock(&shared.session_secret);
    let (control, resumed) = match prior {
        Some(secret) => match open(LaneKey::Session(secret), 0).await {
            Err(Error::PeerAborted {
                reason: AbortReason::AuthFailed,
                ..
            }) => (open(LaneKey::Root, 0).await?, false),
            other => (other?, true),
        },
        None => (open(LaneKey::Root, 0).await?, false),
    };
    *lock(&shared.session_secret) = Some(control.session_secret);
    let (control_stream, agreed) = (control.stream, control.agreed);
    let mut data_streams = Vec::with_capacity(usize::from(cfg.lanes));
    for lane_no in 1..=cfg.lanes {
        let lane = open(LaneKey::Session(control.session_secret), lane_no).await?;
        // Inside TLS (both offered AEAD) the blocks carry no CRC32C; sealed lanes
        // leave TLS's record layer here, right after their HELLO.
        let compress = lane.agreed.capabilities & pdd_core::wire::capability::KV_COMPRESS != 0;
        let protection = if lane::sealed(&lane.agreed) {
            let (tcp, keys) = lane.stream.into_sealed()?;
            Metrics::add(&shared.metrics.lanes_sealed_total, 1);
            (LaneStream::Plain(tcp), Protection::Sealed(Box::new(keys)))
        } else if lane.agreed.capabilities & pdd_core::wire::capability::AEAD != 0 {
            (lane.stream, Protection::Tls)
        } else {
            (lane.stream, Protection::Crc)
        };
        data_streams.push((protection.0, protection.1, compress));
    }
    let fds: Vec<std::os::fd::RawFd> = data_streams
        .iter()
        .map(|(s, _, _)| std::os::fd::AsRawFd::as_raw_fd(s.tcp()))
        .collect();
    let failover = agreed.capabilities & pdd_core::wire::capability::LANE_FAILOVER != 0;
    let cancel = shared.cancel.child_token();
    let (control_tx, control_rx) =
        lane::control_queue(lane::MAX_UNWRITTEN_CONTROL_FRAMES, cancel.clone());
    let mut lanes = Vec::with_capacity(data_streams.len());
    let mut lane_rxs = Vec::with_capacity(data_streams.len());
    for _ in 0..data_streams.len() {
        let (tx, rx) = mpsc::channel(cfg.lane_queue.max(1));
        lanes.push(tx);
        lane_rxs.push(rx);
    }
    let mut conn = Conn {
        generation: 0,
        resume: agreed.capabilities & pdd_core::wire::capability::KV_RESUME != 0,
        control: control_tx,
        lanes,
        next_lane: AtomicUsize::new(0),
        lanes_ctl: failover::Lanes::new(&fds, &cancel, failover),
        cancel: cancel.clone(),
        peer_max_payload: agreed.peer_max_payload,
        death: Mutex::new(None),
    };
    // The machine's new connection instance: its heartbeats and bounds start now.
    let conn = {
        let mut m = lock(&shared.machine);
        if resumed {
            // Suspended transfers stay, each until the receiver's KV_HELD for it.
            m.resumed(agreed.capabilities, cfg.lanes, clock::now())?;
        } else {
            m.connected(agreed.capabilities, cfg.lanes, clock::now())?;
        }
        conn.generation = m.connects();
        let conn = Arc::new(conn);
        *lock(&shared.live) = Some(conn.clone());
        flush(shared, &mut m);
        conn
    };
    for (idx, ((stream, protection, compress), rx)) in
        data_streams.into_iter().zip(lane_rxs).enumerate()
    {
        let (shared, conn) = (shared.clone(), conn.clone());
        match stream {
            // Plain TCP keeps the lock-free owned halves (writev straight from the pool).
            LaneStream::Plain(tcp) => {
                let (rd, wr) = tcp.into_split();
                tokio::spawn(lane_writer(
                    shared, conn, idx, rd, wr, rx, protection, compress,
                ));
            }
            mut tls => {
                tls.for_bulk_writes();
                let (rd, wr) = tokio::io::split(tls);
                tokio::spawn(lane_writer(
                    shared, conn, idx, rd, wr, rx, protection, compress,
                ));
            }
        }
    }
    if failover {
        tokio::spawn(failover::watch_lanes(shared.clone(), conn.clone()));
    }
    tokio::spawn(control_loop(
        shared.clone(),
        conn.clone(),
        control_stream,
        control_rx,
    ));
    if agreed.capabilities & pdd_core::wire::capability::KV_LAYOUT != 0 {
        session::wait_layout(shared, &conn).await?;
    }
    Ok(conn)
}

/// Queue `job` on the next lane, round robin, that has room in its queue; when every
/// lane's queue is full, on the first lane to free a slot. A lane slowed down by loss
/// recovery (or stalled) stops taking blocks and the others carry them, so a lossy
/// line runs at the sum of the lanes' rates rather than lanes x the slowest one's.
/// Revoked lanes (lane failover) are skipped; the block is logged for its lane.
async fn queue_on_a_free_lane(conn: &Conn, mut job: Job) -> Result<(), Error> {
    let n = conn.lanes.len();
    let ctl = &conn.lanes_ctl;
    loop {
        let start = conn.next_lane.load(Ordering::Relaxed);
        for i in 0..n {
            let lane = (start + i) % n;
            if ctl.is_dead(lane) {
                continue;
            }
            match conn.lanes[lane].try_reserve() {
                Ok(permit) => match ctl.place(lane, job, |j| permit.send(j)) {
                    Ok(()) => {
                        conn.next_lane.store(lane + 1, Ordering::Relaxed);
                        return Ok(());
                    }
                    Err(back) => job = back,
                },
                Err(mpsc::error::TrySendError::Full(())) => {}
                // Revoked meanwhile, and its writer gone: the others take the block.
                Err(mpsc::error::TrySendError::Closed(())) if ctl.is_dead(lane) => {}
                Err(mpsc::error::TrySendError::Closed(())) => return Err(conn.dead_error()),
            }
        }
        let live: Vec<usize> = (0..n).filter(|&l| !ctl.is_dead(l)).collect();
        if live.is_empty() {
            return Err(conn.dead_error());
        }
        let mut waits: Vec<_> = live
            .iter()
            .map(|&l| Box::pin(conn.lanes[l].reserve()))
            .collect();
        let (at, permit) = std::future::poll_fn(|cx| {
            for (at, w) in waits.iter_mut().enumerate() {
                if let std::task::Poll::Ready(r) = std::future::Future::poll(w.as_mut(), cx) {
                    return std::task::Poll::Ready((at, r));
                }
            }
            std::task::Poll::Pending
        })
        .await;
        let lane = live[at];
        let permit = match permit {
            Ok(p) => p,
            // A lane revoked while we waited on it closes its queue once its writer
            // is released: try the others.
            Err(_) if ctl.is_dead(lane) => continue,
            Err(_) => return Err(conn.dead_error()),
        };
        match ctl.place(lane, job, |j| permit.send(j)) {
            Ok(()) => {
                conn.next_lane.store(lane + 1, Ordering::Relaxed);
                return Ok(());
            }
            // Revoked while we waited: try the others.
            Err(back) => job = back,
        }
    }
}

/// The sender's handle on one grant.
pub struct OutboundTransfer {
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    started: AtomicBool,
    grant: KvGrant,
    status: watch::Receiver<OutboundStatus>,
    compression: Arc<TransferCompression>,
}

impl OutboundTransfer {
    /// What compression did for this transfer so far (blocks, page bytes before and
    /// after, encoder time).
    pub fn compression(&self) -> &TransferCompression {
        &self.compression
    }

    /// The grant being filled.
    pub fn grant(&self) -> &KvGrant {
        &self.grant
    }

    /// Current status.
    pub fn status(&self) -> OutboundStatus {
        self.status.borrow().clone()
    }

    /// Stream grant layer `layer` from source pool pages `src_pages` (one per grant
    /// page, in grant order) on pool layer `src_layer` (usually the same index).
    /// Returns once every block is queued on a lane; waits while lanes are full.
    pub async fn send_layer(
        &self,
        layer: u16,
        src_layer: u16,
        src_pages: &[u32],
    ) -> Result<(), Error> {
        if src_pages.len() != self.grant.page_count as usize {
            return Err(Error::InvalidArgument(format!(
                "{} source pages for a grant of {}",
                src_pages.len(),
                self.grant.page_count
            )));
        }
        let end = layer
            .checked_add(1)
            .ok_or_else(|| Error::InvalidArgument(format!("layer {layer} outside the grant")))?;
        let all: Vec<u32> = (0..self.grant.page_count).collect();
        self.send_pages(layer..end, Some(src_layer), &all, src_pages)
            .await
    }

    /// Stream grant pages `grant_pages` (grant-relative, any subset, any order) on
    /// every grant layer of `layers`, from source pool pages `src_pages` (one per
    /// grant page, same order) on pool layer `src_layer` (with `None`, the same index
    /// as the grant layer; `Some` only for a single layer). Each `(layer, page)` goes
    /// exactly once per transfer: a call that repeats one, or names one outside the
    /// grant, fails and queues nothing. Returns once every block is queued on a lane.
    ///
    /// A grant whose `page_bytes` is a unit of the pool's (a divisor: the receiver
    /// granted sub-page units) is filled the same way, its source pages then counting
    /// units of that size (unit `u` = byte offset `u * unit` of the source layer).
    pub async fn send_pages(
        &self,
        layers: std::ops::Range<u16>,
        src_layer: Option<u16>,
        grant_pages: &[u32],
        src_pages: &[u32],
    ) -> Result<(), Error> {
        let pool = &self.shared.pool;
        if src_pages.len() != grant_pages.len() {
            return Err(Error::InvalidArgument(format!(
                "{} source pages for {} grant pages",
                src_pages.len(),
                grant_pages.len()
            )));
        }
        // A grant of sub-page units: the source pages count units of its size too.
        let units = pool.units_per_layer(self.grant.page_bytes)?;
        if src_layer.is_some() && layers.len() != 1 {
            return Err(Error::InvalidArgument(
                "src_layer names one source layer: send one grant layer per call with it".into(),
            ));
        }
        let last_src_layer = src_layer.unwrap_or(layers.end.saturating_sub(1));
        if last_src_layer >= pool.layers() {
            return Err(Error::InvalidArgument(format!(
                "source layer {last_src_layer} outside the pool's {}",
                pool.layers()
            )));
        }
        if let Some(p) = src_pages.iter().find(|&&p| u64::from(p) >= units) {
            return Err(Error::InvalidArgument(format!(
                "source page {p} outside the pool's {units} of {} bytes",
                self.grant.page_bytes
            )));
        }
        if let OutboundStatus::Failed(e) = self.status() {
            return Err(e);
        }
        let cap = u64::from(
            self.conn
                .peer_max_payload
                .saturating_sub(KV_PAGES_FIXED_LEN as u32),
        );
        let max_block = u64::from(self.shared.cfg.max_block_bytes)
            .min(cap)
            .min(1000 * u64::from(self.grant.page_bytes));
        let tid = self.grant.transfer_id;
        // Planned, and where it goes, under the machine's lock: the connection live
        // now (a transfer goes on, on the connection that resumed its session), or
        // none while the transfer is suspended (`kv_resume`: its blocks are only
        // logged, and go after the receiver's KV_HELD says they did not land).
        let (jobs, live, logging, mut suspended) = with_machine(&self.shared, |m| {
            let planned = m.send_pages(tid, layers, grant_pages, max_block)?;
            let live = lock(&self.shared.live).clone();
            let suspended = m.is_suspended(tid);
            let logging = suspended || live.as_ref().is_some_and(|c| c.resume);
            let jobs: Vec<Job> = planned
                .into_iter()
                .map(|PlannedBlock { block, first }| {
                    let from = src_layer.unwrap_or(block.layer_start);
                    let src = src_pages[first..first + block.page_count as usize]
                        .iter()
                        .map(|&p| (from, p))
                        .collect();
                    Job {
                        block,
                        src,
                        resent: false,
                    }
                })
                .collect();
            // Logged before the lock is released: a resume (its KV_HELD, handled
            // under this lock) then finds every block planned before it.
            if logging {
                for job in &jobs {
                    resume::log(&self.shared, job);
                }
            }
            Ok::<_, Error>((jobs, live, logging, suspended))
        })
        .map_err(|e| self.ended_error().unwrap_or(e))?;
        self.started.store(true, Ordering::Relaxed);
        for job in jobs {
            let conn = match (&live, suspended) {
                (Some(c), false) => c,
                _ if logging => continue,
                _ => return Err(self.ended_error().unwrap_or_else(|| self.conn.dead_error())),
            };
            let queued = tokio::select! {
                _ = conn.cancel.cancelled() => Err(conn.dead_error()),
                r = queue_on_a_free_lane(conn, job) => r,
            };
            if let Err(e) = queued {
                // The connection died under us: with resume, the rest is logged and
                // goes after the resume unless the transfer ended meanwhile.
                if logging && lock(&self.shared.machine).in_progress(tid) {
                    suspended = true;
                    continue;
                }
                return Err(self.ended_error().unwrap_or(e));
            }
        }
        Ok(())
    }

    /// Whether any page was queued yet (for a pending/transferring poll).
    pub fn started(&self) -> bool {
        self.started.load(Ordering::Relaxed)
    }

    /// Give up on the transfer: the receiver is told with an ABORT (`cancelled`,
    /// carrying `message`) and fails it with `peer_aborted`; here it fails with
    /// `cancelled`. Blocks already queued still reach the receiver, which drains
    /// them. False if the transfer had already ended.
    pub fn abort(&self, message: &str) -> bool {
        let tid = self.grant.transfer_id;
        with_machine(&self.shared, |m| m.abort(tid, message))
    }

    /// Every layer is queued: tell the receiver how many blocks and bytes to expect.
    pub async fn finish(&self) -> Result<(), Error> {
        let tid = self.grant.transfer_id;
        with_machine(&self.shared, |m| m.finish(tid))
            .map(|_| ())
            .map_err(|e| self.ended_error().unwrap_or(e))
    }

    /// Why the transfer ended, if it did (its session's death, the receiver's ABORT,
    /// our own abort): what a call on an ended transfer reports.
    fn ended_error(&self) -> Option<Error> {
        match self.status() {
            OutboundStatus::Failed(e) => Some(e),
            OutboundStatus::Complete { .. } => None,
            // Still the machine's (a suspended transfer waits for its resume).
            OutboundStatus::InProgress
                if lock(&self.shared.machine).in_progress(self.grant.transfer_id) =>
            {
                None
            }
            OutboundStatus::InProgress => self
                .conn
                .cancel
                .is_cancelled()
                .then(|| self.conn.dead_error()),
        }
    }

    /// Wait for the receiver to confirm the transfer (bytes), or for its failure.
    pub async fn wait(&self) -> Result<u64, Error> {
        crate::status::wait_settled(self.status.clone(), "sender").await
    }
}

impl crate::status::Settles for OutboundStatus {
    fn settled(&self) -> Option<Result<u64, Error>> {
        match self {
            OutboundStatus::Complete { bytes } => Some(Ok(*bytes)),
            OutboundStatus::Failed(e) => Some(Err(e.clone())),
            OutboundStatus::InProgress => None,
        }
    }
}
