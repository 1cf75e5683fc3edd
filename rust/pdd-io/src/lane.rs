//! One TCP connection of a session ("lane"): socket tuning, the HELLO exchange, and
//! small-frame I/O. Lane 0 is the control lane (TCP_NODELAY, small frames only); lanes
//! 1.. carry KV_PAGES.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::BytesMut;
use pdd_core::wire::handshake::{negotiate, LocalHello, Negotiated};
use pdd_core::wire::{encode_frame, Abort, Frame, FrameHeader, HEADER_LEN};
use pdd_core::Error;
use socket2::SockRef;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Socket settings for every lane.
#[derive(Debug, Clone)]
pub struct SocketTuning {
    /// SO_SNDBUF / SO_RCVBUF request (the kernel caps it at net.core.[rw]mem_max).
    pub buffer_bytes: Option<usize>,
    /// TCP congestion control (`"bbr"`, `"cubic"`); ignored with a warning counter when
    /// the kernel refuses it.
    pub congestion: Option<String>,
}

impl Default for SocketTuning {
    fn default() -> Self {
        SocketTuning {
            buffer_bytes: Some(8 << 20),
            congestion: None,
        }
    }
}

/// Apply tuning to a connected stream. Returns whether the congestion control
/// requested was applied (false if none was requested or the kernel refused).
pub fn tune(stream: &TcpStream, tuning: &SocketTuning, nodelay: bool) -> bool {
    let sock = SockRef::from(stream);
    // Best effort: a refused buffer size or CC leaves the kernel default, which works.
    let _ = stream.set_nodelay(nodelay);
    if let Some(n) = tuning.buffer_bytes {
        let _ = sock.set_send_buffer_size(n);
        let _ = sock.set_recv_buffer_size(n);
    }
    match &tuning.congestion {
        Some(cc) => sock.set_tcp_congestion(cc.as_bytes()).is_ok(),
        None => false,
    }
}

fn lost(e: std::io::Error, what: &str) -> Error {
    Error::ConnectionLost {
        detail: format!("{what}: {e}"),
    }
}

/// Read one whole frame with exact reads (never past its end), bounded by
/// `max_payload`. `Ok(None)` on a clean EOF before the first byte.
pub async fn read_frame_exact(
    stream: &mut TcpStream,
    max_payload: u32,
) -> Result<Option<Frame>, Error> {
    let mut head = [0u8; HEADER_LEN];
    match stream.read(&mut head[..1]).await {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(lost(e, "read")),
    }
    stream
        .read_exact(&mut head[1..])
        .await
        .map_err(|e| lost(e, "read"))?;
    let header = FrameHeader::parse(&head, max_payload)?;
    let mut buf = BytesMut::with_capacity(HEADER_LEN + header.payload_len as usize);
    buf.extend_from_slice(&head);
    buf.resize(HEADER_LEN + header.payload_len as usize, 0);
    stream
        .read_exact(&mut buf[HEADER_LEN..])
        .await
        .map_err(|e| lost(e, "read"))?;
    match pdd_core::wire::decode_frame(&buf, max_payload)? {
        Some((frame, _)) => Ok(Some(frame)),
        None => Err(Error::ConnectionLost {
            detail: "frame ended early".into(),
        }),
    }
}

/// Encode and write one frame.
pub async fn write_frame(
    stream: &mut TcpStream,
    frame: &Frame,
    max_payload: u32,
) -> Result<(), Error> {
    let mut buf = BytesMut::new();
    encode_frame(frame, max_payload, &mut buf)?;
    stream.write_all(&buf).await.map_err(|e| lost(e, "write"))
}

/// Connect lane `lane` of session `session_id` and exchange HELLO, all within
/// `timeout`.
pub async fn connect(
    addr: SocketAddr,
    local: &LocalHello,
    session_id: u64,
    lane: u16,
    tuning: &SocketTuning,
    timeout: Duration,
) -> Result<(TcpStream, Negotiated), Error> {
    let attempt = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| lost(e, &format!("connect to {addr}")))?;
        tune(&stream, tuning, true);
        write_frame(
            &mut stream,
            &Frame::Hello(local.offer(session_id, lane)),
            local.max_payload,
        )
        .await?;
        let reply = read_frame_exact(&mut stream, local.max_payload)
            .await?
            .ok_or_else(|| Error::ConnectionLost {
                detail: format!("{addr} closed during HELLO"),
            })?;
        let agreed = match reply {
            Frame::Hello(h) => {
                if h.min_version != h.max_version {
                    return Err(Error::InvalidField {
                        kind: pdd_core::wire::FrameKind::Hello,
                        field: "max_version",
                        detail: "a HELLO reply must name exactly one version".into(),
                    });
                }
                negotiate(local, &h)?
            }
            Frame::Abort(a) => {
                return Err(Error::PeerAborted {
                    reason: a.reason,
                    message: a.message,
                })
            }
            other => {
                return Err(Error::InvalidField {
                    kind: other.kind(),
                    field: "kind",
                    detail: "expected HELLO as the first frame".into(),
                })
            }
        };
        if lane > 0 {
            stream
                .set_nodelay(false)
                .map_err(|e| lost(e, "setsockopt"))?;
        }
        Ok((stream, agreed))
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| Error::DeadlineExceeded {
            what: format!("connecting lane {lane} to {addr}"),
        })?
}

/// Accept side of the HELLO exchange, within `timeout`: read the peer's HELLO,
/// negotiate, answer HELLO or ABORT. [`read_hello`] then [`answer_hello`] with nothing
/// to decide in between.
pub async fn accept(
    stream: &mut TcpStream,
    local: &LocalHello,
    timeout: Duration,
) -> Result<Negotiated, Error> {
    let agreed = read_hello(stream, local, timeout).await?;
    answer_hello(stream, local, &agreed, Ok(()), timeout).await?;
    Ok(agreed)
}

/// First half of the accept side, within `timeout`: read the peer's HELLO and
/// negotiate. A HELLO we cannot agree with (or another frame) is answered with an
/// ABORT here; an agreeable one is not answered yet: the caller admits the lane (its
/// session exists, the peer has the capability) and then calls [`answer_hello`]. A
/// connector must never get a HELLO reply for a lane the acceptor is not ready to
/// serve: it starts using the lane as soon as the reply arrives.
pub async fn read_hello(
    stream: &mut TcpStream,
    local: &LocalHello,
    timeout: Duration,
) -> Result<Negotiated, Error> {
    let exchange = async {
        let first = read_frame_exact(stream, local.max_payload)
            .await?
            .ok_or_else(|| Error::ConnectionLost {
                detail: "peer closed before HELLO".into(),
            })?;
        let Frame::Hello(peer) = first else {
            let err = Error::InvalidField {
                kind: first.kind(),
                field: "kind",
                detail: "expected HELLO first".into(),
            };
            let _ = write_frame(stream, &abort_for(&err), local.max_payload).await;
            return Err(err);
        };
        match negotiate(local, &peer) {
            Ok(agreed) => Ok(agreed),
            Err(err) => {
                let _ = write_frame(stream, &abort_for(&err), local.max_payload).await;
                Err(err)
            }
        }
    };
    within(timeout, "HELLO from a connecting peer", exchange).await
}

/// Second half of the accept side, within `timeout`: answer a negotiated HELLO with
/// our HELLO when `admitted` is `Ok`, else with an ABORT saying why (and return that
/// error).
pub async fn answer_hello(
    stream: &mut TcpStream,
    local: &LocalHello,
    agreed: &Negotiated,
    admitted: Result<(), Error>,
    timeout: Duration,
) -> Result<(), Error> {
    let exchange = async {
        match admitted {
            Ok(()) => {
                write_frame(
                    stream,
                    &Frame::Hello(local.reply(agreed)),
                    agreed.peer_max_payload,
                )
                .await?;
                if agreed.lane > 0 {
                    let _ = stream.set_nodelay(false);
                }
                Ok(())
            }
            Err(err) => {
                let _ = write_frame(stream, &abort_for(&err), agreed.peer_max_payload).await;
                Err(err)
            }
        }
    };
    within(timeout, "answering a connecting peer's HELLO", exchange).await
}

/// `step`, or `DeadlineExceeded { what }` once `timeout` passed.
async fn within<T>(
    timeout: Duration,
    what: &str,
    step: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(timeout, step)
        .await
        .unwrap_or_else(|_| Err(Error::DeadlineExceeded { what: what.into() }))
}

/// The ABORT that tells a peer why we are closing (connection-wide).
pub fn abort_for(err: &Error) -> Frame {
    let mut message = err.to_string();
    message.truncate(pdd_core::wire::MAX_ABORT_MESSAGE_LEN);
    while !message.is_char_boundary(message.len()) {
        message.pop();
    }
    Frame::Abort(Abort {
        request_id: 0,
        reason: err.abort_reason(),
        message,
    })
}

/// The writer half of a control lane: sends queued frames as they come and a PING
/// every `heartbeat` (with the kernel's RTT sampled into `metrics`), until `cancel`
/// (then it flushes what is queued, an ABORT saying why included, for at most
/// 200 ms) or the queue closes. `Err` carries why a write failed.
pub async fn control_writer(
    mut writer: tokio_util::codec::FramedWrite<
        tokio::net::tcp::OwnedWriteHalf,
        crate::codec::WireCodec,
    >,
    mut outgoing: tokio::sync::mpsc::UnboundedReceiver<Frame>,
    cancel: tokio_util::sync::CancellationToken,
    heartbeat: Duration,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    now_ns: fn() -> u64,
) -> Result<(), String> {
    use futures_util::SinkExt;

    let mut tick = tokio::time::interval(heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut nonce = 0u64;
    loop {
        let frame = tokio::select! {
            _ = cancel.cancelled() => {
                while let Ok(f) = outgoing.try_recv() {
                    if writer.feed(&f).await.is_err() {
                        break;
                    }
                }
                let _ = tokio::time::timeout(Duration::from_millis(200), writer.flush()).await;
                return Ok(());
            }
            f = outgoing.recv() => match f {
                Some(f) => f,
                None => return Ok(()),
            },
            _ = tick.tick() => {
                nonce += 1;
                crate::metrics::Metrics::add(&metrics.pings_sent_total, 1);
                if let Some(s) = tcp_stats(writer.get_ref().as_ref()) {
                    crate::metrics::Metrics::set(&metrics.tcp_rtt_us, u64::from(s.rtt_us));
                }
                Frame::Ping(pdd_core::wire::Ping { nonce, sent_at_ns: now_ns() })
            }
        };
        if let Err(e) = writer.send(&frame).await {
            return Err(format!("control lane write: {e}"));
        }
    }
}

/// Kernel TCP statistics of a socket (Linux TCP_INFO): smoothed RTT, its variance,
/// retransmissions and the congestion window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Smoothed RTT, microseconds.
    pub rtt_us: u32,
    /// RTT variance, microseconds.
    pub rtt_var_us: u32,
    /// Segments retransmitted over the connection's life.
    pub total_retrans: u32,
    /// Congestion window, segments.
    pub snd_cwnd: u32,
}

/// Read TCP_INFO for a socket; `None` where the kernel does not provide it.
#[cfg(target_os = "linux")]
pub fn tcp_stats(stream: &TcpStream) -> Option<TcpStats> {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    // SAFETY: tcp_info is plain old data; all-zero is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: fd is a live socket owned by `stream` for the duration of the call;
    // `info` and `len` point to writable memory of the size passed.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    Some(TcpStats {
        rtt_us: info.tcpi_rtt,
        rtt_var_us: info.tcpi_rttvar,
        total_retrans: info.tcpi_total_retrans,
        snd_cwnd: info.tcpi_snd_cwnd,
    })
}

/// Read TCP_INFO for a socket; `None` where the kernel does not provide it.
#[cfg(not(target_os = "linux"))]
pub fn tcp_stats(_stream: &TcpStream) -> Option<TcpStats> {
    None
}

/// CRC32C of KV_PAGES payloads, continuing from `crc`: the same value as
/// `crc32c::crc32c_append(crc, data)`, computed by the `crc-fast` crate, whose
/// folding with carry-less multiplies (AVX-512 VPCLMULQDQ where the CPU has it) is
/// about 1.7x faster than the SSE4.2 CRC instruction loop of `crc32c` here. The
/// sender checksums every source page before writing a block and the receiver every
/// landed page, so this was a third of the sender's CPU in `bench stream` profiles.
/// Small frames keep `crc32c` (`pdd_core::wire`), where setup cost dominates.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    if data.len() < 4096 {
        return crc32c::crc32c_append(crc, data);
    }
    // crc-fast takes the raw register; a finished CRC32C is the register xor !0.
    let mut digest =
        crc_fast::Digest::new_with_init_state(crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    digest.update(data);
    digest.finalize() as u32
}

#[cfg(test)]
mod crc_tests {
    use super::crc32c_append;

    #[test]
    fn crc32c_append_matches_the_crate() {
        // Lengths around the 256-byte block, offsets that misalign, any prior state.
        let data: Vec<u8> = (0..(3usize << 20))
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for round in 0..4000 {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let off = (seed >> 40) as usize % 512;
            let len = match round % 4 {
                0 => (seed >> 20) as usize % 1024,
                1 => 256 * ((seed >> 20) as usize % 64),
                2 => (seed >> 20) as usize % 70_000,
                _ => (1 << 20) + (seed >> 20) as usize % 1000,
            };
            let init = (seed >> 3) as u32;
            let piece = &data[off..off + len];
            assert_eq!(
                crc32c_append(init, piece),
                crc32c::crc32c_append(init, piece),
                "off {off} len {len}"
            );
        }
        assert_eq!(crc32c_append(0, b"123456789"), 0xE306_9283);
        assert_eq!(
            crc32c_append(0, &data[..3 << 20]),
            crc32c::crc32c(&data[..3 << 20])
        );
    }
}
