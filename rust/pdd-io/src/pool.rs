//! Registered memory, seen as pages.
//!
//! A [`MemoryRegion`] is memory the engine owns (a numpy array, a torch CPU tensor, a
//! Rust `Vec`) that the transport may read and write while a keep-alive owner lives.
//! A [`PagePool`] views one region per layer as `pages` pages of `page_bytes`. The
//! wire never names these addresses: senders address pages relative to a grant and the
//! receiver's bookkeeping (`pdd_core::kv::ReceiverState`) maps them to pool pages,
//! marking each page in flight while exactly one lane writes it.

use std::any::Any;
use std::ptr::NonNull;

use pdd_core::Error;

/// The address and length of one pool page (see [`PagePool::page_raw`]).
#[derive(Debug, Clone, Copy)]
pub struct RawPage {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an address and a length; who may write through it is decided by the
// transfer bookkeeping, as for `MemoryRegion`.
unsafe impl Send for RawPage {}
// SAFETY: as for Send: sharing the address shares no access by itself.
unsafe impl Sync for RawPage {}

impl RawPage {
    /// A page over a test's own buffer.
    #[cfg(test)]
    pub(crate) fn for_test(ptr: *mut u8, len: usize) -> RawPage {
        RawPage {
            ptr: NonNull::new(ptr).expect("a buffer's address"),
            len,
        }
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes in the page.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the page has no bytes (never, for a valid pool).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A span of memory kept alive by an owner.
pub struct MemoryRegion {
    ptr: NonNull<u8>,
    len: usize,
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: the region is a pointer and a length whose target the owner keeps alive and
// in place; it carries no thread affinity. Who may touch which bytes when is decided
// by the transfer bookkeeping (one writer per page, readers only of pages not being
// written), not by the type.
unsafe impl Send for MemoryRegion {}
// SAFETY: as for Send; `&MemoryRegion` hands out raw access only through the unsafe
// page accessors, whose callers uphold the one-writer rule.
unsafe impl Sync for MemoryRegion {}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl MemoryRegion {
    /// A region over `len` bytes at `ptr`, kept alive by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes, and must stay valid and at
    /// the same address for as long as `owner` is alive. Nobody else may write the
    /// memory while a transfer lands in it (readers see the bytes as they land).
    pub unsafe fn from_raw(
        ptr: *mut u8,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<MemoryRegion, Error> {
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| Error::InvalidArgument("null buffer pointer".into()))?;
        Ok(MemoryRegion {
            ptr,
            len,
            _owner: owner,
        })
    }

    /// A region owning a vector (tests, benchmarks, Rust callers).
    pub fn from_vec(bytes: Vec<u8>) -> MemoryRegion {
        let mut boxed = bytes.into_boxed_slice();
        let len = boxed.len();
        // A boxed slice's heap buffer does not move when the box itself is moved into
        // the owner below. Zero-length boxes have a dangling, non-null pointer.
        let ptr = NonNull::new(boxed.as_mut_ptr()).unwrap_or(NonNull::dangling());
        MemoryRegion {
            ptr,
            len,
            _owner: Box::new(boxed),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Where a pool's memory lives. The WAN path reads and writes it with the CPU, so
/// only host memory works there; the local path registers it with UCX, which must be
/// told the kind. CUDA memory is modelled but refused ([`PagePool::with_memory_kind`])
/// until a machine with a GPU tests that path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host (CPU) memory.
    Host,
    /// CUDA device memory.
    Cuda,
}

impl MemoryKind {
    /// `"host"` or `"cuda"`.
    pub fn name(self) -> &'static str {
        match self {
            MemoryKind::Host => "host",
            MemoryKind::Cuda => "cuda",
        }
    }

    /// The LOCAL_ADDR code (`pdd_core::wire::MEMORY_KIND_*`).
    pub fn code(self) -> u8 {
        match self {
            MemoryKind::Host => pdd_core::wire::MEMORY_KIND_HOST,
            MemoryKind::Cuda => pdd_core::wire::MEMORY_KIND_CUDA,
        }
    }
}

/// `layers` regions of `pages x page_bytes` bytes each.
#[derive(Debug)]
pub struct PagePool {
    layers: Vec<MemoryRegion>,
    pages: u32,
    page_bytes: u32,
    memory_kind: MemoryKind,
}

impl PagePool {
    /// A pool over one region per layer; every region must hold the same whole number
    /// of pages.
    pub fn new(layers: Vec<MemoryRegion>, page_bytes: u32) -> Result<PagePool, Error> {
        let arg = |m: String| Err(Error::InvalidArgument(m));
        if layers.is_empty() || layers.len() > usize::from(u16::MAX) {
            return arg(format!(
                "a pool needs 1..=65535 layers, got {}",
                layers.len()
            ));
        }
        if page_bytes == 0 {
            return arg("page_bytes must be >= 1".into());
        }
        let len = layers[0].len();
        if let Some((i, r)) = layers.iter().enumerate().find(|(_, r)| r.len() != len) {
            return arg(format!(
                "layer {i} has {} bytes, layer 0 has {len}",
                r.len()
            ));
        }
        if len == 0 || !len.is_multiple_of(page_bytes as usize) {
            return arg(format!("layer buffers of {len} bytes are not a whole number (>= 1) of {page_bytes}-byte pages"));
        }
        let pages = u32::try_from(len / page_bytes as usize)
            .map_err(|_| Error::InvalidArgument("more than 2^32 pages per layer".into()))?;
        Ok(PagePool {
            layers,
            pages,
            page_bytes,
            memory_kind: MemoryKind::Host,
        })
    }

    /// The same pool, recording that its memory is of `kind`. Only host memory is
    /// accepted today: CUDA memory is refused with `unsupported_memory_kind` until a
    /// machine with a GPU tests its registration.
    pub fn with_memory_kind(self, kind: MemoryKind) -> Result<PagePool, Error> {
        match kind {
            MemoryKind::Host => Ok(PagePool {
                memory_kind: kind,
                ..self
            }),
            MemoryKind::Cuda => Err(Error::UnsupportedMemoryKind {
                kind: kind.name().into(),
                detail: "CUDA memory is not registered by this build (untested without a \
                         GPU); stage the KV in host memory"
                    .into(),
            }),
        }
    }

    /// Where the pool's memory lives.
    pub fn memory_kind(&self) -> MemoryKind {
        self.memory_kind
    }

    /// The address of a page (for registering it with the local path's transport,
    /// and for the local sender's puts). Reading or writing through it is subject to
    /// the same rules as [`PagePool::page`] and [`PagePool::page_raw`].
    pub fn page_addr(&self, layer: u16, page: u32) -> Result<usize, Error> {
        self.page_ptr(layer, page).map(|p| p as usize)
    }

    /// Layers in the pool.
    pub fn layers(&self) -> u16 {
        self.layers.len() as u16
    }

    /// Pages per layer.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// Bytes per page.
    pub fn page_bytes(&self) -> u32 {
        self.page_bytes
    }

    fn page_ptr(&self, layer: u16, page: u32) -> Result<*mut u8, Error> {
        self.unit_ptr(layer, page, self.page_bytes)
    }

    /// The address of unit `unit` of `unit_bytes` (a divisor of the pool's
    /// `page_bytes`: a sub-page grant's page) on `layer`: byte offset
    /// `unit * unit_bytes` of the layer's buffer. `page_addr` is the unit of a whole
    /// page. Access rules as for [`PagePool::page_raw`].
    pub fn unit_addr(&self, layer: u16, unit: u32, unit_bytes: u32) -> Result<usize, Error> {
        self.unit_ptr(layer, unit, unit_bytes).map(|p| p as usize)
    }

    /// Units of `unit_bytes` in one layer, for a sender filling a grant whose pages
    /// are `unit_bytes` long: its source pages then count units of that size. `Err`
    /// (`invalid_argument`) unless `unit_bytes` divides the pool's `page_bytes`.
    pub fn units_per_layer(&self, unit_bytes: u32) -> Result<u64, Error> {
        if unit_bytes == 0 || !self.page_bytes.is_multiple_of(unit_bytes) {
            return Err(Error::InvalidArgument(format!(
                "the grant's page_bytes {unit_bytes} does not divide the source pool's \
                 page_bytes {}",
                self.page_bytes
            )));
        }
        Ok(u64::from(self.pages) * u64::from(self.page_bytes / unit_bytes))
    }

    fn unit_ptr(&self, layer: u16, unit: u32, unit_bytes: u32) -> Result<*mut u8, Error> {
        if unit_bytes == 0 || !self.page_bytes.is_multiple_of(unit_bytes) {
            return Err(Error::InvalidArgument(format!(
                "page_bytes {unit_bytes} does not divide the pool's page_bytes {}",
                self.page_bytes
            )));
        }
        let region = self.layers.get(usize::from(layer)).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "layer {layer} outside the pool's {}",
                self.layers.len()
            ))
        })?;
        let per_page = u64::from(self.page_bytes / unit_bytes);
        let units = u64::from(self.pages) * per_page;
        if u64::from(unit) >= units {
            return Err(if per_page == 1 {
                Error::InvalidArgument(format!("page {unit} outside the pool's {}", self.pages))
            } else {
                Error::InvalidArgument(format!(
                    "unit {unit} outside the pool's {units} units of {unit_bytes} bytes"
                ))
            });
        }
        let offset = unit as usize * unit_bytes as usize;
        // SAFETY: unit < pages * (page_bytes / unit_bytes), so offset + unit_bytes <=
        // pages * page_bytes = region.len: in bounds.
        Ok(unsafe { region.ptr.as_ptr().add(offset) })
    }

    /// The bytes of one page, to read.
    ///
    /// # Safety
    /// No one may write the page while the returned slice is alive.
    pub unsafe fn page(&self, layer: u16, page: u32) -> Result<&[u8], Error> {
        let ptr = self.page_ptr(layer, page)?;
        // SAFETY: in bounds (page_ptr), alive while &self is (the owner lives in the
        // pool); no concurrent writer by the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts(ptr, self.page_bytes as usize) })
    }

    /// Where one page is, to be written by I/O that never forms a Rust reference to
    /// it (`readv` into raw iovecs, a copy through raw pointers): the engine's code
    /// can also reach pool memory, so the receiver holds no `&mut` to a page while a
    /// lane writes it, only this address. Dereferencing it is the caller's `unsafe`:
    /// sound only while `pdd_core::kv::ReceiverState` marks the page in flight for
    /// the caller's lane, and the engine keeps its obligation (docs/kv.md: it does not
    /// touch granted pages until their transfer ends).
    pub fn page_raw(&self, layer: u16, page: u32) -> Result<RawPage, Error> {
        self.unit_raw(layer, page, self.page_bytes)
    }

    /// [`PagePool::page_raw`] of unit `unit` of `unit_bytes` (a sub-page grant's
    /// page: see [`PagePool::unit_addr`]), under the same rules.
    pub fn unit_raw(&self, layer: u16, unit: u32, unit_bytes: u32) -> Result<RawPage, Error> {
        let ptr = self.unit_ptr(layer, unit, unit_bytes)?;
        Ok(RawPage {
            // unit_ptr is in bounds of a region whose base is non-null.
            ptr: NonNull::new(ptr).ok_or_else(|| Error::InvalidArgument("null page".into()))?,
            len: unit_bytes as usize,
        })
    }

    /// The bytes of unit `unit` of `unit_bytes` (see [`PagePool::unit_addr`]), to
    /// read.
    ///
    /// # Safety
    /// No one may write the unit while the returned slice is alive.
    pub unsafe fn unit(&self, layer: u16, unit: u32, unit_bytes: u32) -> Result<&[u8], Error> {
        let ptr = self.unit_ptr(layer, unit, unit_bytes)?;
        // SAFETY: in bounds (unit_ptr), alive while &self is; no concurrent writer by
        // the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts(ptr, unit_bytes as usize) })
    }

    /// Units `first..first + count` of `unit_bytes` on `layer` as one range (they are
    /// adjacent in the layer's buffer): one iovec and one CRC call where a block's
    /// consecutive grant pages are consecutive units here (a mapped transfer's source
    /// side, whose units are often 1/16 of a page). `Err` if any is out of bounds or
    /// `count` is 0. Access rules as for [`PagePool::page_raw`].
    pub fn unit_run_raw(
        &self,
        layer: u16,
        first: u32,
        count: u32,
        unit_bytes: u32,
    ) -> Result<RawPage, Error> {
        let last = count
            .checked_sub(1)
            .and_then(|c| first.checked_add(c))
            .ok_or_else(|| Error::InvalidArgument(format!("unit run {first}+{count}")))?;
        // Both ends in bounds of the same layer's region: the range between is too.
        self.unit_ptr(layer, last, unit_bytes)?;
        let ptr = self.unit_ptr(layer, first, unit_bytes)?;
        Ok(RawPage {
            ptr: NonNull::new(ptr).ok_or_else(|| Error::InvalidArgument("null page".into()))?,
            len: count as usize * unit_bytes as usize,
        })
    }

    /// The ranges of `units` (`(layer, unit)` of `unit_bytes`, in wire order), each
    /// run of consecutive units on one layer joined into one range: the same bytes in
    /// the same order, in as few iovecs as the memory allows. Access rules as for
    /// [`PagePool::page_raw`].
    pub fn unit_runs_raw(
        &self,
        units: &[(u16, u32)],
        unit_bytes: u32,
    ) -> Result<Vec<RawPage>, Error> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < units.len() {
            let (layer, first) = units[i];
            let mut n = 1;
            while i + n < units.len()
                && units[i + n].0 == layer
                && u64::from(units[i + n].1) == u64::from(first) + n as u64
            {
                n += 1;
            }
            // n <= units.len(), and first + n - 1 is a u32 unit index: fits.
            out.push(self.unit_run_raw(layer, first, n as u32, unit_bytes)?);
            i += n;
        }
        Ok(out)
    }

    /// A copy of one page (tests and verification; not the data path).
    pub fn copy_page(&self, layer: u16, page: u32) -> Result<Vec<u8>, Error> {
        // SAFETY: copied at once; a concurrent writer could only make the copy stale,
        // which callers that verify after completion do not see.
        unsafe { self.page(layer, page) }.map(<[u8]>::to_vec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_checked() {
        let pool = |lens: &[usize], pb| {
            PagePool::new(
                lens.iter()
                    .map(|&n| MemoryRegion::from_vec(vec![0; n]))
                    .collect(),
                pb,
            )
        };
        assert!(pool(&[], 4).is_err());
        assert!(pool(&[8, 12], 4).is_err());
        assert!(pool(&[10], 4).is_err());
        assert!(pool(&[0], 4).is_err());
        let p = pool(&[12, 12], 4).unwrap();
        assert_eq!((p.layers(), p.pages(), p.page_bytes()), (2, 3, 4));
        assert!(p.copy_page(2, 0).is_err());
        assert!(p.copy_page(0, 3).is_err());
        assert_eq!(p.memory_kind(), MemoryKind::Host);
        assert_eq!(p.page_addr(1, 2).unwrap() - p.page_addr(1, 0).unwrap(), 8);
        let refused = p.with_memory_kind(MemoryKind::Cuda).unwrap_err();
        assert_eq!(refused.reason(), "unsupported_memory_kind");
    }

    #[test]
    fn pages_are_the_right_bytes() {
        let v: Vec<u8> = (0..24).collect();
        let p = PagePool::new(vec![MemoryRegion::from_vec(v)], 8).unwrap();
        assert_eq!(p.copy_page(0, 1).unwrap(), (8..16).collect::<Vec<u8>>());
        // SAFETY: the test is the pool's only user.
        let page = p.page_raw(0, 2).unwrap();
        // SAFETY: the test owns the pool; nothing else touches the page.
        unsafe { std::ptr::write_bytes(page.as_ptr(), 7, page.len()) };
        assert_eq!(p.copy_page(0, 2).unwrap(), vec![7; 8]);
    }

    #[test]
    fn units_are_sub_page_slices_of_the_layer() {
        let v: Vec<u8> = (0..24).collect();
        let p = PagePool::new(vec![MemoryRegion::from_vec(v)], 8).unwrap();
        // SAFETY: the test is the pool's only user.
        assert_eq!(unsafe { p.unit(0, 5, 2) }.unwrap(), &[10, 11]);
        let base = p.page_addr(0, 0).unwrap();
        assert_eq!(p.unit_addr(0, 11, 2).unwrap(), base + 22);
        assert_eq!(p.unit_raw(0, 3, 4).unwrap().len(), 4);
        assert!(p.unit_raw(0, 12, 2).is_err(), "past the layer");
        assert!(p.unit_raw(0, 0, 3).is_err(), "3 does not divide 8");
        assert!(p.unit_raw(0, 0, 16).is_err(), "larger than a page");
    }

    #[test]
    fn unit_runs_join_consecutive_units_of_one_layer_only() {
        let p = PagePool::new(
            vec![
                MemoryRegion::from_vec((0..24).collect()),
                MemoryRegion::from_vec((100..124).collect()),
            ],
            8,
        )
        .unwrap();
        let runs = p
            .unit_runs_raw(
                &[(0, 2), (0, 3), (0, 4), (0, 7), (1, 8), (1, 9), (0, 10)],
                2,
            )
            .unwrap();
        let bytes = |r: &RawPage| {
            // SAFETY: the test is the pool's only user.
            unsafe { std::slice::from_raw_parts(r.as_ptr(), r.len()) }.to_vec()
        };
        let got: Vec<Vec<u8>> = runs.iter().map(bytes).collect();
        assert_eq!(
            got,
            vec![
                (4..10).collect::<Vec<u8>>(),
                vec![14, 15],
                (116..120).collect(),
                vec![20, 21],
            ]
        );
        assert!(
            p.unit_runs_raw(&[(0, 11), (0, 12)], 2).is_err(),
            "a run past the layer"
        );
        assert!(p.unit_run_raw(0, 0, 0, 2).is_err(), "an empty run");
        assert!(
            p.unit_run_raw(0, u32::MAX, 2, 2).is_err(),
            "an index past u32"
        );
    }
}
