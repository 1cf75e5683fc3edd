//! The routing policies (`pdd_core::policy`) and the handoff-mode policy
//! (`pdd_core::handoff::choose_mode`) for Python. Pure and quick: the GIL is kept.
//!
//! Counts come in as Python ints and are checked here (a negative count raises
//! `InvalidArgument`, not `OverflowError`); tunables are checked by the core's
//! `validate`. The handoff functions take any object with the five `HandoffPolicy`
//! attributes (`pdd_transport.policy.HandoffPolicy`, or another binding of the same
//! tunables), or `None` for the defaults.

use pdd_core::handoff::{self, CatchUpStep, HandoffPolicy as CoreHandoffPolicy};
use pdd_core::policy::{
    self as core, AnomalyPolicy as CoreAnomaly, PipelinePolicy as CorePipeline, RequestShape,
    RoutingPolicy, WanEstimate as CoreWan,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{invalid, PddErr};

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<WanEstimate>()?;
    m.add_class::<PipelinePolicy>()?;
    m.add_class::<AnomalyPolicy>()?;
    m.add_class::<RouteDecision>()?;
    m.add_function(wrap_pyfunction!(kv_arrival_ms, m)?)?;
    m.add_function(wrap_pyfunction!(choose_pipeline, m)?)?;
    m.add_function(wrap_pyfunction!(is_anomaly, m)?)?;
    m.add_function(wrap_pyfunction!(route, m)?)?;
    m.add_function(wrap_pyfunction!(choose_handoff_mode, m)?)?;
    m.add_function(wrap_pyfunction!(catch_up_step, m)?)?;
    m.add_function(wrap_pyfunction!(check_handoff_policy, m)?)?;
    m.add_function(wrap_pyfunction!(default_handoff_policy, m)?)?;
    Ok(())
}

/// A non-negative count from a Python int; `InvalidArgument` otherwise.
fn count(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<u64> {
    let v: i128 = obj
        .extract()
        .map_err(|_| invalid(format!("{field} must be an int")))?;
    u64::try_from(v).map_err(|_| invalid(format!("{field} must be in 0..=2**64-1, got {v}")))
}

fn count_u32(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<u32> {
    let v = count(obj, field)?;
    u32::try_from(v).map_err(|_| invalid(format!("{field} must be in 0..=2**32-1, got {v}")))
}

fn real(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<f64> {
    obj.extract()
        .map_err(|_| invalid(format!("{field} must be a number")))
}

/// The router's estimate of the WAN path from Prefill to MainDecode.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct WanEstimate {
    inner: CoreWan,
}

crate::properties::properties_with_repr!(WanEstimate, |s| {
    /// Goodput a transfer can expect, Gbit/s.
    goodput_gbit: f64 = s.inner.goodput_gbit(),
    /// Round-trip time, milliseconds.
    rtt_ms: f64 = s.inner.rtt_ms(),
});

#[pymethods]
impl WanEstimate {
    #[new]
    #[pyo3(signature = (goodput_gbit, rtt_ms))]
    fn new(goodput_gbit: &Bound<'_, PyAny>, rtt_ms: &Bound<'_, PyAny>) -> PyResult<Self> {
        let inner = CoreWan::new(real(goodput_gbit, "goodput_gbit")?, real(rtt_ms, "rtt_ms")?)
            .map_err(PddErr)?;
        Ok(WanEstimate { inner })
    }
}

/// Tunables of the pipeline choice (P-MD or P-RLD-MD).
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct PipelinePolicy {
    inner: CorePipeline,
}

crate::properties::keyword_constructor!(PipelinePolicy(CorePipeline) {
    ttft_budget_ms: real,
    setup_rtts: real,
    goodput_share: real,
});
crate::properties::properties_with_repr!(PipelinePolicy, |s| {
    ttft_budget_ms: f64 = s.inner.ttft_budget_ms,
    setup_rtts: f64 = s.inner.setup_rtts,
    goodput_share: f64 = s.inner.goodput_share,
});

/// Tunables of the anomaly filter.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct AnomalyPolicy {
    inner: CoreAnomaly,
}

crate::properties::keyword_constructor!(AnomalyPolicy(CoreAnomaly) {
    long_input_tokens: count,
    low_hit_rate: real,
    short_output_tokens: count,
});
crate::properties::properties_with_repr!(AnomalyPolicy, |s| {
    long_input_tokens: u64 = s.inner.long_input_tokens,
    low_hit_rate: f64 = s.inner.low_hit_rate,
    short_output_tokens: u64 = s.inner.short_output_tokens,
});

#[pymethods]
impl AnomalyPolicy {
    /// A filter that flags nothing.
    #[staticmethod]
    fn disabled() -> Self {
        AnomalyPolicy {
            inner: CoreAnomaly::disabled(),
        }
    }
}

/// What `route` decided.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct RouteDecision {
    /// `"p_md"`, `"p_rld_md"` or `"p_rld"`.
    #[pyo3(get)]
    pipeline: &'static str,
    /// Whether the anomaly filter fired (then the pipeline is `"p_rld"`).
    #[pyo3(get)]
    anomaly: bool,
    /// Prompt tokens MainDecode lacks.
    #[pyo3(get)]
    missing_tokens: u64,
    /// Estimated arrival of that KV at MainDecode, milliseconds.
    #[pyo3(get)]
    kv_arrival_ms: f64,
}

#[pymethods]
impl RouteDecision {
    /// Whether the request's missing KV crosses the WAN to MainDecode.
    #[getter]
    fn sends_kv_over_wan(&self) -> bool {
        self.pipeline != core::Pipeline::PRld.name()
    }

    /// Whether RelayDecode decodes any of its tokens.
    #[getter]
    fn uses_rld(&self) -> bool {
        self.pipeline != core::Pipeline::PMd.name()
    }

    fn __repr__(&self) -> String {
        format!(
            "RouteDecision(pipeline={:?}, anomaly={}, missing_tokens={}, kv_arrival_ms={:.3})",
            self.pipeline,
            if self.anomaly { "True" } else { "False" },
            self.missing_tokens,
            self.kv_arrival_ms
        )
    }
}

fn shape(
    prompt_tokens: &Bound<'_, PyAny>,
    md_cached_tokens: &Bound<'_, PyAny>,
    kv_bytes_per_token: Option<&Bound<'_, PyAny>>,
    expected_output_tokens: Option<&Bound<'_, PyAny>>,
) -> PyResult<RequestShape> {
    let r = RequestShape {
        prompt_tokens: count(prompt_tokens, "prompt_tokens")?,
        md_cached_tokens: count(md_cached_tokens, "md_cached_tokens")?,
        kv_bytes_per_token: kv_bytes_per_token.map_or(Ok(0), |v| count(v, "kv_bytes_per_token"))?,
        expected_output_tokens: expected_output_tokens
            .map(|v| count(v, "expected_output_tokens"))
            .transpose()?,
    };
    r.validate().map_err(PddErr)?;
    Ok(r)
}

/// Estimated milliseconds for `missing_bytes` of KV to reach MainDecode.
#[pyfunction]
fn kv_arrival_ms(
    policy: &PipelinePolicy,
    wan: &WanEstimate,
    missing_bytes: &Bound<'_, PyAny>,
) -> PyResult<f64> {
    Ok(core::kv_arrival_ms(
        &policy.inner,
        &wan.inner,
        count(missing_bytes, "missing_bytes")?,
    ))
}

/// `"p_md"` or `"p_rld_md"` (never `"p_rld"`).
#[pyfunction]
fn choose_pipeline(
    policy: &PipelinePolicy,
    wan: &WanEstimate,
    prompt_tokens: &Bound<'_, PyAny>,
    md_cached_tokens: &Bound<'_, PyAny>,
    kv_bytes_per_token: &Bound<'_, PyAny>,
) -> PyResult<&'static str> {
    let r = shape(
        prompt_tokens,
        md_cached_tokens,
        Some(kv_bytes_per_token),
        None,
    )?;
    Ok(core::choose_pipeline(&policy.inner, &wan.inner, &r).name())
}

/// The anomaly filter.
#[pyfunction]
#[pyo3(signature = (policy, prompt_tokens, md_cached_tokens, expected_output_tokens))]
fn is_anomaly(
    policy: &AnomalyPolicy,
    prompt_tokens: &Bound<'_, PyAny>,
    md_cached_tokens: &Bound<'_, PyAny>,
    expected_output_tokens: Option<&Bound<'_, PyAny>>,
) -> PyResult<bool> {
    let r = shape(
        prompt_tokens,
        md_cached_tokens,
        None,
        expected_output_tokens,
    )?;
    Ok(core::is_anomaly(&policy.inner, &r))
}

/// The anomaly filter, then the pipeline choice.
#[pyfunction]
#[pyo3(signature = (wan, prompt_tokens, md_cached_tokens, kv_bytes_per_token, expected_output_tokens = None, *, pipeline_policy = None, anomaly_policy = None))]
fn route(
    wan: &WanEstimate,
    prompt_tokens: &Bound<'_, PyAny>,
    md_cached_tokens: &Bound<'_, PyAny>,
    kv_bytes_per_token: &Bound<'_, PyAny>,
    expected_output_tokens: Option<&Bound<'_, PyAny>>,
    pipeline_policy: Option<&PipelinePolicy>,
    anomaly_policy: Option<&AnomalyPolicy>,
) -> PyResult<RouteDecision> {
    let r = shape(
        prompt_tokens,
        md_cached_tokens,
        Some(kv_bytes_per_token),
        expected_output_tokens,
    )?;
    let policy = RoutingPolicy {
        pipeline: pipeline_policy.map_or_else(CorePipeline::default, |p| p.inner),
        anomaly: anomaly_policy.map_or_else(CoreAnomaly::default, |p| p.inner),
    };
    let d = core::route(&policy, &wan.inner, &r).map_err(PddErr)?;
    Ok(RouteDecision {
        pipeline: d.pipeline.name(),
        anomaly: d.anomaly,
        missing_tokens: d.missing_tokens,
        kv_arrival_ms: d.kv_arrival_ms,
    })
}

/// The core `HandoffPolicy` read from any object with its five attributes, validated;
/// `None` gives the defaults.
fn handoff_policy(policy: Option<&Bound<'_, PyAny>>) -> PyResult<CoreHandoffPolicy> {
    let Some(p) = policy else {
        return Ok(CoreHandoffPolicy::default());
    };
    let attr = |name: &str| {
        p.getattr(name)
            .map_err(|_| invalid(format!("handoff policy has no attribute {name}")))
    };
    let inner = CoreHandoffPolicy {
        catch_up_threshold_tokens: count_u32(
            &attr("catch_up_threshold_tokens")?,
            "catch_up_threshold_tokens",
        )?,
        level_tokens: count_u32(&attr("level_tokens")?, "level_tokens")?,
        chunk_tokens: count_u32(&attr("chunk_tokens")?, "chunk_tokens")?,
        one_shot_load: real(&attr("one_shot_load")?, "one_shot_load")?,
        max_eager_tokens: count_u32(&attr("max_eager_tokens")?, "max_eager_tokens")?,
    };
    inner.validate().map_err(PddErr)?;
    Ok(inner)
}

/// `pdd_core::handoff::choose_mode`: `"one_shot"` or `"catch_up"`.
#[pyfunction]
#[pyo3(signature = (policy, rld_load, backlog_tokens))]
fn choose_handoff_mode(
    policy: Option<&Bound<'_, PyAny>>,
    rld_load: &Bound<'_, PyAny>,
    backlog_tokens: &Bound<'_, PyAny>,
) -> PyResult<&'static str> {
    let p = handoff_policy(policy)?;
    let rld_load = real(rld_load, "rld_load")?;
    let backlog = count_u32(backlog_tokens, "backlog_tokens")?;
    Ok(handoff::choose_mode(&p, rld_load, backlog).name())
}

/// `pdd_core::handoff::catch_up_step`: `("chunk", n)` or `("final", backlog_tokens)`.
#[pyfunction]
#[pyo3(signature = (policy, backlog_tokens))]
fn catch_up_step(
    policy: Option<&Bound<'_, PyAny>>,
    backlog_tokens: &Bound<'_, PyAny>,
) -> PyResult<(&'static str, u32)> {
    let p = handoff_policy(policy)?;
    let backlog = count_u32(backlog_tokens, "backlog_tokens")?;
    Ok(match handoff::catch_up_step(&p, backlog) {
        CatchUpStep::Chunk(n) => ("chunk", n),
        CatchUpStep::Final => ("final", backlog),
    })
}

/// `HandoffPolicy::validate` on any object with the five attributes.
#[pyfunction]
fn check_handoff_policy(policy: &Bound<'_, PyAny>) -> PyResult<()> {
    handoff_policy(Some(policy)).map(|_| ())
}

/// `HandoffPolicy::default()` as a dict.
#[pyfunction]
fn default_handoff_policy(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let p = CoreHandoffPolicy::default();
    let d = PyDict::new(py);
    d.set_item("catch_up_threshold_tokens", p.catch_up_threshold_tokens)?;
    d.set_item("level_tokens", p.level_tokens)?;
    d.set_item("chunk_tokens", p.chunk_tokens)?;
    d.set_item("one_shot_load", p.one_shot_load)?;
    d.set_item("max_eager_tokens", p.max_eager_tokens)?;
    Ok(d)
}
