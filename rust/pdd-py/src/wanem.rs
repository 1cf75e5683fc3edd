//! `pdd_transport._native.Wanem`: the WAN emulator of `pdd_io::wanem`, steered from
//! Python.
//!
//! Conversions only: addresses come in as `"IP:PORT"` strings, a link profile as a
//! dict (`delay_ms`, `jitter_ms`, `jitter`, `rate_bps`), a direction as a name
//! (`"client_to_upstream"`, `"upstream_to_client"`, or `"both"`). The emulator runs
//! on the process runtime of `runtime.rs`; starting and closing it release the GIL,
//! the control methods only flip shared state and return at once. The friendly API
//! (units, defaults, context manager) is `pdd_transport/wanem.py`.

use std::net::SocketAddr;
use std::time::Duration;

use pdd_io::wanem::{
    Direction, Jitter, LinkProfile, LinkStats, Wanem as CoreWanem, WanemConfig, WanemError,
    WanemHandle, MAX_DELAY,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{invalid, wanem_closed, WanemErr};
use crate::runtime::{block_on, runtime};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Wanem>()?;
    Ok(())
}

/// `WanemError` -> Python, through `errors.rs`.
fn map_err(e: WanemError) -> PyErr {
    WanemErr(e).into()
}

fn parse_addr(what: &str, s: &str) -> PyResult<SocketAddr> {
    s.parse().map_err(|_| {
        invalid(format!(
            "{what} address {s:?} is not IP:PORT \
             (such as 127.0.0.1:8000 or [::1]:8000; no host names)"
        ))
    })
}

/// The directions a name stands for.
fn parse_direction(name: &str, allow_both: bool) -> PyResult<&'static [Direction]> {
    match name {
        "client_to_upstream" => Ok(&Direction::ALL[0..1]),
        "upstream_to_client" => Ok(&Direction::ALL[1..2]),
        "both" if allow_both => Ok(&Direction::ALL),
        _ => {
            let expected = if allow_both {
                "'both', 'client_to_upstream' or 'upstream_to_client'"
            } else {
                "'client_to_upstream' or 'upstream_to_client'"
            };
            Err(invalid(format!(
                "unknown direction {name:?}: expected {expected}"
            )))
        }
    }
}

fn direction_name(d: Direction) -> &'static str {
    match d {
        Direction::ClientToUpstream => "client_to_upstream",
        Direction::UpstreamToClient => "upstream_to_client",
    }
}

/// A duration given in `unit_per_sec` units per second (1000 for ms, 1 for s):
/// finite, not negative, at most `MAX_DELAY`.
fn duration_from(name: &str, value: f64, unit_per_sec: f64) -> PyResult<Duration> {
    let max = MAX_DELAY.as_secs_f64() * unit_per_sec;
    if !value.is_finite() || value < 0.0 || value > max {
        return Err(invalid(format!(
            "{name} must be a finite number from 0 to {max}, got {value}"
        )));
    }
    // Whole nanoseconds, so that 15.0 ms reads back as 15.0.
    let nanos = (value * (1e9 / unit_per_sec)).round();
    Ok(Duration::from_nanos(nanos as u64))
}

fn millis(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1e6
}

/// A profile dict -> `LinkProfile`. Missing keys take the unshaped defaults; unknown
/// keys are refused so that a typo is an error, not a silently ignored setting.
fn profile_from_dict(d: &Bound<'_, PyDict>) -> PyResult<LinkProfile> {
    let mut delay_ms = 0.0;
    let mut jitter_ms = 0.0;
    let mut dist = String::from("uniform");
    let mut rate_bps: Option<u64> = None;
    for (key, value) in d.iter() {
        let key: String = key
            .extract()
            .map_err(|_| invalid("profile keys must be strings"))?;
        let number = |v: &Bound<'_, PyAny>| -> PyResult<f64> {
            v.extract::<f64>()
                .map_err(|_| invalid(format!("profile field {key} must be a number")))
        };
        match key.as_str() {
            "delay_ms" => delay_ms = number(&value)?,
            "jitter_ms" => jitter_ms = number(&value)?,
            "jitter" => {
                dist = value
                    .extract()
                    .map_err(|_| invalid("profile field jitter must be 'uniform' or 'normal'"))?
            }
            "rate_bps" => {
                if !value.is_none() {
                    let r: i128 = value
                        .extract()
                        .map_err(|_| invalid("profile field rate_bps must be an int or None"))?;
                    rate_bps = Some(u64::try_from(r).ok().filter(|&r| r > 0).ok_or_else(|| {
                        invalid(format!(
                            "rate_bps must be positive (None for no cap), got {r}"
                        ))
                    })?);
                }
            }
            other => {
                return Err(invalid(format!(
                "unknown profile field {other:?} (expected delay_ms, jitter_ms, jitter, rate_bps)"
            )))
            }
        }
    }
    let delay = duration_from("delay_ms", delay_ms, 1e3)?;
    let j = duration_from("jitter_ms", jitter_ms, 1e3)?;
    let jitter = match (dist.as_str(), j.is_zero()) {
        ("uniform" | "normal", true) => Jitter::None,
        ("uniform", false) => Jitter::Uniform(j),
        ("normal", false) => Jitter::Normal(j),
        (other, _) => {
            return Err(invalid(format!(
                "jitter must be 'uniform' or 'normal', got {other:?}"
            )))
        }
    };
    let profile = LinkProfile {
        delay,
        jitter,
        rate_bps,
    };
    profile.validate().map_err(map_err)?;
    Ok(profile)
}

fn profile_to_dict<'py>(py: Python<'py>, p: &LinkProfile) -> PyResult<Bound<'py, PyDict>> {
    let (dist, j) = match p.jitter {
        Jitter::None => ("uniform", Duration::ZERO),
        Jitter::Uniform(j) => ("uniform", j),
        Jitter::Normal(s) => ("normal", s),
    };
    let d = PyDict::new(py);
    d.set_item("delay_ms", millis(p.delay))?;
    d.set_item("jitter_ms", millis(j))?;
    d.set_item("jitter", dist)?;
    d.set_item("rate_bps", p.rate_bps)?;
    Ok(d)
}

fn link_stats_to_dict<'py>(py: Python<'py>, s: &LinkStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes_received", s.bytes_received)?;
    d.set_item("bytes_delivered", s.bytes_delivered)?;
    d.set_item("bytes_blackholed", s.bytes_blackholed)?;
    d.set_item("chunks_corrupted", s.chunks_corrupted)?;
    Ok(d)
}

fn addr_tuple(a: SocketAddr) -> (String, u16) {
    (a.ip().to_string(), a.port())
}

/// A running WAN emulator: a TCP proxy from `listen` to `upstream` with an emulated
/// link per direction. Closed by `close()` (bounded, confirmed) or, without waiting,
/// when garbage-collected.
#[pyclass(frozen, module = "pdd_transport._native")]
struct Wanem {
    handle: WanemHandle,
}

impl Wanem {
    /// The handle, unless the emulator was closed (then `InvalidArgument`, reason
    /// `closed`), after the fork guard.
    fn live(&self) -> PyResult<&WanemHandle> {
        runtime()?;
        if self.handle.is_shut_down() {
            return Err(wanem_closed());
        }
        Ok(&self.handle)
    }
}

#[pymethods]
impl Wanem {
    /// Bind `listen` and start relaying to `upstream`. Profiles are dicts as returned
    /// by `profile()`; `None` is unshaped.
    #[new]
    #[pyo3(signature = (listen, upstream, *, client_to_upstream = None, upstream_to_client = None, seed = 0, max_in_flight = None, socket_buffer = None, connect_timeout = 5.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        upstream: &str,
        client_to_upstream: Option<&Bound<'_, PyDict>>,
        upstream_to_client: Option<&Bound<'_, PyDict>>,
        seed: u64,
        max_in_flight: Option<usize>,
        socket_buffer: Option<usize>,
        connect_timeout: f64,
    ) -> PyResult<Self> {
        let mut config = WanemConfig::new(
            parse_addr("listen", listen)?,
            parse_addr("upstream", upstream)?,
        );
        if let Some(p) = client_to_upstream {
            config.client_to_upstream = profile_from_dict(p)?;
        }
        if let Some(p) = upstream_to_client {
            config.upstream_to_client = profile_from_dict(p)?;
        }
        config.seed = seed;
        config.max_in_flight = max_in_flight;
        config.socket_buffer = socket_buffer;
        config.connect_timeout = duration_from("connect_timeout", connect_timeout, 1.0)?;
        let rt = runtime()?.handle().clone();
        let handle = py
            .detach(|| CoreWanem::start_on(&rt, config))
            .map_err(map_err)?;
        Ok(Wanem { handle })
    }

    /// The address it listens on, as `(ip, port)` (the real port when asked for 0).
    #[getter]
    fn local_addr(&self) -> (String, u16) {
        addr_tuple(self.handle.local_addr())
    }

    /// Where connections are relayed to, as `(ip, port)`.
    #[getter]
    fn upstream_addr(&self) -> (String, u16) {
        addr_tuple(self.handle.upstream_addr())
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.handle.is_shut_down()
    }

    /// Whether the blackhole is on.
    #[getter]
    fn blackholed(&self) -> bool {
        self.handle.is_blackholed()
    }

    /// The profile of one direction, as a dict.
    fn profile<'py>(&self, py: Python<'py>, direction: &str) -> PyResult<Bound<'py, PyDict>> {
        let dir = parse_direction(direction, false)?[0];
        profile_to_dict(py, &self.handle.profile(dir))
    }

    /// Replace the profile of `direction` (or of both); validated before anything
    /// changes.
    fn set_profile(&self, direction: &str, profile: &Bound<'_, PyDict>) -> PyResult<()> {
        let dirs = parse_direction(direction, true)?;
        let profile = profile_from_dict(profile)?;
        let handle = self.live()?;
        for &d in dirs {
            handle.set_profile(d, profile).map_err(map_err)?;
        }
        Ok(())
    }

    /// Hold every byte of `direction` for `seconds` from now; 0 lifts a stall.
    fn stall(&self, direction: &str, seconds: f64) -> PyResult<()> {
        let dirs = parse_direction(direction, true)?;
        let duration = duration_from("seconds", seconds, 1.0)?;
        let handle = self.live()?;
        for &d in dirs {
            handle.stall(d, duration);
        }
        Ok(())
    }

    /// Reset (RST) every current connection, both sides.
    fn reset_all(&self) -> PyResult<()> {
        self.live()?.reset_all();
        Ok(())
    }

    /// The live connections' numbers, in accept order.
    fn connections(&self) -> PyResult<Vec<u64>> {
        Ok(self.live()?.connections())
    }

    /// RST connection `conn` only, both sides; whether it was live.
    fn reset_connection(&self, conn: u64) -> PyResult<bool> {
        Ok(self.live()?.reset_connection(conn))
    }

    /// FIN connection `conn` only, both sides; whether it was live.
    fn close_connection(&self, conn: u64) -> PyResult<bool> {
        Ok(self.live()?.close_connection(conn))
    }

    /// Hold the bytes of `direction` on connection `conn` only for `seconds`; 0
    /// lifts it. Whether it was live.
    fn stall_connection(&self, conn: u64, direction: &str, seconds: f64) -> PyResult<bool> {
        let dirs = parse_direction(direction, true)?;
        let duration = duration_from("seconds", seconds, 1.0)?;
        let handle = self.live()?;
        let mut live = true;
        for &d in dirs {
            live &= handle.stall_connection(conn, d, duration);
        }
        Ok(live)
    }

    /// Flip one byte of the next chunk written in `direction` (each, for "both").
    fn corrupt_next(&self, direction: &str) -> PyResult<()> {
        let dirs = parse_direction(direction, true)?;
        let handle = self.live()?;
        for &d in dirs {
            handle.corrupt_next(d);
        }
        Ok(())
    }

    /// Turn the blackhole on or off.
    fn blackhole(&self, on: bool) -> PyResult<()> {
        self.live()?.blackhole(on);
        Ok(())
    }

    /// A snapshot of the counters (still readable after `close()`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.handle.stats();
        let d = PyDict::new(py);
        d.set_item("connections_accepted", s.connections_accepted)?;
        d.set_item("connections_active", s.connections_active)?;
        d.set_item("upstream_connect_failures", s.upstream_connect_failures)?;
        d.set_item("resets", s.resets)?;
        for dir in Direction::ALL {
            d.set_item(direction_name(dir), link_stats_to_dict(py, s.link(dir))?)?;
        }
        Ok(d)
    }

    /// Close the listener and every connection, waiting at most 5 s for them (GIL
    /// released). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        block_on(py, self.handle.shutdown())?.map_err(map_err)
    }

    fn __repr__(&self) -> String {
        format!(
            "<Wanem {} -> {}{}>",
            self.handle.local_addr(),
            self.handle.upstream_addr(),
            if self.handle.is_shut_down() {
                " closed"
            } else {
                ""
            }
        )
    }
}
