//! The handoff event classes an engine receives, and their conversion from the link's events.

use super::*;

// ---------------------------------------------------------------------------------
// Events.
// ---------------------------------------------------------------------------------

/// MD: token IDs RLD decoded, to extend with. Exactly once per position, in order;
/// `first_position` continues the previous event's `end_position`. With `final`, MD
/// owns the request and decodes on after the last token.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct Handoff {
    #[pyo3(get)]
    request_id: u64,
    #[pyo3(get)]
    first_position: u32,
    /// Read-only numpy uint32 array.
    #[pyo3(get)]
    token_ids: Py<PyAny>,
    #[pyo3(get, name = "final")]
    final_: bool,
    len: u32,
}

#[pymethods]
impl Handoff {
    #[classattr]
    fn __match_args__() -> (&'static str, &'static str, &'static str, &'static str) {
        ("request_id", "first_position", "token_ids", "final")
    }

    /// Position after the last token: what to report as progress once extended.
    #[getter]
    fn end_position(&self) -> u32 {
        self.first_position + self.len
    }

    fn __len__(&self) -> usize {
        self.len as usize
    }

    fn __repr__(&self) -> String {
        format!(
            "Handoff(request_id={}, first_position={}, tokens={}, final={})",
            self.request_id,
            self.first_position,
            self.len,
            if self.final_ { "True" } else { "False" }
        )
    }
}

/// RLD: stop decoding this request now (the final handoff left because of a frame,
/// the load or a timer). A token decoded meanwhile is refused by `offer`.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct StopDecoding {
    #[pyo3(get)]
    request_id: u64,
}

#[pymethods]
impl StopDecoding {
    #[classattr]
    fn __match_args__() -> (&'static str,) {
        ("request_id",)
    }
    fn __repr__(&self) -> String {
        format!("StopDecoding(request_id={})", self.request_id)
    }
}

/// RLD: MD acknowledged the final handoff and owns the request; free it on RLD.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct HandoffFinished {
    #[pyo3(get)]
    request_id: u64,
}

#[pymethods]
impl HandoffFinished {
    #[classattr]
    fn __match_args__() -> (&'static str,) {
        ("request_id",)
    }
    fn __repr__(&self) -> String {
        format!("HandoffFinished(request_id={})", self.request_id)
    }
}

/// Either side: the handoff ended without MD owning the request (the peer aborted,
/// or it stayed silent beyond the bounds). `error` is the `PddError` that says why.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct HandoffFailed {
    #[pyo3(get)]
    request_id: u64,
    #[pyo3(get)]
    error: Py<PyAny>,
    #[pyo3(get)]
    reason: &'static str,
}

#[pymethods]
impl HandoffFailed {
    #[classattr]
    fn __match_args__() -> (&'static str, &'static str) {
        ("request_id", "error")
    }
    fn __repr__(&self) -> String {
        format!(
            "HandoffFailed(request_id={}, reason='{}')",
            self.request_id, self.reason
        )
    }
}

pub(super) fn failed(py: Python<'_>, request_id: u64, e: Error) -> PyResult<Py<PyAny>> {
    let reason = e.reason();
    let err: PyErr = PddErr(e).into();
    let obj = HandoffFailed {
        request_id,
        error: err.into_value(py).into_any(),
        reason,
    };
    Ok(Py::new(py, obj)?.into_any())
}

pub(super) fn relay_event_to_py(py: Python<'_>, ev: LinkEvent<RelayEvent>) -> PyResult<Py<PyAny>> {
    let request_id = ev.request_id;
    match ev.event {
        RelayEvent::StopDecoding => Ok(Py::new(py, StopDecoding { request_id })?.into_any()),
        RelayEvent::Finished => Ok(Py::new(py, HandoffFinished { request_id })?.into_any()),
        RelayEvent::Failed(e) => failed(py, request_id, e),
    }
}

pub(super) fn main_event_to_py(py: Python<'_>, ev: LinkEvent<MainEvent>) -> PyResult<Py<PyAny>> {
    match ev.event {
        MainEvent::Handoff {
            request_id,
            first_position,
            token_ids,
            final_,
        } => {
            let len = token_ids.len() as u32;
            let array = PyArray1::from_vec(py, token_ids);
            let kwargs = PyDict::new(py);
            kwargs.set_item("write", false)?;
            array.call_method("setflags", (), Some(&kwargs))?;
            Ok(Py::new(
                py,
                Handoff {
                    request_id,
                    first_position,
                    token_ids: array.into_any().unbind(),
                    final_,
                    len,
                },
            )?
            .into_any())
        }
        MainEvent::Failed(e) => failed(py, ev.request_id, e),
    }
}
