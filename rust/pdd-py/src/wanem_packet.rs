//! `pdd_transport._native.PacketEmulator`: the packet-level emulator of
//! `pdd_io::wanem::packet`, between two TUN devices the Python side opened.
//!
//! Conversions only: a direction's line comes in as a dict (`delay_ms`, `jitter_ms`,
//! `loss_good`, `loss_bad`, `mean_good_ms`, `mean_bad_ms`, `rate_bps`, `queue_bytes`,
//! `reorder`, `reorder_delay_ms`), the devices as file descriptors, which are
//! duplicated (the caller keeps and closes its own). Namespaces, devices and the
//! friendly API are `pdd_transport/wanem.py` (`PacketWan`).

use std::os::fd::{BorrowedFd, RawFd};
use std::sync::Mutex;
use std::time::Duration;

use pdd_io::wanem::packet::{
    End, GilbertElliott, PacketEmulator as CoreEmulator, PacketEmulatorConfig, PacketProfile,
    PacketStats,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::invalid;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PacketEmulator>()?;
    Ok(())
}

/// A duration in ms: finite, not negative, at most an hour (the model checks its
/// own, tighter bounds).
fn ms(name: &str, value: f64) -> PyResult<Duration> {
    if !value.is_finite() || !(0.0..=3.6e6).contains(&value) {
        return Err(invalid(format!(
            "{name} must be a finite number of ms from 0 to 3600000, got {value}"
        )));
    }
    Ok(Duration::from_nanos((value * 1e6).round() as u64))
}

fn profile_from_dict(d: &Bound<'_, PyDict>) -> PyResult<PacketProfile> {
    let mut p = PacketProfile::CLEAN;
    let mut loss = GilbertElliott::NONE;
    for (key, value) in d.iter() {
        let key: String = key
            .extract()
            .map_err(|_| invalid("line keys must be strings"))?;
        let number = || -> PyResult<f64> {
            value
                .extract::<f64>()
                .map_err(|_| invalid(format!("line field {key} must be a number")))
        };
        match key.as_str() {
            "delay_ms" => p.delay = ms(&key, number()?)?,
            "jitter_ms" => p.jitter = ms(&key, number()?)?,
            "reorder_delay_ms" => p.reorder_delay = ms(&key, number()?)?,
            "mean_good_ms" => loss.mean_good = ms(&key, number()?)?,
            "mean_bad_ms" => loss.mean_bad = ms(&key, number()?)?,
            "loss_good" => loss.loss_good = number()?,
            "loss_bad" => loss.loss_bad = number()?,
            "reorder" => p.reorder = number()?,
            "rate_bps" => {
                p.rate_bps = if value.is_none() {
                    None
                } else {
                    let r: u64 = value.extract().map_err(|_| {
                        invalid("line field rate_bps must be a positive int or None")
                    })?;
                    Some(r)
                }
            }
            "queue_bytes" => {
                p.queue_bytes = value
                    .extract()
                    .map_err(|_| invalid("line field queue_bytes must be an int >= 0"))?
            }
            other => {
                return Err(invalid(format!(
                    "unknown line field {other:?} (expected delay_ms, jitter_ms, loss_good, \
                     loss_bad, mean_good_ms, mean_bad_ms, rate_bps, queue_bytes, reorder, \
                     reorder_delay_ms)"
                )))
            }
        }
    }
    p.loss = loss;
    p.validate().map_err(invalid)?;
    Ok(p)
}

fn stats_to_dict<'py>(py: Python<'py>, s: &PacketStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("packets_in", s.packets_in)?;
    d.set_item("bytes_in", s.bytes_in)?;
    d.set_item("packets_out", s.packets_out)?;
    d.set_item("bytes_out", s.bytes_out)?;
    d.set_item("dropped_queue", s.dropped_queue)?;
    d.set_item("dropped_loss", s.dropped_loss)?;
    d.set_item("dropped_overflow", s.dropped_overflow)?;
    d.set_item("dropped_blocked", s.dropped_blocked)?;
    d.set_item("reordered", s.reordered)?;
    d.set_item("write_errors", s.write_errors)?;
    d.set_item("cpu_ns", s.cpu_ns)?;
    d.set_item("realtime", s.realtime)?;
    Ok(d)
}

fn dup(name: &str, fd: RawFd) -> PyResult<std::os::fd::OwnedFd> {
    if fd < 0 {
        return Err(invalid(format!(
            "{name} must be an open file descriptor, got {fd}"
        )));
    }
    // SAFETY: borrowed only for the duplication below; the caller keeps `fd` open
    // for the duration of this call (it is an argument of it).
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    borrowed
        .try_clone_to_owned()
        .map_err(|e| invalid(format!("{name}: cannot duplicate descriptor {fd}: {e}")))
}

#[pyclass(frozen, module = "pdd_transport._native")]
struct PacketEmulator {
    inner: Mutex<CoreEmulator>,
}

fn lock(m: &Mutex<CoreEmulator>) -> std::sync::MutexGuard<'_, CoreEmulator> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[pymethods]
impl PacketEmulator {
    /// Starts relaying between the TUN devices `fd_a` and `fd_b` (duplicated here).
    #[new]
    #[pyo3(signature = (fd_a, fd_b, *, a_to_b, b_to_a, seed = 0, mtu = 1500))]
    fn new(
        fd_a: RawFd,
        fd_b: RawFd,
        a_to_b: &Bound<'_, PyDict>,
        b_to_a: &Bound<'_, PyDict>,
        seed: u64,
        mtu: usize,
    ) -> PyResult<Self> {
        let config = PacketEmulatorConfig {
            a_to_b: profile_from_dict(a_to_b)?,
            b_to_a: profile_from_dict(b_to_a)?,
            seed,
            mtu,
        };
        let inner = CoreEmulator::start(dup("fd_a", fd_a)?, dup("fd_b", fd_b)?, config)
            .map_err(|e| invalid(e.to_string()))?;
        Ok(PacketEmulator {
            inner: Mutex::new(inner),
        })
    }

    /// `{"a_to_b": {...}, "b_to_a": {...}}`, each direction's counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = lock(&self.inner);
        let d = PyDict::new(py);
        d.set_item("a_to_b", stats_to_dict(py, &g.stats(End::AToB))?)?;
        d.set_item("b_to_a", stats_to_dict(py, &g.stats(End::BToA))?)?;
        Ok(d)
    }

    /// Drop every packet to or from TCP port `port` (`None` lifts it).
    #[pyo3(signature = (port))]
    fn block_port(&self, port: Option<u16>) {
        lock(&self.inner).block_port(port);
    }

    #[getter]
    fn blocked_port(&self) -> Option<u16> {
        lock(&self.inner).blocked_port()
    }

    #[getter]
    fn running(&self) -> bool {
        lock(&self.inner).is_running()
    }

    /// Stop both threads (about 20 ms, GIL released) and close the duplicated
    /// descriptors. Idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| lock(&self.inner).stop());
    }
}
