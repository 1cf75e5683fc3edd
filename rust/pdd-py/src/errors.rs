//! `pdd_core::Error` -> Python exceptions.
//!
//! The classes live in `pdd_transport/errors.py` so that each can derive from both
//! `PddError` and the matching built-in (`ValueError`, `ConnectionError`,
//! `TimeoutError`); this file only picks the class by [`ErrorClass`] and fills in
//! `reason` (the stable snake_case code of the Rust variant) and `abort_reason` (what
//! a peer is told in ABORT when this error ends a connection).

use pdd_core::{Error, ErrorClass};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// A `pdd_core::Error` on its way to Python (a newtype: both `Error` and `PyErr` are
/// foreign to this crate, so `From` needs a local type between them).
pub struct PddErr(pub Error);

impl From<Error> for PddErr {
    fn from(e: Error) -> Self {
        PddErr(e)
    }
}

static CLASSES: PyOnceLock<[Py<PyType>; 4]> = PyOnceLock::new();

fn classes(py: Python<'_>) -> PyResult<&[Py<PyType>; 4]> {
    CLASSES.get_or_try_init(py, || {
        let m = py.import("pdd_transport.errors")?;
        let get = |name: &str| -> PyResult<Py<PyType>> {
            Ok(m.getattr(name)?.cast_into::<PyType>()?.unbind())
        };
        Ok([
            get("ProtocolError")?,
            get("InvalidArgument")?,
            get("TransportError")?,
            get("DeadlineExceeded")?,
        ])
    })
}

impl From<PddErr> for PyErr {
    fn from(PddErr(e): PddErr) -> PyErr {
        Python::attach(|py| {
            let idx = match e.class() {
                ErrorClass::Protocol => 0,
                ErrorClass::InvalidArgument => 1,
                ErrorClass::Connection => 2,
                ErrorClass::Timeout => 3,
            };
            match classes(py) {
                Ok(cls) => match cls[idx].bind(py).call1((
                    e.to_string(),
                    e.reason(),
                    e.abort_reason().name(),
                )) {
                    Ok(exc) => PyErr::from_value(exc),
                    Err(err) => err,
                },
                Err(err) => err,
            }
        })
    }
}

/// An `InvalidArgument` raised by the binding itself (a field missing from a dict).
pub fn invalid(msg: impl Into<String>) -> PyErr {
    PddErr(Error::InvalidArgument(msg.into())).into()
}
