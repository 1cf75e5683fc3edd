//! `DualSender`: the dual-path send (pdd_io::dual) for Python. Converts the sides'
//! handles, queues layers without blocking, waits with the GIL released.

use std::sync::Arc;

use pdd_io::dual::{DualSend, GrantWait, SideHandle, SideOutcome};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::{seconds, u32s_from_py};
use crate::errors::PddErr;
use crate::kv::{KvSender, OutboundTransfer};
use crate::kv_events::RequestKey;
use crate::local::{LocalOutbound, LocalSender};
use crate::runtime::{block_on, runtime};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DualSender>()
}

fn invalid(msg: String) -> PyErr {
    PddErr(pdd_core::Error::InvalidArgument(msg)).into()
}

/// A side given as its grant's handle, or as its sender (either path's) (the side waits for the
/// grant of `key` itself).
fn side(
    obj: Option<&Bound<'_, PyAny>>,
    key: Option<u64>,
    name: &str,
) -> PyResult<Option<GrantWait>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(None);
    };
    let need_key = || {
        key.ok_or_else(|| {
            invalid(format!(
                "the {name} side is a sender: give request_key, the request whose grant it waits for"
            ))
        })
    };
    let ready = |h: SideHandle| -> GrantWait { Box::pin(async move { Ok(h) }) };
    // Either side may run on either path: RelayDecode's falls back to the WAN path
    // (TCP lanes) where UCX is unavailable.
    if let Ok(t) = obj.cast::<OutboundTransfer>() {
        return Ok(Some(ready(SideHandle::Wan(t.get().inner.clone()))));
    }
    if let Ok(t) = obj.cast::<LocalOutbound>() {
        return Ok(Some(ready(SideHandle::Local(t.get().inner.clone()))));
    }
    if let Ok(s) = obj.cast::<KvSender>() {
        let (tx, id) = (s.get().inner.clone(), need_key()?);
        return Ok(Some(Box::pin(async move {
            tx.wait_grant(id)
                .await
                .map(|t| SideHandle::Wan(Arc::new(t)))
        })));
    }
    if let Ok(s) = obj.cast::<LocalSender>() {
        let (tx, id) = (s.get().inner.clone(), need_key()?);
        return Ok(Some(Box::pin(async move {
            tx.wait_grant(id)
                .await
                .map(|t| SideHandle::Local(Arc::new(t)))
        })));
    }
    Err(invalid(format!(
        "the {name} side must be a sender (KvSender, LocalSender), a grant's handle \
         (OutboundTransfer, LocalOutbound) or None, got {}",
        obj.get_type().name()?
    )))
}

/// `(local, wan)`: each side's outcome dict, None for a side not asked for.
type Outcomes<'py> = (Option<Bound<'py, PyDict>>, Option<Bound<'py, PyDict>>);

fn outcome_dict<'py>(
    py: Python<'py>,
    o: Option<SideOutcome>,
) -> PyResult<Option<Bound<'py, PyDict>>> {
    let Some(o) = o else { return Ok(None) };
    let d = PyDict::new(py);
    d.set_item("seconds", o.elapsed.as_secs_f64())?;
    match o.result {
        Ok(bytes) => {
            d.set_item("ok", true)?;
            d.set_item("bytes", bytes)?;
        }
        Err(e) => {
            d.set_item("ok", false)?;
            d.set_item("bytes", 0)?;
            d.set_item("reason", e.reason())?;
            d.set_item("message", e.to_string())?;
        }
    }
    Ok(Some(d))
}

/// One request's KV to RelayDecode over the local path and to MainDecode over the
/// WAN path at once, each side a task of the library's runtime (no Python thread):
/// `send_layer` queues a layer on both sides and returns at once. Each side is its
/// grant's handle (`LocalOutbound`, `OutboundTransfer`) or its sender (`LocalSender`,
/// `KvSender`, then with `request_key`: the side waits for that grant, so one side's
/// grant arriving late or never holds nothing of the other's), or None. Each side
/// sends the last `page_count` pages of `pages` its grant covers. A side that fails
/// aborts its own transfer with the reason and never touches the other.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct DualSender {
    inner: DualSend,
}

#[pymethods]
impl DualSender {
    #[new]
    #[pyo3(signature = (local, wan, pages, *, request_key = None, timeout = 120.0))]
    fn new(
        local: Option<&Bound<'_, PyAny>>,
        wan: Option<&Bound<'_, PyAny>>,
        pages: &Bound<'_, PyAny>,
        request_key: Option<RequestKey>,
        timeout: f64,
    ) -> PyResult<Self> {
        let step_timeout = seconds(timeout, "timeout")?;
        let key = request_key.map(|k| k.id);
        let pages = u32s_from_py(pages, "pages")?;
        let local = side(local, key, "local")?;
        let wan = side(wan, key, "wan")?;
        let inner = DualSend::start(runtime()?.handle(), local, wan, pages, step_timeout)
            .map_err(PddErr)?;
        Ok(DualSender { inner })
    }

    /// Queue grant layer `layer` on both sides; returns at once. A side whose grant
    /// has fewer layers skips the ones past it.
    fn send_layer(&self, layer: u16) {
        self.inner.send_layer(layer);
    }

    /// Every layer was queued.
    fn finish(&self) {
        self.inner.finish();
    }

    /// Block (GIL released) until both sides ended, at most `timeout` seconds (by
    /// default the sides' own bounds: grant, each layer, confirmation). Returns
    /// `(local, wan)`: per side None (not asked for) or `{"ok", "bytes", "seconds",
    /// "reason", "message"}`; a side still running when `timeout` passes is reported
    /// `deadline_exceeded` (and keeps running to its own bound).
    #[pyo3(signature = (timeout = None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Outcomes<'py>> {
        let bound = timeout.map(|t| seconds(t, "timeout")).transpose()?;
        let inner = &self.inner;
        let (local, wan) = block_on(py, async move {
            match bound {
                None => inner.wait().await,
                Some(b) => match tokio::time::timeout(b, inner.wait()).await {
                    Ok(both) => both,
                    Err(_) => {
                        let (l, w) = inner.poll();
                        let late = || SideOutcome {
                            result: Err(pdd_core::Error::DeadlineExceeded {
                                what: format!("the side's end within {b:?}"),
                            }),
                            elapsed: inner.elapsed(),
                        };
                        let (has_l, has_w) = inner.sides_asked();
                        (
                            has_l.then(|| l.unwrap_or_else(late)),
                            has_w.then(|| w.unwrap_or_else(late)),
                        )
                    }
                },
            }
        })?;
        Ok((outcome_dict(py, local)?, outcome_dict(py, wan)?))
    }

    /// `(local, wan)` as `wait` returns them, without waiting: None for a side not
    /// asked for or still running.
    fn poll<'py>(&self, py: Python<'py>) -> PyResult<Outcomes<'py>> {
        let (l, w) = self.inner.poll();
        Ok((outcome_dict(py, l)?, outcome_dict(py, w)?))
    }
}
