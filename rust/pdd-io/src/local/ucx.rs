//! A safe wrapper over [`super::ucx_ffi`]: one UCX context and worker per process,
//! owned by one dedicated thread that also drives the worker's progress, and
//! [`UcxEndpoint`]s (one per local sender or receiver) that own their UCX objects
//! (endpoint, registrations, unpacked keys) on it.
//!
//! Every UCX call runs on the worker's thread (the worker is single-threaded,
//! `UCS_THREAD_MODE_SINGLE`): callers send it closures and await the answer. Between
//! commands the thread progresses the worker (a receiver's worker must progress for
//! puts to land wherever UCX emulates them with active messages: on TCP, and with
//! UCX 1.13 on one host too, where puts into memory UCX did not allocate go through
//! the shared-memory FIFO, never CMA). While a [`BusyGuard`] lives (a receiver
//! holds one per live transfer into registered pages; into a shared pool the sender
//! copies itself, [`super::shared`]) it never sleeps; otherwise, after [`SPIN`] without any event it waits on its command
//! queue for at most [`IDLE_WAIT`] between two progress calls: a command wakes it at
//! once, and an idle process costs a thousand wake-ups a second, not a core. (UCX's
//! wakeup feature is not used: it leaves out transports without event support, CMA
//! and shared memory among them.)
//!
//! Why one worker per process, never destroyed: UCX 1.13 aborts the whole process
//! (`ucs_fatal` in `ucp_request_send_state_ff`, from `ucp_worker_destroy` purging an
//! endpoint's pending queue) when a worker is destroyed while one of its internal
//! endpoints still holds a reply to a peer that went away, which is what a receiver
//! whose sender vanished mid-transfer has (seen here, on TCP). An endpoint's own
//! objects are released when it is dropped; the worker lives as long as the process,
//! as UCX applications usually keep theirs. `UCX_*` settings (`UCX_TLS`) are read
//! once, when the process's first local endpoint starts.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use pdd_core::Error;
use tokio::sync::oneshot;

use super::lock;
use super::shared::{attached_mapping, populate, shared_mappings, Mapped};
use super::ucx_ffi::{self as ffi, Api, Handle, Nbx};

/// Longest sleep of an idle worker thread between two progress calls.
pub const IDLE_WAIT: Duration = Duration::from_millis(1);
/// How long the thread keeps polling after the last event before it sleeps.
pub const SPIN: Duration = Duration::from_millis(2);
/// Bound on closing an endpoint (a peer that went away answers nothing).
const CLOSE_BOUND: Duration = Duration::from_secs(1);
/// Keys of mapped memory one endpoint keeps unpacked (one per receiver pool
/// allocation in practice); past this, such keys are unpacked per grant.
pub const MAX_SESSION_KEYS: usize = 1024;

/// One put: `len` bytes at local `src` to `remote` under the unpacked key `rkey`.
#[derive(Debug, Clone, Copy)]
pub struct PutOp {
    /// Local source address (host memory the caller keeps alive until the put's
    /// flush returns).
    pub src: usize,
    /// Bytes.
    pub len: usize,
    /// Remote address, inside the region the key was packed for.
    pub remote: u64,
    /// Key id from [`UcxEndpoint::unpack`].
    pub rkey: u64,
}

pub(super) type Command = Box<dyn FnOnce(&mut State) + Send>;

/// The worker thread's UCX objects.
pub(super) struct State {
    pub(super) api: &'static Api,
    pub(super) context: Handle,
    pub(super) worker: Handle,
    pub(super) eps: HashMap<u64, Handle>,
    pub(super) memhs: HashMap<u64, Handle>,
    pub(super) rkeys: HashMap<u64, Handle>,
    /// Keys whose memory UCX mapped into this process (`ucp_rkey_ptr`): the one
    /// mapping each key's unpack attached. Ops under these keys are copied straight
    /// into it; an op outside it is refused.
    pub(super) direct: HashMap<u64, Mapped>,
    pub(super) next_id: u64,
}

impl State {
    fn progress(&mut self) -> u32 {
        // SAFETY: the worker is alive (never destroyed) and used only by this thread.
        unsafe { (self.api.worker_progress)(self.worker) }
    }

    pub(super) fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Progress until `req` completes or `deadline` passes; frees it either way.
    fn wait(&mut self, op: &'static str, req: Handle, deadline: Instant) -> Result<(), Error> {
        loop {
            if self.progress() == 0 {
                // Nothing moved: let the peer's thread run (on a host with more
                // runnable threads than cores, a spinning waiter starves the very
                // process whose progress it waits for).
                std::thread::yield_now();
            }
            // SAFETY: `req` is a live request returned by a *_nbx call of this
            // worker and not yet freed.
            let status = unsafe { (self.api.request_check_status)(req) };
            if status != ffi::UCS_INPROGRESS {
                // SAFETY: as above; freed exactly once, here.
                unsafe { (self.api.request_free)(req) };
                return self.api.check(op, status);
            }
            if Instant::now() >= deadline {
                // SAFETY: as above. A request freed before it completes is released
                // by UCX when it does.
                unsafe { (self.api.request_free)(req) };
                return Err(Error::DeadlineExceeded {
                    what: format!("UCX {op}"),
                });
            }
        }
    }

    fn finish_nbx(
        &mut self,
        op: &'static str,
        ptr: Handle,
        deadline: Instant,
    ) -> Result<(), Error> {
        match ffi::nbx(ptr) {
            Nbx::Done => Ok(()),
            Nbx::Failed(s) => self.api.check(op, s),
            Nbx::Pending(req) => self.wait(op, req, deadline),
        }
    }

    fn ep(&self, id: Option<u64>) -> Result<Handle, Error> {
        id.and_then(|id| self.eps.get(&id).copied())
            .ok_or_else(|| Error::LocalTransport {
                op: "put",
                detail: "no endpoint: not connected, or closed after a failure".into(),
            })
    }

    /// Close an endpoint, cancelling what it still has queued (bounded).
    fn close_ep(&mut self, id: u64) {
        if let Some(ep) = self.eps.remove(&id) {
            let mut param = ffi::RequestParam::zeroed();
            param.op_attr_mask = ffi::OP_ATTR_FIELD_FLAGS;
            param.flags = ffi::EP_CLOSE_FLAG_FORCE;
            // SAFETY: a live endpoint of this worker, removed from the table so
            // closed once; `param` outlives the call.
            let r = unsafe { (self.api.ep_close_nbx)(ep, &param) };
            let _ = self.finish_nbx("ucp_ep_close_nbx", r, Instant::now() + CLOSE_BOUND);
        }
    }
}

/// The process's worker: its thread's queue, busy count and address.
pub(super) struct Worker {
    api: &'static Api,
    pub(super) commands: Mutex<mpsc::Sender<Command>>,
    busy: Arc<AtomicUsize>,
    address: Vec<u8>,
}

static WORKER: OnceLock<Result<Arc<Worker>, Error>> = OnceLock::new();

pub(super) fn worker() -> Result<Arc<Worker>, Error> {
    // A library given by PDD_UCX_LIBRARY is checked afresh each time (tests point
    // it at a missing one); the worker itself uses the process's libucp.
    if std::env::var_os(ffi::ENV_UCP_LIBRARY).is_some() {
        ffi::api()?;
    }
    WORKER.get_or_init(start_worker).clone()
}

fn start_worker() -> Result<Arc<Worker>, Error> {
    let api = ffi::api()?;
    let (ready_tx, ready_rx) = mpsc::channel::<Result<Vec<u8>, Error>>();
    let (commands, inbox) = mpsc::channel::<Command>();
    let busy = Arc::new(AtomicUsize::new(0));
    let b = busy.clone();
    std::thread::Builder::new()
        .name("pdd-ucx".into())
        .spawn(move || match create(api) {
            Ok(mut state) => {
                let _ = ready_tx.send(worker_address(&state));
                run(&mut state, &inbox, &b);
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })
        .map_err(|e| Error::LocalTransport {
            op: "thread",
            detail: e.to_string(),
        })?;
    let address = ready_rx.recv().map_err(|_| Error::LocalTransport {
        op: "ucp_init",
        detail: "the UCX thread ended during start-up".into(),
    })??;
    Ok(Arc::new(Worker {
        api,
        commands: Mutex::new(commands),
        busy,
        address,
    }))
}

/// UCX's version as `major.minor.release`, loading the library if needed.
pub fn version() -> Result<String, Error> {
    let (a, b, c) = ffi::api()?.version;
    Ok(format!("{a}.{b}.{c}"))
}

/// The UCX library in use (loading it if needed): a soname, or the path of the
/// libucx wheel's copy.
pub fn library() -> Result<String, Error> {
    Ok(ffi::api()?.library.clone())
}

/// One local endpoint's UCX objects on the process's worker: at most one endpoint
/// to a peer, the memory it registered, the keys it unpacked. Dropping it closes
/// the endpoint, then destroys the keys and unmaps the memory, in that order.
pub struct UcxEndpoint {
    worker: Arc<Worker>,
    ep: Mutex<Option<u64>>,
    memory: Arc<Mutex<HashSet<u64>>>,
    keys: Arc<Mutex<HashSet<u64>>>,
    /// Keys of mapped (shared) memory, unpacked once for the endpoint's life (see
    /// [`UcxEndpoint::unpack`]).
    session_keys: Arc<Mutex<SessionKeys>>,
}

/// An endpoint's kept keys: by packed bytes (to find them again) and by id (so that
/// [`UcxEndpoint::destroy`] leaves them alone).
#[derive(Default)]
struct SessionKeys {
    by_key: HashMap<Vec<u8>, u64>,
    ids: HashSet<u64>,
}

impl std::fmt::Debug for UcxEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxEndpoint")
            .field("version", &self.worker.api.version)
            .finish_non_exhaustive()
    }
}

impl UcxEndpoint {
    /// Load UCX and start the process's worker (once: a context with the RMA
    /// feature, transports from the `UCX_*` environment such as `UCX_TLS`), and
    /// return a new endpoint on it.
    pub fn start() -> Result<UcxEndpoint, Error> {
        Ok(UcxEndpoint {
            worker: worker()?,
            ep: Mutex::new(None),
            memory: Default::default(),
            keys: Default::default(),
            session_keys: Default::default(),
        })
    }

    /// Keep the worker progressing without sleeping while the guard lives: a
    /// receiver holds one per live transfer into registered pages, since on
    /// transports that emulate puts
    /// (shared-memory FIFOs, TCP) the bytes only land when the target progresses.
    pub fn busy(&self) -> BusyGuard {
        self.worker.busy.fetch_add(1, Ordering::AcqRel);
        BusyGuard(self.worker.busy.clone())
    }

    /// The worker's address (what a peer creates its endpoint from).
    pub fn worker_address(&self) -> &[u8] {
        &self.worker.address
    }

    /// Run `f` on the worker's thread and await its result.
    async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut State) -> Result<T, Error> + Send + 'static,
    ) -> Result<T, Error> {
        let (tx, rx) = oneshot::channel();
        self.submit(Box::new(move |s| {
            let _ = tx.send(f(s));
        }))?;
        rx.await.map_err(|_| Error::LocalTransport {
            op: "thread",
            detail: "the UCX thread ended".into(),
        })?
    }

    fn submit(&self, cmd: Command) -> Result<(), Error> {
        lock(&self.worker.commands)
            .send(cmd)
            .map_err(|_| Error::LocalTransport {
                op: "thread",
                detail: "the UCX thread ended".into(),
            })
    }

    /// Register `regions` (address, length) of host memory for remote access and
    /// pack a key for each: `(memory id, packed key)`. All or nothing.
    pub async fn map(&self, regions: Vec<(usize, usize)>) -> Result<Vec<(u64, Vec<u8>)>, Error> {
        let mine = self.memory.clone();
        self.call(move |s| {
            let mut out = Vec::with_capacity(regions.len());
            for (addr, len) in regions {
                match map_one(s, addr, len) {
                    Ok(r) => out.push(r),
                    Err(e) => {
                        for (id, _) in out {
                            unmap_one(s, id);
                        }
                        return Err(e);
                    }
                }
            }
            lock(&mine).extend(out.iter().map(|(id, _)| *id));
            Ok(out)
        })
        .await
    }

    /// Revoke registrations: a peer's key for them stops working where the
    /// transport enforces keys (`docs/security.md`). Fire and forget.
    pub fn unmap(&self, ids: Vec<u64>) {
        let mine = self.memory.clone();
        let _ = self.submit(Box::new(move |s| {
            let mut mine = lock(&mine);
            for id in ids {
                if mine.remove(&id) {
                    unmap_one(s, id);
                }
            }
        }));
    }

    /// Create the endpoint to the peer's worker `address`.
    pub async fn connect(&self, address: Vec<u8>) -> Result<(), Error> {
        if lock(&self.ep).is_some() {
            return Err(Error::InvalidArgument("endpoint already connected".into()));
        }
        let id = self
            .call(move |s| {
                // Error handling mode "none": UCX 1.13 refuses peer-failure mode on
                // shared memory and CMA ("Destination is unreachable"). A dead peer
                // is found by the control lane's heartbeat instead, and a put that
                // cannot complete ends at the put timeout.
                let mut p = ffi::EpParams::zeroed();
                p.field_mask = ffi::EP_PARAM_FIELD_REMOTE_ADDRESS;
                p.address = address.as_ptr().cast();
                let mut ep: Handle = std::ptr::null_mut();
                // SAFETY: `p` and the address bytes it points to live across the
                // call; the worker is ours. UCX copies what it needs from the address.
                let st = unsafe { (s.api.ep_create)(s.worker, &p, &mut ep) };
                s.api.check("ucp_ep_create", st)?;
                let id = s.id();
                s.eps.insert(id, ep);
                Ok(id)
            })
            .await?;
        *lock(&self.ep) = Some(id);
        Ok(())
    }

    /// Unpack packed keys on the endpoint: ids for [`PutOp::rkey`]. `probe` is an
    /// address the key covers (a region's first page).
    ///
    /// Where UCX can map the key's memory into this process (`ucp_rkey_ptr`: memory
    /// the receiver had UCX allocate, shared memory on one host), ops under it are
    /// copied straight into that mapping by [`UcxEndpoint::put_all`] (one copy, no
    /// work for the receiver) and the mapping is populated at once, so the first
    /// transfer does not pay its page faults. Such a key is kept: unpacked once for
    /// the endpoint's life (at most [`MAX_SESSION_KEYS`]; the same packed key gets the
    /// same id again), since unmapping and mapping it again per grant would pay the
    /// page faults every time; [`UcxEndpoint::destroy`] leaves it alone. All or
    /// nothing.
    pub async fn unpack(&self, keys: Vec<(Vec<u8>, u64)>) -> Result<Vec<u64>, Error> {
        let ep_id = *lock(&self.ep);
        let mine = self.keys.clone();
        let kept = self.session_keys.clone();
        self.call(move |s| {
            let ep = s.ep(ep_id)?;
            let mut ids = Vec::with_capacity(keys.len());
            // Unpacked by this call and not kept: what a failure must undo.
            let mut fresh = Vec::new();
            for (key, probe) in keys {
                if let Some(&id) = lock(&kept).by_key.get(&key) {
                    ids.push(id);
                    continue;
                }
                let before = shared_mappings();
                let mut rkey: Handle = std::ptr::null_mut();
                // SAFETY: `key` is a buffer the peer's ucp_rkey_pack produced (UCX
                // parses it, bounded by its own format); ep is live.
                let st = unsafe { (s.api.ep_rkey_unpack)(ep, key.as_ptr().cast(), &mut rkey) };
                if let Err(e) = s.api.check("ucp_ep_rkey_unpack", st) {
                    destroy_rkeys(s, &fresh);
                    return Err(e);
                }
                let id = s.id();
                s.rkeys.insert(id, rkey);
                ids.push(id);
                if let Some(mapped) = attached_mapping(s, rkey, probe, &before) {
                    populate(mapped.range);
                    s.direct.insert(id, mapped);
                    let mut kept = lock(&kept);
                    if kept.ids.len() < MAX_SESSION_KEYS {
                        kept.by_key.insert(key, id);
                        kept.ids.insert(id);
                        // Released with the endpoint (Drop destroys every key of it).
                        lock(&mine).insert(id);
                        continue;
                    }
                }
                fresh.push(id);
            }
            lock(&mine).extend(fresh.iter().copied());
            Ok(ids)
        })
        .await
    }

    /// Destroy unpacked keys (the grant ended); kept keys (see
    /// [`UcxEndpoint::unpack`]) stay until the endpoint goes. Fire and forget; runs
    /// after any put already submitted, which has flushed by then.
    pub fn destroy(&self, ids: Vec<u64>) {
        let mine = self.keys.clone();
        let kept = self.session_keys.clone();
        let _ = self.submit(Box::new(move |s| {
            let kept = lock(&kept);
            let mut mine = lock(&mine);
            let ids: Vec<u64> = ids
                .into_iter()
                .filter(|id| !kept.ids.contains(id) && mine.remove(id))
                .collect();
            destroy_rkeys(s, &ids);
        }));
    }

    /// Put every op, then flush the endpoint: returns once every byte is in the
    /// peer's memory (or an error), within `timeout`, with the bytes that went by
    /// direct copy (ops under a key mapped into this process, see
    /// [`UcxEndpoint::unpack`]; each checked to lie inside that key's mapping). A
    /// failed or late flush closes the endpoint (cancelling what it still holds, so
    /// that no put outlives the caller's memory or its key): later calls fail.
    ///
    /// # Safety
    /// Every op's `src..src + len` must be readable host memory that stays alive and
    /// unmodified until this returns.
    pub async unsafe fn put_all(&self, ops: Vec<PutOp>, timeout: Duration) -> Result<u64, Error> {
        let ep_id = *lock(&self.ep);
        self.call(move |s| {
            let deadline = Instant::now() + timeout;
            let ep = s.ep(ep_id)?;
            let param = ffi::RequestParam::zeroed();
            let mut failed = None;
            let (mut direct, mut puts) = (0u64, 0usize);
            // The key of the previous op: ops come in long runs under one key, and the
            // per-op cost matters at 4 KiB pages.
            let mut last: Option<(u64, Handle, Option<Mapped>)> = None;
            for op in &ops {
                let (rkey, mapped) = match last {
                    Some((id, h, m)) if id == op.rkey => (h, m),
                    _ => {
                        let Some(&h) = s.rkeys.get(&op.rkey) else {
                            failed = Some(Error::GrantViolation {
                                transfer_id: 0,
                                detail: "remote key revoked or never unpacked".into(),
                            });
                            break;
                        };
                        let m = s.direct.get(&op.rkey).copied();
                        last = Some((op.rkey, h, m));
                        (h, m)
                    }
                };
                if let Some(m) = mapped {
                    let Some(dst) = m.target(op.remote, op.len) else {
                        failed = Some(Error::GrantViolation {
                            transfer_id: 0,
                            detail: format!(
                                "a region at {:#x} (+{} bytes) lies outside the memory its key maps",
                                op.remote, op.len
                            ),
                        });
                        break;
                    };
                    // SAFETY: src..src+len is readable and alive (the caller's
                    // contract); dst..dst+len lies inside the mapping this key's
                    // unpack attached (Mapped::target checked it), which stays mapped
                    // while the key lives, and nothing else in this process writes
                    // it. The two cannot overlap: the mapping is not the caller's pool.
                    unsafe { std::ptr::copy_nonoverlapping(op.src as *const u8, dst as *mut u8, op.len) };
                    direct += op.len as u64;
                    continue;
                }
                // SAFETY: src..src+len is readable and alive (the caller's
                // contract); rkey and ep are live objects of this worker; `param`
                // (no callback) outlives the call.
                let r = unsafe {
                    (s.api.put_nbx)(ep, op.src as *const _, op.len, op.remote, rkey, &param)
                };
                match ffi::nbx(r) {
                    Nbx::Done => {}
                    Nbx::Failed(st) => {
                        failed = s.api.check("ucp_put_nbx", st).err();
                        break;
                    }
                    // SAFETY: a live request; freeing it lets it complete on its
                    // own (the flush below waits for it).
                    Nbx::Pending(req) => unsafe { (s.api.request_free)(req) },
                }
                puts += 1;
                if puts % 64 == 0 {
                    s.progress();
                }
            }
            // The copies are visible to the receiver before the completion notice the
            // caller sends next (on x86 the socket write orders them anyway).
            std::sync::atomic::fence(Ordering::SeqCst);
            if puts == 0 {
                return failed.map_or(Ok(direct), Err);
            }
            let param = ffi::RequestParam::zeroed();
            // SAFETY: live endpoint, `param` outlives the call.
            let r = unsafe { (s.api.ep_flush_nbx)(ep, &param) };
            // Flushed even after a failed put: the puts issued before it still read
            // the caller's memory until the flush completes.
            let flushed = s.finish_nbx("ucp_ep_flush_nbx", r, deadline);
            if flushed.is_err() {
                if let Some(id) = ep_id {
                    s.close_ep(id);
                }
            }
            match failed {
                Some(e) => Err(e),
                None => flushed.map(|()| direct),
            }
        })
        .await
    }
}

impl Drop for UcxEndpoint {
    fn drop(&mut self) {
        let ep = lock(&self.ep).take();
        let keys: Vec<u64> = lock(&self.keys).drain().collect();
        let memory: Vec<u64> = lock(&self.memory).drain().collect();
        // In this order on the worker's thread: no put may use a key or memory
        // after it is released.
        let _ = self.submit(Box::new(move |s| {
            if let Some(id) = ep {
                s.close_ep(id);
            }
            destroy_rkeys(s, &keys);
            for id in memory {
                unmap_one(s, id);
            }
        }));
    }
}

/// See [`UcxEndpoint::busy`].
#[derive(Debug)]
pub struct BusyGuard(Arc<AtomicUsize>);

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn map_one(s: &mut State, addr: usize, len: usize) -> Result<(u64, Vec<u8>), Error> {
    let mut p = ffi::MemMapParams::zeroed();
    p.field_mask = ffi::MEM_MAP_FIELD_ADDRESS | ffi::MEM_MAP_FIELD_LENGTH;
    p.address = addr as *mut _;
    p.length = len;
    let mut memh: Handle = std::ptr::null_mut();
    // SAFETY: the caller (the local receiver) registers only pages of its pool,
    // which stays alive until it unmaps them; `p` outlives the call.
    let st = unsafe { (s.api.mem_map)(s.context, &p, &mut memh) };
    s.api.check("ucp_mem_map", st)?;
    let key = match pack(s, memh) {
        Ok(k) => k,
        Err(e) => {
            // SAFETY: mapped above, unmapped once.
            unsafe { (s.api.mem_unmap)(s.context, memh) };
            return Err(e);
        }
    };
    let id = s.id();
    s.memhs.insert(id, memh);
    Ok((id, key))
}

/// The packed remote key of a registration.
pub(super) fn pack(s: &State, memh: Handle) -> Result<Vec<u8>, Error> {
    let mut buf: Handle = std::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: memh is mapped on this context; out-pointers are valid.
    let st = unsafe { (s.api.rkey_pack)(s.context, memh, &mut buf, &mut size) };
    s.api.check("ucp_rkey_pack", st)?;
    // SAFETY: UCX returned `size` bytes at `buf`; copied before release.
    let key = unsafe { std::slice::from_raw_parts(buf as *const u8, size) }.to_vec();
    // SAFETY: released once, after the copy.
    unsafe { (s.api.rkey_buffer_release)(buf) };
    Ok(key)
}

pub(super) fn unmap_one(s: &mut State, id: u64) {
    if let Some(memh) = s.memhs.remove(&id) {
        // SAFETY: mapped on this context; removed from the table, so unmapped once.
        unsafe { (s.api.mem_unmap)(s.context, memh) };
    }
}

fn destroy_rkeys(s: &mut State, ids: &[u64]) {
    for id in ids {
        s.direct.remove(id);
        if let Some(rkey) = s.rkeys.remove(id) {
            // SAFETY: unpacked here, removed from the table, so destroyed once.
            unsafe { (s.api.rkey_destroy)(rkey) };
        }
    }
}

fn create(api: &'static Api) -> Result<State, Error> {
    let mut config: Handle = std::ptr::null_mut();
    // SAFETY: NULL prefix and file read the UCX_* environment; out-pointer valid.
    let st = unsafe { (api.config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
    api.check("ucp_config_read", st)?;
    let name = ffi::c_name("pdd_transport");
    let mut params = ffi::UcpParams::zeroed();
    params.field_mask = ffi::PARAM_FIELD_FEATURES | ffi::PARAM_FIELD_NAME;
    params.features = ffi::FEATURE_RMA;
    params.name = name.as_ptr();
    let mut context: Handle = std::ptr::null_mut();
    // SAFETY: params (and the name it points to) and config are valid for the
    // call; API version 1.13 is what the structs follow.
    let st = unsafe { (api.init_version)(1, 13, &params, config, &mut context) };
    // SAFETY: read above, released once.
    unsafe { (api.config_release)(config) };
    api.check("ucp_init", st)?;
    let mut wp = ffi::WorkerParams::zeroed();
    wp.field_mask = ffi::WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = ffi::THREAD_MODE_SINGLE;
    let mut worker: Handle = std::ptr::null_mut();
    // SAFETY: live context; params valid for the call.
    let st = unsafe { (api.worker_create)(context, &wp, &mut worker) };
    if let Err(e) = api.check("ucp_worker_create", st) {
        // SAFETY: created above, cleaned up once (no worker exists on it).
        unsafe { (api.cleanup)(context) };
        return Err(e);
    }
    Ok(State {
        api,
        context,
        worker,
        eps: HashMap::new(),
        memhs: HashMap::new(),
        rkeys: HashMap::new(),
        direct: HashMap::new(),
        next_id: 0,
    })
}

fn worker_address(s: &State) -> Result<Vec<u8>, Error> {
    let mut addr: Handle = std::ptr::null_mut();
    let mut len = 0usize;
    // SAFETY: live worker; out-pointers valid.
    let st = unsafe { (s.api.worker_get_address)(s.worker, &mut addr, &mut len) };
    s.api.check("ucp_worker_get_address", st)?;
    // SAFETY: UCX returned `len` bytes at `addr`; copied, then released once.
    let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
    // SAFETY: as above.
    unsafe { (s.api.worker_release_address)(s.worker, addr) };
    Ok(bytes)
}

fn run(s: &mut State, inbox: &mpsc::Receiver<Command>, busy: &AtomicUsize) {
    let mut last_event = Instant::now();
    loop {
        while let Ok(cmd) = inbox.try_recv() {
            cmd(s);
            last_event = Instant::now();
        }
        if s.progress() != 0 {
            last_event = Instant::now();
            continue;
        }
        if busy.load(Ordering::Acquire) > 0 || last_event.elapsed() < SPIN {
            // Poll, but give the core away between polls (see State::wait).
            std::thread::yield_now();
            continue;
        }
        match inbox.recv_timeout(IDLE_WAIT) {
            Ok(cmd) => {
                cmd(s);
                last_event = Instant::now();
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}
