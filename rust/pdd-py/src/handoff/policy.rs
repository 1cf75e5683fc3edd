//! RLD's handoff policy and both sides' timers, as Python classes.

use super::*;

// ---------------------------------------------------------------------------------
// Policy and timers.
// ---------------------------------------------------------------------------------

/// RLD's handoff policy (see docs/handoff.md, "The policy and its tunables").
#[pyclass(frozen, module = "pdd_transport._native")]
#[derive(Clone)]
pub struct HandoffPolicy {
    inner: CorePolicy,
}

#[pymethods]
impl HandoffPolicy {
    #[new]
    #[pyo3(signature = (*, catch_up_threshold_tokens = 64, level_tokens = 8, chunk_tokens = 256, one_shot_load = 0.85, max_eager_tokens = 1024))]
    fn new(
        catch_up_threshold_tokens: i64,
        level_tokens: i64,
        chunk_tokens: i64,
        one_shot_load: f64,
        max_eager_tokens: i64,
    ) -> PyResult<Self> {
        let inner = CorePolicy {
            catch_up_threshold_tokens: u32_arg(
                "catch_up_threshold_tokens",
                catch_up_threshold_tokens,
            )?,
            level_tokens: u32_arg("level_tokens", level_tokens)?,
            chunk_tokens: u32_arg("chunk_tokens", chunk_tokens)?,
            one_shot_load,
            max_eager_tokens: u32_arg("max_eager_tokens", max_eager_tokens)?,
        };
        inner.validate().map_err(PddErr)?;
        Ok(HandoffPolicy { inner })
    }
}

crate::properties::properties_with_repr!(HandoffPolicy, |s| {
    catch_up_threshold_tokens: u32 = s.inner.catch_up_threshold_tokens,
    level_tokens: u32 = s.inner.level_tokens,
    chunk_tokens: u32 = s.inner.chunk_tokens,
    one_shot_load: f64 = s.inner.one_shot_load,
    max_eager_tokens: u32 = s.inner.max_eager_tokens,
});

/// Retransmission and give-up bounds of both sides, in seconds.
#[pyclass(frozen, module = "pdd_transport._native")]
#[derive(Clone)]
pub struct HandoffTimers {
    inner: CoreTimers,
}

#[pymethods]
impl HandoffTimers {
    #[new]
    #[pyo3(signature = (*, rto_initial = 0.2, rto_max = 2.0, max_attempts = 12, give_up_after = 10.0, kv_wait_timeout = 60.0, linger = 12.0))]
    fn new(
        rto_initial: f64,
        rto_max: f64,
        max_attempts: i64,
        give_up_after: f64,
        kv_wait_timeout: f64,
        linger: f64,
    ) -> PyResult<Self> {
        let max_attempts = u32_arg("max_attempts", max_attempts)?;
        let inner = CoreTimers {
            rto_initial: seconds_or_zero("rto_initial", rto_initial)?,
            rto_max: seconds_or_zero("rto_max", rto_max)?,
            max_attempts,
            give_up_after: seconds_or_zero("give_up_after", give_up_after)?,
            kv_wait_timeout: seconds_or_zero("kv_wait_timeout", kv_wait_timeout)?,
            linger: seconds_or_zero("linger", linger)?,
        };
        inner.validate().map_err(PddErr)?;
        Ok(HandoffTimers { inner })
    }
}

crate::properties::properties_with_repr!(HandoffTimers, |s| {
    rto_initial: f64 = s.inner.rto_initial.as_secs_f64(),
    rto_max: f64 = s.inner.rto_max.as_secs_f64(),
    max_attempts: u32 = s.inner.max_attempts,
    give_up_after: f64 = s.inner.give_up_after.as_secs_f64(),
    kv_wait_timeout: f64 = s.inner.kv_wait_timeout.as_secs_f64(),
    linger: f64 = s.inner.linger.as_secs_f64(),
});

pub(super) fn policy_of(p: Option<&HandoffPolicy>) -> CorePolicy {
    p.map(|p| p.inner).unwrap_or_default()
}

pub(super) fn timers_of(t: Option<&HandoffTimers>) -> CoreTimers {
    t.map(|t| t.inner).unwrap_or_default()
}
