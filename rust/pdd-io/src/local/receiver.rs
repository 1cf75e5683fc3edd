//! The local path's receiver (RelayDecode): listens for a sender's control lane,
//! grants pages, exposes exactly the granted pages to the sender's puts, and checks
//! the sender's completion notices against the grant.
//!
//! The session is the WAN receiver's machine (`pdd_core::kv::session::
//! ReceiverEndpoint`, on sessions that negotiated `local_ucx`): it decides what
//! LOCAL_DONE, ABORT and every other frame mean, sends the PINGs, keeps the
//! dead-peer bound and each grant's deadline, and queues the KV_DONE or ABORT that
//! ends each transfer. Here: UCX (registering exactly the granted pages before the
//! grant is announced, revoking them when the transfer ends, before the sender
//! hears of its end), the control lane's bytes, statuses and the event queue.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use pdd_core::kv::session::{self as core_session, ReceiverEndpoint, SessionTimers};
use pdd_core::kv::{GrantUnits, TransferEvent};
use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, Frame, KvGrant, LocalAddr, LocalGrant, LocalRegion};
use pdd_core::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use super::ucx::UcxEndpoint;
use super::{lock, runs, wait_status, Control, LocalStatus};
use crate::clock;
use crate::lane::{self, LaneStream, SocketTuning, TlsConfig};
use crate::metrics::Metrics;
use crate::pool::{MemoryKind, PagePool};

/// Local receiver settings.
#[derive(Debug, Clone)]
pub struct LocalReceiverConfig {
    /// Where the control lane listens.
    pub listen: SocketAddr,
    /// Our HELLO (`local_ucx` is added).
    pub hello: LocalHello,
    /// TLS on the control lane.
    pub tls: Option<TlsConfig>,
    /// Listen beyond loopback without a secret or TLS.
    pub allow_insecure: bool,
    /// Bound on a connecting peer's HELLO + AUTH.
    pub hello_timeout: Duration,
    /// PING interval.
    pub heartbeat: Duration,
    /// A control lane silent this long is dead.
    pub dead_after: Duration,
    /// Control connections open at once (opening or in session). Opening ones are
    /// bounded as on every acceptor (`crate::admission`: a new connection displaces
    /// an older opening one rather than being kept out); a new connection is closed
    /// unanswered only when every place holds a session. Default: the WAN receiver's
    /// session and half-open bounds together.
    pub max_connections: u64,
    /// Our pool's KV layout (1 ..= 256 opaque bytes), sent to every sender that
    /// has one too (capability `kv_layout`, offered exactly when this is set).
    pub layout: Option<Vec<u8>>,
}

impl LocalReceiverConfig {
    /// Defaults: HELLO in 5 s, 1 s heartbeats, dead after 5 s.
    pub fn new(listen: SocketAddr, hello: LocalHello) -> Self {
        LocalReceiverConfig {
            listen,
            hello,
            tls: None,
            allow_insecure: false,
            hello_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_secs(1),
            dead_after: Duration::from_secs(5),
            max_connections: (crate::receiver::MAX_SESSIONS as u64)
                + crate::receiver::MAX_OPENING_CONNECTIONS,
            layout: None,
        }
    }
}

/// The I/O side of one session (the machine holds the rest).
struct Session {
    control: lane::ControlTx,
    end: CancellationToken,
    peer_max_payload: u32,
}

fn control_max(shared: &Shared, peer: u64) -> u32 {
    lock(&shared.sessions)
        .get(&peer)
        .map_or(0, |s| s.peer_max_payload)
}

struct Entry {
    /// Keeps the UCX thread progressing while the transfer lives (registered pages).
    _busy: Option<super::ucx::BusyGuard>,
    /// The UCX registrations of its pages (set once mapped).
    memory: Vec<u64>,
    status: watch::Sender<LocalStatus>,
}

/// Transfer events kept for [`LocalReceiver::poll_events`]; past this the oldest are
/// dropped (an engine that never polls does not grow the queue without bound).
pub const MAX_QUEUED_EVENTS: usize = 65_536;

struct Shared {
    events: Mutex<std::collections::VecDeque<TransferEvent>>,
    /// Bumped after events were queued ([`LocalReceiver::wait_event`]).
    events_changed: watch::Sender<u64>,
    pool: Arc<PagePool>,
    cfg: LocalReceiverConfig,
    ucx: UcxEndpoint,
    /// The session machine and the pool bookkeeping it drives. Lock order: machine,
    /// then events, transfers, sessions.
    machine: Mutex<ReceiverEndpoint>,
    /// The machine's next timeout as the timer task last armed it (nanoseconds;
    /// `u64::MAX`: none), and its doorbell when an earlier one appears.
    armed: AtomicU64,
    timer_wake: Notify,
    /// Sessions by number (the machine's session id: never resumed, never reused).
    sessions: Mutex<HashMap<u64, Session>>,
    transfers: Mutex<HashMap<u64, Entry>>,
    peers_changed: Notify,
    next_session: AtomicU64,
    metrics: Arc<Metrics>,
    /// Connections still opening, bounded together with `established` by
    /// `max_connections`.
    admission: Arc<crate::admission::Admission>,
    /// Connections past their opening (in session), counted until dropped.
    established: Arc<AtomicU64>,
    cancel: CancellationToken,
}

/// The receiver's handle on one local-path transfer.
#[derive(Clone)]
pub struct LocalInbound {
    /// The grant (what the sender was told).
    pub grant: KvGrant,
    /// The sender's session it was granted to (the receiver's number for it, as
    /// [`LocalReceiver::peers`] lists).
    pub peer: u64,
    status: watch::Receiver<LocalStatus>,
}

impl LocalInbound {
    /// Current status.
    pub fn status(&self) -> LocalStatus {
        self.status.borrow().clone()
    }

    /// Wait until every page is in (bytes) or the transfer fails.
    pub async fn wait(&self) -> Result<u64, Error> {
        wait_status(self.status.clone()).await
    }
}

/// A local-path receiver.
pub struct LocalReceiver {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
}

impl LocalReceiver {
    /// Load UCX, create its worker, listen for senders. Refuses a pool whose memory
    /// is not host memory, and listening beyond loopback without authentication.
    pub async fn start(
        pool: Arc<PagePool>,
        mut cfg: LocalReceiverConfig,
    ) -> Result<LocalReceiver, Error> {
        cfg.validate()?;
        if pool.memory_kind() != MemoryKind::Host {
            return Err(Error::UnsupportedMemoryKind {
                kind: pool.memory_kind().name().into(),
                detail: "the local path registers host memory only".into(),
            });
        }
        cfg.hello.capabilities |=
            capability::LOCAL_UCX | capability::EMPTY_GRANT | capability::REFUSAL;
        lane::offer_layout(&mut cfg.hello, cfg.layout.is_some());
        lane::check_exposure(
            cfg.listen,
            &cfg.hello,
            cfg.allow_insecure || cfg.tls.is_some(),
        )?;
        let ucx = UcxEndpoint::start()?;
        let listener = TcpListener::bind(cfg.listen)
            .await
            .map_err(|e| Error::ConnectionLost {
                detail: format!("bind {}: {e}", cfg.listen),
            })?;
        let local_addr = listener.local_addr().map_err(|e| Error::ConnectionLost {
            detail: format!("local_addr: {e}"),
        })?;
        // Its connections are bounded by `max_connections` (admission), not by the
        // WAN receiver's session bound.
        let timers = SessionTimers::new(cfg.heartbeat, cfg.dead_after);
        let machine =
            ReceiverEndpoint::new(pool.layers(), pool.pages(), pool.page_bytes(), timers)?
                .with_max_sessions(usize::MAX)
                .with_layout(cfg.layout.clone())?;
        let metrics = Arc::new(Metrics::default());
        let shared = Arc::new(Shared {
            events: Mutex::new(std::collections::VecDeque::new()),
            events_changed: watch::channel(0).0,
            pool,
            cfg,
            ucx,
            machine: Mutex::new(machine),
            armed: AtomicU64::new(u64::MAX),
            timer_wake: Notify::new(),
            sessions: Mutex::new(HashMap::new()),
            transfers: Mutex::new(HashMap::new()),
            peers_changed: Notify::new(),
            next_session: AtomicU64::new(1),
            admission: crate::admission::Admission::new(metrics.clone()),
            metrics,
            established: Arc::new(AtomicU64::new(0)),
            cancel: CancellationToken::new(),
        });
        // The machine's timers: sleep until its next one, or until a call armed an
        // earlier one.
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
        let s = shared.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = s.cancel.cancelled() => return,
                    a = listener.accept() => a,
                };
                if let Ok((tcp, peer)) = accepted {
                    // Opening connections get what sessions leave of the bound; with
                    // none left, the new one is closed unanswered.
                    let established = s.established.load(Ordering::Relaxed);
                    let room = s.cfg.max_connections.saturating_sub(established);
                    let room = usize::try_from(room).unwrap_or(usize::MAX);
                    let Some(slot) = s.admission.admit(peer, room) else {
                        drop(tcp);
                        continue;
                    };
                    tokio::spawn(session(s.clone(), tcp, slot));
                }
            }
        });
        Ok(LocalReceiver { shared, local_addr })
    }

    /// The control lane's listening address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The receiver's pool.
    pub fn pool(&self) -> &Arc<PagePool> {
        &self.shared.pool
    }

    /// Endpoint counters.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// Connected senders that are up (their KV_LAYOUT came, where `kv_layout` was
    /// negotiated): local session numbers.
    pub fn peers(&self) -> Vec<u64> {
        let m = lock(&self.shared.machine);
        let sessions = lock(&self.shared.sessions);
        sessions.keys().copied().filter(|&p| m.is_up(p)).collect()
    }

    /// Wait until a sender is connected and up (its endpoint can be granted to;
    /// where both sides have a layout, its KV_LAYOUT came).
    pub async fn wait_peer(&self) -> u64 {
        loop {
            let notified = self.shared.peers_changed.notified();
            if let Some(p) = self.peers().into_iter().min() {
                return p;
            }
            notified.await;
        }
    }

    /// Our layout, as given (`LocalReceiverConfig::layout`).
    pub fn layout(&self) -> Option<Vec<u8>> {
        self.shared.cfg.layout.clone()
    }

    /// The layout `peer` (the only connected sender with `None`) sent in its
    /// KV_LAYOUT. `Ok(None)`: it has none, is older, or is not up yet
    /// ([`LocalReceiver::wait_peer`] returns once it is).
    pub fn peer_layout(&self, peer: Option<u64>) -> Result<Option<Vec<u8>>, Error> {
        let peer = self.the_peer(peer)?;
        Ok(lock(&self.shared.machine)
            .peer_layout(peer)
            .map(<[u8]>::to_vec))
    }

    /// Grant pool pages `pages` (in grant order) on every pool layer to `peer` (the
    /// only connected sender with `None`) for `request_id`: registers exactly those
    /// pages with UCX (pages inside a [`super::shared::SharedAllocation`] go under its
    /// key, unregistered) and sends KV_GRANT and LOCAL_GRANT. With a deadline, the
    /// transfer fails `deadline_exceeded` if it is not complete in time.
    ///
    /// No pages is an empty grant ("I hold all of it, send nothing"), as on the WAN
    /// path: a KV_GRANT of 0 pages and no LOCAL_GRANT (nothing is registered); it
    /// completes with 0 bytes and no `LayerComplete` once the sender finishes. Only
    /// to a sender that offered `empty_grant` (this build's do).
    pub async fn grant(
        &self,
        request_id: u64,
        pages: &[u32],
        peer: Option<u64>,
        deadline: Option<Duration>,
    ) -> Result<LocalInbound, Error> {
        let units = GrantUnits::default();
        self.grant_units(request_id, pages, units, peer, deadline)
            .await
    }

    /// [`grant`](Self::grant) of `pages` counted in `units`, as the WAN receiver's
    /// `grant_units`: with a unit smaller than the pool's page (a divisor of it),
    /// `pages` are pool units (unit `u` is byte offset `u * unit` of a layer's
    /// buffer) and exactly those byte ranges are registered and put into; the grant
    /// covers pool layers `units.first_layer..` to the pool's last.
    pub async fn grant_units(
        &self,
        request_id: u64,
        pages: &[u32],
        units: GrantUnits,
        peer: Option<u64>,
        deadline: Option<Duration>,
    ) -> Result<LocalInbound, Error> {
        let shared = &self.shared;
        let peer = self.the_peer(peer)?;
        let layers = shared.pool.layers().saturating_sub(units.first_layer);
        // Reserved, not yet announced: the pages are registered first. The machine
        // checks the session, its empty-grant capability, the request's uniqueness.
        let (status, rx) = watch::channel(LocalStatus::InProgress);
        let grant = {
            let mut m = lock(&shared.machine);
            let grant = m.reserve_units(
                peer,
                request_id,
                pages,
                layers,
                units,
                deadline,
                rand::random,
            )?;
            lock(&shared.transfers).insert(
                grant.transfer_id,
                Entry {
                    _busy: None,
                    memory: Vec::new(),
                    status,
                },
            );
            grant
        };
        // Register exactly the granted pages (units of the grant's size): one region
        // per run of consecutive pool units, per layer. Pages inside memory the receiver had UCX allocate
        // (`SharedAllocation`) are not registered: their region carries the
        // allocation's key, which a sender on this host maps and copies into.
        let tid = grant.transfer_id;
        let unit = grant.page_bytes;
        let page_runs = runs(pages);
        let mut regions = Vec::with_capacity(page_runs.len() * usize::from(layers));
        let mut to_map = Vec::new();
        for layer in 0..layers {
            for &r in &page_runs {
                let at = shared
                    .pool
                    .unit_addr(units.first_layer + layer, r.pool_start, unit);
                let addr = match at {
                    Ok(a) => a,
                    Err(e) => {
                        with_machine(shared, |m| m.fail_transfer(tid, e.clone()));
                        return Err(e);
                    }
                };
                let len = r.count as usize * unit as usize;
                let key = super::shared::shared_key(addr, len);
                if key.is_none() {
                    to_map.push((addr, len));
                }
                regions.push((layer, r, addr, key));
            }
        }
        let registered = !to_map.is_empty();
        let mapped = if registered {
            match shared.ucx.map(to_map).await {
                Ok(m) => m,
                Err(e) => {
                    with_machine(shared, |m| m.fail_transfer(tid, e.clone()));
                    return Err(e);
                }
            }
        } else {
            Vec::new()
        };
        // The registrations' keys, in the order of the regions that have none.
        let mut fresh = mapped.iter().map(|(_, key)| key.as_slice());
        let local = LocalGrant {
            transfer_id: tid,
            regions: regions
                .iter()
                .map(|(layer, r, addr, key)| LocalRegion {
                    layer: *layer,
                    page_start: r.grant_start,
                    page_count: r.count,
                    remote_addr: *addr as u64,
                    rkey: Bytes::copy_from_slice(match key {
                        Some(k) => k,
                        None => fresh.next().unwrap_or_default(),
                    }),
                })
                .collect(),
        };
        let memory: Vec<u64> = mapped.iter().map(|(id, _)| *id).collect();
        {
            // Registered pages take UCX puts, which land only while this side's
            // worker progresses (emulated puts); into a shared allocation the
            // sender copies itself, and the worker's spin after any event covers a
            // sender that cannot map it and puts instead.
            let mut transfers = lock(&shared.transfers);
            match transfers.get_mut(&tid) {
                Some(e) => {
                    e._busy = registered.then(|| shared.ucx.busy());
                    e.memory = memory;
                }
                // Ended while its pages were being registered (its session did):
                // revoke them here.
                None => shared.ucx.unmap(memory),
            }
        }
        let frame = Frame::LocalGrant(local);
        // An empty grant has no page, no region, no LOCAL_GRANT.
        let extra = if pages.is_empty() {
            Ok(None)
        } else {
            frame
                .validate()
                .and_then(|()| frame.payload_len())
                .and_then(|len| {
                    if len > control_max(shared, peer) as usize {
                        Err(Error::LimitExceeded {
                            what: "LOCAL_GRANT bytes (regions x keys) for the peer's max_payload"
                                .into(),
                            limit: u64::from(control_max(shared, peer)),
                        })
                    } else {
                        Ok(Some(frame))
                    }
                })
        };
        let announced = with_machine(shared, |m| match extra {
            Ok(extra) => m.announce(tid, extra, clock::now()),
            Err(e) => {
                m.fail_transfer(tid, e.clone());
                Err(e)
            }
        });
        announced?;
        Ok(LocalInbound {
            grant,
            peer,
            status: rx,
        })
    }

    /// Take up to `max` transfer events (layer complete, complete, failed), oldest
    /// first.
    pub fn poll_events(&self, max: usize) -> Vec<TransferEvent> {
        let mut q = lock(&self.shared.events);
        let n = max.min(q.len());
        q.drain(..n).collect()
    }

    /// Wait until at least one event is queued (returns at once if one is): woken
    /// by the events themselves, no polling.
    pub async fn wait_event(&self) {
        let mut changed = self.shared.events_changed.subscribe();
        while lock(&self.shared.events).is_empty() {
            if changed.changed().await.is_err() {
                return;
            }
        }
    }

    /// Whether `transfer_id` is still live (granted, not yet ended).
    pub fn is_live(&self, transfer_id: u64) -> bool {
        lock(&self.shared.transfers).contains_key(&transfer_id)
    }

    /// Whether a live transfer has had a layer announced yet (the sender's puts are
    /// invisible to the receiver until its completion notice): `None` once it ended
    /// (or never existed), else `Some(started)`.
    pub fn transfer_started(&self, transfer_id: u64) -> Option<bool> {
        lock(&self.shared.machine)
            .state()
            .progress_of(transfer_id)
            .map(|p| p > 0)
    }

    /// `peer`, or the only connected sender.
    fn the_peer(&self, peer: Option<u64>) -> Result<u64, Error> {
        let sessions = lock(&self.shared.sessions);
        match peer {
            Some(p) => Ok(p),
            None if sessions.len() == 1 => Ok(*sessions.keys().next().unwrap_or(&0)),
            // As on the WAN receiver: no sender yet is a lost connection (a caller
            // retries while the prefill side connects), several is the caller's
            // mistake.
            None if sessions.is_empty() => Err(Error::ConnectionLost {
                detail: "no sender is connected".into(),
            }),
            None => Err(Error::InvalidArgument(format!(
                "{} senders connected: name the peer",
                sessions.len()
            ))),
        }
    }

    /// This receiver will not take `request_id` from `peer` (the only connected
    /// sender with `None`): its transfers of it fail (registrations revoked) and the
    /// sender is told why (ABORT `refused`), so it frees its blocks at once.
    /// `Ok(false)`: nothing was granted and the sender predates `refusal`.
    pub fn refuse(&self, request_id: u64, reason: &str, peer: Option<u64>) -> Result<bool, Error> {
        let peer = self.the_peer(peer)?;
        with_machine(&self.shared, |m| m.refuse(peer, request_id, reason))
    }

    /// Cancel a transfer: it fails `cancelled`, the sender is told, the pages'
    /// registrations are revoked. False if it already ended.
    pub fn cancel(&self, transfer_id: u64) -> bool {
        with_machine(&self.shared, |m| {
            m.fail_transfer(
                transfer_id,
                Error::Cancelled {
                    detail: "the receiver cancelled the transfer".into(),
                },
            )
        })
    }

    /// Stop listening, end every session (their transfers fail), release UCX.
    pub async fn close(&self) {
        // Every sender is told (ABORT shutdown), every session ends, every transfer
        // fails `cancelled` and its pages' registrations are revoked.
        with_machine(&self.shared, |m| m.close());
        self.shared.cancel.cancel();
    }
}

impl Drop for LocalReceiver {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}

/// Run `f` on the machine, then flush what it said.
fn with_machine<R>(shared: &Arc<Shared>, f: impl FnOnce(&mut ReceiverEndpoint) -> R) -> R {
    let mut m = lock(&shared.machine);
    let r = f(&mut m);
    flush(shared, &mut m);
    r
}

/// Move what the machine said. Every ended transfer's pages are revoked first, so
/// that once the sender hears of the end (its KV_DONE or ABORT) the keys it holds
/// are already useless where the transport enforces them; then the frames go onto
/// the control lanes, in order; then the events settle statuses, fill the event
/// queue and close ended sessions. Called with the machine locked.
fn flush(shared: &Arc<Shared>, m: &mut ReceiverEndpoint) {
    let now = clock::now();
    let mut events = Vec::new();
    while let Some(e) = m.poll_event() {
        events.push(e);
    }
    let mut ended = HashMap::new();
    {
        let mut transfers = lock(&shared.transfers);
        for e in &events {
            if let core_session::ReceiverEvent::Transfer(
                TransferEvent::Complete { transfer_id, .. }
                | TransferEvent::Failed { transfer_id, .. },
            ) = e
            {
                if let Some(entry) = transfers.remove(transfer_id) {
                    shared.ucx.unmap(entry.memory.clone());
                    ended.insert(*transfer_id, entry);
                }
            }
        }
    }
    {
        let sessions = lock(&shared.sessions);
        while let Some((h, frame)) = m.poll_transmit(now) {
            if let Some(s) = sessions.get(&h.id) {
                let _ = s.control.send(frame);
            }
        }
    }
    // The events and the statuses they settle change under the events' lock: whoever
    // takes an event sees its transfer's status settled too, and a `wait()` that
    // returned finds its event.
    let mut q = lock(&shared.events);
    let mut queued = false;
    for e in events {
        match e {
            core_session::ReceiverEvent::Transfer(ev) => {
                match &ev {
                    TransferEvent::LayerComplete { .. } => {}
                    TransferEvent::Complete {
                        transfer_id, bytes, ..
                    } => {
                        Metrics::add(&shared.metrics.transfers_completed_total, 1);
                        Metrics::add(&shared.metrics.bytes_received_total, *bytes);
                        if let Some(entry) = ended.remove(transfer_id) {
                            let _ = entry.status.send(LocalStatus::Complete { bytes: *bytes });
                        }
                    }
                    TransferEvent::Failed {
                        transfer_id, error, ..
                    } => {
                        Metrics::add(&shared.metrics.transfers_failed_total, 1);
                        if let Some(entry) = ended.remove(transfer_id) {
                            let _ = entry.status.send(LocalStatus::Failed(error.clone()));
                        }
                    }
                }
                if q.len() >= MAX_QUEUED_EVENTS {
                    q.pop_front();
                }
                q.push_back(ev);
                queued = true;
            }
            core_session::ReceiverEvent::SessionEnded {
                session, violation, ..
            } => {
                if violation {
                    Metrics::add(&shared.metrics.violations_total, 1);
                }
                if let Some(s) = lock(&shared.sessions).remove(&session.id) {
                    s.end.cancel();
                }
                shared.peers_changed.notify_waiters();
            }
            core_session::ReceiverEvent::Rtt { rtt, .. } => {
                Metrics::set(&shared.metrics.rtt_us, rtt.as_micros() as u64);
            }
            // The session is up now: `wait_peer` looks again.
            core_session::ReceiverEvent::PeerLayout { .. } => {
                shared.peers_changed.notify_waiters();
            }
            // Not on a local session: the machine refuses them there (no data
            // lanes to stop, no prefix queries, no transfer resume).
            core_session::ReceiverEvent::StopLane { .. }
            | core_session::ReceiverEvent::PrefixQuery { .. }
            | core_session::ReceiverEvent::SessionSuspended { .. }
            | core_session::ReceiverEvent::SessionResumed { .. } => {}
        }
    }
    drop(q);
    if queued {
        shared
            .events_changed
            .send_modify(|n| *n = n.wrapping_add(1));
    }
    if let Some(t) = m.poll_timeout() {
        if t.as_nanos() < shared.armed.load(Ordering::Relaxed) {
            shared.armed.store(t.as_nanos(), Ordering::Relaxed);
            shared.timer_wake.notify_one();
        }
    }
}

/// One established connection counted against `max_connections` until dropped (also
/// when its task is cancelled or panics).
struct Established(Arc<AtomicU64>);

impl Established {
    fn new(count: Arc<AtomicU64>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Established(count)
    }
}

impl Drop for Established {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One sender's control lane: opening (refusing a peer without `local_ucx`, data
/// lanes and resumptions: the local path has none) in its admission `slot`,
/// LOCAL_ADDR, then its frames.
async fn session(shared: Arc<Shared>, tcp: TcpStream, slot: crate::admission::Opening) {
    lane::tune(&tcp, &SocketTuning::default(), true);
    let hello = &lane::with_aead(&shared.cfg.hello, shared.cfg.tls.is_some());
    let timeout = shared.cfg.hello_timeout;
    let opening = async {
        let mut stream = match &shared.cfg.tls {
            Some(tls) => {
                tokio::time::timeout(timeout, tls.accept(tcp))
                    .await
                    .map_err(|_| Error::DeadlineExceeded {
                        what: "TLS handshake of a connecting peer".into(),
                    })??
                    .0
            }
            None => LaneStream::Plain(tcp),
        };
        let offered = lane::read_hello(&mut stream, hello, timeout).await?;
        let key: Result<&[u8], Error> = if offered.agreed.resume || offered.agreed.lane != 0 {
            Err(Error::AuthFailed {
                detail: "the local path has one control lane per session and no resumption",
            })
        } else {
            Ok(hello.root_key())
        };
        lane::authenticate(&mut stream, hello, &offered, key, timeout).await?;
        let admitted = if offered.agreed.capabilities & capability::LOCAL_UCX == 0 {
            Err(Error::LocalPathUnavailable {
                detail: "the peer did not offer local_ucx".into(),
            })
        } else {
            Ok(())
        };
        lane::answer_hello(&mut stream, hello, &offered.agreed, admitted, timeout).await?;
        Ok::<_, Error>((stream, offered.agreed))
    };
    let opened = tokio::select! {
        _ = shared.cancel.cancelled() => return,
        r = slot.run(opening) => r,
    };
    // Counted as established before the opening slot is freed: the two together
    // never exceed `max_connections`.
    let _established = Established::new(shared.established.clone());
    drop(slot);
    let (stream, agreed) = match opened {
        // Displaced by a newer connection: closed unanswered.
        None => return,
        Some(Ok(o)) => o,
        Some(Err(_)) => {
            Metrics::add(&shared.metrics.lanes_refused_total, 1);
            return;
        }
    };
    // The machine sends the PINGs and keeps the dead-peer bound: the lane only
    // moves frames.
    let mut control = Control::start(
        stream,
        shared.cfg.hello.max_payload,
        agreed.peer_max_payload,
        None,
        None,
        shared.metrics.clone(),
        &shared.cancel,
    );
    let address = Bytes::copy_from_slice(shared.ucx.worker_address());
    // LOCAL_ADDR first, before the machine may queue anything for the session.
    if control
        .tx
        .send(Frame::LocalAddr(LocalAddr {
            memory_kind: shared.pool.memory_kind().code(),
            address,
        }))
        .is_err()
    {
        return;
    }
    let id = shared.next_session.fetch_add(1, Ordering::Relaxed);
    let opened = {
        let mut m = lock(&shared.machine);
        let opened = m.open_session(id, false, [0; 32], None, agreed.capabilities, clock::now());
        if let Ok(h) = opened {
            lock(&shared.sessions).insert(
                h.id,
                Session {
                    control: control.tx.clone(),
                    end: control.cancel.clone(),
                    peer_max_payload: agreed.peer_max_payload,
                },
            );
        }
        flush(&shared, &mut m);
        opened
    };
    let Ok(h) = opened else {
        // The receiver is closing.
        control.cancel.cancel();
        return;
    };
    shared.peers_changed.notify_waiters();
    // Every frame goes to the machine (LOCAL_DONE against the grant, ABORT, PING,
    // anything else a protocol error), until it ends the session or the lane does.
    let why = loop {
        match control.next_frame().await {
            Ok(frame) => with_machine(&shared, |m| m.handle_frame(h, frame, clock::now())),
            Err(e) => break e,
        }
    };
    // The lane ended here (closed, reset, undecodable, the receiver closing), unless
    // the machine ended the session already.
    with_machine(&shared, |m| m.close_session(h, why, false));
    control.cancel.cancel();
    shared.peers_changed.notify_waiters();
}
