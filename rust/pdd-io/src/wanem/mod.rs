//! `wanem`: a user-space WAN emulator for TCP, as a proxy.
//!
//! The kernels we test on have no `netem`, so cross-datacenter conditions are made
//! here: [`Wanem::start`] listens on one address and relays every accepted connection
//! to an upstream address through two emulated links, one per [`Direction`]. Each link
//! applies a one-way delay with seeded jitter (never reordering a stream), a
//! bandwidth cap shared by all connections of that direction, and a bounded buffer
//! (when it is full the proxy stops reading, so the sender feels TCP backpressure).
//!
//! A [`WanemHandle`] steers the running emulator from async or plain threads:
//! [`stall`](WanemHandle::stall), [`reset_all`](WanemHandle::reset_all),
//! [`corrupt_next`](WanemHandle::corrupt_next), [`blackhole`](WanemHandle::blackhole),
//! [`set_profile`](WanemHandle::set_profile), [`stats`](WanemHandle::stats) and a
//! bounded [`shutdown`](WanemHandle::shutdown). None of the control methods awaits:
//! they flip shared state that the relay tasks read.
//!
//! It is a stream proxy, not a packet emulator: there is no loss and no reordering on
//! the wire, and each side's TCP runs over loopback. See `docs/wanem.md`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), pdd_io::wanem::WanemError> {
//! use std::time::Duration;
//! use pdd_io::wanem::{Direction, LinkProfile, Jitter, Wanem, WanemConfig};
//!
//! let profile = LinkProfile {
//!     delay: Duration::from_millis(20),
//!     jitter: Jitter::Uniform(Duration::from_millis(2)),
//!     rate_bps: Some(10_000_000_000),
//! };
//! let config = WanemConfig::new("127.0.0.1:0".parse().unwrap(), "127.0.0.1:7000".parse().unwrap())
//!     .symmetric(profile);
//! let wan = Wanem::start(config).await?;
//! println!("connect to {}", wan.local_addr());
//! wan.stall(Direction::UpstreamToClient, Duration::from_millis(500));
//! wan.shutdown().await?;
//! # Ok(())
//! # }
//! ```

mod config;
mod conn;
mod error;
mod link;
pub mod packet;

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::{
    Direction, Jitter, LinkProfile, WanemConfig, DEFAULT_UNSHAPED_IN_FLIGHT, MAX_DELAY,
    MAX_IN_FLIGHT, MIN_IN_FLIGHT,
};
pub use error::WanemError;
pub use link::LinkStats;

use conn::{ConnControl, ConnEnd};
use link::Link;

/// How long [`WanemHandle::shutdown`] waits for the connection tasks to finish.
pub const SHUTDOWN_BOUND: Duration = Duration::from_secs(5);

/// How long [`WanemHandle::close_connection`] waits, after its FINs, for both ends
/// to close their side before it closes the sockets anyway.
pub const FIN_LINGER: Duration = Duration::from_secs(2);

/// Backlog of the listening socket.
const LISTEN_BACKLOG: u32 = 1024;

/// State shared by the accept loop, every connection task and the handle.
#[derive(Debug)]
pub(crate) struct Shared {
    config: WanemConfig,
    links: [Link; 2],
    /// On: forward nothing (see `WanemHandle::blackhole`); a watch so held EOFs
    /// can wait for it to lift.
    blackhole: watch::Sender<bool>,
    /// Bumped by `reset_all`; each connection watches it from its accept on.
    reset_tx: watch::Sender<u64>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    accepted: AtomicU64,
    active: AtomicU64,
    resets: AtomicU64,
    connect_failures: AtomicU64,
    /// The live connections by number (accept order), for the per-connection
    /// controls; a connection removes itself when its task ends.
    conns: Mutex<BTreeMap<u64, Arc<ConnControl>>>,
}

impl Shared {
    fn conns(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<ConnControl>>> {
        // Only inserts, removes and clones of Arcs happen under it.
        self.conns.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn conn(&self, conn: u64) -> Option<Arc<ConnControl>> {
        self.conns().get(&conn).cloned()
    }

    fn link(&self, dir: Direction) -> &Link {
        &self.links[dir.index()]
    }

    fn blackholed(&self) -> bool {
        *self.blackhole.borrow()
    }
}

/// Counters of a running emulator (a snapshot; they only grow, except
/// `connections_active`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WanemStats {
    /// Connections accepted since start.
    pub connections_accepted: u64,
    /// Connections whose task is still running.
    pub connections_active: u64,
    /// Accepted connections whose upstream connect failed or timed out (the client
    /// got a reset).
    pub upstream_connect_failures: u64,
    /// Connections closed with a RST by [`WanemHandle::reset_all`].
    pub resets: u64,
    /// Client-to-upstream counters.
    pub client_to_upstream: LinkStats,
    /// Upstream-to-client counters.
    pub upstream_to_client: LinkStats,
}

impl WanemStats {
    /// The counters of one direction.
    pub fn link(&self, dir: Direction) -> &LinkStats {
        match dir {
            Direction::ClientToUpstream => &self.client_to_upstream,
            Direction::UpstreamToClient => &self.upstream_to_client,
        }
    }
}

/// Entry point: `Wanem::start(config).await` gives a running emulator's handle.
#[derive(Debug)]
pub struct Wanem;

impl Wanem {
    /// Validates `config`, binds the listener and spawns the accept loop on the
    /// current tokio runtime. Listening on port 0 works: the bound address is
    /// [`WanemHandle::local_addr`].
    pub async fn start(config: WanemConfig) -> Result<WanemHandle, WanemError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| WanemError::NoRuntime)?;
        Self::start_inner(config, runtime)
    }

    /// [`start`](Self::start) for plain (non-async) threads, e.g. a Python binding
    /// that owns a process-wide runtime: binds and spawns on `runtime` without
    /// blocking on it. The runtime must keep running (a multi-threaded one, or a
    /// current-thread one driven elsewhere).
    pub fn start_on(
        runtime: &tokio::runtime::Handle,
        config: WanemConfig,
    ) -> Result<WanemHandle, WanemError> {
        // The listener registers with the runtime's reactor, which needs its context.
        let _context = runtime.enter();
        Self::start_inner(config, runtime.clone())
    }

    fn start_inner(
        config: WanemConfig,
        runtime: tokio::runtime::Handle,
    ) -> Result<WanemHandle, WanemError> {
        config.validate()?;
        let bind_err = |source| WanemError::Bind {
            addr: config.listen,
            source,
        };
        let listener = bind(config.listen, config.socket_buffer).map_err(bind_err)?;
        let local_addr = listener.local_addr().map_err(bind_err)?;
        let shared = Arc::new(Shared {
            links: [
                Link::new(config.client_to_upstream),
                Link::new(config.upstream_to_client),
            ],
            config,
            blackhole: watch::Sender::new(false),
            reset_tx: watch::Sender::new(0),
            shutdown: CancellationToken::new(),
            tracker: TaskTracker::new(),
            accepted: AtomicU64::new(0),
            active: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            connect_failures: AtomicU64::new(0),
            conns: Mutex::new(BTreeMap::new()),
        });
        let accept = accept_loop(Arc::clone(&shared), listener);
        runtime.spawn(shared.tracker.track_future(accept));
        Ok(WanemHandle {
            shared,
            local_addr,
            runtime,
        })
    }
}

fn bind(addr: SocketAddr, buffer: Option<usize>) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    if let Some(n) = buffer {
        // Accepted sockets inherit these from the listener.
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        socket.set_send_buffer_size(n)?;
        socket.set_recv_buffer_size(n)?;
    }
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Decrements `connections_active` and unlists the connection when its task ends,
/// however it ends.
struct ActiveGuard(Arc<Shared>, u64);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.conns().remove(&self.1);
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let mut next_id: u64 = 0;
    loop {
        let accepted = tokio::select! {
            () = shared.shutdown.cancelled() => break,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, _peer)) => {
                let conn_id = next_id;
                next_id = next_id.wrapping_add(1);
                shared.accepted.fetch_add(1, Ordering::Relaxed);
                shared.active.fetch_add(1, Ordering::Relaxed);
                // Listed before the task starts, so that `connections()` shows a
                // connection as soon as it has been accepted.
                let control = Arc::new(ConnControl::new());
                shared.conns().insert(conn_id, Arc::clone(&control));
                let guard = ActiveGuard(Arc::clone(&shared), conn_id);
                let reset_rx = shared.reset_tx.subscribe();
                let task_shared = Arc::clone(&shared);
                shared.tracker.spawn(async move {
                    let _guard = guard;
                    conn::serve(task_shared, conn_id, control, stream, reset_rx).await;
                });
            }
            Err(_) => {
                // Out of descriptors or similar: back off instead of spinning.
                tokio::select! {
                    () = shared.shutdown.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
        }
    }
    // Dropping the listener here closes the port.
}

/// Controls a running emulator. All methods take `&self` and none but
/// [`shutdown`](Self::shutdown) awaits, so it can be shared (`Arc`) and driven from
/// plain threads, e.g. a Python binding with the GIL released.
///
/// Dropping the handle stops the emulator (without waiting; use `shutdown` or
/// `shutdown_blocking` for a bounded, confirmed stop).
#[derive(Debug)]
pub struct WanemHandle {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    runtime: tokio::runtime::Handle,
}

impl WanemHandle {
    /// The address the emulator listens on (the real port when asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Where connections are relayed to.
    pub fn upstream_addr(&self) -> SocketAddr {
        self.shared.config.upstream
    }

    /// The current profile of one direction.
    pub fn profile(&self, dir: Direction) -> LinkProfile {
        self.shared.link(dir).profile()
    }

    /// Replaces the profile of one direction at run time. New delay and jitter apply
    /// to chunks read from now on (a stream still never reorders: a shorter delay
    /// waits for the chunks already queued); a new rate applies from the next chunk.
    /// The per-connection in-flight limit is fixed when a connection is accepted.
    pub fn set_profile(&self, dir: Direction, profile: LinkProfile) -> Result<(), WanemError> {
        profile.validate()?;
        self.shared.link(dir).set_profile(profile);
        Ok(())
    }

    /// Holds every byte of `dir`, on every connection, for `duration` from now:
    /// nothing is written to the receivers until then, while the proxy keeps reading
    /// until each connection's in-flight limit is full. Replaces a stall in
    /// progress; `Duration::ZERO` lifts it.
    pub fn stall(&self, dir: Direction, duration: Duration) {
        self.shared.link(dir).stall(duration);
    }

    /// Closes every current connection with a RST on both sides (`SO_LINGER` 0, then
    /// close), dropping whatever was in flight. Connections accepted afterwards are
    /// not affected. Returns at once; [`WanemStats::resets`] counts them as they go.
    pub fn reset_all(&self) {
        self.shared
            .reset_tx
            .send_modify(|epoch| *epoch = epoch.wrapping_add(1));
    }

    /// The live connections, by number, in accept order (the first connection
    /// accepted is 0, and numbers are never reused). A connection is listed from its
    /// accept until its task ends (both sides closed, reset or shut down).
    pub fn connections(&self) -> Vec<u64> {
        self.shared.conns().keys().copied().collect()
    }

    /// Closes connection `conn` only with a RST on both sides, like
    /// [`reset_all`](Self::reset_all) does to all; counted in
    /// [`WanemStats::resets`]. Returns whether that connection was live.
    pub fn reset_connection(&self, conn: u64) -> bool {
        self.shared
            .conn(conn)
            .is_some_and(|c| c.end(ConnEnd::Reset))
    }

    /// Closes connection `conn` only with a FIN on both sides (a write shutdown of
    /// each socket, what it has in flight dropped), then reads and discards what
    /// either end still sends until it closes too (at most [`FIN_LINGER`], then a
    /// plain close). Returns whether that connection was live.
    pub fn close_connection(&self, conn: u64) -> bool {
        self.shared.conn(conn).is_some_and(|c| c.end(ConnEnd::Fin))
    }

    /// Holds every byte of `dir` on connection `conn` only, for `duration` from now,
    /// as [`stall`](Self::stall) does for all (the proxy keeps reading until that
    /// connection's in-flight limit is full, so its sender soon stops too): the other
    /// connections keep flowing. Replaces that connection's stall in progress;
    /// `Duration::ZERO` lifts it. A whole-line stall applies on top. Returns whether
    /// that connection was live.
    pub fn stall_connection(&self, conn: u64, dir: Direction, duration: Duration) -> bool {
        self.shared.conn(conn).is_some_and(|c| {
            c.stall(dir, duration);
            true
        })
    }

    /// While `on`, reads and so lets TCP acknowledge every byte of `dir` on
    /// connection `conn` but delivers none of them (counted in
    /// [`LinkStats::bytes_blackholed`]): a middlebox that acknowledges and loses, which
    /// the sender's socket cannot tell from a healthy path. The other connections keep
    /// flowing. Returns whether that connection was live.
    pub fn swallow_connection(&self, conn: u64, dir: Direction, on: bool) -> bool {
        self.shared.conn(conn).is_some_and(|c| {
            c.swallow(dir, on);
            true
        })
    }

    /// Flips (XOR 0xFF) one byte, at a seeded random offset, of the next chunk
    /// written in `dir` on any connection. Calls add up: two calls corrupt the next
    /// two chunks.
    pub fn corrupt_next(&self, dir: Direction) {
        self.shared.link(dir).arm_corruption();
    }

    /// Turns the blackhole on or off. While on, the emulator keeps accepting and
    /// reading but forwards nothing, in either direction: existing connections go
    /// silent (data read or queued is dropped and counted in
    /// [`LinkStats::bytes_blackholed`]), and new connections are accepted but never
    /// connected upstream, so they hang until the client gives up, a `reset_all` or
    /// the shutdown (they stay that way after the blackhole is lifted).
    ///
    /// When it is lifted, existing connections forward new bytes again. A FIN (EOF)
    /// that reaches the blackhole is held, not dropped, and passed on when it lifts,
    /// as TCP would retransmit it; so a peer only learns of a close through the
    /// blackhole by its own timeout, or after the lift.
    pub fn blackhole(&self, on: bool) {
        self.shared.blackhole.send_replace(on);
    }

    /// Whether the blackhole is on.
    pub fn is_blackholed(&self) -> bool {
        self.shared.blackholed()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> WanemStats {
        let s = &self.shared;
        WanemStats {
            connections_accepted: s.accepted.load(Ordering::Relaxed),
            connections_active: s.active.load(Ordering::Relaxed),
            upstream_connect_failures: s.connect_failures.load(Ordering::Relaxed),
            resets: s.resets.load(Ordering::Relaxed),
            client_to_upstream: s.link(Direction::ClientToUpstream).stats(),
            upstream_to_client: s.link(Direction::UpstreamToClient).stats(),
        }
    }

    /// Whether a shutdown has been asked for.
    pub fn is_shut_down(&self) -> bool {
        self.shared.shutdown.is_cancelled()
    }

    fn begin_shutdown(&self) {
        self.shared.shutdown.cancel();
        self.shared.tracker.close();
    }

    /// Closes the listener and every connection (plain close, unsent bytes dropped)
    /// and waits, at most [`SHUTDOWN_BOUND`], for all tasks to end. Idempotent.
    pub async fn shutdown(&self) -> Result<(), WanemError> {
        self.begin_shutdown();
        tokio::time::timeout(SHUTDOWN_BOUND, self.shared.tracker.wait())
            .await
            .map_err(|_| WanemError::ShutdownTimedOut(SHUTDOWN_BOUND))
    }

    /// [`shutdown`](Self::shutdown) for plain (non-async) threads: blocks the calling
    /// thread at most [`SHUTDOWN_BOUND`]. Needs the runtime the emulator was started
    /// on to keep running on other threads (a multi-threaded runtime, or a
    /// current-thread one driven elsewhere); do not call it from inside an async task.
    pub fn shutdown_blocking(&self) -> Result<(), WanemError> {
        self.begin_shutdown();
        let (done_tx, done_rx) = std::sync::mpsc::sync_channel::<()>(1);
        let tracker = self.shared.tracker.clone();
        self.runtime.spawn(async move {
            tracker.wait().await;
            let _ = done_tx.send(());
        });
        match done_rx.recv_timeout(SHUTDOWN_BOUND) {
            // Disconnected: the runtime is gone, and every task with it.
            Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Ok(()),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                Err(WanemError::ShutdownTimedOut(SHUTDOWN_BOUND))
            }
        }
    }
}

impl Drop for WanemHandle {
    fn drop(&mut self) {
        self.begin_shutdown();
    }
}

/// Runs an emulator until `stop` completes, then shuts it down (bounded) and returns
/// the final counters. `on_ready` sees the handle once it listens (e.g. to print the
/// bound address, or to keep a way to steer it).
pub async fn run_until<F, R>(
    config: WanemConfig,
    stop: F,
    on_ready: R,
) -> Result<WanemStats, WanemError>
where
    F: Future<Output = ()>,
    R: FnOnce(&WanemHandle),
{
    let handle = Wanem::start(config).await?;
    on_ready(&handle);
    stop.await;
    handle.shutdown().await?;
    Ok(handle.stats())
}

/// The command-line entry point: builds a two-thread tokio runtime, runs the
/// emulator until Ctrl-C (SIGINT), then shuts it down and returns the counters.
/// Prints one line to stderr once listening: `wanem: listening on A, relaying to B`.
///
/// It installs tokio's SIGINT handler, so call it from a program that lets Rust own
/// Ctrl-C (a CLI subcommand), not from inside an existing tokio runtime.
pub fn run_blocking(config: WanemConfig) -> Result<WanemStats, WanemError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("pdd-wanem")
        .enable_all()
        .build()
        .map_err(WanemError::Runtime)?;
    runtime.block_on(async {
        let handle = Wanem::start(config).await?;
        eprintln!(
            "wanem: listening on {}, relaying to {}",
            handle.local_addr(),
            handle.upstream_addr()
        );
        let signal = tokio::signal::ctrl_c().await;
        handle.shutdown().await?;
        signal.map_err(WanemError::Signal)?;
        Ok(handle.stats())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_and_stats_cross_threads() {
        fn shareable<T: Send + Sync + 'static>() {}
        shareable::<WanemHandle>();
        shareable::<WanemStats>();
        shareable::<WanemError>();
    }

    #[tokio::test]
    async fn start_refuses_a_bad_config_and_reports_bind_errors() {
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut bad = WanemConfig::new(addr, addr);
        bad.client_to_upstream.rate_bps = Some(0);
        assert!(matches!(
            Wanem::start(bad).await,
            Err(WanemError::InvalidConfig(_))
        ));

        let first = Wanem::start(WanemConfig::new(addr, addr)).await.unwrap();
        let taken = WanemConfig::new(first.local_addr(), addr);
        let err = Wanem::start(taken).await.unwrap_err();
        assert!(matches!(err, WanemError::Bind { .. }), "{err}");
        assert!(err.to_string().contains(&first.local_addr().to_string()));
        first.shutdown().await.unwrap();
    }
}
