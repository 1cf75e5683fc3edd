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
/// negotiate, answer HELLO or ABORT.
pub async fn accept(
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
            Ok(agreed) => {
                write_frame(
                    stream,
                    &Frame::Hello(local.reply(&agreed)),
                    agreed.peer_max_payload,
                )
                .await?;
                if agreed.lane > 0 {
                    let _ = stream.set_nodelay(false);
                }
                Ok(agreed)
            }
            Err(err) => {
                let _ = write_frame(stream, &abort_for(&err), local.max_payload).await;
                Err(err)
            }
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(Error::DeadlineExceeded {
            what: "HELLO from a connecting peer".into(),
        }),
    }
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

/// CRC32C of KV_PAGES payloads: `crc32c::crc32c_append(crc, data)`, bit for bit, but
/// about 1.7x faster where the CPU has AVX-512 with VPCLMULQDQ (measured on this
/// project's VM, best of 7, 1 MiB slices: 15.3 -> 26.5 GB/s from DRAM, 32 -> 54 GB/s
/// from cache). The sender computes it over every source page before writing a block
/// and the receiver over every landed page, so it was a third of the sender's CPU in
/// `bench stream` profiles. Elsewhere (or with `PDD_CRC32C_PORTABLE=1` in the
/// environment, read once) it is the crate's SSE4.2 code.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    {
        if data.len() >= fold::BLOCK && fold::available() {
            let bulk = data.len() - data.len() % fold::BLOCK;
            let (head, tail) = data.split_at(bulk);
            // SAFETY: available() checked the CPU features the asm uses; `head` is a
            // live slice of a non-zero multiple of BLOCK bytes.
            let raw = unsafe { fold::fold_raw(!crc, head) };
            return crc32c::crc32c_append(!raw, tail);
        }
    }
    crc32c::crc32c_append(crc, data)
}

/// CRC32C by folding with carry-less multiplies (the method of Intel's "Fast CRC
/// Computation for Generic Polynomials Using PCLMULQDQ", on 512-bit registers).
///
/// Bit order: CRC32C is reflected, so in a little-endian 128-bit chunk bit `i` is the
/// coefficient of x^(127-i) (the first byte holds the highest powers). A chunk X
/// followed by D more bits contributes X * x^D to the message; with X = A x^64 + B
/// (A: its first 8 bytes), X * x^D == A * K_A + B * K_B (mod P) where
/// K_A = (x^(D+32) mod P) * x^32 and K_B = (x^(D-32) mod P) * x^32. Stored reflected
/// and shifted left by one (so that a 64x64 carry-less product lands in the same
/// 128-bit reflected frame), those are the constants below; the products have degree
/// < 128 and are xored into the chunk D bits later. Folding everything into the last
/// 16 bytes keeps the message's value mod P, and the CRC32 instruction over those 16
/// bytes from state 0 then gives the CRC state after the whole message (the initial
/// state is xored into its first 4 bytes, as a CRC register is).
#[cfg(target_arch = "x86_64")]
mod fold {
    use std::sync::OnceLock;

    /// Bytes per iteration of the main loop (four 64-byte accumulators).
    pub const BLOCK: usize = 256;

    const POLY: u32 = 0x82F6_3B78; // CRC32C (Castagnoli), reflected.

    /// x^n mod P, reflected (bit i is the coefficient of x^(31-i)).
    const fn xpow_mod(n: u32) -> u32 {
        let mut r: u32 = 1 << 31;
        let mut i = 0;
        while i < n {
            r = if r & 1 != 0 { (r >> 1) ^ POLY } else { r >> 1 };
            i += 1;
        }
        r
    }

    /// [K_A, K_B] for folding across `d` bits.
    const fn fold_k(d: u32) -> [u64; 2] {
        [
            (xpow_mod(d + 32) as u64) << 1,
            (xpow_mod(d - 32) as u64) << 1,
        ]
    }

    /// Fold constants: across 256 bytes (the loop), 64 bytes (accumulator into
    /// accumulator) and 16 bytes (lane into lane).
    static K: [[u64; 2]; 3] = [fold_k(2048), fold_k(512), fold_k(128)];

    /// Whether the CPU (and OS) support the instructions `fold_raw` uses.
    pub fn available() -> bool {
        static AVAILABLE: OnceLock<bool> = OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::env::var_os("PDD_CRC32C_PORTABLE").is_none_or(|v| v.is_empty() || v == "0")
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("vpclmulqdq")
                && std::is_x86_feature_detected!("pclmulqdq")
                && std::is_x86_feature_detected!("avx")
                && std::is_x86_feature_detected!("sse4.2")
        })
    }

    /// The raw (not inverted) CRC32C state after `data`, from raw state `state`.
    ///
    /// Inline asm rather than the AVX-512 intrinsics, which need Rust 1.89 (the
    /// workspace's MSRV is older). `clobber_abi("C")` makes the block clobber exactly
    /// what a call would, zmm upper halves included where the build enables AVX-512.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, VPCLMULQDQ, PCLMULQDQ, AVX and SSE4.2
    /// (`available()`), and `data.len()` must be a non-zero multiple of `BLOCK`.
    pub unsafe fn fold_raw(state: u32, data: &[u8]) -> u32 {
        debug_assert!(!data.is_empty() && data.len() % BLOCK == 0);
        let raw: u64;
        // SAFETY: the caller guarantees the CPU features; the asm reads exactly
        // data.len() bytes from data.as_ptr() (len / BLOCK iterations of BLOCK bytes)
        // and 48 bytes of K, writes no memory, and uses no stack.
        unsafe {
            core::arch::asm!(
                // Four accumulators: the first 256 bytes, the state in the first 4.
                "vmovdqu64 zmm0, zmmword ptr [rsi]",
                "vmovdqu64 zmm1, zmmword ptr [rsi + 64]",
                "vmovdqu64 zmm2, zmmword ptr [rsi + 128]",
                "vmovdqu64 zmm3, zmmword ptr [rsi + 192]",
                "vmovd xmm6, r8d",
                "vpxorq zmm0, zmm0, zmm6",
                "vbroadcasti32x4 zmm4, xmmword ptr [rdx]",
                "add rsi, 256",
                "dec rcx",
                "jz 3f",
                // Each accumulator folds 256 bytes ahead onto the next 64 bytes.
                "2:",
                "vpclmulqdq zmm5, zmm0, zmm4, 0x00",
                "vpclmulqdq zmm0, zmm0, zmm4, 0x11",
                "vpternlogq zmm0, zmm5, zmmword ptr [rsi], 0x96",
                "vpclmulqdq zmm5, zmm1, zmm4, 0x00",
                "vpclmulqdq zmm1, zmm1, zmm4, 0x11",
                "vpternlogq zmm1, zmm5, zmmword ptr [rsi + 64], 0x96",
                "vpclmulqdq zmm5, zmm2, zmm4, 0x00",
                "vpclmulqdq zmm2, zmm2, zmm4, 0x11",
                "vpternlogq zmm2, zmm5, zmmword ptr [rsi + 128], 0x96",
                "vpclmulqdq zmm5, zmm3, zmm4, 0x00",
                "vpclmulqdq zmm3, zmm3, zmm4, 0x11",
                "vpternlogq zmm3, zmm5, zmmword ptr [rsi + 192], 0x96",
                "add rsi, 256",
                "dec rcx",
                "jnz 2b",
                "3:",
                // zmm0 -> zmm1 -> zmm2 -> zmm3, 64 bytes apart.
                "vbroadcasti32x4 zmm4, xmmword ptr [rdx + 16]",
                "vpclmulqdq zmm5, zmm0, zmm4, 0x00",
                "vpclmulqdq zmm0, zmm0, zmm4, 0x11",
                "vpternlogq zmm1, zmm0, zmm5, 0x96",
                "vpclmulqdq zmm5, zmm1, zmm4, 0x00",
                "vpclmulqdq zmm1, zmm1, zmm4, 0x11",
                "vpternlogq zmm2, zmm1, zmm5, 0x96",
                "vpclmulqdq zmm5, zmm2, zmm4, 0x00",
                "vpclmulqdq zmm2, zmm2, zmm4, 0x11",
                "vpternlogq zmm3, zmm2, zmm5, 0x96",
                // The four 16-byte lanes of zmm3, 16 bytes apart, into one.
                "vmovdqu xmm4, xmmword ptr [rdx + 32]",
                "vextracti32x4 xmm1, zmm3, 1",
                "vextracti32x4 xmm2, zmm3, 2",
                "vextracti32x4 xmm6, zmm3, 3",
                "vpclmulqdq xmm5, xmm3, xmm4, 0x00",
                "vpclmulqdq xmm0, xmm3, xmm4, 0x11",
                "vpternlogq xmm0, xmm5, xmm1, 0x96",
                "vpclmulqdq xmm5, xmm0, xmm4, 0x00",
                "vpclmulqdq xmm0, xmm0, xmm4, 0x11",
                "vpternlogq xmm0, xmm5, xmm2, 0x96",
                "vpclmulqdq xmm5, xmm0, xmm4, 0x00",
                "vpclmulqdq xmm0, xmm0, xmm4, 0x11",
                "vpternlogq xmm0, xmm5, xmm6, 0x96",
                // CRC32 of the last 16 bytes from state 0.
                "vmovq rax, xmm0",
                "vpextrq r9, xmm0, 1",
                "xor r10d, r10d",
                "crc32 r10, rax",
                "crc32 r10, r9",
                "vzeroupper",
                inout("rsi") data.as_ptr() => _,
                inout("rcx") data.len() / BLOCK => _,
                in("rdx") K.as_ptr(),
                in("r8") state,
                out("r10") raw,
                clobber_abi("C"),
                options(nostack, readonly),
            );
        }
        raw as u32
    }
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
