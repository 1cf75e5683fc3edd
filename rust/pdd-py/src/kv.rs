//! KV pools and endpoints for Python: `KvPool`, `KvReceiver`, `KvSender` and their
//! transfer handles. Conversion and GIL release only; the logic is `pdd_io::receiver`,
//! `pdd_io::sender` and `pdd_core::kv`.

use std::sync::Arc;
use std::time::Duration;

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pdd_core::kv::GrantUnits;
use pdd_core::wire::capability;
use pdd_core::wire::handshake::LocalHello;
use pdd_core::Error;
use pdd_io::metrics::Metrics;
use pdd_io::pool::{MemoryRegion, PagePool};
use pdd_io::receiver::{self, ReceiverConfig, TransferStatus};
use pdd_io::sender::{self, OutboundStatus, SenderConfig};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict};

use crate::convert::{address, role, seconds, seconds_or_zero, tuning, u32s_from_py};
use crate::errors::{invalid, PddErr};
use crate::kv_events::{event_to_py, poll_state, KeyBook, KvPoll, RequestKey};
use crate::radix::RadixCache;
use crate::runtime::{block_on, runtime};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KvPool>()?;
    m.add_class::<KvReceiver>()?;
    m.add_class::<KvSender>()?;
    m.add_class::<InboundTransfer>()?;
    m.add_class::<OutboundTransfer>()?;
    m.add_function(wrap_pyfunction!(transfer_activity, m)?)?;
    m.add_function(wrap_pyfunction!(wait_transfer_activity, m)?)?;
    Ok(())
}

/// The process's transfer doorbell: a counter every KV sender (WAN or local path)
/// bumps when a grant arrives or a transfer settles. Read it, poll your transfers, and
/// with nothing to do wait in `wait_transfer_activity(seen, timeout)`.
#[pyfunction]
fn transfer_activity() -> u64 {
    pdd_io::activity::current()
}

/// Wait, with the GIL released, until the doorbell differs from `seen` or `timeout`
/// seconds pass; returns the counter then (equal to `seen` on a timeout, which is not
/// an error here: an idle step loop just polls again).
#[pyfunction]
#[pyo3(signature = (seen, timeout))]
fn wait_transfer_activity(py: Python<'_>, seen: u64, timeout: f64) -> PyResult<u64> {
    let bound = seconds_or_zero("timeout", timeout)?;
    block_on(py, async move {
        tokio::time::timeout(bound, pdd_io::activity::changed_since(seen))
            .await
            .unwrap_or(seen)
    })
}

/// Run `fut` on the shared runtime with the GIL released, bounded by `timeout`.
pub(crate) fn wait_bounded<T: Send>(
    py: Python<'_>,
    timeout: Duration,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, Error>> + Send,
) -> PyResult<T> {
    let what = what.to_owned();
    block_on(py, async move {
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(Error::DeadlineExceeded {
                what: format!("{what} within {timeout:?}"),
            }),
        }
    })?
    .map_err(|e| PddErr(e).into())
}

/// `send_layer` of either path (KV lanes, local puts): the source pages converted,
/// then `put(pages)` run with the GIL released, bounded by `timeout`.
pub(crate) fn send_layer_bounded<Fut>(
    py: Python<'_>,
    src_pages: &Bound<'_, PyAny>,
    timeout: f64,
    what: &str,
    put: impl FnOnce(Vec<u32>) -> Fut,
) -> PyResult<()>
where
    Fut: std::future::Future<Output = Result<(), Error>> + Send,
{
    let pages = u32s_from_py(src_pages, "src_pages")?;
    wait_bounded(py, seconds(timeout, "timeout")?, what, put(pages))
}

/// `fut` as a Python awaitable on the shared runtime, bounded by `timeout`.
pub(crate) fn awaitable<'py, T>(
    py: Python<'py>,
    timeout: Duration,
    what: &'static str,
    fut: impl std::future::Future<Output = Result<T, Error>> + Send + 'static,
) -> PyResult<Bound<'py, PyAny>>
where
    T: for<'a> pyo3::IntoPyObject<'a> + Send + 'static,
{
    runtime()?;
    pyo3_async_runtimes::tokio::future_into_py(py, async move {
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r.map_err(|e| PddErr(e).into()),
            Err(_) => Err(PddErr(Error::DeadlineExceeded {
                what: format!("{what} within {timeout:?}"),
            })
            .into()),
        }
    })
}

pub(crate) fn metrics_dict<'py>(py: Python<'py>, m: &Metrics) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (name, value, _, _) in m.snapshot() {
        d.set_item(name, value)?;
    }
    Ok(d)
}

/// Pages of KV over registered buffers: one 1-D, C-contiguous, writable uint8 numpy
/// array per layer, all of the same length, a whole number of `page_bytes` pages.
/// The arrays are kept alive (and so cannot be resized) while the pool lives.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct KvPool {
    pub pool: Arc<PagePool>,
}

#[pymethods]
impl KvPool {
    #[new]
    fn new(layers: Vec<Bound<'_, PyAny>>, page_bytes: u32) -> PyResult<Self> {
        let mut regions = Vec::with_capacity(layers.len());
        for (i, obj) in layers.iter().enumerate() {
            let arr = obj.cast::<PyArray1<u8>>().map_err(|_| {
                invalid(format!("layer {i}: expected a 1-D uint8 numpy array (view other dtypes with .view(np.uint8))"))
            })?;
            if !arr.is_c_contiguous() {
                return Err(invalid(format!(
                    "layer {i}: the array must be C-contiguous"
                )));
            }
            let mut rw = arr.try_readwrite().map_err(|_| {
                invalid(format!(
                    "layer {i}: the array must be writable and not borrowed elsewhere"
                ))
            })?;
            let slice = rw
                .as_slice_mut()
                .map_err(|_| invalid(format!("layer {i}: the array must be contiguous")))?;
            let (ptr, len) = (slice.as_mut_ptr(), slice.len());
            drop(rw);
            let owner: Py<PyArray1<u8>> = arr.clone().unbind();
            // SAFETY: ptr..ptr+len is the array's data, valid for reads and writes; the
            // owner reference keeps the array (and its buffer) alive, and numpy refuses
            // to resize an array that has other references, so the data stays put.
            let region =
                unsafe { MemoryRegion::from_raw(ptr, len, Box::new(owner)) }.map_err(PddErr)?;
            regions.push(region);
        }
        Ok(KvPool {
            pool: Arc::new(PagePool::new(regions, page_bytes).map_err(PddErr)?),
        })
    }

    /// Layers in the pool.
    #[getter]
    fn layers(&self) -> u16 {
        self.pool.layers()
    }

    /// Pages per layer.
    #[getter]
    fn pages(&self) -> u32 {
        self.pool.pages()
    }

    /// Bytes per page.
    #[getter]
    fn page_bytes(&self) -> u32 {
        self.pool.page_bytes()
    }

    /// Where the pool's memory lives: `"host"` (CUDA memory is refused when the
    /// pool is made, until a GPU machine tests it).
    #[getter]
    fn memory_kind(&self) -> &'static str {
        self.pool.memory_kind().name()
    }
}

/// A KV receiver listening for senders.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct KvReceiver {
    inner: Arc<receiver::KvReceiver>,
    keys: Arc<KeyBook>,
}

#[pymethods]
impl KvReceiver {
    #[new]
    #[pyo3(signature = (pool, listen = "127.0.0.1:0", *, role = "main_decode", secret = None, insecure = false, tls = None, heartbeat_s = 1.0, dead_after_s = 5.0, hello_timeout_s = 5.0, socket_buffer = 8388608, congestion = None, max_payload = 16777216, prefix_cache = None, sealed_lanes = true, layout = None, resume_window_s = Some(10.0)))]
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
        socket_buffer: usize,
        congestion: Option<String>,
        max_payload: u32,
        prefix_cache: Option<PyRef<'_, RadixCache>>,
        sealed_lanes: bool,
        layout: Option<PyBackedBytes>,
        resume_window_s: Option<f64>,
    ) -> PyResult<Self> {
        let caps = if prefix_cache.is_some() {
            capability::KV_STREAM | capability::PREFIX_CACHE
        } else {
            capability::KV_STREAM
        };
        let mut hello = LocalHello::new(self::role(role)?, caps);
        hello.secret = secret.map(|c| bytes::Bytes::copy_from_slice(&c));
        hello.max_payload = max_payload;
        let mut cfg = ReceiverConfig::new(address(listen)?, hello);
        cfg.allow_insecure = insecure;
        cfg.tls = tls.map(|t| t.inner.clone());
        cfg.sealed_lanes = sealed_lanes;
        cfg.layout = layout.map(|l| l.to_vec());
        cfg.heartbeat = seconds(heartbeat_s, "heartbeat_s")?;
        cfg.dead_after = seconds(dead_after_s, "dead_after_s")?;
        cfg.hello_timeout = seconds(hello_timeout_s, "hello_timeout_s")?;
        cfg.resume_window = resume_window_s
            .map(|s| seconds(s, "resume_window_s"))
            .transpose()?;
        cfg.tuning = tuning(socket_buffer, congestion);
        cfg.prefix_cache = prefix_cache.map(|c| c.shared());
        let pool = pool.pool.clone();
        let rx = block_on(py, receiver::KvReceiver::start(pool, cfg))?.map_err(PddErr)?;
        Ok(KvReceiver {
            inner: Arc::new(rx),
            keys: Arc::default(),
        })
    }

    /// `(host, port)` the receiver listens on.
    #[getter]
    fn address(&self) -> (String, u16) {
        let a = self.inner.local_addr();
        (a.ip().to_string(), a.port())
    }

    /// Connected peers: `[(node_id, "ip:port"), ...]`.
    fn peers(&self) -> Vec<(u64, String)> {
        self.inner
            .peers()
            .into_iter()
            .map(|(id, a)| (id, a.to_string()))
            .collect()
    }

    /// Our pool's KV layout as given (`layout=`), or None.
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.layout().map(|l| PyBytes::new(py, &l))
    }

    /// The KV layout `peer` (the only peer with None) sent (capability
    /// `kv_layout`): known once `wait_peer` returned for it. None: the peer has no
    /// layout, predates layouts, or this receiver has none (then nothing is
    /// exchanged either way).
    #[pyo3(signature = (peer = None))]
    fn peer_layout<'py>(
        &self,
        py: Python<'py>,
        peer: Option<u64>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let l = self.inner.peer_layout(peer).map_err(PddErr)?;
        Ok(l.map(|l| PyBytes::new(py, &l)))
    }

    /// Wait until `peer` (any peer with None) is connected and up (its KV layout
    /// came, where both sides have one); returns its node id.
    #[pyo3(signature = (peer = None, timeout = 10.0))]
    fn wait_peer(&self, py: Python<'_>, peer: Option<u64>, timeout: f64) -> PyResult<u64> {
        let rx = self.inner.clone();
        wait_bounded(py, seconds(timeout, "timeout")?, "a peer", async move {
            Ok(rx.wait_peer(peer).await)
        })
    }

    /// Grant `pages` (pool page indices, in the order the sender will fill them) on
    /// layers `0..layers` (all with None) to `peer` (the only peer with None), for the
    /// request named `request_id` (an int, or a str/bytes key mapped by
    /// `request_id_of`).
    ///
    /// `page_bytes` (a divisor of the pool's; default the pool's) makes `pages` units
    /// of that size (unit `u` = byte offset `u * page_bytes` of each layer's buffer):
    /// a sub-page grant. `first_layer`: grant layer `i` is pool layer
    /// `first_layer + i` (`layers` then defaults to the pool's layers from there).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (request_id, pages, *, layers = None, peer = None, deadline_s = None, page_bytes = None, first_layer = 0))]
    fn grant(
        &self,
        py: Python<'_>,
        request_id: RequestKey,
        pages: &Bound<'_, PyAny>,
        layers: Option<u16>,
        peer: Option<u64>,
        deadline_s: Option<f64>,
        page_bytes: Option<u32>,
        first_layer: u16,
    ) -> PyResult<InboundTransfer> {
        let pages = u32s_from_py(pages, "pages")?;
        let units = GrantUnits {
            unit_bytes: page_bytes,
            first_layer,
        };
        let deadline = deadline_s.map(|d| seconds(d, "deadline_s")).transpose()?;
        // grant() spawns its deadline timer: it must run inside the runtime.
        let rt = runtime()?;
        let _guard = rt.enter();
        let t = self
            .inner
            .grant_units(request_id.id, &pages, layers, units, peer, deadline)
            .map_err(PddErr)?;
        let rx = self.inner.clone();
        self.keys
            .remember(py, t.grant.transfer_id, &request_id.key, |id| {
                rx.transfer_started(id).is_some()
            });
        Ok(InboundTransfer {
            inner: t,
            receiver: self.inner.clone(),
            key: request_id.key,
        })
    }

    /// Cancel a live transfer (the sender is told). False if it was not live.
    fn cancel(&self, transfer_id: u64) -> bool {
        self.inner.cancel(transfer_id)
    }

    /// This receiver will not take `request_id` (an int, or the str/bytes key) from
    /// `peer` (the only peer with None), granted or not: its transfers of it fail
    /// and the sender is told `reason` (ABORT `refused`, cut to 512 bytes), so it
    /// frees its blocks at once. False: nothing was granted and the sender predates
    /// the `refusal` capability (tell it with an empty grant instead). Raises
    /// `TransportError` (`connection_lost`) when the peer is not connected.
    #[pyo3(signature = (request_id, reason, *, peer = None))]
    fn refuse(&self, request_id: RequestKey, reason: &str, peer: Option<u64>) -> PyResult<bool> {
        let rt = runtime()?;
        let _guard = rt.enter();
        Ok(self
            .inner
            .refuse(request_id.id, reason, peer)
            .map_err(PddErr)?)
    }

    /// Drop a prefix lease (after locking the prefix for the request yourself): its
    /// pin is released. False if it had already lapsed.
    fn release_lease(&self, lease_id: u64) -> bool {
        self.inner.release_lease(lease_id)
    }

    /// Take up to `max` events (`LayerComplete`, `TransferComplete`,
    /// `TransferFailed`, `PrefixQueried`), oldest first.
    #[pyo3(signature = (max = 1024))]
    fn poll_events(&self, py: Python<'_>, max: usize) -> PyResult<Vec<Py<PyAny>>> {
        self.inner
            .poll_events(max)
            .iter()
            .map(|e| event_to_py(py, &self.keys, e))
            .collect()
    }

    /// Wait up to `timeout` seconds for an event; True if one is queued.
    #[pyo3(signature = (timeout = 10.0))]
    fn wait_event(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let rx = self.inner.clone();
        let t = seconds(timeout, "timeout")?;
        block_on(py, async move {
            tokio::time::timeout(t, rx.wait_event()).await.is_ok()
        })
    }

    /// Counters and gauges.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        metrics_dict(py, self.inner.metrics())
    }

    /// Metrics as Prometheus text, labelled `endpoint`.
    #[pyo3(signature = (endpoint = "kv_receiver"))]
    fn prometheus(&self, endpoint: &str) -> String {
        self.inner.metrics().prometheus(endpoint)
    }

    /// Close every session and stop listening, waiting at most `timeout` seconds.
    #[pyo3(signature = (timeout = 5.0))]
    fn close(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let rx = self.inner.clone();
        let t = seconds(timeout, "timeout")?;
        block_on(py, async move { rx.close(t).await })?.map_err(|e| PddErr(e).into())
    }
}

/// The receiver's handle on one granted transfer.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct InboundTransfer {
    inner: receiver::InboundTransfer,
    receiver: Arc<receiver::KvReceiver>,
    key: Py<PyAny>,
}

crate::handles::grant_getters!(InboundTransfer, |h| h.inner.grant);
crate::handles::settle_waits!(
    InboundTransfer,
    "Block (GIL released) until complete (returns page bytes) or failed (raises).",
    "the transfer",
    |h| h.inner.clone()
);

#[pymethods]
impl InboundTransfer {
    /// The request key the grant was made with (int, str or bytes).
    #[getter]
    fn request_key(&self, py: Python<'_>) -> Py<PyAny> {
        self.key.clone_ref(py)
    }

    #[getter]
    fn peer(&self) -> u64 {
        self.inner.peer
    }

    /// Where the transfer stands, without waiting.
    fn poll(&self) -> KvPoll {
        let started = self
            .receiver
            .transfer_started(self.inner.grant.transfer_id)
            .unwrap_or(true);
        match self.inner.status() {
            TransferStatus::Complete { .. } => poll_state(Some(Ok(())), true),
            TransferStatus::Failed(e) => poll_state(Some(Err(&e)), true),
            TransferStatus::InProgress { layers_done } => {
                poll_state(None, started || layers_done > 0)
            }
        }
    }

    /// What a sender needs to find and fill this grant, as a small JSON-safe dict to
    /// carry in the engine's own request metadata: `{"version", "address",
    /// "request_id", "request_key" (str keys only), "peer", "layers", "pages",
    /// "page_bytes"}`. `address` defaults to the receiver's bound address; pass the
    /// one senders should dial when that differs (a wildcard bind, NAT).
    #[pyo3(signature = (address = None))]
    fn ticket<'py>(
        &self,
        py: Python<'py>,
        address: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let address = address.unwrap_or_else(|| self.receiver.local_addr().to_string());
        grant_ticket(py, &self.inner.grant, address, &self.key, self.inner.peer)
    }

    /// `{"state": "in_progress"|"complete"|"failed", ...}`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        match self.inner.status() {
            TransferStatus::InProgress { layers_done } => {
                d.set_item("state", "in_progress")?;
                d.set_item("layers_done", layers_done)?;
            }
            TransferStatus::Complete { bytes, seconds } => {
                d.set_item("state", "complete")?;
                d.set_item("layers_done", self.inner.grant.layer_count)?;
                d.set_item("bytes", bytes)?;
                d.set_item("seconds", seconds)?;
            }
            TransferStatus::Failed(e) => {
                d.set_item("state", "failed")?;
                d.set_item("reason", e.reason())?;
                d.set_item("message", e.to_string())?;
            }
        }
        Ok(d)
    }
}

/// A grant's ticket (`InboundTransfer.ticket`, `LocalInbound.ticket`): what a sender
/// needs to find and fill it, as a JSON-safe dict.
pub(crate) fn grant_ticket<'py>(
    py: Python<'py>,
    g: &pdd_core::wire::KvGrant,
    address: String,
    key: &Py<PyAny>,
    peer: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", 1)?;
    d.set_item("address", address)?;
    d.set_item("request_id", g.request_id)?;
    if key.bind(py).is_instance_of::<pyo3::types::PyString>() {
        d.set_item("request_key", key.bind(py))?;
    }
    d.set_item("peer", peer)?;
    d.set_item("layers", g.layer_count)?;
    d.set_item("pages", g.page_count)?;
    d.set_item("page_bytes", g.page_bytes)?;
    Ok(d)
}

/// A KV sender session connected to a receiver.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct KvSender {
    pub(crate) inner: Arc<sender::KvSender>,
    /// A background reconnect started by `try_grant` is running: polling callers
    /// start at most one at a time.
    reconnecting: Arc<std::sync::atomic::AtomicBool>,
}

#[pymethods]
impl KvSender {
    #[new]
    #[pyo3(signature = (pool, connect, *, lanes = 4, node_id = None, role = "prefill", secret = None, tls = None, heartbeat_s = 1.0, dead_after_s = 5.0, connect_timeout_s = 5.0, block_bytes = 1048576, socket_buffer = 8388608, congestion = None, max_payload = 16777216, lane_stall_s = None, lane_failover = true, sealed_lanes = true, unsent_limit = 1048576, compress = "auto", layout = None, resume_window_s = Some(10.0)))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        pool: &KvPool,
        connect: &str,
        lanes: u16,
        node_id: Option<u64>,
        role: &str,
        secret: Option<PyBackedBytes>,
        tls: Option<PyRef<'_, crate::tls::TlsConfig>>,
        heartbeat_s: f64,
        dead_after_s: f64,
        connect_timeout_s: f64,
        block_bytes: u32,
        socket_buffer: usize,
        congestion: Option<String>,
        max_payload: u32,
        lane_stall_s: Option<f64>,
        lane_failover: bool,
        sealed_lanes: bool,
        unsent_limit: usize,
        compress: &str,
        layout: Option<PyBackedBytes>,
        resume_window_s: Option<f64>,
    ) -> PyResult<Self> {
        let mut hello = LocalHello::new(self::role(role)?, capability::KV_STREAM);
        hello.secret = secret.map(|c| bytes::Bytes::copy_from_slice(&c));
        hello.max_payload = max_payload;
        let node_id = node_id.unwrap_or_else(pdd_io::config::random_session_id);
        let mut cfg = SenderConfig::new(address(connect)?, node_id, hello);
        cfg.lane_stall = lane_stall_s
            .map(|s| seconds(s, "lane_stall_s"))
            .transpose()?;
        cfg.lane_failover = lane_failover;
        cfg.sealed_lanes = sealed_lanes;
        cfg.compress = pdd_io::compress::CompressMode::parse(compress).map_err(PddErr)?;
        cfg.layout = layout.map(|l| l.to_vec());
        cfg.lanes = lanes;
        cfg.tls = tls.map(|t| t.inner.clone());
        cfg.heartbeat = seconds(heartbeat_s, "heartbeat_s")?;
        cfg.dead_after = seconds(dead_after_s, "dead_after_s")?;
        cfg.connect_timeout = seconds(connect_timeout_s, "connect_timeout_s")?;
        cfg.resume_window = resume_window_s
            .map(|s| seconds(s, "resume_window_s"))
            .transpose()?;
        cfg.max_block_bytes = block_bytes;
        cfg.tuning = tuning(socket_buffer, congestion);
        cfg.tuning.unsent_limit = (unsent_limit > 0).then_some(unsent_limit);
        let pool = pool.pool.clone();
        let tx = block_on(py, sender::KvSender::connect(pool, cfg))?.map_err(PddErr)?;
        Ok(KvSender {
            inner: Arc::new(tx),
            reconnecting: Arc::default(),
        })
    }

    /// The id the receiver knows this sender by (`peer` in `KvReceiver.grant`).
    #[getter]
    fn node_id(&self) -> u64 {
        self.inner.session_id()
    }

    /// Reconnect now if the session was lost (it also happens on next use).
    #[pyo3(signature = (timeout = 10.0))]
    fn ensure_connected(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let tx = self.inner.clone();
        wait_bounded(py, seconds(timeout, "timeout")?, "connecting", async move {
            tx.ensure_connected().await
        })
    }

    /// Wait for the receiver's grant for `request_id` (an int, or the str/bytes key
    /// the receiver granted with).
    #[pyo3(signature = (request_id, timeout = 10.0))]
    fn wait_grant(
        &self,
        py: Python<'_>,
        request_id: RequestKey,
        timeout: f64,
    ) -> PyResult<OutboundTransfer> {
        let key = request_id.key;
        let request_id = request_id.id;
        let tx = self.inner.clone();
        let t = wait_bounded(py, seconds(timeout, "timeout")?, "the grant", async move {
            tx.wait_grant(request_id).await
        })?;
        Ok(OutboundTransfer {
            inner: Arc::new(t),
            key,
        })
    }

    /// The grant for `request_id` if it has arrived, else None, without waiting or
    /// blocking: for an engine that drives its transfers from its own step loop (one
    /// call per pending request and step, no thread per request). With no live
    /// session it starts one reconnect in the background (bounded by
    /// `connect_timeout_s`) and returns None; a closed sender raises.
    fn try_grant(&self, request_id: RequestKey) -> PyResult<Option<OutboundTransfer>> {
        use std::sync::atomic::Ordering;
        let key = request_id.key;
        match self.inner.try_grant(request_id.id).map_err(PddErr)? {
            Some(t) => Ok(Some(OutboundTransfer {
                inner: Arc::new(t),
                key,
            })),
            None => {
                if !self.inner.is_connected() && !self.reconnecting.swap(true, Ordering::AcqRel) {
                    let tx = self.inner.clone();
                    let flag = self.reconnecting.clone();
                    runtime()?.spawn(async move {
                        // Its error is the next call's to see: a grant never
                        // arrives, and the caller's own grant timeout ends it.
                        let _ = tx.ensure_connected().await;
                        flag.store(false, Ordering::Release);
                    });
                }
                Ok(None)
            }
        }
    }

    /// Our pool's KV layout as given (`layout=`), or None.
    #[getter]
    fn layout<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.layout().map(|l| PyBytes::new(py, &l))
    }

    /// The receiver's KV layout on the live session (capability `kv_layout`),
    /// known once the constructor (or a reconnect) returned. None: the receiver
    /// has no layout, predates layouts, or this sender has none, or no session is
    /// live.
    #[getter]
    fn peer_layout<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.peer_layout().map(|l| PyBytes::new(py, &l))
    }

    /// Whether a session is up now.
    #[getter]
    fn connected(&self) -> bool {
        self.inner.is_connected()
    }

    /// The receiver's reason if it refused `request_id` (an int, or the str/bytes
    /// key): `wait_grant` / `try_grant` for it then raise `TransportError` with
    /// reason `refused` at once. None otherwise.
    fn refusal(&self, request_id: RequestKey) -> Option<String> {
        self.inner.refusal(request_id.id).map(|e| e.to_string())
    }

    /// This sender will not serve `request_id` (an int, or the str/bytes key): a
    /// grant of it not taken is dropped, its transfer in progress fails, and the
    /// receiver is told `reason` (ABORT `refused`, cut to 512 bytes) now and for any
    /// grant of it that comes later. True if the receiver was told now (False: no
    /// live session).
    fn decline(&self, request_id: RequestKey, reason: &str) -> PyResult<bool> {
        let rt = runtime()?;
        let _guard = rt.enter();
        Ok(self.inner.decline(request_id.id, reason).map_err(PddErr)?)
    }

    /// Ask the receiver how much of `tokens` it caches (and pin it for `lease_s`).
    /// Returns `{"matched_tokens": trusted, "hash_ok", "lease_id", "lease_ms",
    /// "prefix_hash", "reported_tokens"}`; `matched_tokens` is 0 when the decoder's
    /// hash disagreed with ours (send everything).
    #[pyo3(signature = (request_id, tokens, *, namespace = 0, page_size = 64, lease_s = 5.0, timeout = 10.0))]
    #[allow(clippy::too_many_arguments)]
    fn query_prefix<'py>(
        &self,
        py: Python<'py>,
        request_id: RequestKey,
        tokens: &Bound<'py, PyAny>,
        namespace: u64,
        page_size: u16,
        lease_s: f64,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let request_id = request_id.id;
        let tokens = u32s_from_py(tokens, "tokens")?;
        let lease = seconds_or_zero("lease_s", lease_s)?;
        let tx = self.inner.clone();
        let a = wait_bounded(
            py,
            seconds(timeout, "timeout")?,
            "the prefix reply",
            async move {
                tx.query_prefix(request_id, namespace, page_size, lease, tokens)
                    .await
            },
        )?;
        let d = PyDict::new(py);
        d.set_item("matched_tokens", a.verified.matched_tokens)?;
        d.set_item("hash_ok", a.verified.hash_ok)?;
        d.set_item("reported_tokens", a.reply.matched_tokens)?;
        d.set_item("prefix_hash", a.reply.prefix_hash)?;
        d.set_item("lease_id", a.reply.lease_id)?;
        d.set_item("lease_ms", a.reply.lease_ms)?;
        Ok(d)
    }

    /// Counters and gauges.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        metrics_dict(py, self.inner.metrics())
    }

    /// Metrics as Prometheus text, labelled `endpoint`.
    #[pyo3(signature = (endpoint = "kv_sender"))]
    fn prometheus(&self, endpoint: &str) -> String {
        self.inner.metrics().prometheus(endpoint)
    }

    /// Close the session; transfers in flight fail with `cancelled`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let tx = self.inner.clone();
        block_on(py, async move { tx.close().await })
    }
}

/// The sender's handle on one grant.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct OutboundTransfer {
    pub(crate) inner: Arc<sender::OutboundTransfer>,
    key: Py<PyAny>,
}

crate::handles::grant_getters!(OutboundTransfer, |h| h.inner.grant());
crate::handles::send_layer_method!(
    OutboundTransfer,
    "Queue grant layer `layer` from source pages `src_pages` (one per grant page) of \
     source pool layer `src_layer` (`layer` with None). Returns once queued.",
    "queueing the layer"
);
crate::handles::send_pages_method!(
    OutboundTransfer,
    "Queue grant pages `grant_pages` (grant-relative indices, any subset, any order) \
     from source pages `src_pages` (one per grant page), on grant layer `layer` (every \
     grant layer with None, each from the same source layer index) of source pool \
     layer `src_layer` (`layer` with None). Each `(layer, page)` goes once per \
     transfer; a call that repeats one queues nothing and raises.",
    "queueing the pages"
);
crate::handles::settle_waits!(
    OutboundTransfer,
    "Block (GIL released) until the receiver confirms (returns bytes) or it fails.",
    "the receiver's confirmation",
    |h| h.inner.clone()
);

#[pymethods]
impl OutboundTransfer {
    /// The request key given to `wait_grant` (int, str or bytes).
    #[getter]
    fn request_key(&self, py: Python<'_>) -> Py<PyAny> {
        self.key.clone_ref(py)
    }

    /// Give up on the transfer: the receiver fails it with `peer_aborted` and a
    /// message carrying `reason`; here it fails with `cancelled`. False if it had
    /// already ended.
    #[pyo3(signature = (reason = "aborted"))]
    fn abort(&self, reason: &str) -> bool {
        self.inner.abort(reason)
    }

    /// What KV compression did for this transfer so far: `{"blocks", "bytes_before",
    /// "bytes_after", "codec_s"}` (blocks sent compressed, their page bytes, what
    /// they took on the wire, encoder seconds).
    fn compression<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        use std::sync::atomic::Ordering::Relaxed;
        let c = self.inner.compression();
        let d = PyDict::new(py);
        d.set_item("blocks", c.blocks.load(Relaxed))?;
        d.set_item("bytes_before", c.bytes_before.load(Relaxed))?;
        d.set_item("bytes_after", c.bytes_after.load(Relaxed))?;
        d.set_item("codec_s", c.codec_ns.load(Relaxed) as f64 / 1e9)?;
        Ok(d)
    }

    /// Where the transfer stands, without waiting.
    fn poll(&self) -> KvPoll {
        match self.inner.status() {
            OutboundStatus::Complete { .. } => poll_state(Some(Ok(())), true),
            OutboundStatus::Failed(e) => poll_state(Some(Err(&e)), true),
            OutboundStatus::InProgress => poll_state(None, self.inner.started()),
        }
    }

    /// Every layer is queued: send KV_DONE.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let t = self.inner.clone();
        block_on(py, async move { t.finish().await })?.map_err(|e| PddErr(e).into())
    }

    /// `{"state": "in_progress"|"complete"|"failed", ...}`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        match self.inner.status() {
            OutboundStatus::InProgress => d.set_item("state", "in_progress")?,
            OutboundStatus::Complete { bytes } => {
                d.set_item("state", "complete")?;
                d.set_item("bytes", bytes)?;
            }
            OutboundStatus::Failed(e) => {
                d.set_item("state", "failed")?;
                d.set_item("reason", e.reason())?;
                d.set_item("message", e.to_string())?;
            }
        }
        Ok(d)
    }
}
