//! The few UCP (UCX protocol layer) functions the local path uses, loaded at run time.
//!
//! `libucp.so.0` and `libucs.so.0` are opened with `dlopen` (the `libloading` crate)
//! the first time the local path is asked for, never at import: the wheel installs
//! and the WAN path runs where UCX is absent, and asking for the local path there is
//! a [`Error::LocalPathUnavailable`] naming the library that could not be loaded.
//!
//! Only what the local path calls is declared. The parameter structs follow
//! `ucp/api/ucp.h` of UCX 1.13 (the oldest release this was built against); UCX
//! keeps their fields at fixed offsets and only appends new ones, and each struct
//! carries a `field_mask` naming the fields the caller set, so a newer library reads
//! exactly what we set. Every struct is zeroed before use and padded past its 1.13
//! size, so a field we do not set is never read as garbage.
//!
//! Nothing here is safe to call from two threads at once on one worker: the safe
//! wrapper ([`super::ucx`]) gives each context and worker to one thread.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

use libloading::Library;
use pdd_core::Error;

/// `ucs_status_t`: 0 is OK, 1 in progress, negative values are errors.
pub type Status = c_int;
/// `UCS_OK`.
pub const UCS_OK: Status = 0;
/// `UCS_INPROGRESS`.
pub const UCS_INPROGRESS: Status = 1;
/// `UCS_ERR_LAST`: pointers at or above `(uintptr_t)UCS_ERR_LAST` are error codes.
const UCS_ERR_LAST: isize = -100;

/// `UCP_FEATURE_RMA`.
pub const FEATURE_RMA: u64 = 1 << 1;
/// `UCP_PARAM_FIELD_FEATURES`.
pub const PARAM_FIELD_FEATURES: u64 = 1 << 0;
/// `UCP_PARAM_FIELD_NAME`.
pub const PARAM_FIELD_NAME: u64 = 1 << 8;
/// `UCP_WORKER_PARAM_FIELD_THREAD_MODE`.
pub const WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `UCS_THREAD_MODE_SINGLE`: one thread uses the worker.
pub const THREAD_MODE_SINGLE: c_int = 0;
/// `UCP_EP_PARAM_FIELD_REMOTE_ADDRESS`.
pub const EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
/// `UCP_MEM_MAP_PARAM_FIELD_ADDRESS`.
pub const MEM_MAP_FIELD_ADDRESS: u64 = 1 << 0;
/// `UCP_MEM_MAP_PARAM_FIELD_LENGTH`.
pub const MEM_MAP_FIELD_LENGTH: u64 = 1 << 1;
/// `UCP_MEM_MAP_PARAM_FIELD_FLAGS`.
pub const MEM_MAP_FIELD_FLAGS: u64 = 1 << 2;
/// `UCP_MEM_MAP_ALLOCATE`: UCX allocates the memory (shared memory where it can).
pub const MEM_MAP_ALLOCATE: c_uint = 1 << 1;
/// `UCP_MEM_ATTR_FIELD_ADDRESS`.
pub const MEM_ATTR_FIELD_ADDRESS: u64 = 1 << 0;
/// `UCP_MEM_ATTR_FIELD_LENGTH`.
pub const MEM_ATTR_FIELD_LENGTH: u64 = 1 << 1;
/// `UCP_OP_ATTR_FIELD_FLAGS`.
pub const OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
/// `UCP_EP_CLOSE_FLAG_FORCE`.
pub const EP_CLOSE_FLAG_FORCE: u32 = 1;

/// Opaque handles.
pub type Handle = *mut c_void;

/// `ucp_params_t` (80 bytes in 1.13), padded.
#[repr(C)]
pub struct UcpParams {
    pub field_mask: u64,
    pub features: u64,
    _request_size: usize,
    _request_init: usize,
    _request_cleanup: usize,
    _tag_sender_mask: u64,
    _mt_workers_shared: c_int,
    _pad0: c_int,
    _estimated_num_eps: usize,
    _estimated_num_ppn: usize,
    pub name: *const c_char,
    _reserved: [u64; 16],
}

/// `ucp_worker_params_t` (200 bytes in 1.13), padded; only the thread mode is set.
#[repr(C)]
pub struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_int,
    _rest: [u8; 188 + 128],
}

/// `ucp_ep_params_t` (104 bytes in 1.13), padded.
#[repr(C)]
pub struct EpParams {
    pub field_mask: u64,
    pub address: *const c_void,
    _rest: [u8; 88 + 128],
}

/// `ucp_mem_map_params_t` (40 bytes in 1.13), padded.
#[repr(C)]
pub struct MemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    _prot: c_uint,
    _memory_type: c_int,
    _rest: [u8; 4 + 128],
}

/// `ucp_mem_attr_t` (32 bytes in 1.13), padded.
#[repr(C)]
pub struct MemAttr {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    _mem_type: c_int,
    _rest: [u8; 4 + 128],
}

/// `ucp_request_param_t` (72 bytes in 1.13), padded.
#[repr(C)]
pub struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    _rest: [u8; 64 + 128],
}

macro_rules! zeroed_new {
    ($($t:ty),*) => {$(
        impl $t {
            /// All fields zero (an empty `field_mask`).
            pub fn zeroed() -> Self {
                // SAFETY: plain C data: integers and raw pointers, for all of which
                // all-zero bytes are valid.
                unsafe { std::mem::zeroed() }
            }
        }
    )*};
}
zeroed_new!(
    UcpParams,
    WorkerParams,
    EpParams,
    MemMapParams,
    MemAttr,
    RequestParam
);

/// The loaded functions. Fields are function pointers copied out of the libraries,
/// valid while `_ucp` and `_ucs` (kept here) stay loaded.
#[allow(missing_docs)]
pub struct Api {
    /// The library's name as loaded (a soname, or the path of the wheel's copy).
    pub library: String,
    pub config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut Handle) -> Status,
    pub config_release: unsafe extern "C" fn(Handle),
    pub init_version:
        unsafe extern "C" fn(c_uint, c_uint, *const UcpParams, Handle, *mut Handle) -> Status,
    pub cleanup: unsafe extern "C" fn(Handle),
    pub get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint),
    pub worker_create: unsafe extern "C" fn(Handle, *const WorkerParams, *mut Handle) -> Status,
    pub worker_get_address: unsafe extern "C" fn(Handle, *mut Handle, *mut usize) -> Status,
    pub worker_release_address: unsafe extern "C" fn(Handle, Handle),
    pub worker_progress: unsafe extern "C" fn(Handle) -> c_uint,
    pub ep_create: unsafe extern "C" fn(Handle, *const EpParams, *mut Handle) -> Status,
    pub ep_close_nbx: unsafe extern "C" fn(Handle, *const RequestParam) -> Handle,
    pub ep_flush_nbx: unsafe extern "C" fn(Handle, *const RequestParam) -> Handle,
    pub mem_map: unsafe extern "C" fn(Handle, *const MemMapParams, *mut Handle) -> Status,
    pub mem_unmap: unsafe extern "C" fn(Handle, Handle) -> Status,
    pub mem_query: unsafe extern "C" fn(Handle, *mut MemAttr) -> Status,
    pub rkey_ptr: unsafe extern "C" fn(Handle, u64, *mut Handle) -> Status,
    pub rkey_pack: unsafe extern "C" fn(Handle, Handle, *mut Handle, *mut usize) -> Status,
    pub rkey_buffer_release: unsafe extern "C" fn(Handle),
    pub ep_rkey_unpack: unsafe extern "C" fn(Handle, *const c_void, *mut Handle) -> Status,
    pub rkey_destroy: unsafe extern "C" fn(Handle),
    pub put_nbx: unsafe extern "C" fn(
        Handle,
        *const c_void,
        usize,
        u64,
        Handle,
        *const RequestParam,
    ) -> Handle,
    pub request_check_status: unsafe extern "C" fn(Handle) -> Status,
    pub request_free: unsafe extern "C" fn(Handle),
    pub status_string: unsafe extern "C" fn(Status) -> *const c_char,
    /// The library's version, `major.minor.release`.
    pub version: (u32, u32, u32),
    _ucs: Library,
    _ucp: Library,
}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ucx::Api")
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// The default library names (Debian's `libucx0`, and UCX's own builds).
pub const DEFAULT_UCP: &str = "libucp.so.0";
/// See [`DEFAULT_UCP`].
pub const DEFAULT_UCS: &str = "libucs.so.0";
/// Environment variable naming another `libucp` to load (a path or a soname).
pub const ENV_UCP_LIBRARY: &str = "PDD_UCX_LIBRARY";

fn unavailable(detail: String) -> Error {
    Error::LocalPathUnavailable { detail }
}

/// Open `ucp` (and `ucs` next to it) and resolve every function used.
fn open(ucp_name: &str) -> Result<Api, Error> {
    // SAFETY: loading a shared library runs its initialisers. UCX's (libucs's) set up
    // its global configuration and are safe to run in any process; a library given
    // by PDD_UCX_LIBRARY is trusted as much as the process's own environment.
    let ucp = unsafe { Library::new(ucp_name) }.map_err(|e| {
        unavailable(format!(
            "cannot load the UCX library '{ucp_name}' ({e}); install UCX \
             (pip install 'pdd_transport[ucx]', or Debian/Ubuntu: apt-get install \
             libucx0) or use the WAN path"
        ))
    })?;
    // libucs is a dependency of libucp, so it is loaded by now; open it by name for
    // ucs_status_string. Next to a given libucp path first, then the soname.
    let ucs_near = std::path::Path::new(ucp_name)
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map(|p| p.join(DEFAULT_UCS));
    // SAFETY: as above; libucs is already mapped as libucp's dependency.
    let ucs = ucs_near
        .and_then(|p| unsafe { Library::new(p) }.ok())
        .map(Ok)
        .unwrap_or_else(|| unsafe { Library::new(DEFAULT_UCS) })
        .map_err(|e| unavailable(format!("cannot load the UCX library '{DEFAULT_UCS}' ({e})")))?;
    macro_rules! sym {
        ($lib:expr, $name:literal) => {{
            // SAFETY: the symbol is declared with the C signature of ucp.h / ucs's
            // status.h for UCX >= 1.13 (the field's type above); the pointer is copied
            // out and used only while `Api` holds the library open.
            let s = unsafe { $lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                unavailable(format!(
                    "the UCX library '{ucp_name}' lacks {} ({e}); UCX >= 1.13 is needed",
                    $name
                ))
            })?;
            *s
        }};
    }
    let get_version: unsafe extern "C" fn(*mut c_uint, *mut c_uint, *mut c_uint) =
        sym!(ucp, "ucp_get_version");
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: three writable u32s, as ucp_get_version expects.
    unsafe { get_version(&mut major, &mut minor, &mut release) };
    if (major, minor) < (1, 13) {
        return Err(unavailable(format!(
            "the UCX library '{ucp_name}' is version {major}.{minor}; 1.13 or newer is needed"
        )));
    }
    Ok(Api {
        library: ucp_name.to_owned(),
        config_read: sym!(ucp, "ucp_config_read"),
        config_release: sym!(ucp, "ucp_config_release"),
        init_version: sym!(ucp, "ucp_init_version"),
        cleanup: sym!(ucp, "ucp_cleanup"),
        get_version,
        worker_create: sym!(ucp, "ucp_worker_create"),
        worker_get_address: sym!(ucp, "ucp_worker_get_address"),
        worker_release_address: sym!(ucp, "ucp_worker_release_address"),
        worker_progress: sym!(ucp, "ucp_worker_progress"),
        ep_create: sym!(ucp, "ucp_ep_create"),
        ep_close_nbx: sym!(ucp, "ucp_ep_close_nbx"),
        ep_flush_nbx: sym!(ucp, "ucp_ep_flush_nbx"),
        mem_map: sym!(ucp, "ucp_mem_map"),
        mem_unmap: sym!(ucp, "ucp_mem_unmap"),
        mem_query: sym!(ucp, "ucp_mem_query"),
        rkey_ptr: sym!(ucp, "ucp_rkey_ptr"),
        rkey_pack: sym!(ucp, "ucp_rkey_pack"),
        rkey_buffer_release: sym!(ucp, "ucp_rkey_buffer_release"),
        ep_rkey_unpack: sym!(ucp, "ucp_ep_rkey_unpack"),
        rkey_destroy: sym!(ucp, "ucp_rkey_destroy"),
        put_nbx: sym!(ucp, "ucp_put_nbx"),
        request_check_status: sym!(ucp, "ucp_request_check_status"),
        request_free: sym!(ucp, "ucp_request_free"),
        status_string: sym!(ucs, "ucs_status_string"),
        version: (major, minor, release),
        _ucs: ucs,
        _ucp: ucp,
    })
}

static DEFAULT: std::sync::OnceLock<Result<&'static Api, Error>> = std::sync::OnceLock::new();
/// Libraries tried after [`DEFAULT_UCP`] when the system has none (the `libucx-cu12`
/// wheel's `libucp.so.0`, which the Python package finds in site-packages).
static FALLBACKS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
/// Libraries named by `PDD_UCX_LIBRARY`, each opened once (failures are not kept, so
/// a test can point the variable at a missing library and back).
static NAMED: std::sync::Mutex<Vec<(String, &'static Api)>> = std::sync::Mutex::new(Vec::new());

/// Add `path` to the libraries tried when the system's `libucp.so.0` cannot be
/// loaded (at most 16; more are ignored). Only the first load in a process reads the
/// list: a later call changes nothing once UCX was loaded (or failed to load).
pub fn add_fallback(path: &str) {
    let mut list = FALLBACKS.lock().unwrap_or_else(|p| p.into_inner());
    // A process has one or two candidates (the wheel's); past a few, a caller is
    // looping: the list stays bounded.
    if list.len() < 16 && !list.iter().any(|p| p == path) {
        list.push(path.to_owned());
    }
}

fn leak(api: Api) -> &'static Api {
    // Leaked on purpose: handles made from it may outlive any scope; a process keeps
    // at most one per library name.
    &*Box::leak(Box::new(api))
}

/// The UCX API: the library named by `PDD_UCX_LIBRARY` when set, else the system's
/// `libucp.so.0`, else each fallback in turn ([`add_fallback`]); loaded once and kept
/// for the life of the process.
pub fn api() -> Result<&'static Api, Error> {
    if let Ok(name) = std::env::var(ENV_UCP_LIBRARY) {
        if !name.is_empty() && name != DEFAULT_UCP {
            let mut named = NAMED.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((_, api)) = named.iter().find(|(n, _)| *n == name) {
                return Ok(*api);
            }
            let api = leak(open(&name)?);
            named.push((name, api));
            return Ok(api);
        }
    }
    DEFAULT
        .get_or_init(|| {
            let system = match open(DEFAULT_UCP) {
                Ok(api) => return Ok(leak(api)),
                Err(e) => e,
            };
            let fallbacks = FALLBACKS.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let mut tried = Vec::new();
            for path in &fallbacks {
                match open(path) {
                    Ok(api) => return Ok(leak(api)),
                    Err(e) => tried.push(e.to_string()),
                }
            }
            Err(match system {
                Error::LocalPathUnavailable { detail } if !tried.is_empty() => {
                    unavailable(format!(
                        "{detail}; the libucx wheel's library failed too: {}",
                        tried.join("; ")
                    ))
                }
                e => e,
            })
        })
        .clone()
}

impl Api {
    /// UCX's text for a status.
    pub fn status_text(&self, status: Status) -> String {
        // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated
        // string for any status value (an "unknown" text for codes it does not know).
        let p = unsafe { (self.status_string)(status) };
        if p.is_null() {
            return format!("status {status}");
        }
        // SAFETY: non-null, NUL-terminated, static (see above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `Ok` for `UCS_OK`, else the error naming `op`.
    pub fn check(&self, op: &'static str, status: Status) -> Result<(), Error> {
        if status == UCS_OK {
            Ok(())
        } else {
            Err(Error::LocalTransport {
                op,
                detail: self.status_text(status),
            })
        }
    }
}

/// What a `*_nbx` call returned: done, failed, or a request to wait for.
pub enum Nbx {
    /// Completed in place.
    Done,
    /// Failed with this status.
    Failed(Status),
    /// In progress: poll with `request_check_status`, then `request_free`.
    Pending(Handle),
}

/// Classify a `ucs_status_ptr_t` as UCS_PTR_IS_ERR / UCS_PTR_IS_PTR do.
pub fn nbx(ptr: Handle) -> Nbx {
    let v = ptr as usize;
    if v == 0 {
        Nbx::Done
    } else if v >= UCS_ERR_LAST as usize {
        Nbx::Failed(v as isize as Status)
    } else {
        Nbx::Pending(ptr)
    }
}

/// A C string for a context name.
pub fn c_name(name: &str) -> CString {
    CString::new(name.replace('\0', " ")).unwrap_or_default()
}
