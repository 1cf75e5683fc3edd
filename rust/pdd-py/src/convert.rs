//! Python values -> Rust values: every argument helper of the binding lives here
//! once. Range and unit checks of a single argument are here; checks of a whole
//! configuration (lanes, block size, node id, timers, lease bounds) are pdd-io's
//! (`pdd_io::config`), so Rust callers get the same errors.

use std::net::SocketAddr;
use std::time::Duration;

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pdd_core::wire::Role;
use pdd_io::lane::SocketTuning;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::invalid;

/// A positive, finite number of seconds (timeouts, heartbeats), at most 10^6.
pub fn seconds(v: f64, what: &str) -> PyResult<Duration> {
    if !v.is_finite() || v <= 0.0 || v > 1e6 {
        return Err(invalid(format!(
            "{what} must be a positive number of seconds, got {v}"
        )));
    }
    Ok(Duration::from_secs_f64(v))
}

/// A finite number of seconds >= 0 (0 meaning "now" or "none", per parameter).
pub fn seconds_or_zero(name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value).map_err(|_| {
        invalid(format!(
            "{name} must be a finite number of seconds >= 0, got {value}"
        ))
    })
}

/// [`seconds_or_zero`] of an optional argument.
pub fn opt_seconds_or_zero(name: &str, value: Option<f64>) -> PyResult<Option<Duration>> {
    value.map(|v| seconds_or_zero(name, v)).transpose()
}

/// A role by its wire name (`prefill`, `relay_decode`, `main_decode`).
pub fn role(name: &str) -> PyResult<Role> {
    Role::from_name(name).ok_or_else(|| invalid(format!("unknown role '{name}'")))
}

/// An `IP:port` socket address.
pub fn address(s: &str) -> PyResult<SocketAddr> {
    s.parse()
        .map_err(|_| invalid(format!("'{s}' is not an IP:port address")))
}

/// Socket tuning from the endpoints' `socket_buffer` and `congestion` arguments;
/// `socket_buffer` 0 leaves the kernel's default (and its autotuning) alone.
pub fn tuning(socket_buffer: usize, congestion: Option<String>) -> SocketTuning {
    SocketTuning {
        buffer_bytes: (socket_buffer > 0).then_some(socket_buffer),
        congestion,
        ..SocketTuning::default()
    }
}

/// u32 values (token IDs, page indices) from a 1-D numpy int32/int64/uint32 array or a
/// sequence of ints; each must fit u32.
pub fn u32s_from_py(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<u32>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, u32>>() {
        return Ok(a.as_array().to_vec());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return a
            .as_array()
            .iter()
            .map(|&t| u32_arg(field, i64::from(t)))
            .collect();
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return a.as_array().iter().map(|&t| u32_arg(field, t)).collect();
    }
    if let Ok(a) = obj.cast::<numpy::PyUntypedArray>() {
        return Err(PyTypeError::new_err(format!(
            "{field}: expected a 1-D int32, int64 or uint32 array, got {}-D {}",
            a.ndim(),
            a.dtype()
        )));
    }
    let values: Vec<i64> = obj.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{field}: expected a sequence of ints or an int array"
        ))
    })?;
    values.into_iter().map(|t| u32_arg(field, t)).collect()
}

/// A count, position, page or token id given as a Python int: out of `u32` range
/// (negative included) is an `InvalidArgument` naming the parameter, not an
/// `OverflowError`.
pub fn u32_arg(name: &str, value: i64) -> PyResult<u32> {
    u32::try_from(value).map_err(|_| invalid(format!("{name}: {value} is outside 0..=4294967295")))
}

/// A request id from Python: an int in `0..=2^64-1`. One out of that range (negative
/// included) is an `InvalidArgument` naming the parameter, as for every other
/// argument, rather than the `OverflowError` of the plain `u64` conversion; a
/// non-int stays a `TypeError`.
#[derive(Clone, Copy, Debug)]
pub struct RequestId(pub u64);

impl<'a, 'py> FromPyObject<'a, 'py> for RequestId {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<u64>() {
            Ok(v) => Ok(RequestId(v)),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(obj.py()) => {
                Err(invalid(format!(
                    "request_id must be in 0..=18446744073709551615, got {}",
                    obj.str().map(|s| s.to_string()).unwrap_or_default()
                )))
            }
            Err(e) => Err(e),
        }
    }
}
