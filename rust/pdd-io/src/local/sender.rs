//! The local path's sender (Prefill): one control lane to a local receiver, one UCX
//! endpoint to its worker; pages are put straight from the source pool into the
//! granted regions, flushed, and each layer announced with LOCAL_DONE once its last
//! page is in.
//!
//! The session is the WAN sender's machine (`pdd_core::kv::session::SenderSession`,
//! on a session that negotiated `local_ucx`): it pairs each grant's LOCAL_GRANT with
//! its KV_GRANT and checks the regions cover it, plans which pages each call puts
//! (`SenderTransfer`), announces each layer once its pages are all in (LOCAL_DONE),
//! holds the receiver's KV_DONE to those notices, handles ABORT both ways, sends the
//! PINGs and keeps the dead-peer bound. Here: UCX (keys unpacked before a grant is
//! offered to the engine, puts and flushes, keys destroyed when a transfer ends) and
//! the control lane's bytes.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pdd_core::kv::session::{SenderEvent, SenderSession, SessionTimers};
use pdd_core::kv::PlannedBlock;
use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, Frame, KvGrant, LocalGrant, MEMORY_KIND_HOST};
use pdd_core::Error;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use super::ucx::{PutOp, UcxEndpoint};
use super::{lock, wait_status, Control, LocalStatus};
use crate::clock;
use crate::lane::{self, LaneKey, SocketTuning, TlsConfig};
use crate::metrics::Metrics;
use crate::pool::{MemoryKind, PagePool};

/// The largest control frame (a LOCAL_GRANT) a local sender accepts.
pub const LOCAL_MAX_PAYLOAD: u32 = 256 << 20;

/// Local sender settings.
#[derive(Debug, Clone)]
pub struct LocalSenderConfig {
    /// The receiver's control lane.
    pub addr: SocketAddr,
    /// Session id (the receiver grants to the connected session).
    pub session_id: u64,
    /// Our HELLO (`local_ucx` is added).
    pub hello: LocalHello,
    /// TLS on the control lane.
    pub tls: Option<TlsConfig>,
    /// Connect + HELLO + LOCAL_ADDR bound.
    pub connect_timeout: Duration,
    /// PING interval.
    pub heartbeat: Duration,
    /// A control lane silent this long is dead.
    pub dead_after: Duration,
    /// Bound on one layer's puts and flush.
    pub put_timeout: Duration,
    /// Our pool's KV layout (1 ..= 256 opaque bytes), sent to a receiver that has
    /// one too (capability `kv_layout`, offered exactly when this is set).
    pub layout: Option<Vec<u8>>,
}

impl LocalSenderConfig {
    /// Defaults: connect in 5 s, 1 s heartbeats, dead after 5 s, 30 s per layer.
    pub fn new(addr: SocketAddr, session_id: u64, hello: LocalHello) -> Self {
        LocalSenderConfig {
            addr,
            session_id,
            hello,
            tls: None,
            connect_timeout: Duration::from_secs(5),
            heartbeat: Duration::from_secs(1),
            dead_after: Duration::from_secs(5),
            put_timeout: Duration::from_secs(30),
            layout: None,
        }
    }
}

/// One region of a grant, its key unpacked on our endpoint.
#[derive(Debug, Clone, Copy)]
struct Region {
    layer: u16,
    page_start: u32,
    page_count: u32,
    remote_addr: u64,
    rkey: u64,
}

struct Ready {
    grant: KvGrant,
    regions: Vec<Region>,
    keys: Vec<u64>,
}

struct Transfer {
    status: watch::Sender<LocalStatus>,
    keys: Arc<Mutex<Option<Vec<u64>>>>,
}

struct Shared {
    pool: Arc<PagePool>,
    cfg: LocalSenderConfig,
    ucx: UcxEndpoint,
    control: lane::ControlTx,
    /// Ends the control lane's tasks.
    control_end: CancellationToken,
    /// The session machine. Lock order: machine, then ready, transfers.
    machine: Mutex<SenderSession>,
    /// The machine's next timeout as the timer task last armed it (nanoseconds;
    /// `u64::MAX`: none), and its doorbell when an earlier one appears.
    armed: AtomicU64,
    timer_wake: Notify,
    /// Grants ready to send (keys unpacked), by request.
    ready: Mutex<HashMap<u64, Vec<Ready>>>,
    ready_changed: Notify,
    transfers: Mutex<HashMap<u64, Transfer>>,
    death: Mutex<Option<Error>>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
}

/// A local-path sender.
pub struct LocalSender {
    shared: Arc<Shared>,
}

impl LocalSender {
    /// Load UCX, connect the control lane (which must negotiate `local_ucx`), take
    /// the receiver's LOCAL_ADDR and create the UCX endpoint, all within
    /// `connect_timeout`.
    pub async fn connect(
        pool: Arc<PagePool>,
        mut cfg: LocalSenderConfig,
    ) -> Result<LocalSender, Error> {
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
        // A LOCAL_GRANT carries one key per run of granted pages: a gigabyte of
        // shuffled 4 KiB pages is 262,144 regions. The receiver is authenticated and
        // in our datacenter; its frames may take up to this.
        cfg.hello.max_payload = cfg.hello.max_payload.max(LOCAL_MAX_PAYLOAD);
        let ucx = UcxEndpoint::start()?;
        let connected = lane::connect(
            cfg.addr,
            &cfg.hello,
            cfg.session_id,
            0,
            &LaneKey::Root,
            &SocketTuning::default(),
            cfg.tls.as_ref(),
            cfg.connect_timeout,
        )
        .await?;
        if connected.agreed.capabilities & capability::LOCAL_UCX == 0 {
            return Err(Error::LocalPathUnavailable {
                detail: format!("{} did not negotiate local_ucx", cfg.addr),
            });
        }
        let cancel = CancellationToken::new();
        let metrics = Arc::new(Metrics::default());
        // The session machine sends the PINGs and keeps the dead-peer bound; the
        // lane only moves frames (LOCAL_ADDR is awaited within connect_timeout).
        let mut control = Control::start(
            connected.stream,
            cfg.hello.max_payload,
            connected.agreed.peer_max_payload,
            None,
            None,
            metrics.clone(),
            &cancel,
        );
        let first = tokio::time::timeout(cfg.connect_timeout, control.next())
            .await
            .map_err(|_| Error::DeadlineExceeded {
                what: format!("LOCAL_ADDR from {}", cfg.addr),
            })??;
        let addr = match first {
            Frame::LocalAddr(a) => a,
            other => {
                let e = Error::InvalidField {
                    kind: other.kind(),
                    field: "kind",
                    detail: "expected LOCAL_ADDR first".into(),
                };
                control.end(&e);
                return Err(e);
            }
        };
        if addr.memory_kind != MEMORY_KIND_HOST {
            let e = Error::UnsupportedMemoryKind {
                kind: "cuda".into(),
                detail: "the receiver's pool is CUDA memory, which this build does not put to"
                    .into(),
            };
            control.end(&e);
            return Err(e);
        }
        if let Err(e) = ucx.connect(addr.address.to_vec()).await {
            control.end(&e);
            return Err(e);
        }
        // No data lanes: the stall bound is never used, only checked.
        let timers = SessionTimers::new(cfg.heartbeat, cfg.dead_after);
        let mut machine =
            SenderSession::new(timers, cfg.dead_after / 2)?.with_layout(cfg.layout.clone())?;
        machine.connected(connected.agreed.capabilities, 0, clock::now())?;
        if connected.agreed.capabilities & capability::KV_LAYOUT != 0 {
            // The receiver's KV_LAYOUT follows its LOCAL_ADDR: the connection is up
            // (and `connect` returns) only once it came.
            let next = tokio::time::timeout(cfg.connect_timeout, control.next()).await;
            let outcome = match next {
                Err(_) => Err(Error::DeadlineExceeded {
                    what: format!("KV_LAYOUT from {}", cfg.addr),
                }),
                Ok(Err(e)) => Err(e),
                Ok(Ok(frame)) => {
                    machine.handle_frame(frame, clock::now());
                    if machine.is_up() {
                        Ok(())
                    } else {
                        Err(Error::InvalidField {
                            kind: pdd_core::wire::FrameKind::KvLayout,
                            field: "kind",
                            detail: "expected the receiver's KV_LAYOUT after LOCAL_ADDR".into(),
                        })
                    }
                }
            };
            if let Err(e) = outcome {
                control.end(&e);
                return Err(e);
            }
        }
        let shared = Arc::new(Shared {
            pool,
            cfg,
            ucx,
            control: control.tx.clone(),
            control_end: control.cancel.clone(),
            machine: Mutex::new(machine),
            armed: AtomicU64::new(u64::MAX),
            timer_wake: Notify::new(),
            ready: Mutex::new(HashMap::new()),
            ready_changed: Notify::new(),
            transfers: Mutex::new(HashMap::new()),
            death: Mutex::new(None),
            metrics,
            cancel,
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
        tokio::spawn(read_loop(shared.clone(), control));
        Ok(LocalSender { shared })
    }

    /// Endpoint counters.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// The receiver's KV layout (its KV_LAYOUT), known once `connect` returned
    /// where both sides have a layout. `None`: the receiver has none or is older.
    pub fn peer_layout(&self) -> Option<Vec<u8>> {
        lock(&self.shared.machine).peer_layout().map(<[u8]>::to_vec)
    }

    /// Our layout, as given (`LocalSenderConfig::layout`).
    pub fn layout(&self) -> Option<Vec<u8>> {
        self.shared.cfg.layout.clone()
    }

    /// Wait for the receiver's grant for `request_id` (KV_GRANT and its LOCAL_GRANT).
    pub async fn wait_grant(&self, request_id: u64) -> Result<LocalOutbound, Error> {
        loop {
            let notified = self.shared.ready_changed.notified();
            if let Some(t) = self.try_grant(request_id)? {
                return Ok(t);
            }
            notified.await;
        }
    }

    /// The grant for `request_id` if it has arrived (KV_GRANT and its LOCAL_GRANT),
    /// without waiting; `Err` once the session died.
    pub fn try_grant(&self, request_id: u64) -> Result<Option<LocalOutbound>, Error> {
        if let Some(e) = lock(&self.shared.death).clone() {
            return Err(e);
        }
        if let Some(e) = self.refusal(request_id) {
            return Err(e);
        }
        let ready = {
            let mut ready = lock(&self.shared.ready);
            let r = ready.get_mut(&request_id).and_then(|v| {
                if v.is_empty() {
                    None
                } else {
                    Some(v.remove(0))
                }
            });
            if ready.get(&request_id).is_some_and(Vec::is_empty) {
                ready.remove(&request_id);
            }
            r
        };
        let Some(r) = ready else {
            return Ok(None);
        };
        // The transfer is in progress from here (the machine's grant is this one:
        // a grant the receiver voided meanwhile took its keys with it).
        let tid = r.grant.transfer_id;
        let taken = with_machine(&self.shared, |m| m.take_grant(request_id));
        if taken.as_ref().map(|g| g.transfer_id) != Some(tid) {
            self.shared.ucx.destroy(r.keys);
            return Ok(None);
        }
        let (status, rx) = watch::channel(LocalStatus::InProgress);
        let keys = Arc::new(Mutex::new(Some(r.keys)));
        lock(&self.shared.transfers).insert(
            tid,
            Transfer {
                status,
                keys: keys.clone(),
            },
        );
        // Per grant layer, its regions by first page (check_cover made them cover
        // every page of the layer exactly once).
        let mut regions = vec![Vec::new(); usize::from(r.grant.layer_count)];
        for reg in r.regions {
            regions[usize::from(reg.layer)].push(reg);
        }
        for layer in &mut regions {
            layer.sort_unstable_by_key(|reg: &Region| reg.page_start);
        }
        Ok(Some(LocalOutbound {
            shared: self.shared.clone(),
            serial: Arc::new(tokio::sync::Mutex::new(())),
            grant: r.grant,
            regions: Arc::new(regions),
            keys,
            started: AtomicBool::new(false),
            status: rx,
        }))
    }

    /// The receiver's refusal of `request_id`, if it refused it: `try_grant` and
    /// `wait_grant` fail with it at once (`pdd_core::Error::Refused`).
    pub fn refusal(&self, request_id: u64) -> Option<Error> {
        lock(&self.shared.machine).refusal(request_id)
    }

    /// This sender will not serve `request_id`: a grant of it not taken is dropped
    /// (its keys destroyed), a transfer of it in progress fails, and the receiver is
    /// told why (ABORT `refused`), now and for a grant that comes later. True if the
    /// receiver was told now.
    pub fn decline(&self, request_id: u64, reason: &str) -> Result<bool, Error> {
        let told = with_machine(&self.shared, |m| m.decline(request_id, reason))?;
        let keys: Vec<u64> = lock(&self.shared.ready)
            .remove(&request_id)
            .into_iter()
            .flatten()
            .flat_map(|r| r.keys)
            .collect();
        self.shared.ucx.destroy(keys);
        Ok(told)
    }

    /// End the session (live transfers fail) and release UCX.
    pub async fn close(&self) {
        // The session ends and every transfer fails `cancelled`.
        with_machine(&self.shared, |m| m.close());
        self.shared.cancel.cancel();
    }
}

impl Drop for LocalSender {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}

/// End a transfer with `status`; false if it had already ended.
fn end_transfer(shared: &Shared, tid: u64, status: LocalStatus) -> bool {
    let Some(t) = lock(&shared.transfers).remove(&tid) else {
        return false;
    };
    if let Some(keys) = lock(&t.keys).take() {
        shared.ucx.destroy(keys);
    }
    let _ = t.status.send(status);
    crate::activity::bump();
    true
}

/// The session ended: no grant of it can be taken any more; its transfers failed
/// (the machine's events); the control lane's tasks stop.
fn end_session(shared: &Shared, why: Error) {
    lock(&shared.death).get_or_insert(why);
    let keys: Vec<u64> = lock(&shared.ready)
        .drain()
        .flat_map(|(_, v)| v.into_iter().flat_map(|r| r.keys))
        .collect();
    shared.ucx.destroy(keys);
    shared.ready_changed.notify_waiters();
    shared.control_end.cancel();
}

/// Run `f` on the machine, then flush what it said. Returns the grants whose
/// regions came, for the caller to unpack their keys (outside the machine).
fn with_machine<R>(shared: &Arc<Shared>, f: impl FnOnce(&mut SenderSession) -> R) -> R {
    with_machine_regions(shared, f).0
}

fn with_machine_regions<R>(
    shared: &Arc<Shared>,
    f: impl FnOnce(&mut SenderSession) -> R,
) -> (R, Vec<(KvGrant, LocalGrant)>) {
    let mut m = lock(&shared.machine);
    let r = f(&mut m);
    let regions = flush(shared, &mut m);
    (r, regions)
}

/// Move what the machine said: its frames onto the control lane, in order; its
/// events onto statuses, keys and waiters. A grant of a page size that does not divide
/// our pool's is refused here (the machine answers it). Called with the machine locked.
fn flush(shared: &Arc<Shared>, m: &mut SenderSession) -> Vec<(KvGrant, LocalGrant)> {
    let now = clock::now();
    let mut regions = Vec::new();
    loop {
        let mut moved = false;
        while let Some(frame) = m.poll_transmit(now) {
            moved = true;
            let _ = shared.control.send(frame);
        }
        while let Some(event) = m.poll_event() {
            moved = true;
            match event {
                SenderEvent::GrantArrived { request_id } => {
                    let Some(g) = m.pending_grant(request_id).cloned() else {
                        continue;
                    };
                    // A grant of sub-page units (a divisor of our page size) is
                    // filled from units of our own pages; any other size cannot be.
                    if let Err(e) = shared.pool.units_per_layer(g.page_bytes) {
                        m.refuse_grant(request_id, &e);
                    } else if g.page_count == 0 {
                        // An empty grant: no LOCAL_GRANT follows, nothing to put.
                        lock(&shared.ready)
                            .entry(request_id)
                            .or_default()
                            .push(Ready {
                                grant: g,
                                regions: Vec::new(),
                                keys: Vec::new(),
                            });
                        shared.ready_changed.notify_waiters();
                        crate::activity::bump();
                    }
                }
                SenderEvent::RegionsArrived { grant, regions: r } => regions.push((grant, r)),
                SenderEvent::TransferComplete {
                    transfer_id, bytes, ..
                } => {
                    Metrics::add(&shared.metrics.transfers_completed_total, 1);
                    end_transfer(shared, transfer_id, LocalStatus::Complete { bytes });
                }
                SenderEvent::TransferFailed {
                    transfer_id, error, ..
                } => {
                    Metrics::add(&shared.metrics.transfers_failed_total, 1);
                    end_transfer(shared, transfer_id, LocalStatus::Failed(error));
                }
                SenderEvent::RequestAborted { request_id, .. } => {
                    // A grant not yet taken by the engine is revoked too.
                    let keys: Vec<u64> = lock(&shared.ready)
                        .remove(&request_id)
                        .into_iter()
                        .flatten()
                        .flat_map(|r| r.keys)
                        .collect();
                    shared.ucx.destroy(keys);
                    // A refusal ends a wait for the grant.
                    shared.ready_changed.notify_waiters();
                    crate::activity::bump();
                }
                SenderEvent::SessionEnded { error } => end_session(shared, error),
                SenderEvent::Rtt(rtt) => {
                    Metrics::set(&shared.metrics.rtt_us, rtt.as_micros() as u64);
                }
                // No data lanes, no prefix queries on the local path; the
                // receiver's layout is awaited in `connect`.
                SenderEvent::PeerLayout
                | SenderEvent::StopLane { .. }
                | SenderEvent::LaneReleased { .. }
                | SenderEvent::PrefixReply(_)
                // Transfer resume is a WAN capability: never negotiated here.
                | SenderEvent::TransfersSuspended { .. }
                | SenderEvent::TransferResumed { .. } => {}
            }
        }
        if !moved {
            break;
        }
    }
    if let Some(t) = m.poll_timeout() {
        if t.as_nanos() < shared.armed.load(Ordering::Relaxed) {
            shared.armed.store(t.as_nanos(), Ordering::Relaxed);
            shared.timer_wake.notify_one();
        }
    }
    regions
}

/// Every frame goes to the machine; a grant whose regions came is offered to the
/// engine once its keys are unpacked (or refused, ABORT for the request, if they
/// will not unpack).
async fn read_loop(shared: Arc<Shared>, mut control: Control) {
    let why = loop {
        let frame = tokio::select! {
            _ = shared.cancel.cancelled() => break Error::Cancelled { detail: "sender closed".into() },
            f = control.next_frame() => match f {
                Ok(f) => f,
                Err(e) => break e,
            },
        };
        let ((), arrived) = with_machine_regions(&shared, |m| m.handle_frame(frame, clock::now()));
        for (grant, l) in arrived {
            let unpacked = shared
                .ucx
                .unpack(
                    l.regions
                        .iter()
                        .map(|r| (r.rkey.to_vec(), r.remote_addr))
                        .collect(),
                )
                .await;
            let keys = match unpacked {
                Ok(k) => k,
                Err(e) => {
                    with_machine(&shared, |m| m.refuse_grant(grant.request_id, &e));
                    continue;
                }
            };
            let regions = l
                .regions
                .iter()
                .zip(&keys)
                .map(|(r, &k)| Region {
                    layer: r.layer,
                    page_start: r.page_start,
                    page_count: r.page_count,
                    remote_addr: r.remote_addr,
                    rkey: k,
                })
                .collect();
            lock(&shared.ready)
                .entry(grant.request_id)
                .or_default()
                .push(Ready {
                    grant,
                    regions,
                    keys,
                });
            shared.ready_changed.notify_waiters();
            crate::activity::bump();
        }
    };
    // The lane ended here (closed, reset, undecodable, the sender closing), unless
    // the machine ended the session already.
    with_machine(&shared, |m| m.close_session(why, false));
    control.cancel.cancel();
}

/// The sender's handle on one local-path grant.
pub struct LocalOutbound {
    shared: Arc<Shared>,
    grant: KvGrant,
    /// Per grant layer, its regions by first grant page.
    regions: Arc<Vec<Vec<Region>>>,
    keys: Arc<Mutex<Option<Vec<u64>>>>,
    /// Held from a call's planning (the machine's) until its puts are flushed and its
    /// layers announced, so calls on one transfer run one after another and a
    /// layer's LOCAL_DONE follows every put into it.
    serial: Arc<tokio::sync::Mutex<()>>,
    started: AtomicBool,
    status: watch::Receiver<LocalStatus>,
}

impl LocalOutbound {
    /// The grant being filled.
    pub fn grant(&self) -> &KvGrant {
        &self.grant
    }

    /// Current status.
    pub fn status(&self) -> LocalStatus {
        self.status.borrow().clone()
    }

    /// Whether any page was sent yet (for a pending/transferring poll).
    pub fn started(&self) -> bool {
        self.started.load(Ordering::Relaxed)
    }

    /// Put grant layer `layer` from source pool pages `src_pages` (one per grant
    /// page, in grant order) of pool layer `src_layer`: [`LocalOutbound::send_pages`]
    /// of every page of one layer.
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

    /// Put grant pages `grant_pages` (grant-relative, any subset, any order) on every
    /// grant layer of `layers`, from source pool pages `src_pages` (one per grant
    /// page, same order) on pool layer `src_layer` (with `None`, the same index as
    /// the grant layer; `Some` only for a single layer), as the WAN sender's
    /// `send_pages`: each `(layer, page)` goes exactly once per transfer, and a call
    /// that repeats one, or names one outside the grant, fails and puts nothing.
    /// Returns once the puts are flushed (the bytes are in the receiver's memory)
    /// and a LOCAL_DONE is queued for each layer whose last page this call put. Runs
    /// of consecutive source pages that land in one region go as one put. A grant of
    /// sub-page units (its `page_bytes` a divisor of our pool's) is put from units of
    /// that size: source page `u` is byte offset `u * unit` of the source layer.
    ///
    /// The puts and notices run on a task of their own: a caller that stops waiting
    /// (its timeout) leaves them to finish, so the pages it was told went do go.
    pub async fn send_pages(
        &self,
        layers: Range<u16>,
        src_layer: Option<u16>,
        grant_pages: &[u32],
        src_pages: &[u32],
    ) -> Result<(), Error> {
        let pool = &self.shared.pool;
        let g = &self.grant;
        if src_pages.len() != grant_pages.len() {
            return Err(Error::InvalidArgument(format!(
                "{} source pages for {} grant pages",
                src_pages.len(),
                grant_pages.len()
            )));
        }
        // A grant of sub-page units: the source pages count units of its size too.
        let units = pool.units_per_layer(g.page_bytes)?;
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
                g.page_bytes
            )));
        }
        let serial = self.serial.clone().lock_owned().await;
        if let LocalStatus::Failed(e) = self.status() {
            return Err(e);
        }
        if lock(&self.keys).is_none() {
            return Err(Error::GrantViolation {
                transfer_id: g.transfer_id,
                detail: "the grant ended: its remote keys are revoked".into(),
            });
        }
        let tid = g.transfer_id;
        let planned = with_machine(&self.shared, |m| {
            m.send_pages(tid, layers.clone(), grant_pages, u64::MAX)
        })
        .map_err(|e| self.ended_error().unwrap_or(e))?;
        if planned.is_empty() {
            // An empty grant: nothing to put; its notice goes with finish().
            return Ok(());
        }
        self.started.store(true, Ordering::Relaxed);
        let ops = self.plan_puts(&planned, src_layer, src_pages)?;
        let (shared, grant, status) = (self.shared.clone(), g.clone(), self.status.clone());
        let task = tokio::spawn(async move {
            // SAFETY: every op reads pages of our pool, which `shared` keeps alive
            // across the call; the engine may not modify source pages until the
            // transfer completes (the documented contract of send_pages).
            let put = unsafe { shared.ucx.put_all(ops, shared.cfg.put_timeout) }.await;
            let direct = match put {
                Ok(direct) => direct,
                Err(e) => {
                    // The receiver is told why (ABORT for the request).
                    with_machine(&shared, |m| m.fail_transfer(grant.transfer_id, e.clone()));
                    return Err(e);
                }
            };
            Metrics::add(&shared.metrics.local_direct_bytes_total, direct);
            let pages: u64 = planned.iter().map(|p| u64::from(p.block.page_count)).sum();
            Metrics::add(
                &shared.metrics.bytes_sent_total,
                pages * u64::from(grant.page_bytes),
            );
            // The machine announces the layers this call completed, consecutive ones
            // in one notice; only then may the next call on the transfer run.
            let announced = with_machine(&shared, |m| m.layers_put(grant.transfer_id, layers));
            drop(serial);
            // Refused only when the transfer ended meanwhile (the receiver's ABORT for
            // it, the session's end): report that, not a dead lane. The statuses are
            // settled under the machine's lock, so the ending is visible here.
            announced.map_err(|e| ended_with(&status, &shared, e))
        });
        task.await.unwrap_or_else(|e| {
            Err(Error::Cancelled {
                detail: format!("the put task ended: {e}"),
            })
        })
    }

    /// The puts of `planned` (from `src_pages` on `src_layer`, or each block's own
    /// layer), runs that are consecutive on both ends merged.
    fn plan_puts(
        &self,
        planned: &[PlannedBlock],
        src_layer: Option<u16>,
        src_pages: &[u32],
    ) -> Result<Vec<PutOp>, Error> {
        let pool = &self.shared.pool;
        let pb = u64::from(self.grant.page_bytes);
        let mut ops: Vec<PutOp> = Vec::new();
        for PlannedBlock { block, first } in planned {
            let layer = block.layer_start;
            let from = src_layer.unwrap_or(layer);
            let regions = &self.regions[usize::from(layer)];
            for i in 0..block.page_count {
                let gp = block.page_start + i;
                let at = regions.partition_point(|r| r.page_start <= gp);
                let r = regions
                    .get(at.wrapping_sub(1))
                    .filter(|r| gp - r.page_start < r.page_count)
                    .ok_or_else(|| Error::GrantViolation {
                        transfer_id: self.grant.transfer_id,
                        detail: format!("layer {layer} page {gp} lies in no region"),
                    })?;
                // Pages of the grant's size: whole pool pages, or units of them.
                let src =
                    pool.unit_addr(from, src_pages[first + i as usize], self.grant.page_bytes)?;
                let remote = r.remote_addr + u64::from(gp - r.page_start) * pb;
                match ops.last_mut() {
                    Some(last)
                        if last.rkey == r.rkey
                            && last.src + last.len == src
                            && last.remote + last.len as u64 == remote =>
                    {
                        last.len += pb as usize;
                    }
                    _ => ops.push(PutOp {
                        src,
                        len: pb as usize,
                        remote,
                        rkey: r.rkey,
                    }),
                }
            }
        }
        Ok(ops)
    }

    /// Every page of every layer was sent (an error says how many were not). For an
    /// empty grant this is the transfer's one notice (LOCAL_DONE naming every layer,
    /// 0 pages); otherwise each layer's notice went when its last page did.
    pub async fn finish(&self) -> Result<(), Error> {
        let _serial = self.serial.lock().await;
        match self.status() {
            LocalStatus::Failed(e) => return Err(e),
            // The last layer's notice already completed it: every page went.
            LocalStatus::Complete { .. } => return Ok(()),
            LocalStatus::InProgress => {}
        }
        let tid = self.grant.transfer_id;
        match with_machine(&self.shared, |m| m.finish(tid)) {
            Ok(_) => Ok(()),
            // The receiver's confirmation of the last layer can complete the transfer
            // between the status check above and the machine's lock: done, not an
            // error.
            Err(_) if matches!(self.status(), LocalStatus::Complete { .. }) => Ok(()),
            Err(e) => Err(self.ended_error().unwrap_or(e)),
        }
    }

    /// Give up on the transfer: the receiver is told with an ABORT (`cancelled`,
    /// carrying `reason`) and fails it with `peer_aborted`; here it fails with
    /// `cancelled`; the keys are destroyed. Puts already flushed stay where they
    /// landed (the receiver frees the pages). False if the transfer had already
    /// ended.
    pub fn abort(&self, reason: &str) -> bool {
        let tid = self.grant.transfer_id;
        with_machine(&self.shared, |m| m.abort(tid, reason))
    }

    /// Why the transfer ended, if it did: what a call on it then reports.
    fn ended_error(&self) -> Option<Error> {
        match self.status() {
            LocalStatus::Failed(e) => Some(e),
            LocalStatus::Complete { .. } => None,
            LocalStatus::InProgress => lock(&self.shared.death).clone(),
        }
    }

    /// Wait for the receiver's confirmation (bytes) or the transfer's failure.
    pub async fn wait(&self) -> Result<u64, Error> {
        wait_status(self.status.clone()).await
    }
}

/// Why the machine refused a call on a transfer with `e`: the transfer's own failure
/// if it failed (the receiver's ABORT, a put that failed), else the session's death
/// if it died, else `e` itself.
fn ended_with(status: &watch::Receiver<LocalStatus>, shared: &Shared, e: Error) -> Error {
    match &*status.borrow() {
        LocalStatus::Failed(f) => f.clone(),
        _ => lock(&shared.death).clone().unwrap_or(e),
    }
}
