//! The state one link's tasks and engine threads share: the router, the current
//! connection's send and receive sides, timers, pings, and the I/O paths over them.

use super::*;

/// HANDOFFs awaiting their ack whose send time is kept for the round-trip histogram.
pub(super) const MAX_HANDOFFS_TIMED: u64 = 65_536;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The current connection's receive side. The I/O task and engine threads that
/// busy-poll share it; whoever holds the lock reads, decodes and routes, so frames
/// are handled in the order they arrived whichever thread read them.
pub(super) struct Rx {
    /// The connection these bytes belong to (`Conn::generation`).
    pub(super) generation: u64,
    /// MD: the session that connection carries (`Conn::tag`), which the router
    /// checks each frame's request against.
    pub(super) session: Option<u64>,
    pub(super) decoder: FrameDecoder,
    pub(super) buf: BytesMut,
    /// The connection's TLS state, when it runs TLS (shared with `Conn`).
    pub(super) tls: Option<Tls>,
}

/// A TLS connection driven by hand over the non-blocking socket (rustls is sans-IO),
/// so engine threads and the I/O task keep reading and writing the socket directly.
/// Lock order: `rx` or `conn` first, then this; never held while routing frames.
pub(super) type Tls = Arc<Mutex<rustls::Connection>>;

/// The socket as `io::Read`/`io::Write` for rustls: non-blocking, `WouldBlock` when
/// nothing is ready.
pub(super) struct Sock<'a>(&'a TcpStream);

impl std::io::Read for Sock<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.try_read(buf)
    }
}

impl std::io::Write for Sock<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.try_write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The current connection's send side.
pub(super) struct Conn {
    pub(super) stream: Option<Arc<TcpStream>>,
    /// TLS state of the current connection, if it runs TLS.
    pub(super) tls: Option<Tls>,
    /// Encoded bytes not yet accepted by the socket.
    pub(super) pending: BytesMut,
    pub(super) send_max: u32,
    pub(super) generation: u64,
    /// Stops the current connection's task.
    pub(super) stop: Option<CancellationToken>,
    pub(super) last_error: Option<Error>,
    /// RLD: the session it holds with MD: its id, the secret its opening exchange
    /// derived (a reconnect resumes it by proving the secret), the TLS identity.
    pub(super) session: Option<(u64, AuthBytes, Option<[u8; 32]>)>,
    /// MD: the sessions it knows (the current one and every one that still owns a
    /// handoff), and who may open or resume one.
    pub(super) book: SessionBook,
    /// MD: the tag of the session the current connection carries.
    pub(super) tag: Option<u64>,
}

/// Who a connection being installed belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Joining {
    /// RLD: its own session with MD (one peer, which proved itself: no ownership to
    /// keep apart).
    Own,
    /// MD: a new session, admitted while nobody was connected.
    Open,
    /// MD: the known session with this tag, resumed (the peer proved its secret).
    Resume(u64),
}

pub(super) struct Shared<M: HandoffMachine> {
    pub(super) router: Mutex<Router<M>>,
    pub(super) conn: Mutex<Conn>,
    /// Lock order: `rx`, then `router`, then `conn`.
    pub(super) rx: Mutex<Rx>,
    /// When bytes last arrived (ns on the link's clock), by any reader: the
    /// dead-peer check reads it.
    pub(super) last_rx_ns: AtomicU64,
    /// Engine threads busy-polling now ([`HandoffLink::next_event_busy`]).
    pub(super) spinners: AtomicU64,
    /// Until when (ns on the link's clock) the I/O task leaves reading to the
    /// engine: a spinner that got its event will likely spin again soon, and each
    /// needless wake of the I/O task costs a core for a moment.
    pub(super) spin_linger_until_ns: AtomicU64,
    /// The spin length last asked for (ns): how often a stepped-back I/O task
    /// looks again whether the engine still polls.
    pub(super) spin_ns: AtomicU64,
    /// Tells the I/O task that the engine stopped busy-polling.
    pub(super) reader_wake: Notify,
    /// The connection task flushes what the socket refused.
    pub(super) writer_wake: Notify,
    /// The timer task re-reads the earliest deadline.
    pub(super) timer_wake: Notify,
    /// Deadline (ns) the timer task sleeps until; u64::MAX when none.
    pub(super) armed: AtomicU64,
    pub(super) events: EventQueue<LinkEvent<M::Event>>,
    pub(super) origin: Instant,
    pub(super) config: LinkConfig,
    pub(super) counters: Counters,
    pub(super) connected: watch::Sender<bool>,
    pub(super) pings: Mutex<HashMap<u64, oneshot::Sender<Duration>>>,
    pub(super) next_nonce: AtomicU64,
    pub(super) shutdown: CancellationToken,
    pub(super) closed: AtomicBool,
    pub(super) local_addr: Mutex<Option<SocketAddr>>,
}

impl<M: HandoffMachine> Shared<M> {
    pub(super) fn now(&self) -> Timestamp {
        Timestamp::from_duration_since_origin(self.origin.elapsed()).unwrap_or(Timestamp::MAX)
    }

    pub(super) fn instant_of(&self, t: Timestamp) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.origin + t.duration_since_origin())
    }

    /// Run a router operation; write what it emitted, deliver its events, re-arm the
    /// timer task if a machine now wants waking sooner.
    pub(super) fn with_router<T>(
        &self,
        f: impl FnOnce(&mut Router<M>, Timestamp, &mut Outbox<M::Event>) -> T,
    ) -> T {
        let mut out = Outbox::default();
        let mut router = lock(&self.router);
        let now = self.now();
        let value = f(&mut router, now, &mut out);
        // Still under the router lock: frames leave in the order machines made them.
        if !out.frames.is_empty() {
            self.send_frames(&out.frames);
        }
        drop(router);
        if !out.events.is_empty() {
            self.events.push_all(out.events);
        }
        if let Some(t) = out.earliest_timeout {
            if t.as_nanos() < self.armed.load(Ordering::Acquire) {
                self.timer_wake.notify_one();
            }
        }
        value
    }

    /// Encode frames into the send buffer and push it to the socket at once (a
    /// non-blocking write from this thread); what the socket refuses, the connection
    /// task writes when it is writable.
    pub(super) fn send_frames(&self, frames: &[Frame]) {
        let mut conn = lock(&self.conn);
        let Some(stream) = conn.stream.clone() else {
            bump(
                &self.counters.frames_dropped_disconnected,
                frames.len() as u64,
            );
            return;
        };
        let send_max = conn.send_max;
        let mut sent = 0;
        self.note_handoffs_sent(frames);
        for f in frames {
            // Machines only emit valid frames under the 64 KiB floor; an error here
            // is a bug, counted as a drop rather than a broken connection.
            if encode_frame(f, send_max, &mut conn.pending).is_ok() {
                sent += 1;
            }
        }
        bump(&self.counters.frames_sent, sent);
        if !self.flush_locked(&mut conn, &stream) {
            return;
        }
        if conn.pending.len() > MAX_UNWRITTEN_BYTES {
            // The peer stopped reading (while still sending, or we would have found it
            // dead): drop the connection rather than grow. The machines replay what
            // matters on the next one.
            conn.last_error = Some(Error::LimitExceeded {
                what: "handoff-link bytes queued for a peer that does not read them".into(),
                limit: MAX_UNWRITTEN_BYTES as u64,
            });
            bump(&self.counters.unread_overflows, 1);
            conn.pending.clear();
            if let Some(stop) = &conn.stop {
                stop.cancel();
            }
        }
    }

    /// Write as much of the pending bytes as the socket takes now. Returns true when
    /// some are left (the caller must wait for writability).
    pub(super) fn flush_locked(&self, conn: &mut Conn, stream: &TcpStream) -> bool {
        if let Some(tls) = conn.tls.clone() {
            return self.flush_tls(conn, &tls, stream);
        }
        while !conn.pending.is_empty() {
            match stream.try_write(&conn.pending) {
                Ok(n) => conn.pending.advance(n),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.writer_wake.notify_one();
                    return true;
                }
                Err(e) => {
                    conn.last_error = Some(Error::ConnectionLost {
                        detail: format!("write: {e}"),
                    });
                    conn.pending.clear();
                    if let Some(stop) = &conn.stop {
                        stop.cancel();
                    }
                    return false;
                }
            }
        }
        false
    }

    /// [`Shared::flush_locked`] through TLS: plaintext into rustls (bounded by its
    /// buffer limit), records out to the socket until it would block.
    pub(super) fn flush_tls(&self, conn: &mut Conn, tls: &Tls, stream: &TcpStream) -> bool {
        use std::io::Write;
        let mut t = lock(tls);
        let fail = |conn: &mut Conn, detail: String| {
            conn.last_error = Some(Error::ConnectionLost { detail });
            conn.pending.clear();
            if let Some(stop) = &conn.stop {
                stop.cancel();
            }
            false
        };
        loop {
            if !conn.pending.is_empty() {
                match t.writer().write(&conn.pending) {
                    Ok(n) => conn.pending.advance(n),
                    Err(e) => return fail(conn, format!("TLS write: {e}")),
                }
            }
            if !t.wants_write() {
                if conn.pending.is_empty() {
                    return false;
                }
                continue;
            }
            match t.write_tls(&mut Sock(stream)) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.writer_wake.notify_one();
                    return true;
                }
                Err(e) => return fail(conn, format!("write: {e}")),
            }
        }
    }

    /// Remember when each HANDOFF first left (a replay keeps the first time), for
    /// the round-trip histogram. Bounded: handoffs of requests that ended without
    /// an ack stay until the cap, when the table starts over (the handoffs then in
    /// flight go unmeasured).
    pub(super) fn note_handoffs_sent(&self, frames: &[Frame]) {
        let mut sent = None;
        for f in frames {
            let Frame::Handoff(h) = f else { continue };
            let map = sent.get_or_insert_with(|| lock(&self.counters.handoff_sent));
            let timed = &self.counters.handoffs_timed;
            if timed.load(Ordering::Relaxed) >= MAX_HANDOFFS_TIMED {
                map.clear();
                timed.store(0, Ordering::Relaxed);
            }
            let seqs = map.entry(h.request_id).or_default();
            if !seqs.iter().any(|&(seq, _)| seq == h.seq) {
                seqs.push((h.seq, self.now().as_nanos()));
                timed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A HANDOFF_ACK covers every handoff of its request up to `acked_seq` (all of
    /// them when final): each one's round trip is recorded once.
    pub(super) fn note_handoff_ack(&self, ack: &HandoffAck) {
        let now = self.now().as_nanos();
        let mut map = lock(&self.counters.handoff_sent);
        let Some(seqs) = map.get_mut(&ack.request_id) else {
            return;
        };
        let before = seqs.len();
        seqs.retain(|&(seq, at)| {
            let covered = ack.final_ || seq <= ack.acked_seq;
            if covered {
                let rtt = Duration::from_nanos(now.saturating_sub(at));
                self.counters.handoff_round_trip.observe(rtt);
            }
            !covered
        });
        let done = (before - seqs.len()) as u64;
        if seqs.is_empty() {
            map.remove(&ack.request_id);
        }
        self.counters
            .handoffs_timed
            .fetch_sub(done, Ordering::Relaxed);
    }

    pub(super) fn send_control(&self, frame: Frame) {
        // Control frames (PING/PONG) never touch a machine; ordering against handoff
        // frames does not matter, so the router lock is not needed.
        self.send_frames(std::slice::from_ref(&frame));
    }

    /// Route frames read from a connection of session `from` (MD; `None` on RLD).
    pub(super) fn handle_frames(&self, frames: Vec<Frame>, from: Option<u64>) {
        bump(&self.counters.frames_received, frames.len() as u64);
        let mut handoff = Vec::with_capacity(frames.len());
        for frame in frames {
            match frame {
                Frame::Ping(p) => self.send_control(Frame::Pong(p)),
                Frame::Pong(p) => {
                    let now = self.now().as_nanos();
                    let rtt = Duration::from_nanos(now.saturating_sub(p.sent_at_ns));
                    self.counters.rtt_us.store(
                        u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX),
                        Ordering::Relaxed,
                    );
                    if let Some(tx) = lock(&self.pings).remove(&p.nonce) {
                        let _ = tx.send(rtt);
                    }
                }
                Frame::HandoffAck(a) => {
                    self.note_handoff_ack(&a);
                    handoff.push(Frame::HandoffAck(a));
                }
                other => handoff.push(other),
            }
        }
        if handoff.is_empty() {
            return;
        }
        self.with_router(|r, now, out| {
            for f in handoff {
                // Rejections leave the machine unchanged (counted in the router);
                // frames that are not the handoff's are ignored on this lane; frames
                // for another session's request are refused (answered on this
                // connection, which is the sender's: the router drops frames of a
                // connection replaced since).
                let _ = match from {
                    Some(session) => r.handle_frame_from(session, f, now, out),
                    None => r.handle_frame(f, now, out),
                };
            }
        });
    }

    /// Install a fresh connection: it replaces any current one, and the machines
    /// of its session (every machine on RLD) re-send what the peer may have missed.
    /// MD: the session book has the last word (a new session is refused if another
    /// connection was installed since it was admitted), and sessions that own no
    /// handoff any more are forgotten.
    pub(super) fn install(
        &self,
        stream: Arc<TcpStream>,
        tls: Option<Tls>,
        agreed: &Negotiated,
        secret: AuthBytes,
        identity: Option<[u8; 32]>,
        joining: Joining,
    ) -> Result<(u64, CancellationToken)> {
        let stop = self.shutdown.child_token();
        let generation;
        {
            let mut router = lock(&self.router);
            let tag;
            {
                let mut conn = lock(&self.conn);
                let live = conn.stream.is_some();
                tag = match joining {
                    Joining::Own => None,
                    Joining::Open => {
                        Some(conn.book.open(agreed.session_id, secret, identity, live)?)
                    }
                    Joining::Resume(t) => Some(conn.book.resume(t)?),
                };
                if let Some(old) = conn.stop.take() {
                    old.cancel();
                }
                conn.stream = Some(stream);
                conn.tls = tls;
                conn.pending.clear();
                conn.send_max = agreed.peer_max_payload;
                conn.generation += 1;
                conn.stop = Some(stop.clone());
                conn.last_error = None;
                conn.session = Some((agreed.session_id, secret, identity));
                conn.tag = tag;
                generation = conn.generation;
            }
            let mut out = Outbox::default();
            let now = self.now();
            match tag {
                Some(t) => router.on_session(t, now, &mut out),
                None => router.on_reconnect(now, &mut out),
            }
            if tag.is_some() {
                lock(&self.conn).book.retain(|t| router.holds_session(t));
            }
            if !out.frames.is_empty() {
                self.send_frames(&out.frames);
            }
            drop(router);
            self.events.push_all(out.events);
        }
        bump(&self.counters.connects, 1);
        self.connected.send_replace(true);
        self.timer_wake.notify_one();
        Ok((generation, stop))
    }

    pub(super) fn uninstall(&self, generation: u64, error: Option<Error>) {
        let mut conn = lock(&self.conn);
        if conn.generation != generation {
            return; // already replaced
        }
        conn.stream = None;
        conn.tls = None;
        conn.pending.clear();
        conn.stop = None;
        if error.is_some() {
            conn.last_error = error;
        }
        drop(conn);
        if !self.shutdown.is_cancelled() {
            bump(&self.counters.connections_lost, 1);
        }
        self.connected.send_replace(false);
    }

    /// Serve one connection until it is lost or stopped: read and route frames, flush
    /// what direct writes left, heartbeat, and watch for a dead peer.
    pub(super) async fn serve(
        self: Arc<Self>,
        stream: Arc<TcpStream>,
        generation: u64,
        stop: CancellationToken,
    ) {
        let pending_plaintext = {
            let mut rx = lock(&self.rx);
            let conn = lock(&self.conn);
            if conn.generation != generation {
                // Replaced before this task started: the newer connection's task
                // owns `rx` (and its TLS state and session are not this one's).
                return;
            }
            rx.tls = conn.tls.clone();
            rx.session = conn.tag;
            drop(conn);
            rx.generation = generation;
            rx.decoder = FrameDecoder::new(DEFAULT_MAX_PAYLOAD);
            rx.buf = BytesMut::with_capacity(64 << 10);
            // What TLS already decrypted during the handshake never shows up as
            // socket readiness: route it now.
            match rx.tls.is_some() {
                true => self.read_available(&mut rx, &stream).err(),
                false => None,
            }
        };
        if let Some(e) = pending_plaintext {
            self.uninstall(generation, Some(e));
            return;
        }
        self.last_rx_ns
            .store(self.now().as_nanos(), Ordering::Relaxed);
        let mut heartbeat = tokio::time::interval(self.config.heartbeat_interval);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut want_writable = false;
        let error: Option<Error> = loop {
            let now = self.now().as_nanos();
            let linger_until = self.spin_linger_until_ns.load(Ordering::Acquire);
            let engine_reads = self.spinners.load(Ordering::Acquire) > 0 || now < linger_until;
            // Looked at again after the linger, and at least every spin length (1 ms
            // at the least): an engine that stops polling without blocking gets its
            // socket read by this task again within that.
            let look_again = Timestamp::from_nanos(
                linger_until
                    .max(now.saturating_add(self.spin_ns.load(Ordering::Relaxed).max(1_000_000))),
            );
            tokio::select! {
                biased;
                _ = stop.cancelled() => {
                    let err = lock(&self.conn).last_error.clone();
                    break err;
                }
                // While an engine thread busy-polls this link it does the reading;
                // this task steps back (no wake-up per frame) and checks again when
                // told the spinning stopped, or when the linger runs out.
                _ = self.reader_wake.notified(), if engine_reads => {}
                _ = tokio::time::sleep_until(self.instant_of(look_again)), if engine_reads => {}
                ready = stream.readable(), if !engine_reads => {
                    if let Err(e) = ready {
                        break Some(Error::ConnectionLost { detail: format!("read: {e}") });
                    }
                    let mut rx = lock(&self.rx);
                    if rx.generation != generation {
                        // Replaced by a newer connection, whose bytes `rx` now holds.
                        break None;
                    }
                    if let Err(e) = self.read_available(&mut rx, &stream) {
                        break Some(e);
                    }
                }
                _ = self.writer_wake.notified(), if !want_writable => {
                    want_writable = self.flush_current(&stream);
                }
                ready = stream.writable(), if want_writable => {
                    if let Err(e) = ready {
                        break Some(Error::ConnectionLost { detail: format!("write: {e}") });
                    }
                    want_writable = self.flush_current(&stream);
                }
                _ = heartbeat.tick() => {
                    let silent = Duration::from_nanos(
                        self.now().as_nanos().saturating_sub(self.last_rx_ns.load(Ordering::Relaxed)),
                    );
                    if silent >= self.config.dead_after {
                        bump(&self.counters.dead_peer, 1);
                        break Some(Error::DeadlineExceeded {
                            what: format!(
                                "peer silent for {} ms (dead_after)",
                                silent.as_millis()
                            ),
                        });
                    }
                    self.send_ping(0);
                }
            }
        };
        // After a framing error we sent an ABORT: close so that the peer reads it
        // (FIN after it, the rest of what the peer sent drained for a moment) rather
        // than a reset that could destroy it in flight. Otherwise dropping the
        // stream closes it; a reset peer sees our FIN or RST.
        let said_why = error.as_ref().is_some_and(|e| {
            !matches!(
                e,
                Error::ConnectionLost { .. } | Error::DeadlineExceeded { .. }
            )
        });
        if said_why {
            let _ = self.flush_current(&stream);
        }
        self.uninstall(generation, error);
        if said_why {
            let _ = socket2::SockRef::from(stream.as_ref()).shutdown(std::net::Shutdown::Write);
            let drain = async {
                let mut sink = [0u8; 4096];
                let mut left = 1usize << 20;
                while left > 0 {
                    if stream.readable().await.is_err() {
                        return;
                    }
                    match stream.try_read(&mut sink) {
                        Ok(0) => return,
                        Ok(n) => left = left.saturating_sub(n),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(_) => return,
                    }
                }
            };
            let _ = tokio::time::timeout(Duration::from_millis(200), drain).await;
        }
    }

    /// One non-blocking read of the connection into `rx`, then decode and route every
    /// complete frame. `Ok(true)` when bytes came, `Ok(false)` when none were waiting.
    /// An error means the connection is lost (closed, reset, or its framing broken;
    /// the peer has been sent an ABORT saying why in the last case).
    pub(super) fn read_available(&self, rx: &mut Rx, stream: &TcpStream) -> Result<bool> {
        let got = match rx.tls.clone() {
            None => stream.try_read_buf(&mut rx.buf),
            Some(tls) => self.read_tls(&tls, &mut rx.buf, stream),
        };
        match got {
            Ok(0) => Err(Error::ConnectionLost {
                detail: "closed by the peer".into(),
            }),
            Ok(_) => {
                self.last_rx_ns
                    .store(self.now().as_nanos(), Ordering::Relaxed);
                let mut frames = Vec::new();
                let failed = loop {
                    let Rx { decoder, buf, .. } = &mut *rx;
                    match decoder.decode(buf) {
                        Ok(Some(f)) => frames.push(f),
                        Ok(None) => break None,
                        Err(e) => break Some(e),
                    }
                };
                if !frames.is_empty() {
                    self.handle_frames(frames, rx.session);
                }
                if let Some(e) = failed {
                    // Framing is lost: tell the peer why, then drop the connection.
                    self.send_control(lane::abort_for(&e));
                    return Err(e);
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(Error::ConnectionLost {
                detail: format!("read: {e}"),
            }),
        }
    }

    /// Ciphertext from the socket into rustls, plaintext out into `buf`: like
    /// `try_read_buf`, `Ok(0)` at the end of the stream and `WouldBlock` when nothing
    /// (plain) came. Records rustls must answer are flushed on the next write.
    pub(super) fn read_tls(
        &self,
        tls: &Tls,
        buf: &mut BytesMut,
        stream: &TcpStream,
    ) -> std::io::Result<usize> {
        use std::io::Read;
        let mut t = lock(tls);
        let mut eof = false;
        match t.read_tls(&mut Sock(stream)) {
            Ok(0) => eof = true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        let state = t
            .process_new_packets()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let want = state.plaintext_bytes_to_read();
        if want > 0 {
            let start = buf.len();
            buf.resize(start + want, 0);
            let n = t.reader().read(&mut buf[start..])?;
            buf.truncate(start + n);
            if t.wants_write() {
                self.writer_wake.notify_one();
            }
            return Ok(n);
        }
        if eof || state.peer_has_closed() {
            return Ok(0);
        }
        Err(std::io::ErrorKind::WouldBlock.into())
    }

    /// Read and route what the current connection has waiting, on the calling
    /// thread, without blocking: a thread that waits for an event this way does not
    /// need the I/O task to be woken first. Skipped (false) while another thread is
    /// reading. An error ends the connection the way the I/O task would.
    pub(super) fn poll_io(&self) -> bool {
        let (stream, generation) = {
            let conn = lock(&self.conn);
            match &conn.stream {
                Some(s) => (Arc::clone(s), conn.generation),
                None => return false,
            }
        };
        let mut rx = match self.rx.try_lock() {
            Ok(rx) => rx,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        // Until the I/O task has set up this connection's decoder, leave it alone.
        if rx.generation != generation {
            return false;
        }
        match self.read_available(&mut rx, &stream) {
            Ok(progress) => {
                if progress {
                    bump(&self.counters.reads_on_caller, 1);
                }
                progress
            }
            Err(e) => {
                drop(rx);
                let mut conn = lock(&self.conn);
                if conn.generation == generation {
                    conn.last_error = Some(e);
                    if let Some(stop) = &conn.stop {
                        stop.cancel();
                    }
                }
                false
            }
        }
    }

    pub(super) fn flush_current(&self, stream: &TcpStream) -> bool {
        let mut conn = lock(&self.conn);
        match &conn.stream {
            Some(s) if std::ptr::eq(Arc::as_ptr(s), stream) => self.flush_locked(&mut conn, stream),
            _ => false,
        }
    }

    pub(super) fn send_ping(&self, nonce: u64) {
        bump(&self.counters.pings_sent, 1);
        self.send_control(Frame::Ping(Ping {
            nonce,
            sent_at_ns: self.now().as_nanos(),
        }));
    }

    /// Fire machine timers when due.
    pub(super) async fn run_timers(self: Arc<Self>) {
        loop {
            // "Scanning": an engine call that arms a deadline after the scan below
            // (it waits for the router lock the scan holds) and before `armed` is
            // stored sees u64::MAX and notifies; the permit `notify_one` leaves makes
            // the `notified` below complete at once, so nothing is missed.
            self.armed.store(u64::MAX, Ordering::Release);
            let deadline = {
                let r = lock(&self.router);
                r.poll_timeout()
            };
            let armed = deadline.map_or(u64::MAX, Timestamp::as_nanos);
            self.armed.store(armed, Ordering::Release);
            let notified = self.timer_wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let sleep = async {
                match deadline {
                    Some(t) => tokio::time::sleep_until(self.instant_of(t)).await,
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = &mut notified => continue,
                _ = sleep => {}
            }
            self.with_router(|r, now, out| r.handle_timeout(now, out));
        }
    }

    pub(super) fn stats(&self) -> LinkStats {
        let (rs, requests) = {
            let r = lock(&self.router);
            (r.stats(), r.len() as u64)
        };
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LinkStats {
            connects: get(&c.connects),
            connections_lost: get(&c.connections_lost),
            dead_peer: get(&c.dead_peer),
            frames_sent: get(&c.frames_sent),
            frames_received: get(&c.frames_received),
            frames_dropped_disconnected: get(&c.frames_dropped_disconnected),
            frames_unroutable: rs.frames_unroutable,
            frames_rejected: rs.frames_rejected,
            connection_faults: rs.connection_faults,
            frames_foreign: rs.frames_foreign,
            frames_withheld: rs.frames_withheld,
            unread_overflows: get(&c.unread_overflows),
            pings_sent: get(&c.pings_sent),
            rtt_us: get(&c.rtt_us),
            reads_on_caller: get(&c.reads_on_caller),
            requests,
            connected: *self.connected.borrow(),
            half_open: get(&c.opening.half_open),
            half_open_evicted: get(&c.opening.half_open_evicted_total),
        }
    }
}
