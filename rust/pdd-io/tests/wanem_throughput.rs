//! Throughput and latency figures for `docs/wanem.md`. Ignored by default (they
//! measure, they do not check); run them in release mode, one at a time:
//!
//! ```text
//! cargo test --release -p pdd-io --test wanem_throughput -- --ignored --nocapture --test-threads=1
//! ```

use std::net::SocketAddr;
use std::time::Duration;

use pdd_io::wanem::{LinkProfile, Wanem, WanemConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout, Instant};

fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Moves `total` bytes over `conns` connections to `target` (whose accepts land on
/// `listener`); returns Gbit/s measured at the receivers.
async fn transfer(listener: &TcpListener, target: SocketAddr, conns: usize, total: usize) -> f64 {
    let per_conn = total / conns;
    let mut pairs = Vec::new();
    for _ in 0..conns {
        let c = TcpStream::connect(target).await.unwrap();
        c.set_nodelay(true).unwrap();
        let (s, _) = listener.accept().await.unwrap();
        pairs.push((c, s));
    }
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (mut c, mut s) in pairs {
        tasks.push(tokio::spawn(async move {
            let block = vec![0xA5u8; 1 << 20];
            let mut left = per_conn;
            while left > 0 {
                let n = left.min(block.len());
                c.write_all(&block[..n]).await.unwrap();
                left -= n;
            }
            c
        }));
        tasks.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 20];
            let mut got = 0;
            while got < per_conn {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0);
                got += n;
            }
            s
        }));
    }
    for t in tasks {
        timeout(Duration::from_secs(60), t).await.unwrap().unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    (per_conn * conns) as f64 * 8.0 / secs / 1e9
}

async fn median_rtt(target: SocketAddr, listener: &TcpListener, rounds: usize) -> Duration {
    let mut c = TcpStream::connect(target).await.unwrap();
    c.set_nodelay(true).unwrap();
    let (mut s, _) = listener.accept().await.unwrap();
    s.set_nodelay(true).unwrap();
    let echo = tokio::spawn(async move {
        let mut b = [0u8; 64];
        loop {
            match s.read(&mut b).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if s.write_all(&b[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mut rtts = Vec::with_capacity(rounds);
    let mut back = [0u8; 64];
    for _ in 0..rounds {
        let t0 = Instant::now();
        c.write_all(&[1u8; 64]).await.unwrap();
        c.read_exact(&mut back).await.unwrap();
        rtts.push(t0.elapsed());
    }
    drop(c);
    let _ = echo.await;
    rtts.sort();
    rtts[rounds / 2]
}

const TOTAL: usize = 1 << 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run with --release --ignored --nocapture"]
async fn throughput_figures() {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let upstream = listener.local_addr().unwrap();

    let direct1 = transfer(&listener, upstream, 1, TOTAL).await;
    let direct4 = transfer(&listener, upstream, 4, TOTAL).await;
    println!("direct loopback, 1 conn:            {direct1:6.2} Gbit/s");
    println!("direct loopback, 4 conns:           {direct4:6.2} Gbit/s");

    let wan = Wanem::start(WanemConfig::new(any_port(), upstream))
        .await
        .unwrap();
    let proxy1 = transfer(&listener, wan.local_addr(), 1, TOTAL).await;
    let proxy4 = transfer(&listener, wan.local_addr(), 4, TOTAL).await;
    println!("wanem unshaped, 1 conn:             {proxy1:6.2} Gbit/s");
    println!("wanem unshaped, 4 conns:            {proxy4:6.2} Gbit/s");
    wan.shutdown().await.unwrap();

    // The in-flight limit is the emulated BDP: 4 MiB over 10 ms one way.
    let mut cfg = WanemConfig::new(any_port(), upstream)
        .symmetric(LinkProfile::with_delay(Duration::from_millis(10)));
    cfg.max_in_flight = Some(4 << 20);
    let wan = Wanem::start(cfg).await.unwrap();
    let bdp1 = transfer(&listener, wan.local_addr(), 1, TOTAL / 4).await;
    let bdp4 = transfer(&listener, wan.local_addr(), 4, TOTAL / 4).await;
    println!(
        "wanem 10 ms, 4 MiB in flight, 1 conn:  {bdp1:6.2} Gbit/s (limit/delay = {:.2})",
        (4u64 << 20) as f64 * 8.0 / 0.010 / 1e9
    );
    println!("wanem 10 ms, 4 MiB in flight, 4 conns: {bdp4:6.2} Gbit/s");
    wan.shutdown().await.unwrap();

    // A 2 Gbit/s cap, shared.
    let mut cfg = WanemConfig::new(any_port(), upstream);
    cfg.client_to_upstream.rate_bps = Some(2_000_000_000);
    let wan = Wanem::start(cfg).await.unwrap();
    let cap1 = transfer(&listener, wan.local_addr(), 1, TOTAL / 4).await;
    let cap4 = transfer(&listener, wan.local_addr(), 4, TOTAL / 4).await;
    println!("wanem 2 Gbit/s cap, 1 conn:         {cap1:6.2} Gbit/s");
    println!("wanem 2 Gbit/s cap, 4 conns:        {cap4:6.2} Gbit/s");
    wan.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement; run with --release --ignored --nocapture"]
async fn latency_figures() {
    let listener = TcpListener::bind(any_port()).await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let direct = median_rtt(upstream, &listener, 2000).await;
    let wan = Wanem::start(WanemConfig::new(any_port(), upstream))
        .await
        .unwrap();
    let proxied = median_rtt(wan.local_addr(), &listener, 2000).await;
    wan.shutdown().await.unwrap();
    let wan = Wanem::start(
        WanemConfig::new(any_port(), upstream)
            .symmetric(LinkProfile::with_delay(Duration::from_millis(10))),
    )
    .await
    .unwrap();
    let delayed = median_rtt(wan.local_addr(), &listener, 50).await;
    wan.shutdown().await.unwrap();
    println!("median RTT, 64 B ping-pong, direct loopback: {direct:?}");
    println!("median RTT, through wanem, no delay:         {proxied:?}");
    println!("median RTT, through wanem, 10 ms each way:   {delayed:?}");
}
