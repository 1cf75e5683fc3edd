//! Request routing policies: which pipeline serves a request, and which requests the
//! anomaly filter finishes on RelayDecode. Pure functions over tunables and numbers
//! the caller supplies (WAN estimates, cache hit, expected output); no I/O, no clocks.
//!
//! - [`choose_pipeline`]: P-MD when the KV that MainDecode lacks would cross the WAN
//!   within the TTFT budget (RLD is not needed), otherwise P-RLD-MD (RLD masks the
//!   WAN). Never P-RLD: finishing requests on RLD as a general path starves MD's cache
//!   and overloads the small RLD tier (pdd-system.md, "Pipelines and the anomaly
//!   filter").
//! - [`is_anomaly`]: the anomaly filter. A long input with a low MD hit rate and a
//!   short expected output is finished on RLD and its WAN transfer is cancelled.
//! - [`route`]: the two together, as a router applies them: the filter first, then the
//!   pipeline choice.
//!
//! The handoff-mode policy (One-Shot or Catch-Up) lives with the handoff machines:
//! [`crate::handoff::choose_mode`].
//!
//! The defaults and their rationale are documented in `docs/policies.md`.

use crate::error::{Error, Result};

/// The path a request's KV and decoding take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pipeline {
    /// Prefill then MainDecode: MD waits for the missing KV and produces every token.
    /// For requests whose missing KV is small enough to arrive within the TTFT budget.
    PMd,
    /// Prefill, RelayDecode while the KV crosses the WAN, then MainDecode after the
    /// token-ID handoff. For the rest.
    PRldMd,
    /// Prefill then RelayDecode only; the WAN transfer is cancelled (or never
    /// started). Only for anomalies ([`is_anomaly`]), never as a general path.
    PRld,
}

impl Pipeline {
    /// snake_case name for logs and Python: `"p_md"`, `"p_rld_md"`, `"p_rld"`.
    pub fn name(self) -> &'static str {
        match self {
            Pipeline::PMd => "p_md",
            Pipeline::PRldMd => "p_rld_md",
            Pipeline::PRld => "p_rld",
        }
    }

    /// Whether the request's missing KV is sent to MainDecode over the WAN.
    pub fn sends_kv_over_wan(self) -> bool {
        !matches!(self, Pipeline::PRld)
    }

    /// Whether RelayDecode decodes any of the request's tokens.
    pub fn uses_rld(self) -> bool {
        !matches!(self, Pipeline::PMd)
    }
}

/// The router's current estimate of the WAN path from Prefill to MainDecode.
/// Built with [`WanEstimate::new`], which checks the numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WanEstimate {
    goodput_gbit: f64,
    rtt_ms: f64,
}

impl WanEstimate {
    /// `goodput_gbit`: bytes the path delivers to MD per second, in Gbit/s (what a
    /// transfer of this request can expect, not the line rate); finite and > 0.
    /// `rtt_ms`: round-trip time in milliseconds; finite and >= 0.
    pub fn new(goodput_gbit: f64, rtt_ms: f64) -> Result<WanEstimate> {
        if !(goodput_gbit.is_finite() && goodput_gbit > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "goodput_gbit must be finite and > 0, got {goodput_gbit}"
            )));
        }
        if !(rtt_ms.is_finite() && rtt_ms >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "rtt_ms must be finite and >= 0, got {rtt_ms}"
            )));
        }
        Ok(WanEstimate {
            goodput_gbit,
            rtt_ms,
        })
    }

    /// Estimated goodput in Gbit/s.
    pub fn goodput_gbit(&self) -> f64 {
        self.goodput_gbit
    }

    /// Estimated round-trip time in milliseconds.
    pub fn rtt_ms(&self) -> f64 {
        self.rtt_ms
    }
}

/// What the router knows about one request when it routes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestShape {
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens whose KV MainDecode already holds (its prefix-cache match, from
    /// the P side's mirror or the prefix handshake). At most `prompt_tokens`.
    pub md_cached_tokens: u64,
    /// KV bytes of one token across all layers (`ModelShape.kv_bytes_per_token`).
    pub kv_bytes_per_token: u64,
    /// Output tokens the request is expected to produce (the client's `max_tokens`
    /// when small, or a predictor's estimate); `None` when unknown. Unknown output is
    /// never an anomaly: the filter must not guess towards RLD.
    pub expected_output_tokens: Option<u64>,
}

impl RequestShape {
    /// Check `md_cached_tokens <= prompt_tokens`.
    pub fn validate(&self) -> Result<()> {
        if self.md_cached_tokens > self.prompt_tokens {
            return Err(Error::InvalidArgument(format!(
                "md_cached_tokens ({}) exceeds prompt_tokens ({})",
                self.md_cached_tokens, self.prompt_tokens
            )));
        }
        Ok(())
    }

    /// Prompt tokens MainDecode lacks: what must cross the WAN.
    pub fn missing_tokens(&self) -> u64 {
        self.prompt_tokens.saturating_sub(self.md_cached_tokens)
    }

    /// MainDecode's hit rate on this prompt, `0.0..=1.0`; an empty prompt counts as a
    /// full hit (nothing is missing).
    pub fn md_hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            return 1.0;
        }
        (self.md_cached_tokens.min(self.prompt_tokens) as f64) / (self.prompt_tokens as f64)
    }
}

/// Tunables of [`choose_pipeline`]. [`PipelinePolicy::validate`] checks them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PipelinePolicy {
    /// Most time, in milliseconds, that waiting for MD's missing KV may add to TTFT
    /// (beyond the prefill itself) before RLD is worth using to mask it.
    pub ttft_budget_ms: f64,
    /// Round trips the transfer costs before its last byte lands, besides the bytes
    /// themselves: the prefix handshake and grant (one RTT) and the data's one-way
    /// trip (half an RTT).
    pub setup_rtts: f64,
    /// Share of the estimated goodput to count on, in `(0, 1]`: a margin for jitter
    /// and for other transfers sharing the line, so that P-MD requests do not miss
    /// the budget whenever the estimate is a little optimistic.
    pub goodput_share: f64,
}

impl Default for PipelinePolicy {
    fn default() -> Self {
        PipelinePolicy {
            ttft_budget_ms: 500.0,
            setup_rtts: 1.5,
            goodput_share: 0.8,
        }
    }
}

impl PipelinePolicy {
    /// Check the tunables: `ttft_budget_ms` and `setup_rtts` finite and >= 0,
    /// `goodput_share` in `(0, 1]`.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if !(self.ttft_budget_ms.is_finite() && self.ttft_budget_ms >= 0.0) {
            return bad(format!(
                "ttft_budget_ms must be finite and >= 0, got {}",
                self.ttft_budget_ms
            ));
        }
        if !(self.setup_rtts.is_finite() && self.setup_rtts >= 0.0) {
            return bad(format!(
                "setup_rtts must be finite and >= 0, got {}",
                self.setup_rtts
            ));
        }
        if !(self.goodput_share > 0.0 && self.goodput_share <= 1.0) {
            return bad(format!(
                "goodput_share must be in (0, 1], got {}",
                self.goodput_share
            ));
        }
        Ok(())
    }
}

/// Estimated time, in milliseconds, for `missing_bytes` of KV to reach MainDecode:
/// `setup_rtts * rtt + missing_bytes / (goodput * goodput_share)`.
///
/// Non-decreasing in `missing_bytes` and the RTT, non-increasing in the goodput (each
/// step of the formula is monotone in IEEE arithmetic, so this holds exactly, not
/// only up to rounding).
pub fn kv_arrival_ms(policy: &PipelinePolicy, wan: &WanEstimate, missing_bytes: u64) -> f64 {
    // Gbit/s -> bytes per millisecond: 1e9 / 8 / 1e3.
    let bytes_per_ms = wan.goodput_gbit * policy.goodput_share * 125_000.0;
    policy.setup_rtts * wan.rtt_ms + (missing_bytes as f64) / bytes_per_ms
}

/// Pick P-MD or P-RLD-MD for a request (never P-RLD; see [`route`]).
///
/// P-MD when the missing KV (`missing_tokens * kv_bytes_per_token`) is estimated to
/// arrive within `ttft_budget_ms` ([`kv_arrival_ms`]): the user waits no longer than
/// the budget for MD's first token, and RLD stays free. Otherwise P-RLD-MD: RLD starts
/// decoding within tens of ms and hands over by token IDs once MD has the KV.
///
/// Monotone: more missing tokens, more KV bytes per token, a longer RTT, a lower
/// goodput or a smaller budget never turn P-RLD-MD into P-MD.
pub fn choose_pipeline(
    policy: &PipelinePolicy,
    wan: &WanEstimate,
    request: &RequestShape,
) -> Pipeline {
    let missing_bytes = request
        .missing_tokens()
        .saturating_mul(request.kv_bytes_per_token);
    if kv_arrival_ms(policy, wan, missing_bytes) <= policy.ttft_budget_ms {
        Pipeline::PMd
    } else {
        Pipeline::PRldMd
    }
}

/// Tunables of the anomaly filter ([`is_anomaly`]). [`AnomalyPolicy::validate`]
/// checks them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnomalyPolicy {
    /// An input is long above this many prompt tokens.
    pub long_input_tokens: u64,
    /// MD's hit rate is low below this fraction (`0..=1`).
    pub low_hit_rate: f64,
    /// An expected output is short below this many tokens.
    pub short_output_tokens: u64,
}

impl Default for AnomalyPolicy {
    fn default() -> Self {
        AnomalyPolicy {
            long_input_tokens: 32_768,
            low_hit_rate: 0.2,
            short_output_tokens: 64,
        }
    }
}

impl AnomalyPolicy {
    /// Check the tunables: `low_hit_rate` in `0..=1` (not NaN). A zero
    /// `low_hit_rate` or `short_output_tokens` is valid and turns the filter off.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..=1.0).contains(&self.low_hit_rate) {
            return Err(Error::InvalidArgument(format!(
                "low_hit_rate must be in 0..=1, got {}",
                self.low_hit_rate
            )));
        }
        Ok(())
    }

    /// A policy that never flags anything.
    pub fn disabled() -> AnomalyPolicy {
        AnomalyPolicy {
            long_input_tokens: u64::MAX,
            low_hit_rate: 0.0,
            short_output_tokens: 0,
        }
    }
}

/// The anomaly filter: true when all three hold:
/// - `prompt_tokens > long_input_tokens` (a long input),
/// - MD hit rate `< low_hit_rate` (most of it would cross the WAN),
/// - expected output known and `< short_output_tokens` (RLD would finish it before
///   the KV arrives at MD).
///
/// Such a request would occupy the WAN for seconds for a few tokens that RLD has
/// already produced; it is finished on RLD and its WAN transfer is cancelled. Rare by
/// construction: every condition must hold, and agentic traffic is dominated by high
/// hit rates (70-80% of requests above 95%).
///
/// Monotone: a higher hit rate or a longer expected output never makes a request an
/// anomaly.
pub fn is_anomaly(policy: &AnomalyPolicy, request: &RequestShape) -> bool {
    let Some(output) = request.expected_output_tokens else {
        return false;
    };
    request.prompt_tokens > policy.long_input_tokens
        && output < policy.short_output_tokens
        && request.md_hit_rate() < policy.low_hit_rate
}

/// The tunables of [`route`]: the anomaly filter and the pipeline choice.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RoutingPolicy {
    /// Pipeline choice for the requests that are not anomalies.
    pub pipeline: PipelinePolicy,
    /// The anomaly filter, applied first.
    pub anomaly: AnomalyPolicy,
}

impl RoutingPolicy {
    /// Check both parts.
    pub fn validate(&self) -> Result<()> {
        self.pipeline.validate()?;
        self.anomaly.validate()
    }
}

/// What [`route`] decided, with the numbers behind it for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteDecision {
    /// The pipeline.
    pub pipeline: Pipeline,
    /// Whether the anomaly filter fired (then `pipeline` is [`Pipeline::PRld`]).
    pub anomaly: bool,
    /// Prompt tokens MainDecode lacks.
    pub missing_tokens: u64,
    /// Estimated arrival of that KV at MainDecode, in milliseconds
    /// ([`kv_arrival_ms`]).
    pub kv_arrival_ms: f64,
}

/// Route a request: the anomaly filter first ([`Pipeline::PRld`], WAN transfer
/// cancelled), otherwise [`choose_pipeline`]. Checks the request
/// ([`RequestShape::validate`]); the policy is assumed valid.
pub fn route(
    policy: &RoutingPolicy,
    wan: &WanEstimate,
    request: &RequestShape,
) -> Result<RouteDecision> {
    request.validate()?;
    let missing_tokens = request.missing_tokens();
    let arrival = kv_arrival_ms(
        &policy.pipeline,
        wan,
        missing_tokens.saturating_mul(request.kv_bytes_per_token),
    );
    let anomaly = is_anomaly(&policy.anomaly, request);
    let pipeline = if anomaly {
        Pipeline::PRld
    } else {
        choose_pipeline(&policy.pipeline, wan, request)
    };
    Ok(RouteDecision {
        pipeline,
        anomaly,
        missing_tokens,
        kv_arrival_ms: arrival,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt: u64, cached: u64, output: Option<u64>) -> RequestShape {
        RequestShape {
            prompt_tokens: prompt,
            md_cached_tokens: cached,
            kv_bytes_per_token: 50_000,
            expected_output_tokens: output,
        }
    }

    #[test]
    fn arrival_formula() {
        let p = PipelinePolicy {
            ttft_budget_ms: 100.0,
            setup_rtts: 2.0,
            goodput_share: 1.0,
        };
        let wan = WanEstimate::new(8.0, 10.0).unwrap(); // 1e6 bytes per ms
        assert_eq!(kv_arrival_ms(&p, &wan, 0), 20.0);
        assert_eq!(kv_arrival_ms(&p, &wan, 5_000_000), 25.0);
    }

    #[test]
    fn empty_prompt_is_a_full_hit() {
        assert_eq!(req(0, 0, None).md_hit_rate(), 1.0);
        assert_eq!(req(0, 0, None).missing_tokens(), 0);
    }
}
