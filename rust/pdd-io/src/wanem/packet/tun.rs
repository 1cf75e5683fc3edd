//! The I/O half of the packet emulator: two TUN devices (file descriptors the caller
//! opened, one per end), one thread per direction that reads packets from one device,
//! runs them through its [`LinkModel`] and writes them, when due, to the other.
//!
//! Each thread sleeps in `ppoll` until a packet arrives or the next one is due (its
//! timer slack set to 10 µs, so releases are that precise), reads what is there in a
//! batch, and writes out everything due. A packet costs one `read` and one `write`;
//! the `cpu_ns` counter (the thread's CPU time) over `packets_in` is the emulator's
//! cost per packet.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::model::{DelayLine, DropReason, LinkModel, PacketProfile, Verdict};

/// Packets one direction may hold at once (delayed or queued); beyond it a packet is
/// dropped and counted in `dropped_overflow`. At 1500 bytes, about 190 MiB.
pub const MAX_HELD_PACKETS: usize = 1 << 17;

/// Packets read per wake-up before the due ones are written out.
const READ_BATCH: usize = 64;

/// Longest sleep, so that [`PacketEmulator::stop`] is seen promptly.
const MAX_SLEEP: Duration = Duration::from_millis(20);

/// The two directions: index 0 reads end A and writes end B, index 1 the reverse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// From end A to end B.
    AToB = 0,
    /// From end B to end A.
    BToA = 1,
}

/// What the emulator runs with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PacketEmulatorConfig {
    /// The line from A to B.
    pub a_to_b: PacketProfile,
    /// The line from B to A.
    pub b_to_a: PacketProfile,
    /// Seeds both directions' RNGs (each direction its own stream).
    pub seed: u64,
    /// The largest packet either device can hand over (its MTU), 576..=65535.
    pub mtu: usize,
}

/// Counters of one direction (a snapshot).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketStats {
    /// Packets and bytes read from the source device.
    pub packets_in: u64,
    pub bytes_in: u64,
    /// Packets and bytes written to the other device.
    pub packets_out: u64,
    pub bytes_out: u64,
    /// Dropped by the bottleneck's full queue.
    pub dropped_queue: u64,
    /// Lost on the line (the loss model).
    pub dropped_loss: u64,
    /// Dropped because `MAX_HELD_PACKETS` were held.
    pub dropped_overflow: u64,
    /// Dropped because they belong to a blocked TCP port ([`PacketEmulator::block_port`]).
    pub dropped_blocked: u64,
    /// Held back and overtaken (reordering).
    pub reordered: u64,
    /// Writes the device refused (e.g. it is down).
    pub write_errors: u64,
    /// CPU time this direction's thread used, in ns.
    pub cpu_ns: u64,
    /// 1 if the thread runs `SCHED_FIFO` (see `run_ahead_of_the_load`), else 0.
    pub realtime: u64,
}

#[derive(Default)]
struct Counters {
    packets_in: AtomicU64,
    bytes_in: AtomicU64,
    packets_out: AtomicU64,
    bytes_out: AtomicU64,
    dropped_queue: AtomicU64,
    dropped_loss: AtomicU64,
    dropped_overflow: AtomicU64,
    dropped_blocked: AtomicU64,
    reordered: AtomicU64,
    write_errors: AtomicU64,
    cpu_ns: AtomicU64,
    realtime: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> PacketStats {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PacketStats {
            packets_in: g(&self.packets_in),
            bytes_in: g(&self.bytes_in),
            packets_out: g(&self.packets_out),
            bytes_out: g(&self.bytes_out),
            dropped_queue: g(&self.dropped_queue),
            dropped_loss: g(&self.dropped_loss),
            dropped_overflow: g(&self.dropped_overflow),
            dropped_blocked: g(&self.dropped_blocked),
            reordered: g(&self.reordered),
            write_errors: g(&self.write_errors),
            cpu_ns: g(&self.cpu_ns),
            realtime: g(&self.realtime),
        }
    }
}

struct Shared {
    stop: AtomicBool,
    /// A TCP port whose packets (either port field, either direction) are dropped; 0: none.
    blocked_port: AtomicU32,
    counters: [Counters; 2],
}

/// A running packet emulator. Dropping it stops it (and closes its descriptors).
pub struct PacketEmulator {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for PacketEmulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketEmulator")
            .field("running", &!self.threads.is_empty())
            .finish()
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own, with integer arguments only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The TCP ports of an IPv4 packet (`None` for anything else or a fragment's tail).
fn tcp_ports(pkt: &[u8]) -> Option<(u16, u16)> {
    if pkt.len() < 20 || pkt[0] >> 4 != 4 || pkt[9] != 6 {
        return None;
    }
    let frag_offset = u16::from_be_bytes([pkt[6], pkt[7]]) & 0x1fff;
    let ihl = usize::from(pkt[0] & 0x0f) * 4;
    if frag_offset != 0 || pkt.len() < ihl + 4 {
        return None;
    }
    Some((
        u16::from_be_bytes([pkt[ihl], pkt[ihl + 1]]),
        u16::from_be_bytes([pkt[ihl + 2], pkt[ihl + 3]]),
    ))
}

impl PacketEmulator {
    /// Starts relaying between the TUN devices `a` and `b` (opened with `IFF_TUN |
    /// IFF_NO_PI`; the emulator owns them from here and sets them non-blocking).
    pub fn start(
        a: OwnedFd,
        b: OwnedFd,
        config: PacketEmulatorConfig,
    ) -> io::Result<PacketEmulator> {
        for p in [&config.a_to_b, &config.b_to_a] {
            p.validate()
                .map_err(|m| io::Error::new(io::ErrorKind::InvalidInput, m))?;
        }
        if !(576..=65535).contains(&config.mtu) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("mtu must be in 576..=65535, got {}", config.mtu),
            ));
        }
        set_nonblocking(a.as_raw_fd())?;
        set_nonblocking(b.as_raw_fd())?;
        let (a, b) = (Arc::new(a), Arc::new(b));
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            blocked_port: AtomicU32::new(0),
            counters: Default::default(),
        });
        let origin = Instant::now();
        let mut threads = Vec::new();
        let dirs = [
            (End::AToB, a.clone(), b.clone(), config.a_to_b),
            (End::BToA, b, a, config.b_to_a),
        ];
        for (end, src, dst, profile) in dirs {
            let shared2 = shared.clone();
            let model = LinkModel::new(
                profile,
                config.seed ^ 0x9e37_79b9_7f4a_7c15_u64.wrapping_mul(end as u64 + 1),
            );
            let mtu = config.mtu;
            let spawned = std::thread::Builder::new()
                .name(format!(
                    "pdd-wanem-{}",
                    if end == End::AToB { "ab" } else { "ba" }
                ))
                .spawn(move || relay(end, &src, &dst, model, mtu, origin, &shared2));
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    shared.stop.store(true, Ordering::Relaxed);
                    for t in threads {
                        let _ = t.join();
                    }
                    return Err(e);
                }
            }
        }
        Ok(PacketEmulator { shared, threads })
    }

    /// A snapshot of one direction's counters.
    pub fn stats(&self, end: End) -> PacketStats {
        self.shared.counters[end as usize].snapshot()
    }

    /// Drops every packet to or from TCP port `port` (both directions) until called
    /// again with `None`: the connection using it stalls, as one flow through a
    /// broken path does, while the others flow.
    pub fn block_port(&self, port: Option<u16>) {
        self.shared
            .blocked_port
            .store(port.map_or(0, u32::from), Ordering::Relaxed);
    }

    /// The blocked port, if any.
    pub fn blocked_port(&self) -> Option<u16> {
        match self.shared.blocked_port.load(Ordering::Relaxed) {
            0 => None,
            p => u16::try_from(p).ok(),
        }
    }

    /// Whether it is still relaying.
    pub fn is_running(&self) -> bool {
        !self.threads.is_empty()
    }

    /// Stops both threads (within about 20 ms) and closes the devices; what was held
    /// is dropped. Idempotent.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for PacketEmulator {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The line must not wait for a busy host: this thread asks for `SCHED_FIFO` (priority
/// 10; it sleeps in `ppoll` between packets, and the kernel's RT throttling bounds it
/// anyway), else for nice -20. Returns whether it got `SCHED_FIFO`. On a host whose
/// load average exceeds its cores, a normal thread was seen waking 30-90 ms late,
/// which the ends measured as RTT and lost throughput to.
fn run_ahead_of_the_load() -> bool {
    let param = libc::sched_param { sched_priority: 10 };
    // SAFETY: sets the calling thread's own policy from a parameter we own.
    let fifo =
        unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_FIFO, &param) } == 0;
    if !fifo {
        // SAFETY: who = 0 is the calling thread (a task) on Linux; integer arguments.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, -20) };
    }
    fifo
}

fn relay(
    end: End,
    src: &OwnedFd,
    dst: &OwnedFd,
    mut model: LinkModel,
    mtu: usize,
    origin: Instant,
    shared: &Shared,
) {
    // SAFETY: prctl with integer arguments; 10 µs of timer slack for this thread only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 10_000u64, 0u64, 0u64, 0u64) };
    let c = &shared.counters[end as usize];
    c.realtime
        .store(u64::from(run_ahead_of_the_load()), Ordering::Relaxed);
    let now_ns = || u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
    let mut line: DelayLine<Vec<u8>> = DelayLine::default();
    let mut spare: Vec<Vec<u8>> = Vec::new();
    let (src_fd, dst_fd) = (src.as_raw_fd(), dst.as_raw_fd());
    let cpu0 = thread_cpu_ns();
    while !shared.stop.load(Ordering::Relaxed) {
        let now = now_ns();
        let sleep = match line.next_at() {
            Some(at) => Duration::from_nanos(at.saturating_sub(now)).min(MAX_SLEEP),
            None => MAX_SLEEP,
        };
        if !sleep.is_zero() {
            c.cpu_ns.store(thread_cpu_ns() - cpu0, Ordering::Relaxed);
            let mut pfd = libc::pollfd {
                fd: src_fd,
                events: libc::POLLIN,
                revents: 0,
            };
            let ts = libc::timespec {
                tv_sec: sleep.as_secs() as libc::time_t,
                tv_nsec: libc::c_long::from(sleep.subsec_nanos() as i32),
            };
            // SAFETY: one pollfd and one timespec we own; no signal mask change.
            unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
        }
        // Read what is there, in a batch.
        let blocked = shared.blocked_port.load(Ordering::Relaxed);
        for _ in 0..READ_BATCH {
            let mut buf = spare.pop().unwrap_or_else(|| Vec::with_capacity(mtu));
            buf.resize(mtu, 0);
            // SAFETY: reads at most buf.len() bytes into buf, which we own.
            let n = unsafe { libc::read(src_fd, buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                spare.push(buf);
                break; // EAGAIN (nothing more), or the device is gone
            }
            buf.truncate(n as usize);
            c.packets_in.fetch_add(1, Ordering::Relaxed);
            c.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
            if blocked != 0 {
                if let Some((sp, dp)) = tcp_ports(&buf) {
                    if u32::from(sp) == blocked || u32::from(dp) == blocked {
                        c.dropped_blocked.fetch_add(1, Ordering::Relaxed);
                        spare.push(buf);
                        continue;
                    }
                }
            }
            if line.len() >= MAX_HELD_PACKETS {
                c.dropped_overflow.fetch_add(1, Ordering::Relaxed);
                spare.push(buf);
                continue;
            }
            match model.offer(now_ns(), buf.len()) {
                Verdict::Deliver { at, reordered } => {
                    if reordered {
                        c.reordered.fetch_add(1, Ordering::Relaxed);
                    }
                    line.push(at, buf);
                }
                Verdict::Drop(reason) => {
                    let counter = match reason {
                        DropReason::QueueFull => &c.dropped_queue,
                        DropReason::Loss => &c.dropped_loss,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    spare.push(buf);
                }
            }
        }
        // Write out what is due.
        let now = now_ns();
        while let Some(pkt) = line.pop_due(now) {
            // SAFETY: writes pkt.len() bytes from pkt, which we own.
            let n = unsafe { libc::write(dst_fd, pkt.as_ptr().cast(), pkt.len()) };
            if n == pkt.len() as isize {
                c.packets_out.fetch_add(1, Ordering::Relaxed);
                c.bytes_out.fetch_add(pkt.len() as u64, Ordering::Relaxed);
            } else {
                c.write_errors.fetch_add(1, Ordering::Relaxed);
            }
            if spare.len() < 4096 {
                spare.push(pkt);
            }
        }
    }
    c.cpu_ns.store(thread_cpu_ns() - cpu0, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_ports_of_an_ipv4_segment() {
        let mut pkt = vec![0u8; 40];
        pkt[0] = 0x45;
        pkt[9] = 6;
        pkt[20..22].copy_from_slice(&5000u16.to_be_bytes());
        pkt[22..24].copy_from_slice(&443u16.to_be_bytes());
        assert_eq!(tcp_ports(&pkt), Some((5000, 443)));
        pkt[9] = 17; // UDP
        assert_eq!(tcp_ports(&pkt), None);
        pkt[9] = 6;
        pkt[7] = 1; // a later fragment
        assert_eq!(tcp_ports(&pkt), None);
        assert_eq!(tcp_ports(&pkt[..10]), None);
    }

    /// Two socketpairs stand in for the TUN devices: what is written on one end's
    /// "wire" comes out of the other after the delay.
    #[test]
    fn relays_with_delay_over_datagram_sockets() {
        use std::os::fd::FromRawFd;
        fn pair() -> (OwnedFd, OwnedFd) {
            let mut fds = [0; 2];
            // SAFETY: socketpair writes two descriptors we then own.
            let rc = unsafe {
                libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, fds.as_mut_ptr())
            };
            assert_eq!(rc, 0);
            // SAFETY: both descriptors were just created and are owned by nobody else.
            unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
        }
        let (a_host, a_emu) = pair();
        let (b_host, b_emu) = pair();
        let profile = PacketProfile {
            delay: Duration::from_millis(30),
            ..PacketProfile::CLEAN
        };
        let mut emu = PacketEmulator::start(
            a_emu,
            b_emu,
            PacketEmulatorConfig {
                a_to_b: profile,
                b_to_a: PacketProfile::CLEAN,
                seed: 1,
                mtu: 1500,
            },
        )
        .unwrap();
        let t0 = Instant::now();
        let msg = b"hello through the line";
        // SAFETY: writes msg from our buffer to our descriptor.
        let n = unsafe { libc::write(a_host.as_raw_fd(), msg.as_ptr().cast(), msg.len()) };
        assert_eq!(n, msg.len() as isize);
        let mut buf = [0u8; 1500];
        // SAFETY: reads into our buffer from our (blocking) descriptor.
        let n = unsafe { libc::read(b_host.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        let waited = t0.elapsed();
        assert_eq!(&buf[..n as usize], msg);
        assert!(waited >= Duration::from_millis(30), "{waited:?}");
        emu.stop();
        let s = emu.stats(End::AToB);
        assert_eq!((s.packets_in, s.packets_out), (1, 1));
        assert!(!emu.is_running());
    }
}
