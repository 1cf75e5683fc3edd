//! The local (UCX) path for Python: `LocalReceiver`, `LocalSender` and their
//! transfer handles, and `ucx_version()`. Conversion and GIL release only; the
//! logic is `pdd_io::local`.

use std::sync::Arc;

use pdd_core::kv::GrantUnits;
use pdd_core::wire::capability;
use pdd_core::wire::handshake::LocalHello;
use pdd_io::local::receiver::{self, LocalReceiverConfig};
use pdd_io::local::sender::{self, LocalSenderConfig};
use pdd_io::local::LocalStatus;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict};

use crate::convert::{address, role, seconds, u32s_from_py};
use crate::errors::PddErr;
use crate::kv::{grant_ticket, metrics_dict, wait_bounded, KvPool};
use crate::kv_events::{poll_state, KvPoll, RequestKey};
use crate::runtime::{block_on, runtime};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<LocalReceiver>()?;
    m.add_class::<LocalSender>()?;
    m.add_class::<LocalInbound>()?;
    m.add_class::<LocalOutbound>()?;
    m.add_function(wrap_pyfunction!(ucx_version, m)?)?;
    m.add_function(wrap_pyfunction!(ucx_library, m)?)?;
    m.add_function(wrap_pyfunction!(add_ucx_fallback, m)?)?;
    m.add_function(wrap_pyfunction!(shared_buffers, m)?)?;
    m.add_class::<SharedAllocation>()?;
    Ok(())
}

/// Memory UCX allocated for a receiver's pool (`shared_buffers`): the base object of
/// the arrays over it, released when the last of them is gone.
#[pyclass(frozen, weakref, module = "pdd_transport._native")]
pub struct SharedAllocation {
    inner: pdd_io::local::shared::SharedAllocation,
}

#[pymethods]
impl SharedAllocation {
    /// Bytes allocated.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }
}

/// `layers` zeroed uint8 arrays of `layer_bytes` each, in one allocation UCX made
/// (shared memory on one host): a `LocalReceiver` over a pool of them grants pages
/// without registering them, and a local sender on the same host copies into them
/// directly (one copy, nothing for the receiver to do). See docs/kv.md. More than
/// the machine's physical memory is refused (`InvalidArgument`).
#[pyfunction]
#[pyo3(signature = (layers, layer_bytes))]
fn shared_buffers(py: Python<'_>, layers: usize, layer_bytes: usize) -> PyResult<Vec<Py<PyAny>>> {
    if layers == 0 || layer_bytes == 0 {
        return Err(crate::errors::invalid(format!(
            "shared_buffers needs layers >= 1 and layer_bytes >= 1, got {layers} and {layer_bytes}"
        )));
    }
    let total = layers.checked_mul(layer_bytes).ok_or_else(|| {
        crate::errors::invalid(format!("{layers} x {layer_bytes} bytes overflows"))
    })?;
    let inner = py
        .detach(|| pdd_io::local::shared::SharedAllocation::new(total))
        .map_err(PddErr)?;
    let base = inner.as_ptr();
    let owner = Bound::new(py, SharedAllocation { inner })?;
    (0..layers)
        .map(|i| {
            // SAFETY: layer i is `layer_bytes` bytes at base + i * layer_bytes,
            // inside the allocation (total = layers x layer_bytes), which `owner`
            // keeps mapped for as long as an array over it lives (it is their base
            // object).
            let view = unsafe {
                numpy::ndarray::ArrayView1::from_shape_ptr(layer_bytes, base.add(i * layer_bytes))
            };
            // SAFETY: as above: the memory stays valid and in place while `owner`
            // (the array's base) lives.
            let arr = unsafe {
                numpy::PyArray1::<u8>::borrow_from_array(&view, owner.clone().into_any())
            };
            Ok(arr.into_any().unbind())
        })
        .collect()
}

/// UCX's version (`"1.13.1"`), loading libucp if needed; raises `TransportError`
/// (`local_path_unavailable`, naming the library) where it cannot be loaded.
#[pyfunction]
fn ucx_version() -> PyResult<String> {
    pdd_io::local::ucx_version().map_err(|e| PddErr(e).into())
}

/// The UCX library in use, loading it if needed: `"libucp.so.0"` (the system's) or the
/// path of the libucx wheel's copy; raises like `ucx_version`.
#[pyfunction]
fn ucx_library() -> PyResult<String> {
    pdd_io::local::ucx_library().map_err(|e| PddErr(e).into())
}

/// Try `path` (a libucp file) when the system has no `libucp.so.0`; read by the
/// process's first UCX load only. `pdd_transport.local` calls it at import with the
/// libucx wheel's library, where that wheel is installed.
#[pyfunction]
fn add_ucx_fallback(path: &str) -> PyResult<()> {
    if path.is_empty() || path.len() > 4096 || path.contains('\0') {
        return Err(PddErr(pdd_core::Error::InvalidArgument(
            "a UCX library path is 1-4096 bytes with no NUL".into(),
        ))
        .into());
    }
    pdd_io::local::add_ucx_fallback(path);
    Ok(())
}

/// The address prefix that names the local path (`pdd_transport.local.LOCAL_SCHEME`).
const LOCAL_SCHEME: &str = "local://";

/// The poll state of a local transfer's status; `started`: whether any page moved.
fn poll_of(s: &LocalStatus, started: bool) -> KvPoll {
    match s {
        LocalStatus::Complete { .. } => poll_state(Some(Ok(())), true),
        LocalStatus::Failed(e) => poll_state(Some(Err(e)), true),
        LocalStatus::InProgress => poll_state(None, started),
    }
}

fn status_dict<'py>(py: Python<'py>, s: &LocalStatus) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match s {
        LocalStatus::InProgress => d.set_item("state", "in_progress")?,
        LocalStatus::Complete { bytes } => {
            d.set_item("state", "complete")?;
            d.set_item("bytes", bytes)?;
        }
        LocalStatus::Failed(e) => {
            d.set_item("state", "failed")?;
            d.set_item("reason", e.reason())?;
            d.set_item("message", e.to_string())?;
        }
    }
    Ok(d)
}

/// The local path's receiver (RelayDecode): senders connect its control lane; KV
/// arrives by UCX puts into exactly the pages it grants, or, for a pool in
/// `shared_buffers` memory, by a same-host sender's own copies into them.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct LocalReceiver {
    inner: Arc<receiver::LocalReceiver>,
    keys: crate::kv_events::KeyBook,
}

#[pymethods]
impl LocalReceiver {
    #[new]
    #[pyo3(signature = (pool, listen = "127.0.0.1:0", *, role = "relay_decode", secret = None, insecure = false, tls = None, heartbeat_s = 1.0, dead_after_s = 5.0, hello_timeout_s = 5.0, layout = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        pool: &KvPool,
        listen: &str,
        role: &str,
        secret: Option<PyBackedBytes>,
        insecure: bool,
        tls: Option<PyRef<'_, crate::tls::TlsConfig>>,
        heartbeat_s: f64,
        dead_after_s: f64,
        hello_timeout_s: f64,
        layout: Option<PyBackedBytes>,
    ) -> PyResult<Self> {
        let mut hello = LocalHello::new(self::role(role)?, capability::KV_STREAM);
        hello.secret = secret.map(|c| bytes::Bytes::copy_from_slice(&c));
        let mut cfg = LocalReceiverConfig::new(address(listen)?, hello);
        cfg.layout = layout.map(|l| l.to_vec());
        cfg.allow_insecure = insecure;
        cfg.tls = tls.map(|t| t.inner.clone());
        cfg.heartbeat = seconds(heartbeat_s, "heartbeat_s")?;
        cfg.dead_after = seconds(dead_after_s, "dead_after_s")?;
        cfg.hello_timeout = seconds(hello_timeout_s, "hello_timeout_s")?;
        let pool = pool.pool.clone();
        let rx = block_on(py, receiver::LocalReceiver::start(pool, cfg))?.map_err(PddErr)?;
        Ok(LocalReceiver {
            inner: Arc::new(rx),
            keys: Default::default(),
        })
    }

    /// `(host, port)` of the control lane's listener.
    #[getter]
    fn address(&self) -> (String, u16) {
        let a = self.inner.local_addr();
        (a.ip().to_string(), a.port())
    }

    /// Connected senders.
    fn peers(&self) -> Vec<u64> {
        self.inner.peers()
    }

    /// Our pool's KV layout as given (`layout=`), or None.
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.layout().map(|l| PyBytes::new(py, &l))
    }

    /// The KV layout `peer` (the only sender with None) sent (capability
    /// `kv_layout`): known once `wait_peer` returned for it. None: the sender has
    /// no layout, predates layouts, or this receiver has none.
    #[pyo3(signature = (peer = None))]
    fn peer_layout<'py>(
        &self,
        py: Python<'py>,
        peer: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let l = self.inner.peer_layout(peer).map_err(PddErr)?;
        Ok(l.map(|l| PyBytes::new(py, &l)))
    }

    /// Wait until a sender is connected and up (its KV layout came, where both
    /// sides have one); returns its local session number.
    #[pyo3(signature = (timeout = 10.0))]
    fn wait_peer(&self, py: Python<'_>, timeout: f64) -> PyResult<u64> {
        let rx = self.inner.clone();
        wait_bounded(
            py,
            seconds(timeout, "timeout")?,
            "a local-path sender",
            async move { Ok(rx.wait_peer().await) },
        )
    }

    /// Grant `pages` (pool pages, in the order the sender fills them) on every
    /// layer to `peer` (the only sender with None): only these pages are exposed.
    /// `request_id` is an int or the engine's str/bytes key (`kv.request_id_of`).
    /// No pages is an empty grant, as on the KV lanes: it completes with 0 bytes
    /// once the sender finishes. `page_bytes` and `first_layer` as for
    /// `KvReceiver.grant` (the grant covers pool layers `first_layer..`).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request_id, pages, *, peer = None, deadline_s = None, timeout = 10.0, page_bytes = None, first_layer = 0))]
    fn grant(
        &self,
        py: Python<'_>,
        request_id: RequestKey,
        pages: &Bound<'_, PyAny>,
        peer: Option<u64>,
        deadline_s: Option<f64>,
        timeout: f64,
        page_bytes: Option<u32>,
        first_layer: u16,
    ) -> PyResult<LocalInbound> {
        let pages = u32s_from_py(pages, "pages")?;
        let units = GrantUnits {
            unit_bytes: page_bytes,
            first_layer,
        };
        let deadline = deadline_s.map(|d| seconds(d, "deadline_s")).transpose()?;
        let rx = self.inner.clone();
        let t = wait_bounded(
            py,
            seconds(timeout, "timeout")?,
            "registering a grant",
            async move {
                rx.grant_units(request_id.id, &pages, units, peer, deadline)
                    .await
            },
        )?;
        // Events carry the engine's key (str keys included), as on the KV receiver.
        let live = self.inner.clone();
        self.keys
            .remember(py, t.grant.transfer_id, &request_id.key, |id| {
                live.is_live(id)
            });
        Ok(LocalInbound {
            inner: t,
            receiver: self.inner.clone(),
            key: request_id.key,
        })
    }

    /// This receiver will not take `request_id` from `peer` (the only sender with
    /// None), granted or not, as `KvReceiver.refuse`: its transfers of it fail (keys
    /// revoked) and the sender is told `reason`. False: nothing was granted and the
    /// sender predates `refusal`.
    #[pyo3(signature = (request_id, reason, *, peer = None))]
    fn refuse(&self, request_id: RequestKey, reason: &str, peer: Option<u64>) -> PyResult<bool> {
        let rt = runtime()?;
        let _guard = rt.enter();
        Ok(self
            .inner
            .refuse(request_id.id, reason, peer)
            .map_err(PddErr)?)
    }

    /// Cancel a live transfer (its keys are revoked, the sender told). False if it
    /// had ended.
    fn cancel(&self, transfer_id: u64) -> PyResult<bool> {
        let rt = runtime()?;
        let _guard = rt.enter();
        Ok(self.inner.cancel(transfer_id))
    }

    /// Take up to `max` events (`LayerComplete`, `TransferComplete`,
    /// `TransferFailed`, as `KvReceiver.poll_events` gives them), oldest first.
    #[pyo3(signature = (max = 1024))]
    fn poll_events(&self, py: Python<'_>, max: usize) -> PyResult<Vec<Py<PyAny>>> {
        self.inner
            .poll_events(max)
            .into_iter()
            .map(|e| {
                crate::kv_events::event_to_py(
                    py,
                    &self.keys,
                    &pdd_io::receiver::ReceiverEvent::Transfer(e),
                )
            })
            .collect()
    }

    /// Wait up to `timeout` seconds (GIL released) for an event; True if one is
    /// queued. Woken by the events themselves, as `KvReceiver.wait_event`.
    #[pyo3(signature = (timeout = 10.0))]
    fn wait_event(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let rx = self.inner.clone();
        let t = seconds(timeout, "timeout")?;
        block_on(py, async move {
            tokio::time::timeout(t, rx.wait_event()).await.is_ok()
        })
    }

    /// As `KvReceiver.release_lease`; the local path has no prefix cache, so it
    /// never hands out a lease and there is none to drop: always False.
    fn release_lease(&self, lease_id: u64) -> bool {
        let _ = lease_id;
        false
    }

    /// Counters.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        metrics_dict(py, self.inner.metrics())
    }

    /// End every session (their transfers fail) and stop listening.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let rx = self.inner.clone();
        block_on(py, async move { rx.close().await })
    }
}

/// The receiver's handle on one local-path transfer.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct LocalInbound {
    inner: receiver::LocalInbound,
    receiver: Arc<receiver::LocalReceiver>,
    key: Py<PyAny>,
}

crate::handles::grant_getters!(LocalInbound, |h| h.inner.grant);
crate::handles::settle_waits!(
    LocalInbound,
    "Wait until every page is in (returns the bytes) or raise why it failed.",
    "a local transfer",
    |h| h.inner.clone()
);

#[pymethods]
impl LocalInbound {
    /// The request key the grant was made with (int, str or bytes).
    #[getter]
    fn request_key(&self, py: Python<'_>) -> Py<PyAny> {
        self.key.clone_ref(py)
    }

    /// The sender it was granted to (the receiver's number for it, as `peers()`
    /// lists).
    #[getter]
    fn peer(&self) -> u64 {
        self.inner.peer
    }

    /// Where the transfer stands, without waiting. TRANSFERRING once the sender
    /// announced a layer (its puts are invisible here until then).
    fn poll(&self) -> KvPoll {
        let started = self
            .receiver
            .transfer_started(self.inner.grant.transfer_id)
            .unwrap_or(true);
        poll_of(&self.inner.status(), started)
    }

    /// As `InboundTransfer.ticket`, its address naming the local path:
    /// `"local://host:port"` (`address`, `host:port` or already `local://`, defaults
    /// to the receiver's bound address), for a `LocalSender` connected to `host:port`.
    #[pyo3(signature = (address = None))]
    fn ticket<'py>(
        &self,
        py: Python<'py>,
        address: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let address = address.unwrap_or_else(|| self.receiver.local_addr().to_string());
        let address = if address.starts_with(LOCAL_SCHEME) {
            address
        } else {
            format!("{LOCAL_SCHEME}{address}")
        };
        grant_ticket(py, &self.inner.grant, address, &self.key, self.inner.peer)
    }

    /// `{"state": "in_progress" | "complete" | "failed", ...}`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        status_dict(py, &self.inner.status())
    }
}

/// The local path's sender (Prefill).
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct LocalSender {
    pub(crate) inner: Arc<sender::LocalSender>,
}

#[pymethods]
impl LocalSender {
    #[new]
    #[pyo3(signature = (pool, connect, *, node_id = None, role = "prefill", secret = None, tls = None, heartbeat_s = 1.0, dead_after_s = 5.0, connect_timeout_s = 5.0, put_timeout_s = 30.0, layout = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        pool: &KvPool,
        connect: &str,
        node_id: Option<u64>,
        role: &str,
        secret: Option<PyBackedBytes>,
        tls: Option<PyRef<'_, crate::tls::TlsConfig>>,
        heartbeat_s: f64,
        dead_after_s: f64,
        connect_timeout_s: f64,
        put_timeout_s: f64,
        layout: Option<PyBackedBytes>,
    ) -> PyResult<Self> {
        let session_id = node_id.unwrap_or_else(pdd_io::config::random_session_id);
        let mut hello = LocalHello::new(self::role(role)?, capability::KV_STREAM);
        hello.secret = secret.map(|c| bytes::Bytes::copy_from_slice(&c));
        let mut cfg = LocalSenderConfig::new(address(connect)?, session_id, hello);
        cfg.tls = tls.map(|t| t.inner.clone());
        cfg.heartbeat = seconds(heartbeat_s, "heartbeat_s")?;
        cfg.dead_after = seconds(dead_after_s, "dead_after_s")?;
        cfg.connect_timeout = seconds(connect_timeout_s, "connect_timeout_s")?;
        cfg.put_timeout = seconds(put_timeout_s, "put_timeout_s")?;
        cfg.layout = layout.map(|l| l.to_vec());
        let pool = pool.pool.clone();
        let tx = block_on(py, sender::LocalSender::connect(pool, cfg))?.map_err(PddErr)?;
        Ok(LocalSender {
            inner: Arc::new(tx),
        })
    }

    /// Our pool's KV layout as given (`layout=`), or None.
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.layout().map(|l| PyBytes::new(py, &l))
    }

    /// The receiver's KV layout (capability `kv_layout`), known once the
    /// constructor returned. None: the receiver has no layout, predates layouts,
    /// or this sender has none.
    #[getter]
    fn peer_layout<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.peer_layout().map(|l| PyBytes::new(py, &l))
    }

    /// Wait for the receiver's grant for `request_id` (an int, or the str/bytes key
    /// the receiver granted with).
    #[pyo3(signature = (request_id, timeout = 10.0))]
    fn wait_grant(
        &self,
        py: Python<'_>,
        request_id: RequestKey,
        timeout: f64,
    ) -> PyResult<LocalOutbound> {
        let tx = self.inner.clone();
        let id = request_id.id;
        let out = wait_bounded(
            py,
            seconds(timeout, "timeout")?,
            "a local grant",
            async move { tx.wait_grant(id).await },
        )?;
        Ok(LocalOutbound {
            inner: Arc::new(out),
            key: request_id.key,
        })
    }

    /// The grant for `request_id` if it has arrived, else None, without waiting (see
    /// `KvSender.try_grant`); raises once the session died.
    fn try_grant(&self, request_id: RequestKey) -> PyResult<Option<LocalOutbound>> {
        Ok(self
            .inner
            .try_grant(request_id.id)
            .map_err(PddErr)?
            .map(|out| LocalOutbound {
                inner: Arc::new(out),
                key: request_id.key,
            }))
    }

    /// The receiver's reason if it refused `request_id` (see `KvSender.refusal`).
    fn refusal(&self, request_id: RequestKey) -> Option<String> {
        self.inner.refusal(request_id.id).map(|e| e.to_string())
    }

    /// This sender will not serve `request_id` (see `KvSender.decline`). True if the
    /// receiver was told now.
    fn decline(&self, request_id: RequestKey, reason: &str) -> PyResult<bool> {
        let rt = runtime()?;
        let _guard = rt.enter();
        Ok(self.inner.decline(request_id.id, reason).map_err(PddErr)?)
    }

    /// Counters.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        metrics_dict(py, self.inner.metrics())
    }

    /// End the session (live transfers fail).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let tx = self.inner.clone();
        block_on(py, async move { tx.close().await })
    }
}

/// The sender's handle on one local-path grant.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct LocalOutbound {
    pub(crate) inner: Arc<sender::LocalOutbound>,
    key: Py<PyAny>,
}

crate::handles::grant_getters!(LocalOutbound, |h| h.inner.grant());
crate::handles::send_layer_method!(
    LocalOutbound,
    "Put grant layer `layer` from source pages `src_pages` (one per grant page) of pool \
     layer `src_layer` (`layer` with None); returns once the bytes are in the \
     receiver's memory and the completion notice is queued.",
    "a local layer put"
);
crate::handles::send_pages_method!(
    LocalOutbound,
    "Put grant pages `grant_pages` (grant-relative indices, any subset, any order) from \
     source pages `src_pages` (one per grant page), on grant layer `layer` (every grant \
     layer with None, each from the same source layer index) of source pool layer \
     `src_layer` (`layer` with None), as `OutboundTransfer.send_pages`: each `(layer, \
     page)` goes once per transfer, and a call that repeats one puts nothing and raises. \
     Returns once the bytes are in the receiver's memory and the notices of the layers \
     it completed are queued.",
    "a local put"
);
crate::handles::settle_waits!(
    LocalOutbound,
    "Wait for the receiver's confirmation (bytes) or raise why it failed.",
    "a local transfer",
    |h| h.inner.clone()
);

#[pymethods]
impl LocalOutbound {
    /// The request key given to `wait_grant` (int, str or bytes).
    #[getter]
    fn request_key(&self, py: Python<'_>) -> Py<PyAny> {
        self.key.clone_ref(py)
    }

    /// Every page of every layer was sent (raises naming how many were not); for an
    /// empty grant, this is what completes it.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let out = self.inner.clone();
        block_on(py, async move { out.finish().await })?.map_err(|e| PddErr(e).into())
    }

    /// Give up on the transfer: the receiver fails it with `peer_aborted` and a
    /// message carrying `reason`; here it fails with `cancelled`; the keys are
    /// destroyed. False if it had already ended.
    #[pyo3(signature = (reason = "aborted"))]
    fn abort(&self, reason: &str) -> PyResult<bool> {
        let rt = runtime()?;
        let _guard = rt.enter();
        Ok(self.inner.abort(reason))
    }

    /// Where the transfer stands, without waiting.
    fn poll(&self) -> KvPoll {
        poll_of(&self.inner.status(), self.inner.started())
    }

    /// `{"state": ...}` as for `LocalInbound.status`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        status_dict(py, &self.inner.status())
    }
}
