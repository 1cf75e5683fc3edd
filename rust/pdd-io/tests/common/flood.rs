//! A flood of connections that never finish their opening, from several loopback
//! sources (client sockets bound to 127.0.0.x), kept up for as long as the test
//! wants it: every `REFRESH` the flood reopens whatever the acceptor closed. Its
//! connections stay idle (no bytes), stop inside a HELLO header, or send a whole
//! HELLO and never answer the AUTH challenge, in turn. Included with `#[path]` by
//! the tests that need it.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdd_core::wire::handshake::LocalHello;
use pdd_core::wire::{capability, Frame, Role};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;

/// How often the flood reopens what was closed ("every few seconds" is the threat;
/// this is faster).
pub const REFRESH: Duration = Duration::from_millis(250);
/// The longest a flood runs, whatever the test does.
pub const MAX_RUN: Duration = Duration::from_secs(60);

type Conns = Arc<tokio::sync::Mutex<Vec<(Ipv4Addr, usize, Option<TcpStream>)>>>;

/// A running flood.
pub struct Flood {
    stop: CancellationToken,
    conns: Conns,
    /// Flood connections opened in all (reopenings included).
    opened: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

async fn connect_from(source: Ipv4Addr, to: SocketAddr) -> Option<TcpStream> {
    let socket = TcpSocket::new_v4().ok()?;
    socket.bind(SocketAddr::new(source.into(), 0)).ok()?;
    tokio::time::timeout(Duration::from_secs(1), socket.connect(to))
        .await
        .ok()?
        .ok()
}

/// What connection number `n` sends before it stalls.
fn opening_bytes(n: usize, role: Role) -> Vec<u8> {
    match n % 3 {
        0 => Vec::new(),
        1 => b"PD\x01\x01\x00\x00".to_vec(),
        _ => {
            let offer = LocalHello::new(role, capability::ALL_KNOWN).offer(
                1000 + n as u64,
                0,
                rand::random(),
                false,
            );
            pdd_core::wire::encode_frame_to_vec(&Frame::Hello(offer), 1 << 20).unwrap()
        }
    }
}

async fn open_one(source: Ipv4Addr, to: SocketAddr, n: usize, role: Role) -> Option<TcpStream> {
    let mut s = connect_from(source, to).await?;
    let bytes = opening_bytes(n, role);
    if !bytes.is_empty() {
        let _ = s.write_all(&bytes).await;
    }
    Some(s)
}

/// Whether the acceptor closed `s` (EOF or reset); what it sent is discarded.
fn closed_by_peer(s: &TcpStream) -> bool {
    let mut sink = [0u8; 4096];
    loop {
        match s.try_read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => return true,
        }
    }
}

impl Flood {
    /// Open `per_source` connections from each of `sources` to `to` (a HELLO in
    /// some of them says `role`), and keep them open until stopped.
    pub async fn start(
        to: SocketAddr,
        sources: &[Ipv4Addr],
        per_source: usize,
        role: Role,
    ) -> Flood {
        let stop = CancellationToken::new();
        let opened = Arc::new(AtomicUsize::new(0));
        let mut first = Vec::new();
        for &source in sources {
            for _ in 0..per_source {
                let n = first.len();
                first.push((source, n, open_one(source, to, n, role).await));
                opened.fetch_add(1, Ordering::Relaxed);
            }
        }
        let conns: Conns = Arc::new(tokio::sync::Mutex::new(first));
        let task = {
            let (stop, conns, opened) = (stop.clone(), conns.clone(), opened.clone());
            tokio::spawn(async move {
                let started = Instant::now();
                while !stop.is_cancelled() && started.elapsed() < MAX_RUN {
                    for (source, n, conn) in conns.lock().await.iter_mut() {
                        if conn.as_ref().is_some_and(closed_by_peer) {
                            *conn = None;
                        }
                        if conn.is_none() {
                            *conn = open_one(*source, to, *n, role).await;
                            opened.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(REFRESH) => {}
                    }
                }
            })
        };
        Flood {
            stop,
            conns,
            opened,
            task,
        }
    }

    /// Flood connections opened so far (reopenings included).
    pub fn opened(&self) -> usize {
        self.opened.load(Ordering::Relaxed)
    }

    /// Hold the reopening, let the acceptor at `at` settle for `settle`, and count
    /// the flood's connections it still holds open, and every socket it holds
    /// ([`established_at`]); the flood resumes after.
    pub async fn settle(&self, settle: Duration, at: SocketAddr) -> (usize, usize) {
        let mut conns = self.conns.lock().await;
        tokio::time::sleep(settle).await;
        let mut held = 0;
        for (_, _, conn) in conns.iter_mut() {
            if conn.as_ref().is_some_and(closed_by_peer) {
                *conn = None;
            }
            held += usize::from(conn.is_some());
        }
        (held, established_at(at))
    }

    /// Stop the flood and close its connections.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.task).await;
    }
}

/// Sockets in ESTABLISHED state whose local end is `addr` (an acceptor's side of its
/// connections, from /proc/net/tcp): what it holds open, whatever its bookkeeping
/// says. Connections the kernel completed but the acceptor has not accepted yet
/// count too.
pub fn established_at(addr: SocketAddr) -> usize {
    let SocketAddr::V4(v4) = addr else {
        panic!("IPv4 only")
    };
    let want = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(v4.ip().octets()),
        v4.port()
    );
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    table
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[1] == want && f[3] == "01"
        })
        .count()
}
