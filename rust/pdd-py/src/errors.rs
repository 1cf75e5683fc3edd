//! `pdd_core::Error` -> Python exceptions.
//!
//! The classes live in `pdd_transport/errors.py` so that each can derive from both
//! `PddError` and the matching built-in (`ValueError`, `ConnectionError`,
//! `TimeoutError`); this file only picks the class by [`ErrorClass`] and fills in
//! `reason` (the stable snake_case code of the Rust variant) and `abort_reason` (what
//! a peer is told in ABORT when this error ends a connection).

use pdd_core::{Error, ErrorClass};
use pdd_io::wanem::WanemError;
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

/// An instance of the `pdd_transport.errors` class for `class`, carrying `reason` and
/// `abort_reason`: the one place a binding error becomes a Python exception.
pub(crate) fn raise(class: ErrorClass, message: String, reason: &str, abort_reason: &str) -> PyErr {
    Python::attach(|py| {
        let idx = match class {
            ErrorClass::Protocol => 0,
            ErrorClass::InvalidArgument => 1,
            ErrorClass::Connection => 2,
            ErrorClass::Timeout => 3,
        };
        match classes(py) {
            Ok(cls) => match cls[idx].bind(py).call1((message, reason, abort_reason)) {
                Ok(exc) => PyErr::from_value(exc),
                Err(err) => err,
            },
            Err(err) => err,
        }
    })
}

impl From<PddErr> for PyErr {
    fn from(PddErr(e): PddErr) -> PyErr {
        raise(
            e.class(),
            e.to_string(),
            e.reason(),
            e.abort_reason().name(),
        )
    }
}

/// A `pdd_io::wanem::WanemError` on its way to Python (the emulator's errors are not
/// `pdd_core::Error`s: it is a test and bench tool, not a protocol endpoint).
pub struct WanemErr(pub WanemError);

impl From<WanemErr> for PyErr {
    /// A bad config is the caller's (`InvalidArgument`, reason `invalid_argument`), a
    /// port that cannot be bound a `TransportError` (`bind_failed`), a shutdown that ran
    /// out of time a `DeadlineExceeded` (`shutdown_timed_out`), a runtime or signal
    /// failure a `TransportError` (`runtime_failed`). No catch-all arm: a new variant
    /// must be given its class here.
    fn from(WanemErr(e): WanemErr) -> PyErr {
        let (class, reason) = match &e {
            WanemError::InvalidConfig(_) => (ErrorClass::InvalidArgument, "invalid_argument"),
            WanemError::Bind { .. } => (ErrorClass::Connection, "bind_failed"),
            WanemError::ShutdownTimedOut(_) => (ErrorClass::Timeout, "shutdown_timed_out"),
            WanemError::NoRuntime | WanemError::Runtime(_) | WanemError::Signal(_) => {
                (ErrorClass::Connection, "runtime_failed")
            }
        };
        raise(class, e.to_string(), reason, "internal")
    }
}

/// The emulator's `closed` error: a method called after `close()`.
pub fn wanem_closed() -> PyErr {
    raise(
        ErrorClass::InvalidArgument,
        "the WAN emulator is closed".into(),
        "closed",
        "internal",
    )
}

/// An `InvalidArgument` raised by the binding itself (a field missing from a dict).
pub fn invalid(msg: impl Into<String>) -> PyErr {
    PddErr(Error::InvalidArgument(msg.into())).into()
}
