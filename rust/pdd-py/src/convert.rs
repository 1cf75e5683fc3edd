//! Python values -> Rust values shared by several binding files.

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::invalid;

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
            .map(|&t| to_u32(i64::from(t), field))
            .collect();
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return a.as_array().iter().map(|&t| to_u32(t, field)).collect();
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
    values.into_iter().map(|t| to_u32(t, field)).collect()
}

pub fn to_u32(t: i64, field: &str) -> PyResult<u32> {
    u32::try_from(t).map_err(|_| invalid(format!("{field}: {t} is outside 0..=4294967295")))
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
