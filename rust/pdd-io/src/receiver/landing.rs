//! How a plain data lane lands a KV_PAGES block: through the lane's small staging
//! buffer, checksummed there, then streamed into the granted pages with
//! non-temporal stores.
//!
//! Why not `readv` straight into the pages (what this replaced): the pool is far
//! larger than any cache, so the kernel's copy into it misses on every line and
//! first reads the line from DRAM (read-for-ownership) before writing it, and the
//! CRC32C that follows reads the block back from memory again. Profiled on this
//! project's 2-core Xeon host (`docs/benchmarks.md`, "Where a plain lane's CPU
//! goes"), the copy into the pool and the receiver's CRC were 29% of a loopback
//! transfer's cycles. Through a buffer of [`STAGE_BYTES`] the kernel's copy and the
//! CRC stay in L1/L2, and the one pass into the pool uses streaming stores, which
//! write whole lines without reading them first (2.2x the bandwidth of plain stores
//! into DRAM on that host). The bytes still land only in the block's granted pages,
//! in order, and the block counts only if the CRC over what arrived matches.

use std::time::Duration;

use tokio::io::AsyncReadExt;

use crate::lane;
use crate::pool::RawPage;

/// Bytes one read stages: small enough that the kernel's copy, the CRC and the
/// streaming copy out all run from L1/L2 (32 and 64 KiB measured alike, 128 KiB
/// worse, 256 KiB no better than no staging at all).
pub(super) const STAGE_BYTES: usize = 64 << 10;

/// Read exactly the bytes of `pages`, in order, from `tcp` into them through
/// `stage`, each read within `stall`; returns `crc` (CRC32C state) extended over
/// those bytes. Reads never go past the block's last page (the next frame stays in
/// the socket).
///
/// # Safety
/// Every page must be in flight for this lane alone until the caller finishes the
/// block (nothing else writes or reads it meanwhile).
pub(super) async unsafe fn land_plain(
    tcp: &mut tokio::net::TcpStream,
    stage: &mut [u8],
    pages: &[RawPage],
    stall: Duration,
    mut crc: u32,
) -> std::io::Result<u32> {
    let mut left: usize = pages.iter().map(RawPage::len).sum();
    // The page being filled and how much of it is filled.
    let (mut page, mut filled) = (0usize, 0usize);
    while left > 0 {
        let want = left.min(stage.len());
        let got = super::data_lane::within_stall(stall, tcp.read(&mut stage[..want])).await?;
        if got == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let staged = &stage[..got];
        crc = lane::crc32c_append(crc, staged);
        let mut from = 0;
        while from < got {
            let p = &pages[page];
            let n = (p.len() - filled).min(got - from);
            // SAFETY: `filled + n <= p.len()`: inside the page, which the caller
            // guarantees is this lane's alone; `staged` is our own buffer.
            unsafe { copy_streaming(p.as_ptr().add(filled), &staged[from..from + n]) };
            from += n;
            filled += n;
            if filled == p.len() {
                page += 1;
                filled = 0;
            }
        }
        left -= got;
    }
    // Streaming stores are weakly ordered: make them visible before the block is
    // reported landed (and the engine may read its pages).
    store_fence();
    Ok(crc)
}

/// Below this many bytes a plain copy (aligning a streaming copy costs more).
const STREAMING_MIN: usize = 256;

/// Copy `src` to `dst` with non-temporal (streaming) stores where the CPU has them;
/// a plain copy elsewhere and for short pieces. Callers end a run of these with
/// [`store_fence`].
///
/// # Safety
/// `dst..dst + src.len()` must be writable and not overlap `src`.
pub(crate) unsafe fn copy_streaming(dst: *mut u8, src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAMING_MIN {
        // SAFETY: as the caller guarantees; AVX2 only where the CPU has it.
        unsafe {
            if std::arch::is_x86_feature_detected!("avx2") {
                x86::copy_streaming_avx2(dst, src);
            } else {
                x86::copy_streaming_sse2(dst, src);
            }
        }
        return;
    }
    // SAFETY: as the caller guarantees.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
}

/// Order every streaming store before the stores that follow.
pub(crate) fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Bytes before `dst` reaches `align` (a power of two), at most `len`.
    fn head_len(dst: *mut u8, align: usize, len: usize) -> usize {
        (dst.align_offset(align)).min(len)
    }

    /// # Safety
    /// As `copy_streaming`, and the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_streaming_avx2(dst: *mut u8, src: &[u8]) {
        let len = src.len();
        let head = head_len(dst, 32, len);
        // SAFETY: every access stays inside `dst..dst + len` and `src`; streaming
        // stores go to 32-byte-aligned addresses (after `head`).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
            let mut i = head;
            while i + 64 <= len {
                let s = src.as_ptr().add(i).cast::<__m256i>();
                let d = dst.add(i).cast::<__m256i>();
                _mm256_stream_si256(d, _mm256_loadu_si256(s));
                _mm256_stream_si256(d.add(1), _mm256_loadu_si256(s.add(1)));
                i += 64;
            }
            std::ptr::copy_nonoverlapping(src.as_ptr().add(i), dst.add(i), len - i);
        }
    }

    /// # Safety
    /// As `copy_streaming`.
    pub(super) unsafe fn copy_streaming_sse2(dst: *mut u8, src: &[u8]) {
        let len = src.len();
        let head = head_len(dst, 16, len);
        // SAFETY: as above, 16-byte-aligned streaming stores (SSE2 is part of x86_64).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
            let mut i = head;
            while i + 64 <= len {
                let s = src.as_ptr().add(i).cast::<__m128i>();
                let d = dst.add(i).cast::<__m128i>();
                _mm_stream_si128(d, _mm_loadu_si128(s));
                _mm_stream_si128(d.add(1), _mm_loadu_si128(s.add(1)));
                _mm_stream_si128(d.add(2), _mm_loadu_si128(s.add(2)));
                _mm_stream_si128(d.add(3), _mm_loadu_si128(s.add(3)));
                i += 64;
            }
            std::ptr::copy_nonoverlapping(src.as_ptr().add(i), dst.add(i), len - i);
        }
    }

    #[cfg(test)]
    pub(super) fn sse2(dst: *mut u8, src: &[u8]) {
        // SAFETY: test buffers, disjoint and in bounds.
        unsafe { copy_streaming_sse2(dst, src) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length around the streaming threshold and the 64-byte step, at every
    /// destination misalignment within a line: the bytes written are exactly the
    /// source's, and nothing before or after the destination range changes.
    fn check(copy: impl Fn(*mut u8, &[u8])) {
        let src: Vec<u8> = (0..5000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        for len in (0..600).chain([1000, 4095, 4096, 4097, 4999]) {
            for dst_off in 0..64 {
                for src_off in [0, 1, 7] {
                    if src_off + len > src.len() {
                        continue;
                    }
                    let mut dst = vec![0xA5u8; len + 256];
                    let piece = &src[src_off..src_off + len];
                    // SAFETY: `dst_off + len < dst.len()`.
                    copy(unsafe { dst.as_mut_ptr().add(dst_off) }, piece);
                    store_fence();
                    assert!(
                        dst[..dst_off].iter().all(|&b| b == 0xA5),
                        "len {len} off {dst_off}: before"
                    );
                    assert_eq!(
                        &dst[dst_off..dst_off + len],
                        piece,
                        "len {len} off {dst_off}"
                    );
                    assert!(
                        dst[dst_off + len..].iter().all(|&b| b == 0xA5),
                        "len {len} off {dst_off}: after"
                    );
                }
            }
        }
    }

    #[test]
    fn streaming_copy_writes_exactly_its_range() {
        // SAFETY: `check` hands a writable range of `s.len()` bytes apart from `s`.
        check(|d, s| unsafe { copy_streaming(d, s) });
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_sse2_fallback_writes_exactly_its_range() {
        check(x86::sse2);
    }
}
