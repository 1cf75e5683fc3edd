//! `TlsConfig` and the test PKI helper: converts paths and names, maps errors.

use std::path::PathBuf;

use pdd_io::tls::{TestPki, TlsConfig as IoTlsConfig};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::PddErr;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TlsConfig>()?;
    m.add_function(wrap_pyfunction!(make_test_pki, m)?)?;
    Ok(())
}

/// TLS 1.3 with mutual authentication: our certificate chain and key, the CA that
/// signs every peer, the name an accepting peer's certificate must carry, and the
/// names a connecting peer's certificate may carry (empty: any the CA signed).
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct TlsConfig {
    pub(crate) inner: IoTlsConfig,
    server_name: String,
    allowed_peers: Vec<String>,
}

#[pymethods]
impl TlsConfig {
    #[new]
    #[pyo3(signature = (cert, key, ca, *, server_name, allowed_peers = Vec::new()))]
    fn new(
        py: Python<'_>,
        cert: PathBuf,
        key: PathBuf,
        ca: PathBuf,
        server_name: String,
        allowed_peers: Vec<String>,
    ) -> PyResult<Self> {
        let inner = py
            .detach(|| IoTlsConfig::from_files(&cert, &key, &ca, &server_name, &allowed_peers))
            .map_err(PddErr)?;
        Ok(TlsConfig {
            inner,
            server_name,
            allowed_peers,
        })
    }

    /// The name an accepting peer must prove.
    #[getter]
    fn server_name(&self) -> &str {
        &self.server_name
    }

    /// Names a connecting peer may prove (empty: any the CA signed).
    #[getter]
    fn allowed_peers(&self) -> Vec<String> {
        self.allowed_peers.clone()
    }

    fn __repr__(&self) -> String {
        format!(
            "TlsConfig(server_name={:?}, allowed_peers={:?})",
            self.server_name, self.allowed_peers
        )
    }
}

/// Make a throwaway CA and one certificate per name (each usable as TLS client and
/// server, naming itself) in `directory`: `ca.pem`, `<name>.pem`, `<name>.key`.
/// Returns `{"ca": path, name: (cert path, key path), ...}`. For tests, benches and
/// demos only.
#[pyfunction]
fn make_test_pki<'py>(
    py: Python<'py>,
    directory: PathBuf,
    names: Vec<String>,
) -> PyResult<Bound<'py, PyDict>> {
    if names.is_empty() {
        return Err(crate::errors::invalid(
            "make_test_pki needs at least one name",
        ));
    }
    // Names become file names: DNS-style only, nothing that could leave `directory`.
    if let Some(bad) = names.iter().find(|n| {
        n.is_empty()
            || n.starts_with('.')
            || !n
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
    }) {
        return Err(crate::errors::invalid(format!(
            "make_test_pki: '{bad}' is not a DNS-style name"
        )));
    }
    let pki = py.detach(|| TestPki::generate(&names)).map_err(PddErr)?;
    let write = |name: &str, text: &str| -> PyResult<PathBuf> {
        let path = directory.join(name);
        std::fs::write(&path, text)
            .map_err(|e| crate::errors::invalid(format!("cannot write {}: {e}", path.display())))?;
        Ok(path)
    };
    let out = PyDict::new(py);
    out.set_item("ca", write("ca.pem", &pki.ca_pem)?)?;
    for (name, cert, key) in &pki.leaves {
        let c = write(&format!("{name}.pem"), cert)?;
        let k = write(&format!("{name}.key"), key)?;
        out.set_item(name, (c, k))?;
    }
    Ok(out)
}
