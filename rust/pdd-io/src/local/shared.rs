//! Shared pools: memory UCX allocated for a local receiver's pool, and the sender's
//! side of it, a key whose memory UCX maps into the sender's process. A receiver
//! grants pages of a [`SharedAllocation`] under its one key instead of registering
//! them; a sender on the same host that can map the key ([`attached_mapping`],
//! `ucp_rkey_ptr`) copies each page in itself ([`super::ucx::UcxEndpoint::put_all`]),
//! every copy checked against the mapping its unpack attached ([`Mapped`]). One copy,
//! by the sender; nothing for the receiver to do.

use std::collections::HashSet;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use pdd_core::Error;

use super::lock;
use super::ucx::{pack, unmap_one, worker, State, Worker};
use super::ucx_ffi::{self as ffi, Handle};

/// Where a mapped key's memory is in this process: the mapping its unpack attached,
/// `(start, end)`, and the distance from a remote address to its local one (one
/// attachment maps the remote memory contiguously, and UCX's `ucp_rkey_ptr` for such
/// a key is the remote address plus a fixed offset, so one distance serves every
/// address; [`super::ucx::UcxEndpoint::put_all`] places each op by it, inside the
/// mapping or not at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapped {
    /// The attached mapping, `(start, end)`.
    pub range: (usize, usize),
    /// Local address minus remote address (wrapping).
    pub delta: usize,
}

impl Mapped {
    /// The local address of `remote` by the mapping's distance (not bounds-checked).
    fn local(&self, remote: u64) -> usize {
        (remote as usize).wrapping_add(self.delta)
    }

    /// Where op's bytes go in this process, if they lie whole inside the mapping.
    pub fn target(&self, remote: u64, len: usize) -> Option<usize> {
        let dst = self.local(remote);
        inside(dst, len, self.range).then_some(dst)
    }
}

/// Of the shared mappings `after` an unpack, the one holding `p` that was not there
/// `before` it (what the unpack attached), if any.
fn pick_attached(
    after: HashSet<(usize, usize)>,
    before: &HashSet<(usize, usize)>,
    p: usize,
) -> Option<(usize, usize)> {
    after
        .into_iter()
        .find(|&(a, b)| a <= p && p < b && !before.contains(&(a, b)))
}

/// The shared mappings of this process, `(start, end)`, from `/proc/self/maps`
/// (empty where it cannot be read: then nothing is mapped directly).
pub(super) fn shared_mappings() -> HashSet<(usize, usize)> {
    std::fs::read_to_string("/proc/self/maps")
        .map(|text| parse_shared_mappings(&text))
        .unwrap_or_default()
}

/// The `(start, end)` of every shared (`s` in the permissions) mapping in a
/// `/proc/<pid>/maps` text.
pub fn parse_shared_mappings(text: &str) -> HashSet<(usize, usize)> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            let range = parts.next()?;
            let perms = parts.next()?;
            if perms.as_bytes().get(3) != Some(&b's') {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            let (a, b) = (
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            );
            (a < b).then_some((a, b))
        })
        .collect()
}

/// The mapping that unpacking `rkey` attached to this process and that holds the
/// key's address `probe`, if UCX maps the key's memory here at all: a shared mapping
/// absent `before` the unpack. Only such a mapping is ever written directly, so a
/// receiver's key or addresses can never point the copies at other memory of ours.
pub(super) fn attached_mapping(
    s: &State,
    rkey: Handle,
    probe: u64,
    before: &HashSet<(usize, usize)>,
) -> Option<Mapped> {
    let mut p: Handle = std::ptr::null_mut();
    // SAFETY: a live key of this worker; out-pointer valid. UCX only computes an
    // address (or answers that the memory is not reachable this way).
    let st = unsafe { (s.api.rkey_ptr)(rkey, probe, &mut p) };
    if st != ffi::UCS_OK || p.is_null() {
        return None;
    }
    let p = p as usize;
    pick_attached(shared_mappings(), before, p).map(|range| Mapped {
        range,
        delta: p.wrapping_sub(probe as usize),
    })
}

/// Mappings up to this size are populated when attached ([`populate`]); a larger one
/// fills its page tables as copies first touch it (populating costs page-table memory,
/// about 0.2% of the mapping, and time, tens of ms per GiB, at the first grant).
pub const POPULATE_MAX: usize = 8 << 30;

/// Populate a fresh mapping's page tables (writable) now, not on the first copy's
/// page faults (a 256 MiB first transfer otherwise spends most of its time in them).
/// Best effort: kernels before 5.14 lack MADV_POPULATE_WRITE.
pub(super) fn populate((start, end): (usize, usize)) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    if end - start > POPULATE_MAX {
        return;
    }
    // SAFETY: the range is a whole mapping of this process (from /proc/self/maps);
    // populating changes no contents, only when pages are faulted in.
    unsafe { libc::madvise(start as *mut libc::c_void, end - start, MADV_POPULATE_WRITE) };
}

/// Whether `start..start + len` lies inside `range` (no overflow).
pub fn inside(start: usize, len: usize, (a, b): (usize, usize)) -> bool {
    start >= a && start.checked_add(len).is_some_and(|end| end <= b)
}

/// Memory UCX allocated (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`: shared memory
/// where UCX can, SysV with Debian's UCX), for a local receiver's pool. A local
/// receiver grants pages inside it without registering them: the whole allocation's
/// key goes to the sender, which (on the same host) maps the memory and copies
/// into it directly: one copy, by the sender, nothing for the receiver to do.
/// The trade (`docs/security.md`): a sender holding the key can reach the whole
/// allocation for as long as its session lives, not only the granted pages.
/// Released (unmapped) when dropped.
pub struct SharedAllocation {
    worker: Arc<Worker>,
    id: u64,
    addr: usize,
    len: usize,
}

impl std::fmt::Debug for SharedAllocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedAllocation")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// A live allocation as a receiver's grant looks it up.
struct Exposed {
    id: u64,
    start: usize,
    len: usize,
    key: Arc<[u8]>,
}

/// Live allocations.
static ALLOCATIONS: Mutex<Vec<Exposed>> = Mutex::new(Vec::new());

/// Bound on waiting for the UCX thread to make an allocation (it may be in the middle
/// of another endpoint's puts, each bounded by its own timeout).
pub const ALLOCATE_BOUND: Duration = Duration::from_secs(60);

/// This machine's physical memory in bytes, where the OS says.
fn physical_memory() -> Option<usize> {
    // SAFETY: sysconf only reads the system's configuration.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let (pages, page) = (usize::try_from(pages).ok()?, usize::try_from(page).ok()?);
    (pages > 0 && page > 0).then(|| pages.saturating_mul(page))
}

impl SharedAllocation {
    /// Allocate `len` bytes (zeroed) through the process's UCX worker and populate
    /// them, so the first transfer into them pays no page faults.
    ///
    /// More than the machine's physical memory is refused (`InvalidArgument`): UCX
    /// backs the allocation with shared memory (a tmpfs file) and fills it as it
    /// maps it, so a request for terabytes filled /dev/shm and had the process killed
    /// for want of memory instead of failing.
    pub fn new(len: usize) -> Result<SharedAllocation, Error> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "an allocation needs >= 1 byte".into(),
            ));
        }
        if let Some(max) = physical_memory().filter(|&max| len > max) {
            return Err(Error::InvalidArgument(format!(
                "an allocation of {len} bytes is more than this machine's {max} bytes of memory"
            )));
        }
        let worker = worker()?;
        let (tx, rx) = mpsc::channel();
        lock(&worker.commands)
            .send(Box::new(move |s: &mut State| {
                let made = allocate_one(s, len);
                if let Err(mpsc::SendError(Ok((id, ..)))) = tx.send(made) {
                    // The caller gave up waiting (ALLOCATE_BOUND): nobody owns it.
                    unmap_one(s, id);
                }
            }))
            .map_err(|_| Error::LocalTransport {
                op: "thread",
                detail: "the UCX thread ended".into(),
            })?;
        let (id, addr, mapped_len, key) = match rx.recv_timeout(ALLOCATE_BOUND) {
            Ok(made) => made?,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(Error::DeadlineExceeded {
                    what: format!("a UCX allocation of {len} bytes within {ALLOCATE_BOUND:?}"),
                })
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Error::LocalTransport {
                    op: "thread",
                    detail: "the UCX thread ended".into(),
                })
            }
        };
        populate((addr, addr + mapped_len));
        lock(&ALLOCATIONS).push(Exposed {
            id,
            start: addr,
            len,
            key: key.into(),
        });
        Ok(SharedAllocation {
            worker,
            id,
            addr,
            len,
        })
    }

    /// First byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (an allocation has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SharedAllocation {
    fn drop(&mut self) {
        lock(&ALLOCATIONS).retain(|a| a.id != self.id);
        let id = self.id;
        let _ = lock(&self.worker.commands).send(Box::new(move |s: &mut State| unmap_one(s, id)));
    }
}

/// The packed key of the live [`SharedAllocation`] holding `addr..addr + len`, if
/// any: a local receiver grants such pages under it instead of registering them.
pub fn shared_key(addr: usize, len: usize) -> Option<Arc<[u8]>> {
    lock(&ALLOCATIONS)
        .iter()
        .find(|a| inside(addr, len, (a.start, a.start + a.len)))
        .map(|a| a.key.clone())
}

pub(super) fn allocate_one(
    s: &mut State,
    len: usize,
) -> Result<(u64, usize, usize, Vec<u8>), Error> {
    let mut p = ffi::MemMapParams::zeroed();
    p.field_mask = ffi::MEM_MAP_FIELD_LENGTH | ffi::MEM_MAP_FIELD_FLAGS;
    p.length = len;
    p.flags = ffi::MEM_MAP_ALLOCATE;
    let mut memh: Handle = std::ptr::null_mut();
    // SAFETY: `p` outlives the call; UCX allocates the memory and owns it until
    // ucp_mem_unmap.
    let st = unsafe { (s.api.mem_map)(s.context, &p, &mut memh) };
    s.api.check("ucp_mem_map", st)?;
    let id = s.id();
    s.memhs.insert(id, memh);
    let mut attr = ffi::MemAttr::zeroed();
    attr.field_mask = ffi::MEM_ATTR_FIELD_ADDRESS | ffi::MEM_ATTR_FIELD_LENGTH;
    // SAFETY: memh was just mapped on this context; `attr` is writable.
    let st = unsafe { (s.api.mem_query)(memh, &mut attr) };
    let queried = s.api.check("ucp_mem_query", st).and_then(|()| {
        if attr.address.is_null() || attr.length < len {
            Err(Error::LocalTransport {
                op: "ucp_mem_query",
                detail: format!(
                    "allocated {} bytes at {:?} for {len}",
                    attr.length, attr.address
                ),
            })
        } else {
            Ok(())
        }
    });
    let packed = queried.and_then(|()| pack(s, memh));
    match packed {
        Ok(key) => Ok((id, attr.address as usize, attr.length, key)),
        Err(e) => {
            unmap_one(s, id);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Refused before UCX is asked (so this runs without UCX too): a terabyte request
    /// once filled /dev/shm and had the process killed.
    #[test]
    fn an_allocation_past_physical_memory_is_refused() {
        let max = physical_memory().expect("Linux says how much memory it has");
        for len in [max + 1, max.saturating_mul(4), usize::MAX] {
            let e = SharedAllocation::new(len).unwrap_err();
            assert_eq!(e.reason(), "invalid_argument", "{e}");
        }
    }

    #[test]
    fn only_shared_mappings_are_taken_from_proc_maps() {
        let text = "\
7f6ea4000000-7f6ea8000000 rw-s 00000000 00:01 1802240                    /SYSV00000000 (deleted)
7f6ea8000000-7f6ea9000000 rw-p 00000000 00:00 0
7f6eada71000-7f6eada74000 r--s 00000000 00:01 1769534                    /dev/shm/x
garbage line
7f6eadb00000-7f6eadb00000 rw-s 00000000 00:01 1 /empty
";
        let got = parse_shared_mappings(text);
        let want: HashSet<(usize, usize)> = [
            (0x7f6e_a400_0000, 0x7f6e_a800_0000),
            (0x7f6e_ada7_1000, 0x7f6e_ada7_4000),
        ]
        .into_iter()
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_copy_must_lie_whole_inside_its_mapping() {
        let m = (0x1000, 0x3000);
        assert!(inside(0x1000, 0x2000, m));
        assert!(inside(0x2fff, 1, m));
        assert!(!inside(0x2fff, 2, m));
        assert!(!inside(0x0fff, 1, m));
        assert!(!inside(usize::MAX - 1, 4, m));
    }

    #[test]
    fn a_mapped_key_places_ops_by_its_distance_and_only_inside() {
        // Remote 0x10_0000.. is mapped at local 0x7000_0000..0x7000_2000.
        let m = Mapped {
            range: (0x7000_0000, 0x7000_2000),
            delta: 0x7000_0000usize.wrapping_sub(0x10_0000),
        };
        assert_eq!(m.target(0x10_0000, 0x2000), Some(0x7000_0000));
        assert_eq!(m.target(0x10_1000, 16), Some(0x7000_1000));
        assert_eq!(m.target(0x10_1ff8, 16), None);
        assert_eq!(m.target(0x0f_fff8, 8), None);
        assert_eq!(m.target(u64::MAX, 1), None);
        // A mapping below its remote addresses (negative distance) works the same.
        let low = Mapped {
            range: (0x1000, 0x2000),
            delta: 0x1000usize.wrapping_sub(0x9000),
        };
        assert_eq!(low.target(0x9800, 0x800), Some(0x1800));
        assert_eq!(low.target(0x8fff, 1), None);
    }

    #[test]
    fn only_a_mapping_the_unpack_attached_is_taken() {
        let before: HashSet<(usize, usize)> = [(0x1000, 0x3000)].into_iter().collect();
        let after: HashSet<(usize, usize)> =
            [(0x1000, 0x3000), (0x8000, 0x9000)].into_iter().collect();
        // The address lies in a mapping that was there before: not the key's.
        assert_eq!(pick_attached(after.clone(), &before, 0x2000), None);
        assert_eq!(
            pick_attached(after.clone(), &before, 0x8fff),
            Some((0x8000, 0x9000))
        );
        assert_eq!(pick_attached(after, &before, 0x9000), None);
    }

    proptest::proptest! {
        /// Whatever the receiver's addresses and the mapping's distance, a target is
        /// only ever given inside the mapping, whole.
        #[test]
        fn a_target_is_always_inside_the_mapping(
            a in proptest::prelude::any::<usize>(),
            span in 0usize..1 << 40,
            delta in proptest::prelude::any::<usize>(),
            remote in proptest::prelude::any::<u64>(),
            len in 0usize..1 << 32,
        ) {
            let m = Mapped { range: (a, a.saturating_add(span)), delta };
            if let Some(dst) = m.target(remote, len) {
                proptest::prop_assert!(dst >= m.range.0);
                proptest::prop_assert!(dst.checked_add(len).is_some_and(|e| e <= m.range.1));
            }
        }

        /// The maps parser takes any text without panicking, and returns only
        /// non-empty ranges.
        #[test]
        fn any_maps_text_parses_without_panicking(text in "[0-9a-f\\-rwxsp \n/]{0,400}") {
            for (a, b) in parse_shared_mappings(&text) {
                proptest::prop_assert!(a < b);
            }
        }
    }

    #[test]
    fn this_process_maps_are_readable() {
        // The mappings come from /proc/self/maps: a shared mapping made here shows.
        let len = 1 << 16;
        // SAFETY: a fresh anonymous shared mapping, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let a = p as usize;
        assert!(shared_mappings()
            .iter()
            .any(|&(s, e)| s <= a && a + len <= e));
        // SAFETY: mapped above, unmapped once.
        unsafe { libc::munmap(p, len) };
    }
}
