//! Behaviour of the WAN emulator proxy, on loopback. Timing checks assert lower
//! bounds strictly (they follow from the design) and upper bounds only loosely.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdd_io::wanem::{
    run_until, Direction, Jitter, LinkProfile, Wanem, WanemConfig, WanemHandle, WanemStats,
};
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout, Instant};

const C2U: Direction = Direction::ClientToUpstream;
const U2C: Direction = Direction::UpstreamToClient;

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Fails the test instead of hanging it.
async fn bounded<F: std::future::Future>(secs: u64, what: &str, fut: F) -> F::Output {
    match timeout(Duration::from_secs(secs), fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: not done within {secs} s"),
    }
}

fn payload(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// FNV-1a, enough to name a payload in a failure message.
fn checksum(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// An upstream that echoes every connection; counts the connections it accepted.
async fn echo_server() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&accepted);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    (addr, accepted)
}

async fn start(config: WanemConfig) -> WanemHandle {
    let wan = Wanem::start(config).await.expect("wanem starts");
    assert_ne!(wan.local_addr().port(), 0, "port 0 resolves to a real port");
    wan
}

/// Sends `msg`, reads it back, returns the round-trip time.
async fn ping(stream: &mut TcpStream, msg: &[u8]) -> Duration {
    let t0 = Instant::now();
    stream.write_all(msg).await.unwrap();
    let mut back = vec![0u8; msg.len()];
    stream.read_exact(&mut back).await.unwrap();
    assert_eq!(back, msg);
    t0.elapsed()
}

/// Polls `cond` on the stats until it holds (or panics after `secs`).
async fn stats_until(wan: &WanemHandle, secs: u64, cond: impl Fn(&WanemStats) -> bool) {
    bounded(secs, "stats condition", async {
        while !cond(&wan.stats()) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
}

fn is_reset_or_eof(r: &std::io::Result<usize>) -> bool {
    match r {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => matches!(
            e.kind(),
            ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_pass_unchanged_both_ways() {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let mut config =
        WanemConfig::new(any_port(), listener.local_addr().unwrap()).symmetric(LinkProfile {
            delay: Duration::from_millis(1),
            jitter: Jitter::Uniform(Duration::from_millis(1)),
            rate_bps: None,
        });
    // A small buffer, so the relay goes through many full/empty cycles.
    config.max_in_flight = Some(256 << 10);
    let wan = start(config).await;

    let up = payload(1, 8 << 20);
    let down = payload(2, 6 << 20);
    let (up_ck, down_ck) = (checksum(&up), checksum(&down));

    let server = {
        let down = down.clone();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let (mut r, mut w) = s.split();
            let mut got = Vec::new();
            let send = async {
                w.write_all(&down).await.unwrap();
                w.shutdown().await.unwrap();
            };
            let (_, n) = tokio::join!(send, r.read_to_end(&mut got));
            n.unwrap();
            got
        })
    };
    let mut client = TcpStream::connect(wan.local_addr()).await.unwrap();
    let (mut r, mut w) = client.split();
    let mut got_down = Vec::new();
    let send = async {
        w.write_all(&up).await.unwrap();
        w.shutdown().await.unwrap();
    };
    bounded(20, "transfer", async {
        let (_, n) = tokio::join!(send, r.read_to_end(&mut got_down));
        n.unwrap();
    })
    .await;
    let got_up = bounded(5, "server", server).await.unwrap();

    assert_eq!(got_up.len(), up.len());
    assert_eq!(checksum(&got_up), up_ck);
    assert!(got_up == up);
    assert_eq!(got_down.len(), down.len());
    assert_eq!(checksum(&got_down), down_ck);
    assert!(got_down == down);

    let stats = wan.stats();
    assert_eq!(stats.connections_accepted, 1);
    assert_eq!(stats.client_to_upstream.bytes_delivered, up.len() as u64);
    assert_eq!(stats.upstream_to_client.bytes_delivered, down.len() as u64);
    assert_eq!(stats.client_to_upstream.chunks_corrupted, 0);
    wan.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_adds_to_the_round_trip_and_can_change_at_run_time() {
    let (echo, _) = echo_server().await;
    let delay = Duration::from_millis(20);
    let wan =
        start(WanemConfig::new(any_port(), echo).symmetric(LinkProfile::with_delay(delay))).await;
    let mut client = TcpStream::connect(wan.local_addr()).await.unwrap();
    client.set_nodelay(true).unwrap();

    let mut rtts = Vec::new();
    for i in 0..6u8 {
        rtts.push(bounded(5, "ping", ping(&mut client, &[i; 16])).await);
    }
    rtts.sort();
    for rtt in &rtts {
        assert!(
            *rtt >= 2 * delay,
            "rtt {rtt:?} below twice the one-way delay"
        );
    }
    let median = rtts[rtts.len() / 2];
    assert!(
        median < 2 * delay + Duration::from_millis(500),
        "median {median:?}"
    );

    // Longer delay on one direction only, at run time.
    let longer = Duration::from_millis(60);
    wan.set_profile(U2C, LinkProfile::with_delay(longer))
        .unwrap();
    assert_eq!(wan.profile(U2C).delay, longer);
    assert_eq!(wan.profile(C2U).delay, delay);
    for i in 0..3u8 {
        let rtt = bounded(5, "ping", ping(&mut client, &[i; 16])).await;
        assert!(rtt >= delay + longer, "rtt {rtt:?} after the change");
    }

    // A zero rate is refused and leaves the profile alone.
    let bad = LinkProfile {
        rate_bps: Some(0),
        ..LinkProfile::UNSHAPED
    };
    assert!(wan.set_profile(C2U, bad).is_err());
    assert_eq!(wan.profile(C2U).delay, delay);
    wan.shutdown().await.unwrap();
}

/// Sends `bytes` over each of `conns` connections at once, returns the time until the
/// upstream had read everything.
async fn timed_upload(
    wan: &WanemHandle,
    listener: &TcpListener,
    conns: usize,
    bytes: usize,
) -> Duration {
    let mut clients = Vec::new();
    let mut servers = Vec::new();
    for _ in 0..conns {
        clients.push(TcpStream::connect(wan.local_addr()).await.unwrap());
        servers.push(listener.accept().await.unwrap().0);
    }
    let t0 = Instant::now();
    let readers: Vec<_> = servers
        .into_iter()
        .map(|mut s| {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                let mut total = 0;
                while total < bytes {
                    let n = s.read(&mut buf).await.unwrap();
                    assert!(n > 0, "early EOF");
                    total += n;
                }
            })
        })
        .collect();
    for mut c in clients {
        tokio::spawn(async move {
            c.write_all(&vec![7u8; bytes]).await.unwrap();
            // Keep the connection open until the reader is done.
            let mut b = [0u8; 1];
            let _ = c.read(&mut b).await;
        });
    }
    for r in readers {
        r.await.unwrap();
    }
    t0.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_cap_holds_and_is_shared_by_connections() {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let rate: u64 = 80_000_000; // 10 MB/s
    let mut config = WanemConfig::new(any_port(), listener.local_addr().unwrap());
    config.client_to_upstream.rate_bps = Some(rate);
    let wan = start(config).await;
    let total = 2_500_000usize;
    let line_time = Duration::from_secs_f64(total as f64 * 8.0 / rate as f64);
    // The token bucket may let its 2 ms depth out at once.
    let floor = line_time - Duration::from_millis(2);

    let one = bounded(
        10,
        "one connection",
        timed_upload(&wan, &listener, 1, total),
    )
    .await;
    assert!(one >= floor, "1 connection: {one:?} < {floor:?}");
    assert!(one < line_time * 10, "1 connection: {one:?}");

    // Four connections share the same line: together no faster than one.
    let four = bounded(
        10,
        "four connections",
        timed_upload(&wan, &listener, 4, total / 4),
    )
    .await;
    assert!(four >= floor, "4 connections: {four:?} < {floor:?}");
    assert!(four < line_time * 10, "4 connections: {four:?}");
    wan.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jitter_never_reorders_a_stream() {
    for jitter in [
        Jitter::Uniform(Duration::from_millis(5)),
        Jitter::Normal(Duration::from_millis(3)),
    ] {
        let listener = TcpListener::bind(any_port()).await.unwrap();
        let mut config = WanemConfig::new(any_port(), listener.local_addr().unwrap());
        config.client_to_upstream = LinkProfile {
            delay: Duration::from_millis(5),
            jitter,
            rate_bps: None,
        };
        config.seed = 42;
        let wan = start(config).await;
        let mut client = TcpStream::connect(wan.local_addr()).await.unwrap();
        client.set_nodelay(true).unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        const COUNT: u32 = 3000;
        let sender = tokio::spawn(async move {
            for i in 0..COUNT {
                client.write_all(&i.to_be_bytes()).await.unwrap();
                if i % 100 == 99 {
                    // Gaps, so the relay sees many separate chunks.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            client.shutdown().await.unwrap();
            client
        });
        bounded(10, "sequence", async {
            let mut buf = Vec::new();
            server.read_to_end(&mut buf).await.unwrap();
            assert_eq!(buf.len(), COUNT as usize * 4);
            for (expect, word) in buf.chunks_exact(4).enumerate() {
                let got = u32::from_be_bytes(word.try_into().unwrap());
                assert_eq!(got, expect as u32, "out of order under {jitter:?}");
            }
        })
        .await;
        sender.await.unwrap();
        wan.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stall_holds_bytes_for_its_duration() {
    let (echo, _) = echo_server().await;
    let wan = start(WanemConfig::new(any_port(), echo)).await;
    let mut client = TcpStream::connect(wan.local_addr()).await.unwrap();
    bounded(5, "warm-up ping", ping(&mut client, b"warm")).await;

    let hold = Duration::from_millis(300);
    let t0 = Instant::now();
    wan.stall(C2U, hold);
    bounded(5, "stalled ping", ping(&mut client, b"held")).await;
    let held = t0.elapsed();
    assert!(held >= hold, "released after {held:?}");

    // A long stall, lifted early with a zero duration.
    wan.stall(U2C, Duration::from_secs(30));
    let pinger = ping(&mut client, b"lift");
    tokio::pin!(pinger);
    // Not through while stalled...
    assert!(timeout(Duration::from_millis(200), &mut pinger)
        .await
        .is_err());
    wan.stall(U2C, Duration::ZERO);
    // ...and through once lifted, long before the 30 s.
    bounded(5, "lifted ping", pinger).await;
    wan.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_all_resets_both_ends_promptly() {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let wan = start(WanemConfig::new(any_port(), listener.local_addr().unwrap())).await;
    let mut client = TcpStream::connect(wan.local_addr()).await.unwrap();
    let (mut server, _) = listener.accept().await.unwrap();
    client.write_all(b"hello").await.unwrap();
    let mut buf = [0u8; 5];
    bounded(5, "relay", server.read_exact(&mut buf))
        .await
        .unwrap();

    wan.reset_all();
    let mut b = [0u8; 16];
    let c = bounded(2, "client sees the reset", client.read(&mut b)).await;
    let s = bounded(2, "server sees the reset", server.read(&mut b)).await;
    assert!(is_reset_or_eof(&c), "client got {c:?}");
    assert!(is_reset_or_eof(&s), "server got {s:?}");
    // SO_LINGER 0 means a real RST, not a FIN.
    assert_eq!(c.unwrap_err().kind(), ErrorKind::ConnectionReset);
    assert_eq!(s.unwrap_err().kind(), ErrorKind::ConnectionReset);
    stats_until(&wan, 2, |s| s.resets == 1 && s.connections_active == 0).await;

    // Connections made afterwards are not affected.
    let mut again = TcpStream::connect(wan.local_addr()).await.unwrap();
    let (mut server2, _) = listener.accept().await.unwrap();
    again.write_all(b"again").await.unwrap();
    bounded(5, "relay after reset", server2.read_exact(&mut buf))
        .await
        .unwrap();
    assert_eq!(&buf, b"again");
    wan.shutdown().await.unwrap();
}

/// Three connections through one emulator, each with its accepted upstream side.
async fn three_connections(
    wan: &WanemHandle,
    listener: &TcpListener,
) -> Vec<(TcpStream, TcpStream)> {
    let mut pairs = Vec::new();
    for _ in 0..3 {
        let client = TcpStream::connect(wan.local_addr()).await.unwrap();
        let (server, _) = bounded(5, "upstream accept", listener.accept())
            .await
            .unwrap();
        pairs.push((client, server));
    }
    pairs
}

/// `client` writes `msg`, `server` reads it back whole within `secs`.
async fn relayed(client: &mut TcpStream, server: &mut TcpStream, msg: &[u8], secs: u64) {
    client.write_all(msg).await.unwrap();
    let mut got = vec![0u8; msg.len()];
    bounded(secs, "relay", server.read_exact(&mut got))
        .await
        .unwrap();
    assert_eq!(got, msg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_can_be_reset_closed_or_stalled_alone() {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let wan = start(WanemConfig::new(any_port(), listener.local_addr().unwrap())).await;
    assert!(wan.connections().is_empty());
    let mut pairs = three_connections(&wan, &listener).await;
    assert_eq!(wan.connections(), vec![0, 1, 2], "accept order");
    assert!(!wan.reset_connection(7) && !wan.close_connection(7));
    assert!(!wan.stall_connection(7, C2U, Duration::from_secs(1)));

    // Stall connection 1 only: its bytes are held, the others flow.
    assert!(wan.stall_connection(1, C2U, Duration::from_secs(30)));
    let (c1, s1) = &mut pairs[1];
    c1.write_all(b"held").await.unwrap();
    let mut b = [0u8; 4];
    assert!(timeout(Duration::from_millis(300), s1.read_exact(&mut b))
        .await
        .is_err());
    for i in [0, 2] {
        let (c, s) = &mut pairs[i];
        relayed(c, s, b"flows", 5).await;
    }
    // The other direction of the stalled connection is not held.
    let (c1, s1) = &mut pairs[1];
    relayed(s1, c1, b"back", 5).await;
    // Lifted: what was held arrives, nothing lost.
    assert!(wan.stall_connection(1, C2U, Duration::ZERO));
    bounded(5, "held bytes after the lift", s1.read_exact(&mut b))
        .await
        .unwrap();
    assert_eq!(&b, b"held");

    // A RST of connection 0 only.
    assert!(wan.reset_connection(0));
    let (c0, s0) = &mut pairs[0];
    let mut buf = [0u8; 16];
    let c = bounded(2, "client 0 sees the reset", c0.read(&mut buf)).await;
    let s = bounded(2, "server 0 sees the reset", s0.read(&mut buf)).await;
    assert_eq!(c.unwrap_err().kind(), ErrorKind::ConnectionReset);
    assert_eq!(s.unwrap_err().kind(), ErrorKind::ConnectionReset);
    stats_until(&wan, 2, |s| s.resets == 1 && s.connections_active == 2).await;
    assert_eq!(wan.connections(), vec![1, 2]);

    // A FIN of connection 2 only: both ends read EOF, not a reset.
    assert!(wan.close_connection(2));
    let (c2, s2) = &mut pairs[2];
    let c = bounded(2, "client 2 sees the FIN", c2.read(&mut buf)).await;
    let s = bounded(2, "server 2 sees the FIN", s2.read(&mut buf)).await;
    assert_eq!(c.unwrap(), 0);
    assert_eq!(s.unwrap(), 0);
    c2.shutdown().await.unwrap();
    s2.shutdown().await.unwrap();
    stats_until(&wan, 4, |s| s.connections_active == 1).await;
    assert_eq!(wan.connections(), vec![1]);
    assert_eq!(wan.stats().resets, 1, "a FIN is not a reset");

    // Connection 1 still works both ways, and new connections get new numbers.
    let (c1, s1) = &mut pairs[1];
    relayed(c1, s1, b"still", 5).await;
    let _c3 = TcpStream::connect(wan.local_addr()).await.unwrap();
    let (_s3, _) = bounded(5, "upstream accept", listener.accept())
        .await
        .unwrap();
    stats_until(&wan, 2, |s| s.connections_accepted == 4).await;
    assert_eq!(wan.connections(), vec![1, 3]);
    wan.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_next_changes_exactly_one_byte() {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let wan = start(WanemConfig::new(any_port(), listener.local_addr().unwrap())).await;
    let mut client = TcpStream::connect(wan.local_addr()).await.unwrap();
    let (mut server, _) = listener.accept().await.unwrap();

    let data = payload(3, 64 << 10);
    wan.corrupt_next(C2U);
    client.write_all(&data).await.unwrap();
    let mut got = vec![0u8; data.len()];
    bounded(5, "corrupted payload", server.read_exact(&mut got))
        .await
        .unwrap();
    let diffs = data.iter().zip(&got).filter(|(a, b)| a != b).count();
    assert_eq!(diffs, 1, "exactly one byte differs");

    // The next payload, and the other direction, are clean.
    client.write_all(&data).await.unwrap();
    bounded(5, "clean payload", server.read_exact(&mut got))
        .await
        .unwrap();
    assert!(got == data);
    server.write_all(&data).await.unwrap();
    bounded(5, "clean reply", client.read_exact(&mut got))
        .await
        .unwrap();
    assert!(got == data);

    let stats = wan.stats();
    assert_eq!(stats.client_to_upstream.chunks_corrupted, 1);
    assert_eq!(stats.upstream_to_client.chunks_corrupted, 0);
    wan.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blackhole_swallows_data_and_hangs_new_connections() {
    let (echo, upstream_accepts) = echo_server().await;
    let wan = start(WanemConfig::new(any_port(), echo)).await;
    let mut old = TcpStream::connect(wan.local_addr()).await.unwrap();
    bounded(5, "ping", ping(&mut old, b"before")).await;
    assert_eq!(upstream_accepts.load(Ordering::SeqCst), 1);

    wan.blackhole(true);
    assert!(wan.is_blackholed());
    old.write_all(b"swallowed").await.unwrap();
    // A new connection is accepted but goes nowhere.
    let mut new = bounded(5, "connect", TcpStream::connect(wan.local_addr()))
        .await
        .unwrap();
    new.write_all(b"into the void").await.unwrap();
    let mut b = [0u8; 64];
    assert!(timeout(Duration::from_millis(300), old.read(&mut b))
        .await
        .is_err());
    assert!(timeout(Duration::from_millis(50), new.read(&mut b))
        .await
        .is_err());
    assert_eq!(
        upstream_accepts.load(Ordering::SeqCst),
        1,
        "no upstream connect"
    );
    stats_until(&wan, 2, |s| {
        s.client_to_upstream.bytes_blackholed
            == (b"swallowed".len() + b"into the void".len()) as u64
    })
    .await;

    // Lifted: the old connection forwards new bytes again (the swallowed ones are gone).
    wan.blackhole(false);
    bounded(5, "ping after", ping(&mut old, b"after")).await;
    assert_eq!(wan.stats().connections_accepted, 2);

    // A FIN that meets the blackhole is held (TCP would resend it), not lost: the
    // echo server only closes its side, and so our read only ends, after the lift.
    wan.blackhole(true);
    old.shutdown().await.unwrap();
    assert!(timeout(Duration::from_millis(300), old.read(&mut b))
        .await
        .is_err());
    wan.blackhole(false);
    let eof = bounded(5, "EOF after the lift", old.read(&mut b)).await;
    assert_eq!(eof.unwrap(), 0);
    wan.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_is_bounded_when_the_receiver_is_slow() {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let limit = 256 << 10;
    let mut config = WanemConfig::new(any_port(), listener.local_addr().unwrap());
    config.max_in_flight = Some(limit);
    let wan = start(config).await;
    let mut client = TcpStream::connect(wan.local_addr()).await.unwrap();
    let (server, _) = listener.accept().await.unwrap(); // never reads

    // Write until the sender is blocked for a while: backpressure reached it.
    let chunk = vec![1u8; 64 << 10];
    let mut written = 0usize;
    while let Ok(r) = timeout(Duration::from_millis(300), client.write_all(&chunk)).await {
        r.unwrap();
        written += chunk.len();
        assert!(written < 512 << 20, "the sender was never pushed back");
    }
    let s = wan.stats().client_to_upstream;
    let held = s.bytes_received - s.bytes_delivered;
    assert!(
        held <= limit as u64,
        "proxy holds {held} bytes, limit {limit}"
    );
    assert!(s.bytes_received <= written as u64 + chunk.len() as u64);
    drop(server);
    wan.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_upstream_resets_the_client() {
    // A port that was just free: nothing listens there.
    let dead = TcpListener::bind(any_port())
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let wan = start(WanemConfig::new(any_port(), dead)).await;
    // The reset can be so quick that it is the connect that reports it.
    match TcpStream::connect(wan.local_addr()).await {
        Ok(mut client) => {
            let mut b = [0u8; 8];
            let r = bounded(5, "client sees the failure", client.read(&mut b)).await;
            assert!(is_reset_or_eof(&r), "got {r:?}");
        }
        Err(e) => assert_eq!(e.kind(), ErrorKind::ConnectionReset),
    }
    stats_until(&wan, 2, |s| s.upstream_connect_failures == 1).await;
    wan.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_and_closes_everything() {
    let (echo, _) = echo_server().await;
    let wan = start(WanemConfig::new(any_port(), echo)).await;
    // One connection with bytes held by a long stall, one idle, one in the blackhole.
    let mut busy = TcpStream::connect(wan.local_addr()).await.unwrap();
    let mut idle = TcpStream::connect(wan.local_addr()).await.unwrap();
    bounded(5, "ping", ping(&mut idle, b"x")).await;
    wan.stall(U2C, Duration::from_secs(60));
    busy.write_all(&[5u8; 100_000]).await.unwrap();
    wan.blackhole(true);
    let mut hung = TcpStream::connect(wan.local_addr()).await.unwrap();
    stats_until(&wan, 2, |s| s.connections_active == 3).await;

    let t0 = Instant::now();
    wan.shutdown().await.expect("shutdown within its bound");
    assert!(t0.elapsed() < pdd_io::wanem::SHUTDOWN_BOUND);
    assert_eq!(wan.stats().connections_active, 0);
    assert!(wan.is_shut_down());

    let mut b = vec![0u8; 200_000];
    for s in [&mut busy, &mut idle, &mut hung] {
        let r = bounded(2, "closed", async {
            loop {
                match s.read(&mut b).await {
                    Ok(0) => return Ok(0),
                    Ok(_) => continue,
                    Err(e) => return Err(e),
                }
            }
        })
        .await;
        assert!(is_reset_or_eof(&r), "got {r:?}");
    }
    assert!(
        TcpStream::connect(wan.local_addr()).await.is_err(),
        "listener closed"
    );
    // Idempotent.
    wan.shutdown().await.unwrap();
}

#[test]
fn the_handle_works_from_plain_threads() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (echo, _) = runtime.block_on(echo_server());
    let rt = runtime.handle().clone();

    // The "Python" thread: no runtime context, only a handle to the runtime.
    let steer = std::thread::spawn(move || {
        assert!(tokio::runtime::Handle::try_current().is_err());
        let wan = Wanem::start_on(&rt, WanemConfig::new(any_port(), echo)).unwrap();
        wan.set_profile(C2U, LinkProfile::with_delay(Duration::from_millis(30)))
            .unwrap();
        wan.corrupt_next(U2C);
        wan.stall(U2C, Duration::ZERO);
        wan.blackhole(false);
        wan
    });
    let wan = steer.join().unwrap();
    let addr = wan.local_addr();

    // The settings took effect on the runtime side.
    let _client = runtime.block_on(async {
        let mut client = TcpStream::connect(addr).await.unwrap();
        let t0 = Instant::now();
        client.write_all(&[0u8; 64]).await.unwrap();
        let mut back = [0u8; 64];
        bounded(5, "ping", client.read_exact(&mut back))
            .await
            .unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(30));
        assert_eq!(
            back.iter().filter(|&&b| b != 0).count(),
            1,
            "one byte corrupted"
        );
        // Kept open over the shutdown below.
        client
    });

    let closer = std::thread::spawn(move || {
        let t0 = std::time::Instant::now();
        wan.shutdown_blocking().unwrap();
        assert!(t0.elapsed() < pdd_io::wanem::SHUTDOWN_BOUND);
        wan.stats()
    });
    let stats = closer.join().unwrap();
    assert_eq!(stats.connections_active, 0);
    assert_eq!(stats.upstream_to_client.chunks_corrupted, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_until_reports_the_address_and_stops() {
    let (echo, _) = echo_server().await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (addr_tx, addr_rx) = tokio::sync::oneshot::channel::<SocketAddr>();
    let runner = tokio::spawn(run_until(
        WanemConfig::new(any_port(), echo),
        async {
            let _ = stop_rx.await;
        },
        move |h| {
            let _ = addr_tx.send(h.local_addr());
        },
    ));
    let addr = bounded(5, "ready", addr_rx).await.unwrap();
    let mut client = TcpStream::connect(addr).await.unwrap();
    bounded(5, "ping", ping(&mut client, b"run")).await;
    stop_tx.send(()).unwrap();
    let stats = bounded(10, "run_until returns", runner)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stats.connections_accepted, 1);
    assert_eq!(stats.client_to_upstream.bytes_delivered, 3);
}
