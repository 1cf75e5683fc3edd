//! One relayed connection: the upstream connect, and per direction a reader that
//! timestamps and paces chunks and a writer that releases them on time.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::time::{sleep_until, Instant};

use super::config::Direction;
use super::{Shared, FIN_LINGER};

/// How one connection is ended by its own control (`reset_connection`,
/// `close_connection`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnEnd {
    /// RST both sides.
    Reset,
    /// FIN both sides.
    Fin,
}

/// The controls of one connection, shared by its task and the handle.
#[derive(Debug)]
pub(crate) struct ConnControl {
    /// Per direction: `Some(t)` holds this connection's bytes until `t`.
    stall: [watch::Sender<Option<Instant>>; 2],
    /// Set once to end the connection.
    end: watch::Sender<Option<ConnEnd>>,
    /// Per direction: read and acknowledge this connection's bytes but deliver none
    /// (a middlebox that lost its way while TCP still acknowledges).
    swallow: [std::sync::atomic::AtomicBool; 2],
}

impl ConnControl {
    pub(crate) fn new() -> Self {
        ConnControl {
            stall: [watch::Sender::new(None), watch::Sender::new(None)],
            end: watch::Sender::new(None),
            swallow: Default::default(),
        }
    }

    pub(crate) fn swallow(&self, dir: Direction, on: bool) {
        self.swallow[dir.index()].store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn swallowing(&self, dir: Direction) -> bool {
        self.swallow[dir.index()].load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Asks the task to end the connection `how`; the first request wins. Returns
    /// true (the connection was live when asked).
    pub(crate) fn end(&self, how: ConnEnd) -> bool {
        self.end.send_if_modified(|end| {
            if end.is_none() {
                *end = Some(how);
                true
            } else {
                false
            }
        });
        true
    }

    pub(crate) fn stall(&self, dir: Direction, duration: Duration) {
        let until = if duration.is_zero() {
            None
        } else {
            Some(Instant::now() + duration)
        };
        self.stall[dir.index()].send_replace(until);
    }
}

/// Returns how the connection is to end, once its control asks.
async fn ended(end: &mut watch::Receiver<Option<ConnEnd>>) -> ConnEnd {
    let how = end.wait_for(Option::is_some).await.map(|how| *how);
    match how {
        Ok(how) => how.unwrap_or(ConnEnd::Reset),
        // The control lives as long as the task (it holds an Arc): never closed.
        Err(_) => std::future::pending().await,
    }
}

/// Largest single read. Big enough that an unshaped relay moves several Gbit/s with
/// one task per connection, small enough to keep the pacing of a capped line smooth.
const MAX_CHUNK: usize = 256 << 10;
/// Smallest read size a capped line uses (a few MSS).
const MIN_CHUNK: usize = 4 << 10;

/// What travels from a reader to its writer.
enum Item {
    Data { release: Instant, bytes: BytesMut },
    Eof { release: Instant },
}

/// How a connection ended.
enum Outcome {
    /// Both directions saw EOF and forwarded it.
    Done,
    /// A socket failed: pass it on as a reset to both ends.
    Failed,
    /// `reset_all` or `reset_connection` was called.
    Reset,
    /// `close_connection` was called.
    Fin,
    /// The emulator is shutting down.
    Shutdown,
}

/// SplitMix64 finaliser: turns (seed, connection, direction) into independent seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn stream_seed(seed: u64, conn_id: u64, dir: Direction, role: u64) -> u64 {
    mix(mix(mix(seed) ^ conn_id) ^ ((dir.index() as u64) << 8) ^ role)
}

/// Tunes a freshly created socket (before connect) to the configured buffer size.
fn tune(socket: &TcpSocket, buffer: Option<usize>) -> io::Result<()> {
    if let Some(n) = buffer {
        // `validate` bounds it to u32.
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        socket.set_send_buffer_size(n)?;
        socket.set_recv_buffer_size(n)?;
    }
    Ok(())
}

async fn connect(addr: SocketAddr, buffer: Option<usize>) -> io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    tune(&socket, buffer)?;
    let stream = socket.connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Closes a stream with a RST: `SO_LINGER` 0, then drop.
fn reset(stream: TcpStream) {
    // Errors here only mean the socket is already dead, which is what we want.
    let _ = stream.set_zero_linger();
    drop(stream);
}

/// Drives one accepted connection to its end.
pub(crate) async fn serve(
    shared: Arc<Shared>,
    conn_id: u64,
    control: Arc<ConnControl>,
    client: TcpStream,
    mut reset_rx: watch::Receiver<u64>,
) {
    let _ = client.set_nodelay(true);
    let mut end_rx = control.end.subscribe();
    if shared.blackholed() {
        sink(&shared, client, &mut reset_rx, &mut end_rx).await;
        return;
    }

    let connecting = tokio::time::timeout(
        shared.config.connect_timeout,
        connect(shared.config.upstream, shared.config.socket_buffer),
    );
    let upstream = tokio::select! {
        r = connecting => r,
        _ = reset_rx.changed() => {
            shared.resets.fetch_add(1, Ordering::Relaxed);
            reset(client);
            return;
        }
        how = ended(&mut end_rx) => {
            if how == ConnEnd::Reset {
                shared.resets.fetch_add(1, Ordering::Relaxed);
                reset(client);
            }
            // A FIN: dropping the client closes it gracefully.
            return;
        }
        () = shared.shutdown.cancelled() => return,
    };
    let mut upstream = match upstream {
        Ok(Ok(s)) => s,
        // Refused, unreachable or timed out: the client sees a reset, as it would if
        // the server were down behind a real line.
        _ => {
            shared.connect_failures.fetch_add(1, Ordering::Relaxed);
            reset(client);
            return;
        }
    };
    let mut client = client;

    let outcome = {
        let (client_rd, client_wr) = client.split();
        let (upstream_rd, upstream_wr) = upstream.split();
        let c2u = relay(
            &shared,
            &control,
            Direction::ClientToUpstream,
            conn_id,
            client_rd,
            upstream_wr,
        );
        let u2c = relay(
            &shared,
            &control,
            Direction::UpstreamToClient,
            conn_id,
            upstream_rd,
            client_wr,
        );
        tokio::select! {
            r = async { tokio::try_join!(c2u, u2c) } => match r {
                Ok(_) => Outcome::Done,
                Err(_) => Outcome::Failed,
            },
            _ = reset_rx.changed() => Outcome::Reset,
            how = ended(&mut end_rx) => match how {
                ConnEnd::Reset => Outcome::Reset,
                ConnEnd::Fin => Outcome::Fin,
            },
            () = shared.shutdown.cancelled() => Outcome::Shutdown,
        }
    };
    match outcome {
        Outcome::Done | Outcome::Shutdown => {}
        Outcome::Fin => {
            let _ = client.shutdown().await;
            let _ = upstream.shutdown().await;
            // Read and drop what the ends still send until they close their side, so
            // that the close that follows is a FIN, not a RST for unread data.
            let drain = async {
                let (mut a, mut b) = (vec![0u8; 16 << 10], vec![0u8; 16 << 10]);
                tokio::join!(discard(&mut client, &mut a), discard(&mut upstream, &mut b));
            };
            tokio::select! {
                _ = tokio::time::timeout(FIN_LINGER, drain) => {}
                () = shared.shutdown.cancelled() => {}
            }
        }
        Outcome::Reset => {
            shared.resets.fetch_add(1, Ordering::Relaxed);
            reset(client);
            reset(upstream);
        }
        Outcome::Failed => {
            reset(client);
            reset(upstream);
        }
    }
}

/// Reads and drops until EOF or an error.
async fn discard(stream: &mut TcpStream, buf: &mut [u8]) {
    while let Ok(n) = stream.read(buf).await {
        if n == 0 {
            return;
        }
    }
}

/// A connection accepted while the blackhole is on: never connected upstream, every
/// byte read and dropped, until the client leaves, a reset or the shutdown.
async fn sink(
    shared: &Shared,
    mut client: TcpStream,
    reset_rx: &mut watch::Receiver<u64>,
    end_rx: &mut watch::Receiver<Option<ConnEnd>>,
) {
    let link = shared.link(Direction::ClientToUpstream);
    let mut buf = vec![0u8; 64 << 10];
    let drain = async {
        loop {
            match client.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    link.count_received(n);
                    link.count_blackholed(n);
                }
            }
        }
    };
    let was_reset = tokio::select! {
        () = drain => false,
        _ = reset_rx.changed() => true,
        how = ended(end_rx) => how == ConnEnd::Reset,
        () = shared.shutdown.cancelled() => false,
    };
    if was_reset {
        shared.resets.fetch_add(1, Ordering::Relaxed);
        reset(client);
    }
}

/// One direction of one connection: `src` -> link -> `dst`, ending after the EOF has
/// been passed on (as a write shutdown, after the same delay as the data).
async fn relay<R, W>(
    shared: &Shared,
    control: &ConnControl,
    dir: Direction,
    conn_id: u64,
    mut src: R,
    mut dst: W,
) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let link = shared.link(dir);
    let in_flight = shared.config.in_flight(dir);
    // Bytes in flight, as permits: the reader takes them before reading, the writer
    // gives them back once the bytes are in the receiving socket.
    let budget = Semaphore::new(in_flight);
    let (tx, mut rx) = mpsc::unbounded_channel::<Item>();
    let seed = shared.config.seed;

    let reader = async {
        let mut rng = StdRng::seed_from_u64(stream_seed(seed, conn_id, dir, 1));
        let mut last_release = Instant::now();
        let mut buf = BytesMut::new();
        loop {
            let profile = link.profile();
            let want = chunk_size(profile.rate_bps, in_flight);
            // `want <= in_flight <= MAX_IN_FLIGHT` fits u32; the semaphore is never closed.
            let permit = budget
                .acquire_many(want as u32)
                .await
                .map_err(io::Error::other)?;
            buf.reserve(want);
            let n = (&mut src).take(want as u64).read_buf(&mut buf).await?;
            let arrival = Instant::now();
            permit.forget();
            budget.add_permits(want - n);
            // Queue the chunk without pinning more memory than about twice its size:
            // a big read keeps its buffer, a small one is copied out and the read
            // buffer reused. So the memory held stays within ~2x the in-flight limit.
            let bytes = if n * 2 >= buf.capacity() {
                buf.split()
            } else {
                let small = BytesMut::from(&buf[..]);
                buf.clear();
                small
            };
            let profile = link.profile();
            if n == 0 {
                let release = (arrival + profile.sample_delay(&mut rng)).max(last_release);
                let _ = tx.send(Item::Eof { release });
                return Ok::<(), io::Error>(());
            }
            link.count_received(n);
            if shared.blackholed() || control.swallowing(dir) {
                link.count_blackholed(n);
                budget.add_permits(n);
                continue;
            }
            let departed = link.reserve(n, arrival, profile.rate_bps);
            let release =
                (departed.max(arrival) + profile.sample_delay(&mut rng)).max(last_release);
            last_release = release;
            if tx.send(Item::Data { release, bytes }).is_err() {
                return Ok(());
            }
            // Pace the reader at the line rate so the queue in front of the
            // bottleneck stays in the sender's socket buffer, where TCP sees it.
            if departed > Instant::now() {
                sleep_until(departed).await;
            }
        }
    };

    let writer = async {
        let mut rng = StdRng::seed_from_u64(stream_seed(seed, conn_id, dir, 2));
        let mut stall = link.subscribe_stall();
        let mut conn_stall = control.stall[dir.index()].subscribe();
        while let Some(item) = rx.recv().await {
            let release = match &item {
                Item::Data { release, .. } | Item::Eof { release } => *release,
            };
            if release > Instant::now() {
                sleep_until(release).await;
            }
            // The line's stall and this connection's, until neither holds.
            loop {
                wait_out_stall(&mut stall).await;
                wait_out_stall(&mut conn_stall).await;
                if !stalled(&stall) {
                    break;
                }
            }
            match item {
                Item::Eof { .. } => {
                    // Held while the blackhole is on, like a FIN TCP keeps resending.
                    let mut blackhole = shared.blackhole.subscribe();
                    if blackhole.wait_for(|on| !on).await.is_err() {
                        return Ok(());
                    }
                    dst.shutdown().await?;
                    return Ok(());
                }
                Item::Data { mut bytes, .. } => {
                    let n = bytes.len();
                    if shared.blackholed() {
                        link.count_blackholed(n);
                    } else {
                        if link.take_corruption() {
                            let at = rng.random_range(0..n);
                            bytes[at] ^= 0xFF;
                            link.count_corrupted();
                        }
                        // Counted before the write: once the peer can read the bytes,
                        // stats() must already include them (a reader that checks
                        // stats right after receiving would otherwise race the count).
                        link.count_delivered(n);
                        dst.write_all(&bytes).await?;
                    }
                    budget.add_permits(n);
                }
            }
        }
        Ok(())
    };

    tokio::try_join!(reader, writer).map(|_| ())
}

/// The read size for a line at `rate_bps`: about 1 ms of line time, within
/// [`MIN_CHUNK`]..=[`MAX_CHUNK`], never above the in-flight limit.
fn chunk_size(rate_bps: Option<u64>, in_flight: usize) -> usize {
    let by_rate = match rate_bps {
        None => MAX_CHUNK,
        Some(r) => usize::try_from(r / 8 / 1000)
            .unwrap_or(MAX_CHUNK)
            .clamp(MIN_CHUNK, MAX_CHUNK),
    };
    by_rate.min(in_flight).max(1)
}

/// Whether a stall is in force now.
fn stalled(stall: &watch::Receiver<Option<Instant>>) -> bool {
    matches!(*stall.borrow(), Some(t) if t > Instant::now())
}

/// Returns once no stall is in force (a stall set or extended meanwhile is honoured).
async fn wait_out_stall(stall: &mut watch::Receiver<Option<Instant>>) {
    loop {
        let until = *stall.borrow_and_update();
        match until {
            Some(t) if t > Instant::now() => {
                tokio::select! {
                    () = sleep_until(t) => {}
                    r = stall.changed() => {
                        if r.is_err() {
                            return;
                        }
                    }
                }
            }
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes() {
        assert_eq!(chunk_size(None, 32 << 20), MAX_CHUNK);
        assert_eq!(chunk_size(None, 8 << 10), 8 << 10);
        // 1 Mbit/s: 125 B per ms, floored at MIN_CHUNK.
        assert_eq!(chunk_size(Some(1_000_000), 1 << 20), MIN_CHUNK);
        // 1 Gbit/s: 125 kB per ms.
        assert_eq!(chunk_size(Some(1_000_000_000), 1 << 20), 125_000);
    }

    #[test]
    fn seeds_differ_per_connection_and_direction() {
        let a = stream_seed(1, 0, Direction::ClientToUpstream, 1);
        let b = stream_seed(1, 1, Direction::ClientToUpstream, 1);
        let c = stream_seed(1, 0, Direction::UpstreamToClient, 1);
        let d = stream_seed(1, 0, Direction::ClientToUpstream, 2);
        assert!(a != b && a != c && a != d && b != c);
        assert_eq!(a, stream_seed(1, 0, Direction::ClientToUpstream, 1));
    }
}
