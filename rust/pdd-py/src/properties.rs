//! Read-only properties with a matching `__repr__`, and keyword-only constructors,
//! for the binding's small value classes (policies, estimates): written once instead
//! of a getter per field per class. Each macro adds a `#[pymethods]` block to its
//! class (pyo3's `multiple-pymethods`).

/// `properties_with_repr!(Class, |s| { name: Type = expr, ... })`: a read-only
/// property `name` per entry returning `expr` (with `s` bound to `&self`; doc comments
/// before an entry document it), and `__repr__` as `Class(name=value, ...)`.
macro_rules! properties_with_repr {
    ($ty:ident, |$s:ident| { $($(#[$doc:meta])* $name:ident: $fty:ty = $get:expr),+ $(,)? }) => {
        #[pyo3::pymethods]
        impl $ty {
            $(
                $(#[$doc])*
                #[getter]
                fn $name(&self) -> $fty {
                    let $s = self;
                    $get
                }
            )+

            fn __repr__(&self) -> String {
                let $s = self;
                let fields = [$(format!(concat!(stringify!($name), "={}"), $get)),+];
                format!(concat!(stringify!($ty), "({})"), fields.join(", "))
            }
        }
    };
}

/// `keyword_constructor!(Class(CoreType) { field: convert, ... })`: `Class(*, field=None,
/// ...)` builds `CoreType` from its `Default`, each given field converted by
/// `convert(obj, "field")`, and refuses what `CoreType::validate` refuses. The core
/// type must have exactly these fields.
macro_rules! keyword_constructor {
    ($ty:ident($core:ident) { $($name:ident: $conv:ident),+ $(,)? }) => {
        #[pyo3::pymethods]
        impl $ty {
            #[new]
            #[pyo3(signature = (*, $($name = None),+))]
            fn new($($name: Option<&pyo3::Bound<'_, pyo3::PyAny>>),+) -> pyo3::PyResult<Self> {
                let d = $core::default();
                let inner = $core {
                    $($name: $name.map_or(Ok(d.$name), |v| $conv(v, stringify!($name)))?,)+
                };
                inner.validate().map_err($crate::errors::PddErr)?;
                Ok($ty { inner })
            }
        }
    };
}

pub(crate) use keyword_constructor;
pub(crate) use properties_with_repr;
