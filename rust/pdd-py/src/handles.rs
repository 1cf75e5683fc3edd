//! Methods every transfer handle shares (KV and local path, either side), written
//! once. Each handle is its own pyclass over a different Rust type and pyo3 has no
//! generic `#[pymethods]`, so each macro adds one more `#[pymethods]` block to the
//! class it is given (pyo3's `multiple-pymethods` feature).

/// The grant's shape as read-only properties: `transfer_id`, `request_id`,
/// `layer_count`, `page_count`, `page_bytes`. `|h| expr` reads the `KvGrant` from
/// handle `h`.
macro_rules! grant_getters {
    ($ty:ty, |$h:ident| $grant:expr) => {
        #[pyo3::pymethods]
        impl $ty {
            /// The transfer's id (the receiver's choice, unguessable).
            #[getter]
            fn transfer_id(&self) -> u64 {
                let $h = self;
                $grant.transfer_id
            }

            /// The request's 64-bit wire id.
            #[getter]
            fn request_id(&self) -> u64 {
                let $h = self;
                $grant.request_id
            }

            /// Layers in the grant.
            #[getter]
            fn layer_count(&self) -> u16 {
                let $h = self;
                $grant.layer_count
            }

            /// Pages per layer in the grant (0: an empty grant, nothing to send).
            #[getter]
            fn page_count(&self) -> u32 {
                let $h = self;
                $grant.page_count
            }

            /// Bytes of one page of one layer.
            #[getter]
            fn page_bytes(&self) -> u32 {
                let $h = self;
                $grant.page_bytes
            }
        }
    };
}

/// `wait(timeout=60.0)` (blocks with the GIL released) and `wait_async(timeout=60.0)`
/// (an awaitable): the transfer's bytes once it settled well, or its error raised.
/// `$doc` is `wait`'s docstring, `$what` names the wait in a timeout's message, and
/// `|h| expr` gives an owned handle (from handle `h`) whose async `wait()` settles.
macro_rules! settle_waits {
    ($ty:ty, $doc:literal, $what:literal, |$h:ident| $handle:expr) => {
        #[pyo3::pymethods]
        impl $ty {
            #[doc = $doc]
            #[pyo3(signature = (timeout = 60.0))]
            fn wait(&self, py: pyo3::Python<'_>, timeout: f64) -> pyo3::PyResult<u64> {
                let $h = self;
                let t = $handle;
                $crate::kv::wait_bounded(
                    py,
                    $crate::convert::seconds(timeout, "timeout")?,
                    $what,
                    async move { t.wait().await },
                )
            }

            /// Awaitable `wait`.
            #[pyo3(signature = (timeout = 60.0))]
            fn wait_async<'py>(
                &self,
                py: pyo3::Python<'py>,
                timeout: f64,
            ) -> pyo3::PyResult<pyo3::Bound<'py, pyo3::PyAny>> {
                let $h = self;
                let t = $handle;
                $crate::kv::awaitable(
                    py,
                    $crate::convert::seconds(timeout, "timeout")?,
                    $what,
                    async move { t.wait().await },
                )
            }
        }
    };
}

/// `send_layer(layer, src_pages, src_layer=None, timeout=60.0)`: the sender's whole-layer
/// send on either path (the handle's `inner` has an async `send_layer(layer,
/// src_layer, &pages)`), the GIL released, bounded by `timeout`. `$doc` is its
/// docstring, `$what` names it in a timeout's message.
macro_rules! send_layer_method {
    ($ty:ty, $doc:literal, $what:literal) => {
        #[pyo3::pymethods]
        impl $ty {
            #[doc = $doc]
            #[pyo3(signature = (layer, src_pages, src_layer = None, timeout = 60.0))]
            fn send_layer(
                &self,
                py: pyo3::Python<'_>,
                layer: u16,
                src_pages: &pyo3::Bound<'_, pyo3::PyAny>,
                src_layer: Option<u16>,
                timeout: f64,
            ) -> pyo3::PyResult<()> {
                let t = self.inner.clone();
                let src_layer = src_layer.unwrap_or(layer);
                $crate::kv::send_layer_bounded(py, src_pages, timeout, $what, |pages| async move {
                    t.send_layer(layer, src_layer, &pages).await
                })
            }
        }
    };
}

/// `send_pages(grant_pages, src_pages, *, layer=None, src_layer=None, timeout=60.0)`:
/// the sender's partial send on either path (the handle's `inner` has an async
/// `send_pages(layers, src_layer, &grant_pages, &src_pages)` and a `grant()`), the
/// GIL released, bounded by `timeout`. `$doc` is its docstring, `$what` names it in a
/// timeout's message.
macro_rules! send_pages_method {
    ($ty:ty, $doc:literal, $what:literal) => {
        #[pyo3::pymethods]
        impl $ty {
            #[doc = $doc]
            #[pyo3(signature = (grant_pages, src_pages, *, layer = None, src_layer = None, timeout = 60.0))]
            fn send_pages(
                &self,
                py: pyo3::Python<'_>,
                grant_pages: &pyo3::Bound<'_, pyo3::PyAny>,
                src_pages: &pyo3::Bound<'_, pyo3::PyAny>,
                layer: Option<u16>,
                src_layer: Option<u16>,
                timeout: f64,
            ) -> pyo3::PyResult<()> {
                let grant_pages = $crate::convert::u32s_from_py(grant_pages, "grant_pages")?;
                let src_pages = $crate::convert::u32s_from_py(src_pages, "src_pages")?;
                let layers = match layer {
                    Some(l) => l..l.saturating_add(1),
                    None => 0..self.inner.grant().layer_count,
                };
                if layer.is_none() && src_layer.is_some() {
                    return Err($crate::errors::invalid(
                        "src_layer needs layer: one source layer feeds one grant layer",
                    ));
                }
                let t = self.inner.clone();
                $crate::kv::wait_bounded(
                    py,
                    $crate::convert::seconds(timeout, "timeout")?,
                    $what,
                    async move {
                        t.send_pages(layers, src_layer, &grant_pages, &src_pages)
                            .await
                    },
                )
            }
        }
    };
}

pub(crate) use grant_getters;
pub(crate) use send_layer_method;
pub(crate) use send_pages_method;
pub(crate) use settle_waits;
