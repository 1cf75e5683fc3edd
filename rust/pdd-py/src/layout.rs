//! KV layouts and the mapping plan (`pdd_core::kv::layout`), for Python. Converts and
//! maps errors only: an invalid field is `InvalidArgument` (reason `invalid_layout`,
//! `.field` set), two layouts that do not map are `LayoutMismatch` (reason
//! `layout_mismatch`, `.field`), a plan over its bounds is `InvalidArgument` (reason
//! `layout_plan_too_large`).
//!
//! A plan's unit lists come back as numpy uint32 arrays: the `Vec<u32>` the core built
//! is handed to numpy without a copy, where a list would cost a Python int per unit.

use numpy::PyArray1;
use pdd_core::kv::layout::{
    self, Arrangement, KvDtype, LayoutError, LayoutFields, LayoutMismatch, PlanError,
};
use pdd_core::ErrorClass;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyType};

use crate::errors::raise;

/// Plans over at least this many tokens release the GIL (they walk every head vector).
const DETACH_TOKENS: u32 = 4096;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KvLayout>()?;
    m.add_class::<LayoutPlan>()?;
    m.add_function(wrap_pyfunction!(layout_plan, m)?)?;
    m.add_function(wrap_pyfunction!(first_token_for_units, m)?)?;
    m.add_function(wrap_pyfunction!(check_layout_compatible, m)?)?;
    Ok(())
}

/// `InvalidArgument` with reason `invalid_layout` and the field as `.field`.
fn invalid_layout(e: LayoutError) -> PyErr {
    let LayoutError::InvalidField { field, .. } = &e;
    let field = *field;
    let err = raise(
        ErrorClass::InvalidArgument,
        e.to_string(),
        "invalid_layout",
        "internal",
    );
    Python::attach(|py| match err.value(py).setattr("field", field) {
        Ok(()) => err,
        Err(set) => set,
    })
}

static MISMATCH: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// `pdd_transport.errors.LayoutMismatch(message, "layout_mismatch", "refused", field)`.
fn mismatch(e: LayoutMismatch) -> PyErr {
    Python::attach(|py| {
        let cls = MISMATCH.get_or_try_init(py, || -> PyResult<Py<PyType>> {
            let m = py.import("pdd_transport.errors")?;
            Ok(m.getattr("LayoutMismatch")?.cast_into::<PyType>()?.unbind())
        });
        match cls.and_then(|c| {
            c.bind(py)
                .call1((e.to_string(), e.reason(), "refused", e.field()))
        }) {
            Ok(exc) => PyErr::from_value(exc),
            Err(err) => err,
        }
    })
}

fn plan_error(e: PlanError) -> PyErr {
    match e {
        PlanError::Mismatch(m) => mismatch(m),
        PlanError::TokenRange { .. } => raise(
            ErrorClass::InvalidArgument,
            e.to_string(),
            "invalid_token_range",
            "internal",
        ),
        PlanError::TooLarge { .. } => raise(
            ErrorClass::InvalidArgument,
            e.to_string(),
            "layout_plan_too_large",
            "internal",
        ),
    }
}

fn named_field(field: &'static str, why: String) -> PyErr {
    invalid_layout(LayoutError::InvalidField { field, why })
}

/// One pool's KV layout: what a page of one block of one layer holds, and where.
#[pyclass(frozen, eq, hash, module = "pdd_transport._native")]
#[derive(PartialEq, Eq, Hash)]
pub struct KvLayout {
    inner: layout::KvLayout,
}

#[pymethods]
impl KvLayout {
    /// `layers` and `heads` default to all of them, `page_bytes` to the data's size.
    #[new]
    #[pyo3(signature = (*, model, dtype, total_layers, tokens_per_block, total_kv_heads, head_size, layers = None, heads = None, arrangement = "kv_head_token", page_bytes = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        model: String,
        dtype: &str,
        total_layers: u16,
        tokens_per_block: u32,
        total_kv_heads: u16,
        head_size: u32,
        layers: Option<(u16, u16)>,
        heads: Option<(u16, u16)>,
        arrangement: &str,
        page_bytes: Option<u32>,
    ) -> PyResult<Self> {
        let dtype = KvDtype::from_name(dtype).ok_or_else(|| {
            let names: Vec<_> = KvDtype::ALL.iter().map(|d| d.name()).collect();
            named_field("dtype", format!("{dtype:?} is none of {names:?}"))
        })?;
        let arrangement = Arrangement::from_name(arrangement).ok_or_else(|| {
            let names: Vec<_> = Arrangement::ALL.iter().map(|a| a.name()).collect();
            named_field(
                "arrangement",
                format!("{arrangement:?} is none of {names:?}"),
            )
        })?;
        let mut fields = LayoutFields {
            model,
            dtype,
            total_layers,
            layers: layers.unwrap_or((0, total_layers)),
            tokens_per_block,
            total_kv_heads,
            heads: heads.unwrap_or((0, total_kv_heads)),
            head_size,
            arrangement,
            page_bytes: 0,
        };
        // Data past u32 is refused as `page_bytes` by the core's check.
        fields.page_bytes =
            page_bytes.unwrap_or_else(|| u32::try_from(fields.data_bytes()).unwrap_or(u32::MAX));
        let inner = layout::KvLayout::new(fields).map_err(invalid_layout)?;
        Ok(KvLayout { inner })
    }

    /// The model's name or id.
    #[getter]
    fn model(&self) -> &str {
        &self.inner.fields().model
    }

    /// Element type: "f32", "f16", "bf16", "f8_e4m3" or "f8_e5m2".
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.fields().dtype.name()
    }

    /// Layers of the model.
    #[getter]
    fn total_layers(&self) -> u16 {
        self.inner.fields().total_layers
    }

    /// Absolute layers held, `(first, end)`.
    #[getter]
    fn layers(&self) -> (u16, u16) {
        self.inner.fields().layers
    }

    /// Token slots per block (page).
    #[getter]
    fn tokens_per_block(&self) -> u32 {
        self.inner.fields().tokens_per_block
    }

    /// KV heads of the model.
    #[getter]
    fn total_kv_heads(&self) -> u16 {
        self.inner.fields().total_kv_heads
    }

    /// Absolute KV heads held, `(first, end)`.
    #[getter]
    fn heads(&self) -> (u16, u16) {
        self.inner.fields().heads
    }

    /// Elements per head vector.
    #[getter]
    fn head_size(&self) -> u32 {
        self.inner.fields().head_size
    }

    /// Order of the outer dimensions of a page ("kv_head_token", ...).
    #[getter]
    fn arrangement(&self) -> &'static str {
        self.inner.fields().arrangement.name()
    }

    /// Bytes of one page (data, then padding).
    #[getter]
    fn page_bytes(&self) -> u32 {
        self.inner.fields().page_bytes
    }

    /// Bytes of data in one page.
    #[getter]
    fn data_bytes(&self) -> u32 {
        self.inner.data_bytes()
    }

    /// SHA-256 (32 bytes) of what must match between two sides: model, dtype, total
    /// layers, total KV heads, head size.
    #[getter]
    fn digest<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.digest())
    }

    /// The wire encoding (at most 256 bytes).
    fn encode<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.encode())
    }

    /// The layout an `encode()` gave; `InvalidArgument` (reason `invalid_layout`,
    /// `.field`) for anything else.
    #[staticmethod]
    fn decode(data: &[u8]) -> PyResult<KvLayout> {
        let inner = layout::decode(data).map_err(invalid_layout)?;
        Ok(KvLayout { inner })
    }

    fn __repr__(&self) -> String {
        let f = self.inner.fields();
        format!(
            "KvLayout(model={:?}, dtype={:?}, total_layers={}, layers={:?}, tokens_per_block={}, total_kv_heads={}, heads={:?}, head_size={}, arrangement={:?}, page_bytes={})",
            f.model,
            f.dtype.name(),
            f.total_layers,
            f.layers,
            f.tokens_per_block,
            f.total_kv_heads,
            f.heads,
            f.head_size,
            f.arrangement.name(),
            f.page_bytes
        )
    }
}

/// What moves for one request: `src_units[i]` of the source's pages goes to
/// `dst_units[i]` of the destination's, on every layer of `layers`.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct LayoutPlan {
    /// Bytes of every unit (divides both page sizes).
    #[pyo3(get)]
    unit_bytes: u32,
    /// Absolute layers held by both, `(first, end)`.
    #[pyo3(get)]
    layers: (u16, u16),
    /// The source pool's layer index of `layers[0]`.
    #[pyo3(get)]
    src_first_layer: u16,
    /// The destination pool's layer index of `layers[0]`.
    #[pyo3(get)]
    dst_first_layer: u16,
    /// Units per source page.
    #[pyo3(get)]
    src_units_per_page: u32,
    /// Units per destination page.
    #[pyo3(get)]
    dst_units_per_page: u32,
    /// Source units relative to the request's block list (uint32).
    #[pyo3(get)]
    src_units: Py<PyArray1<u32>>,
    /// Destination units relative to the request's block list (uint32).
    #[pyo3(get)]
    dst_units: Py<PyArray1<u32>>,
    len: usize,
}

#[pymethods]
impl LayoutPlan {
    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!(
            "LayoutPlan(units={}, unit_bytes={}, layers={:?})",
            self.len, self.unit_bytes, self.layers
        )
    }
}

/// The plan moving tokens `[first_token, end_token)` from `src`'s pages to `dst`'s.
#[pyfunction]
#[pyo3(signature = (src, dst, first_token, end_token))]
fn layout_plan(
    py: Python<'_>,
    src: &KvLayout,
    dst: &KvLayout,
    first_token: u32,
    end_token: u32,
) -> PyResult<LayoutPlan> {
    let run = || layout::plan(&src.inner, &dst.inner, first_token, end_token);
    let p = if end_token.saturating_sub(first_token) >= DETACH_TOKENS {
        py.detach(run)
    } else {
        run()
    }
    .map_err(plan_error)?;
    Ok(LayoutPlan {
        unit_bytes: p.unit_bytes,
        layers: p.layers,
        src_first_layer: p.src_first_layer,
        dst_first_layer: p.dst_first_layer,
        src_units_per_page: p.src_units_per_page,
        dst_units_per_page: p.dst_units_per_page,
        len: p.src_units.len(),
        src_units: PyArray1::from_vec(py, p.src_units).unbind(),
        dst_units: PyArray1::from_vec(py, p.dst_units).unbind(),
    })
}

/// The first token of the range whose plan up to `end_token` has `unit_count` units
/// (of `unit_bytes`, when given) and starts at a destination block boundary; `None`
/// when none does, or (without `unit_bytes`) more than one.
#[pyfunction]
#[pyo3(signature = (src, dst, end_token, unit_count, *, unit_bytes = None))]
fn first_token_for_units(
    py: Python<'_>,
    src: &KvLayout,
    dst: &KvLayout,
    end_token: u32,
    unit_count: u64,
    unit_bytes: Option<u32>,
) -> PyResult<Option<u32>> {
    let run =
        || layout::first_token_for_units(&src.inner, &dst.inner, end_token, unit_count, unit_bytes);
    if end_token >= DETACH_TOKENS {
        py.detach(run)
    } else {
        run()
    }
    .map_err(plan_error)
}

/// `None` when `src`'s KV maps into `dst`'s; `LayoutMismatch` (its `.field`) otherwise.
#[pyfunction]
#[pyo3(signature = (src, dst))]
fn check_layout_compatible(src: &KvLayout, dst: &KvLayout) -> PyResult<()> {
    layout::check_compatible(&src.inner, &dst.inner).map_err(mismatch)
}
