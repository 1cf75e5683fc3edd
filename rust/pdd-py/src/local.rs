//! The local (UCX) path for Python: `LocalReceiver`, `LocalSender` and their
//! transfer handles, and `ucx_version()`. Conversion and GIL release only; the
//! logic is `pdd_io::local`.

use std::sync::Arc;

use pdd_core::wire::capability;
use pdd_core::wire::handshake::LocalHello;
use pdd_io::local::receiver::{self, LocalReceiverConfig};
use pdd_io::local::sender::{self, LocalSenderConfig};
use pdd_io::local::LocalStatus;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyDict;

use crate::convert::{address, role, seconds, u32s_from_py};
use crate::errors::PddErr;
use crate::kv::{metrics_dict, wait_bounded, KvPool};
use crate::kv_events::RequestKey;
use crate::runtime::{block_on, runtime};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<LocalReceiver>()?;
    m.add_class::<LocalSender>()?;
    m.add_class::<LocalInbound>()?;
    m.add_class::<LocalOutbound>()?;
    m.add_function(wrap_pyfunction!(ucx_version, m)?)?;
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
    #[pyo3(signature = (pool, listen = "127.0.0.1:0", *, role = "relay_decode", secret = None, insecure = false, tls = None, heartbeat_s = 1.0, dead_after_s = 5.0, hello_timeout_s = 5.0))]
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
    ) -> PyResult<Self> {
        let mut hello = LocalHello::new(self::role(role)?, capability::KV_STREAM);
        hello.secret = secret.map(|c| bytes::Bytes::copy_from_slice(&c));
        let mut cfg = LocalReceiverConfig::new(address(listen)?, hello);
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

    /// Wait until a sender is connected; returns its local session number.
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
    #[pyo3(signature = (request_id, pages, *, peer = None, deadline_s = None, timeout = 10.0))]
    fn grant(
        &self,
        py: Python<'_>,
        request_id: RequestKey,
        pages: &Bound<'_, PyAny>,
        peer: Option<u64>,
        deadline_s: Option<f64>,
        timeout: f64,
    ) -> PyResult<LocalInbound> {
        let pages = u32s_from_py(pages, "pages")?;
        let deadline = deadline_s.map(|d| seconds(d, "deadline_s")).transpose()?;
        let rx = self.inner.clone();
        let t = wait_bounded(
            py,
            seconds(timeout, "timeout")?,
            "registering a grant",
            async move { rx.grant(request_id.id, &pages, peer, deadline).await },
        )?;
        // Events carry the engine's key (str keys included), as on the KV receiver.
        let live = self.inner.clone();
        self.keys
            .remember(py, t.grant.transfer_id, &request_id.key, |id| {
                live.is_live(id)
            });
        Ok(LocalInbound { inner: t })
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
    /// `{"state": "in_progress" | "complete" | "failed", ...}`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        status_dict(py, &self.inner.status())
    }
}

/// The local path's sender (Prefill).
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct LocalSender {
    inner: Arc<sender::LocalSender>,
}

#[pymethods]
impl LocalSender {
    #[new]
    #[pyo3(signature = (pool, connect, *, node_id = None, role = "prefill", secret = None, tls = None, heartbeat_s = 1.0, dead_after_s = 5.0, connect_timeout_s = 5.0, put_timeout_s = 30.0))]
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
        let pool = pool.pool.clone();
        let tx = block_on(py, sender::LocalSender::connect(pool, cfg))?.map_err(PddErr)?;
        Ok(LocalSender {
            inner: Arc::new(tx),
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
    ) -> PyResult<LocalOutbound> {
        let tx = self.inner.clone();
        let out = wait_bounded(
            py,
            seconds(timeout, "timeout")?,
            "a local grant",
            async move { tx.wait_grant(request_id.id).await },
        )?;
        Ok(LocalOutbound {
            inner: Arc::new(out),
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
            }))
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
    inner: Arc<sender::LocalOutbound>,
}

crate::handles::grant_getters!(LocalOutbound, |h| h.inner.grant());
crate::handles::send_layer_method!(
    LocalOutbound,
    "Put grant layer `layer` from source pages `src_pages` (one per grant page) of pool \
     layer `src_layer` (`layer` with None); returns once the bytes are in the \
     receiver's memory and the completion notice is queued.",
    "a local layer put"
);
crate::handles::settle_waits!(
    LocalOutbound,
    "Wait for the receiver's confirmation (bytes) or raise why it failed.",
    "a local transfer",
    |h| h.inner.clone()
);

#[pymethods]
impl LocalOutbound {
    /// Check every layer was sent.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let out = self.inner.clone();
        block_on(py, async move { out.finish().await })?.map_err(|e| PddErr(e).into())
    }

    /// Give up (the receiver is told; keys destroyed).
    fn abort(&self) -> PyResult<()> {
        let rt = runtime()?;
        let _guard = rt.enter();
        self.inner.abort();
        Ok(())
    }

    /// `{"state": ...}` as for `LocalInbound.status`.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        status_dict(py, &self.inner.status())
    }
}
