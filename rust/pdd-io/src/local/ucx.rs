//! A safe wrapper over [`super::ucx_ffi`]: one UCX context and worker per endpoint,
//! owned by one dedicated thread that also drives the worker's progress.
//!
//! Every UCX call of an endpoint runs on its thread (UCX workers are single-threaded
//! here, `UCS_THREAD_MODE_SINGLE`): callers send it closures and await the answer.
//! Between commands the thread progresses the worker (on TCP, a receiver's worker
//! must progress for puts to land: UCX emulates them with active messages). After
//! [`SPIN`] without any event it waits on its command queue for at most
//! [`IDLE_WAIT`] between two progress calls: a command wakes it at once, and an
//! idle endpoint costs a thousand wake-ups a second, not a core. (UCX's own wakeup
//! feature is not used: it leaves out transports without event support, CMA and
//! shared memory among them.)

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use pdd_core::Error;
use tokio::sync::oneshot;

use super::ucx_ffi::{self as ffi, Api, Handle, Nbx};

/// Longest sleep of an idle endpoint thread between two progress calls.
pub const IDLE_WAIT: Duration = Duration::from_millis(1);
/// How long the thread keeps polling after the last event before it sleeps.
pub const SPIN: Duration = Duration::from_millis(2);

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

type Command = Box<dyn FnOnce(&mut State) + Send>;

/// The thread's UCX objects.
struct State {
    api: &'static Api,
    context: Handle,
    worker: Handle,
    ep: Option<Handle>,
    memhs: HashMap<u64, Handle>,
    rkeys: HashMap<u64, Handle>,
    next_id: u64,
}

impl State {
    fn progress(&mut self) -> u32 {
        // SAFETY: the worker is alive and used only by this thread.
        unsafe { (self.api.worker_progress)(self.worker) }
    }

    /// Progress until `req` completes or `deadline` passes; frees it either way.
    fn wait(&mut self, op: &'static str, req: Handle, deadline: Instant) -> Result<(), Error> {
        loop {
            self.progress();
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

    fn ep(&self) -> Result<Handle, Error> {
        self.ep.ok_or_else(|| Error::LocalTransport {
            op: "put",
            detail: "no endpoint: the peer's worker address never came".into(),
        })
    }

    fn teardown(&mut self) {
        let api = self.api;
        for (_, rkey) in self.rkeys.drain() {
            // SAFETY: unpacked on this worker's endpoint, destroyed once.
            unsafe { (api.rkey_destroy)(rkey) };
        }
        if let Some(ep) = self.ep.take() {
            let mut param = ffi::RequestParam::zeroed();
            param.op_attr_mask = ffi::OP_ATTR_FIELD_FLAGS;
            param.flags = ffi::EP_CLOSE_FLAG_FORCE;
            // SAFETY: a live endpoint of this worker; param outlives the call.
            let r = unsafe { (api.ep_close_nbx)(ep, &param) };
            let _ = self.finish_nbx("ep_close", r, Instant::now() + Duration::from_secs(1));
        }
        for (_, memh) in self.memhs.drain() {
            // SAFETY: mapped on this context, unmapped once.
            unsafe { (api.mem_unmap)(self.context, memh) };
        }
        // SAFETY: nothing of the worker or context is used after this; destroyed once.
        unsafe {
            (api.worker_destroy)(self.worker);
            (api.cleanup)(self.context);
        }
    }
}

/// One endpoint's UCX context, worker and thread.
pub struct UcxEndpoint {
    api: &'static Api,
    commands: mpsc::Sender<Command>,
    stop: Arc<AtomicBool>,
    address: Vec<u8>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for UcxEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxEndpoint")
            .field("version", &self.api.version)
            .finish_non_exhaustive()
    }
}

/// UCX's version as `major.minor.release`, loading the library if needed.
pub fn version() -> Result<String, Error> {
    let (a, b, c) = ffi::api()?.version;
    Ok(format!("{a}.{b}.{c}"))
}

impl UcxEndpoint {
    /// Load UCX (once), create a context (RMA and wakeup features; transports from
    /// `UCX_*` environment variables such as `UCX_TLS`) and a worker on a new thread
    /// named `name`.
    pub fn start(name: &str) -> Result<UcxEndpoint, Error> {
        let api = ffi::api()?;
        let (ready_tx, ready_rx) = mpsc::channel::<Result<Vec<u8>, Error>>();
        let (commands, inbox) = mpsc::channel::<Command>();
        let stop = Arc::new(AtomicBool::new(false));
        let cname = ffi::c_name(name);
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("pdd-ucx-{name}"))
            .spawn(move || match create(api, &cname) {
                Ok(mut state) => {
                    let _ = ready_tx.send(worker_address(&state));
                    run(&mut state, &inbox, &s);
                    state.teardown();
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
        Ok(UcxEndpoint {
            api,
            commands,
            stop,
            address,
            thread: Some(thread),
        })
    }

    /// This worker's address (what a peer creates its endpoint from).
    pub fn worker_address(&self) -> &[u8] {
        &self.address
    }

    /// Run `f` on the endpoint's thread and await its result.
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
        self.commands.send(cmd).map_err(|_| Error::LocalTransport {
            op: "thread",
            detail: "the UCX thread ended".into(),
        })
    }

    /// Register `regions` (address, length) of host memory for remote access and
    /// pack a key for each: `(memory id, packed key)`. All or nothing.
    pub async fn map(&self, regions: Vec<(usize, usize)>) -> Result<Vec<(u64, Vec<u8>)>, Error> {
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
            Ok(out)
        })
        .await
    }

    /// Revoke registrations: a peer's key for them stops working where the
    /// transport enforces keys (`docs/security.md`). Fire and forget.
    pub fn unmap(&self, ids: Vec<u64>) {
        let _ = self.submit(Box::new(move |s| {
            for id in ids {
                unmap_one(s, id);
            }
        }));
    }

    /// Create the endpoint to the peer's worker `address`.
    pub async fn connect(&self, address: Vec<u8>) -> Result<(), Error> {
        self.call(move |s| {
            if s.ep.is_some() {
                return Err(Error::InvalidArgument("endpoint already connected".into()));
            }
            let mut p = ffi::EpParams::zeroed();
            // Error handling mode "none": UCX 1.13 refuses peer-failure mode on
            // shared memory and CMA ("Destination is unreachable"). A dead peer is
            // found by the control lane's heartbeat instead, and a put that cannot
            // complete ends at the put timeout.
            p.field_mask = ffi::EP_PARAM_FIELD_REMOTE_ADDRESS;
            p.address = address.as_ptr().cast();
            let mut ep: Handle = std::ptr::null_mut();
            // SAFETY: `p` and the address bytes it points to live across the call;
            // the worker is ours. UCX copies what it needs from the address.
            let st = unsafe { (s.api.ep_create)(s.worker, &p, &mut ep) };
            s.api.check("ucp_ep_create", st)?;
            s.ep = Some(ep);
            Ok(())
        })
        .await
    }

    /// Unpack packed keys on the endpoint: ids for [`PutOp::rkey`]. All or nothing.
    pub async fn unpack(&self, keys: Vec<Vec<u8>>) -> Result<Vec<u64>, Error> {
        self.call(move |s| {
            let ep = s.ep()?;
            let mut ids = Vec::with_capacity(keys.len());
            for key in keys {
                let mut rkey: Handle = std::ptr::null_mut();
                // SAFETY: `key` is a buffer the peer's ucp_rkey_pack produced (UCX
                // validates its contents, bounded by what it parses); ep is live.
                let st = unsafe { (s.api.ep_rkey_unpack)(ep, key.as_ptr().cast(), &mut rkey) };
                if let Err(e) = s.api.check("ucp_ep_rkey_unpack", st) {
                    destroy_rkeys(s, &ids);
                    return Err(e);
                }
                s.next_id += 1;
                s.rkeys.insert(s.next_id, rkey);
                ids.push(s.next_id);
            }
            Ok(ids)
        })
        .await
    }

    /// Destroy unpacked keys (the grant ended). Fire and forget.
    pub fn destroy(&self, ids: Vec<u64>) {
        let _ = self.submit(Box::new(move |s| destroy_rkeys(s, &ids)));
    }

    /// Put every op, then flush the endpoint: returns once every byte is in the
    /// peer's memory (or an error), within `timeout`.
    ///
    /// # Safety
    /// Every op's `src..src + len` must be readable host memory that stays alive and
    /// unmodified until this returns.
    pub async unsafe fn put_all(&self, ops: Vec<PutOp>, timeout: Duration) -> Result<(), Error> {
        self.call(move |s| {
            let deadline = Instant::now() + timeout;
            let ep = s.ep()?;
            let param = ffi::RequestParam::zeroed();
            let mut failed = None;
            for (i, op) in ops.iter().enumerate() {
                let Some(&rkey) = s.rkeys.get(&op.rkey) else {
                    failed = Some(Error::GrantViolation {
                        transfer_id: 0,
                        detail: "remote key revoked or never unpacked".into(),
                    });
                    break;
                };
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
                if i % 64 == 63 {
                    s.progress();
                }
            }
            let param = ffi::RequestParam::zeroed();
            // SAFETY: live endpoint, `param` outlives the call.
            let r = unsafe { (s.api.ep_flush_nbx)(ep, &param) };
            // Flushed even after a failed put: the puts issued before it still read
            // the caller's memory until the flush completes.
            let flushed = s.finish_nbx("ucp_ep_flush_nbx", r, deadline);
            if let Some(e) = failed {
                return Err(e);
            }
            flushed?;
            s.ep().map(|_| ())
        })
        .await
    }
}

impl Drop for UcxEndpoint {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake it if it sleeps on the queue.
        let _ = self.commands.send(Box::new(|_| {}));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
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
    let mut buf: Handle = std::ptr::null_mut();
    let mut size = 0usize;
    // SAFETY: memh was just mapped on this context; out-pointers are valid.
    let st = unsafe { (s.api.rkey_pack)(s.context, memh, &mut buf, &mut size) };
    if let Err(e) = s.api.check("ucp_rkey_pack", st) {
        // SAFETY: mapped above, unmapped once.
        unsafe { (s.api.mem_unmap)(s.context, memh) };
        return Err(e);
    }
    // SAFETY: UCX returned `size` bytes at `buf`; copied before release.
    let key = unsafe { std::slice::from_raw_parts(buf as *const u8, size) }.to_vec();
    // SAFETY: released once, after the copy.
    unsafe { (s.api.rkey_buffer_release)(buf) };
    s.next_id += 1;
    s.memhs.insert(s.next_id, memh);
    Ok((s.next_id, key))
}

fn unmap_one(s: &mut State, id: u64) {
    if let Some(memh) = s.memhs.remove(&id) {
        // SAFETY: mapped on this context; removed from the table, so unmapped once.
        unsafe { (s.api.mem_unmap)(s.context, memh) };
    }
}

fn destroy_rkeys(s: &mut State, ids: &[u64]) {
    for id in ids {
        if let Some(rkey) = s.rkeys.remove(id) {
            // SAFETY: unpacked here, removed from the table, so destroyed once.
            unsafe { (s.api.rkey_destroy)(rkey) };
        }
    }
}

fn create(api: &'static Api, name: &std::ffi::CStr) -> Result<State, Error> {
    let mut config: Handle = std::ptr::null_mut();
    // SAFETY: NULL prefix and file read the UCX_* environment; out-pointer valid.
    let st = unsafe { (api.config_read)(std::ptr::null(), std::ptr::null(), &mut config) };
    api.check("ucp_config_read", st)?;
    let mut params = ffi::UcpParams::zeroed();
    params.field_mask = ffi::PARAM_FIELD_FEATURES | ffi::PARAM_FIELD_NAME;
    params.features = ffi::FEATURE_RMA;
    params.name = name.as_ptr();
    let mut context: Handle = std::ptr::null_mut();
    // SAFETY: params and config are valid for the call; API version 1.13 is what
    // the structs above follow (the library accepts older API users).
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
        // SAFETY: created above, cleaned up once.
        unsafe { (api.cleanup)(context) };
        return Err(e);
    }
    Ok(State {
        api,
        context,
        worker,
        ep: None,
        memhs: HashMap::new(),
        rkeys: HashMap::new(),
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

fn run(s: &mut State, inbox: &mpsc::Receiver<Command>, stop: &AtomicBool) {
    let mut last_event = Instant::now();
    loop {
        while let Ok(cmd) = inbox.try_recv() {
            cmd(s);
            last_event = Instant::now();
        }
        if stop.load(Ordering::Acquire) {
            return;
        }
        if s.progress() != 0 {
            last_event = Instant::now();
            continue;
        }
        if last_event.elapsed() < SPIN {
            std::hint::spin_loop();
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
