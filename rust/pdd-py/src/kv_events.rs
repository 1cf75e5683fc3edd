//! What a KV endpoint tells its engine, as typed Python values: the receiver's events
//! (`LayerComplete`, `TransferComplete`, `TransferFailed`, `PrefixQueried`), the
//! non-blocking per-transfer state `KvPoll`, and the request key conversion.

use std::collections::HashMap;
use std::sync::Mutex;

use pdd_core::kv::{request_id_of, TransferEvent};
use pdd_core::Error;
use pdd_io::receiver::ReceiverEvent;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyString};

use crate::convert::RequestId;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KvPoll>()?;
    m.add_class::<LayerComplete>()?;
    m.add_class::<TransferComplete>()?;
    m.add_class::<TransferFailed>()?;
    m.add_class::<PrefixQueried>()?;
    m.add_function(wrap_pyfunction!(py_request_id_of, m)?)?;
    Ok(())
}

/// Where one transfer stands, without waiting: like SGLang's `KVPoll`.
#[pyclass(eq, eq_int, frozen, module = "pdd_transport._native")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPoll {
    /// Granted, nothing sent (sender) or landed (receiver) yet.
    #[pyo3(name = "PENDING")]
    Pending = 0,
    /// Pages are moving.
    #[pyo3(name = "TRANSFERRING")]
    Transferring = 1,
    /// Every page landed and verified; the receiver confirmed.
    #[pyo3(name = "DONE")]
    Done = 2,
    /// The transfer failed (`status()` / `wait()` say why).
    #[pyo3(name = "FAILED")]
    Failed = 3,
}

/// A request key from Python: an int in `0..2**64` (the id itself), a `str` (its
/// UTF-8 bytes) or `bytes`, the last two mapped by `request_id_of`. The original
/// object is kept so the engine gets its own key back.
pub struct RequestKey {
    pub id: u64,
    pub key: Py<PyAny>,
}

impl<'a, 'py> FromPyObject<'a, 'py> for RequestKey {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let id = if obj.is_instance_of::<PyInt>() {
            obj.extract::<RequestId>()?.0
        } else if let Ok(s) = obj.cast::<PyString>() {
            request_id_of(s.to_str()?.as_bytes())
        } else if let Ok(b) = obj.cast::<PyBytes>() {
            request_id_of(b.as_bytes())
        } else {
            return Err(PyTypeError::new_err(format!(
                "a request key is an int, str or bytes, got {}",
                obj.get_type().name()?
            )));
        };
        Ok(RequestKey {
            id,
            key: obj.to_owned().unbind(),
        })
    }
}

/// The 64-bit id the wire carries for request key `key` (int: itself; str: its UTF-8
/// bytes; bytes: the first 8 bytes, little-endian, of SHA-256 over a fixed domain
/// prefix and the key). Sender and receiver compute the same id.
#[pyfunction(name = "request_id_of")]
fn py_request_id_of(key: RequestKey) -> u64 {
    key.id
}

/// Transfer id -> the engine's request key, for the receiver's events. Entries go
/// when their transfer's last event is taken; bounded so that a receiver whose
/// events are never polled does not grow without limit.
#[derive(Default)]
pub struct KeyBook {
    keys: Mutex<HashMap<u64, Py<PyAny>>>,
}

/// Keys remembered for events at most; past this the oldest ended ones are dropped
/// (their events then carry the numeric id as the key).
const KEY_BOOK_CAP: usize = 65_536;

impl KeyBook {
    pub fn remember(
        &self,
        py: Python<'_>,
        transfer_id: u64,
        key: &Py<PyAny>,
        live: impl Fn(u64) -> bool,
    ) {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if keys.len() >= KEY_BOOK_CAP {
            keys.retain(|&id, _| live(id));
        }
        keys.insert(transfer_id, key.clone_ref(py));
    }

    fn key(
        &self,
        py: Python<'_>,
        transfer_id: u64,
        request_id: u64,
        last: bool,
    ) -> PyResult<Py<PyAny>> {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let found = if last {
            keys.remove(&transfer_id)
        } else {
            keys.get(&transfer_id).map(|k| k.clone_ref(py))
        };
        match found {
            Some(k) => Ok(k),
            None => Ok(request_id.into_pyobject(py)?.into_any().unbind()),
        }
    }
}

/// Every page of one layer landed and passed its checksum.
#[pyclass(frozen, get_all, module = "pdd_transport._native")]
pub struct LayerComplete {
    transfer_id: u64,
    request_id: u64,
    request_key: Py<PyAny>,
    layer: u16,
}

/// Every page of every layer landed and the sender's KV_DONE agrees.
#[pyclass(frozen, get_all, module = "pdd_transport._native")]
pub struct TransferComplete {
    transfer_id: u64,
    request_id: u64,
    request_key: Py<PyAny>,
    bytes: u64,
    blocks: u32,
}

/// The transfer failed; `reason` is the stable reason string (`peer_aborted`,
/// `connection_lost`, `checksum_mismatch`...), `message` says what happened.
#[pyclass(frozen, get_all, module = "pdd_transport._native")]
pub struct TransferFailed {
    transfer_id: u64,
    request_id: u64,
    request_key: Py<PyAny>,
    reason: &'static str,
    message: String,
}

/// A sender asked how much of a request's prompt this receiver caches; it was
/// answered (and, with `lease_id` != 0, the match pinned until `release_lease`).
#[pyclass(frozen, get_all, module = "pdd_transport._native")]
pub struct PrefixQueried {
    peer: u64,
    request_id: u64,
    matched_tokens: u32,
    lease_id: u64,
}

#[pymethods]
impl LayerComplete {
    #[classattr]
    fn __match_args__() -> (&'static str, &'static str, &'static str) {
        ("transfer_id", "request_key", "layer")
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "LayerComplete(transfer_id={}, request_key={}, layer={})",
            self.transfer_id,
            repr(py, &self.request_key),
            self.layer
        )
    }
}

#[pymethods]
impl TransferComplete {
    #[classattr]
    fn __match_args__() -> (&'static str, &'static str, &'static str) {
        ("transfer_id", "request_key", "bytes")
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "TransferComplete(transfer_id={}, request_key={}, bytes={}, blocks={})",
            self.transfer_id,
            repr(py, &self.request_key),
            self.bytes,
            self.blocks
        )
    }
}

#[pymethods]
impl TransferFailed {
    #[classattr]
    fn __match_args__() -> (&'static str, &'static str, &'static str) {
        ("transfer_id", "request_key", "reason")
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "TransferFailed(transfer_id={}, request_key={}, reason='{}', message={:?})",
            self.transfer_id,
            repr(py, &self.request_key),
            self.reason,
            self.message
        )
    }
}

#[pymethods]
impl PrefixQueried {
    #[classattr]
    fn __match_args__() -> (&'static str, &'static str, &'static str) {
        ("peer", "request_id", "matched_tokens")
    }
    fn __repr__(&self) -> String {
        format!(
            "PrefixQueried(peer={}, request_id={}, matched_tokens={}, lease_id={})",
            self.peer, self.request_id, self.matched_tokens, self.lease_id
        )
    }
}

fn repr(py: Python<'_>, obj: &Py<PyAny>) -> String {
    obj.bind(py)
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// One transfer event as its typed Python value; the key book gives the engine's own
/// request key back (and forgets it once the transfer ended).
fn transfer_event_to_py(py: Python<'_>, book: &KeyBook, t: &TransferEvent) -> PyResult<Py<PyAny>> {
    let (transfer_id, request_id, ended) = match t {
        TransferEvent::LayerComplete {
            transfer_id,
            request_id,
            ..
        } => (*transfer_id, *request_id, false),
        TransferEvent::Complete {
            transfer_id,
            request_id,
            ..
        }
        | TransferEvent::Failed {
            transfer_id,
            request_id,
            ..
        } => (*transfer_id, *request_id, true),
    };
    let request_key = book.key(py, transfer_id, request_id, ended)?;
    Ok(match t {
        TransferEvent::LayerComplete { layer, .. } => {
            let layer = *layer;
            Py::new(
                py,
                LayerComplete {
                    transfer_id,
                    request_id,
                    request_key,
                    layer,
                },
            )?
            .into_any()
        }
        TransferEvent::Complete { bytes, blocks, .. } => {
            let (bytes, blocks) = (*bytes, *blocks);
            Py::new(
                py,
                TransferComplete {
                    transfer_id,
                    request_id,
                    request_key,
                    bytes,
                    blocks,
                },
            )?
            .into_any()
        }
        TransferEvent::Failed { error, .. } => {
            let (reason, message) = (error.reason(), error.to_string());
            Py::new(
                py,
                TransferFailed {
                    transfer_id,
                    request_id,
                    request_key,
                    reason,
                    message,
                },
            )?
            .into_any()
        }
    })
}

/// One receiver event as its typed Python value.
pub fn event_to_py(py: Python<'_>, book: &KeyBook, e: &ReceiverEvent) -> PyResult<Py<PyAny>> {
    let obj = match e {
        ReceiverEvent::PrefixQuery {
            peer,
            request_id,
            matched_tokens,
            lease_id,
        } => Py::new(
            py,
            PrefixQueried {
                peer: *peer,
                request_id: *request_id,
                matched_tokens: *matched_tokens,
                lease_id: *lease_id,
            },
        )?
        .into_any(),
        ReceiverEvent::Transfer(t) => transfer_event_to_py(py, book, t)?,
    };
    Ok(obj)
}

/// The poll state of a transfer from its terminal outcome, if any, and whether any
/// page moved.
pub fn poll_state(outcome: Option<Result<(), &Error>>, started: bool) -> KvPoll {
    match outcome {
        Some(Ok(())) => KvPoll::Done,
        Some(Err(_)) => KvPoll::Failed,
        None if started => KvPoll::Transferring,
        None => KvPoll::Pending,
    }
}
