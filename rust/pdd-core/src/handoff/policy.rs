//! The handoff policy: pure functions over tunables, no state.
//!
//! Two decisions are made here, both by RelayDecode:
//! - [`choose_mode`]: when MainDecode reports its KV complete, hand the whole backlog
//!   at once (One-Shot) or in chunks while RLD keeps decoding (Catch-Up);
//! - [`catch_up_step`]: each time MainDecode has caught up with a chunk, hand the next
//!   chunk or, once the backlog is level, the rest with the final flag.
//!
//! The rationale for the defaults is in `docs/handoff.md`.

use std::time::Duration;

use crate::error::{Error, Result};

/// Most token IDs any single HANDOFF may carry, and so the largest
/// [`HandoffPolicy::max_eager_tokens`]. 16,000 IDs at the widest packing (32 bits)
/// plus the frame's fixed parts stay under 64 KiB, the smallest payload limit a peer
/// may advertise ([`crate::wire::MIN_MAX_PAYLOAD`]), so a handoff never needs to be
/// split for size and never exceeds any peer's limit.
pub const MAX_HANDOFF_TOKENS: u32 = 16_000;

/// How RelayDecode hands its eager tokens to MainDecode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandoffMode {
    /// Every pending token in one final HANDOFF; RLD stops decoding at once. Frees
    /// RLD soonest; MD absorbs the whole backlog in one extend step (a visible stall
    /// when the backlog is large).
    OneShot,
    /// Non-final chunks while RLD keeps decoding; each next chunk goes once MD has
    /// caught up with the previous one; the rest goes final once the backlog is level.
    /// MD never stalls on a big extend; RLD runs a little longer.
    CatchUp,
}

impl HandoffMode {
    /// snake_case name for logs and Python.
    pub fn name(self) -> &'static str {
        match self {
            HandoffMode::OneShot => "one_shot",
            HandoffMode::CatchUp => "catch_up",
        }
    }
}

/// What RelayDecode hands next while catching up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CatchUpStep {
    /// A non-final chunk of this many tokens (the oldest pending ones); keep decoding.
    Chunk(u32),
    /// Everything pending, with the final flag; stop decoding.
    Final,
}

/// Tunables of the handoff policy. Cheap to copy; one value is typically shared by
/// every request of an RLD instance. [`HandoffPolicy::validate`] checks them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HandoffPolicy {
    /// Catch-Up is chosen only for a backlog above this many tokens; at or below it a
    /// single extend step is cheap enough for MD that One-Shot costs nothing visible.
    pub catch_up_threshold_tokens: u32,
    /// While catching up, a backlog at or below this is "level": the rest goes final
    /// and RLD stops. Below the threshold, so that Catch-Up has hysteresis and does
    /// not end the moment the backlog dips under the threshold.
    pub level_tokens: u32,
    /// Most tokens in one non-final chunk: bounds the extend step MD runs per chunk.
    pub chunk_tokens: u32,
    /// RLD utilisation (0..=1) at or above which One-Shot is chosen whatever the
    /// backlog: a busy RLD must free its slot rather than keep decoding for MD. Also
    /// re-checked at every Catch-Up step, so a load spike ends catching up early.
    pub one_shot_load: f64,
    /// Most eager tokens RLD decodes for one request. Reaching it stops RLD, which
    /// then hands everything over final. Bounds RLD's share of the output even when
    /// MD's KV is slow or Catch-Up does not converge. At most [`MAX_HANDOFF_TOKENS`].
    pub max_eager_tokens: u32,
}

impl Default for HandoffPolicy {
    fn default() -> Self {
        HandoffPolicy {
            catch_up_threshold_tokens: 64,
            level_tokens: 8,
            chunk_tokens: 256,
            one_shot_load: 0.85,
            max_eager_tokens: 1024,
        }
    }
}

impl HandoffPolicy {
    /// Check the tunables are usable: `level_tokens < catch_up_threshold_tokens`,
    /// `chunk_tokens >= 1`, `one_shot_load` in `0..=1` (not NaN), and
    /// `1 <= max_eager_tokens <= MAX_HANDOFF_TOKENS`.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.level_tokens >= self.catch_up_threshold_tokens {
            return bad(format!(
                "level_tokens ({}) must be below catch_up_threshold_tokens ({})",
                self.level_tokens, self.catch_up_threshold_tokens
            ));
        }
        if self.chunk_tokens == 0 {
            return bad("chunk_tokens must be >= 1".into());
        }
        if !(0.0..=1.0).contains(&self.one_shot_load) {
            return bad(format!(
                "one_shot_load {} outside 0..=1",
                self.one_shot_load
            ));
        }
        if self.max_eager_tokens == 0 || self.max_eager_tokens > MAX_HANDOFF_TOKENS {
            return bad(format!(
                "max_eager_tokens {} outside 1..={MAX_HANDOFF_TOKENS}",
                self.max_eager_tokens
            ));
        }
        Ok(())
    }
}

/// Pick the handoff mode for a request at the moment MainDecode's KV is complete.
///
/// - `rld_load`: RLD's current utilisation, `0.0` idle to `1.0` saturated (values
///   outside are clamped; NaN counts as saturated, the safe side).
/// - `backlog_tokens`: eager tokens RLD holds that MD has not been handed yet.
///
/// Rules, in order:
/// 1. load at or above `one_shot_load` -> One-Shot: RLD is the scarce tier (it only
///    masks the WAN), so when it is busy it must stop decoding now and free the slot;
/// 2. backlog above `catch_up_threshold_tokens` -> Catch-Up: one extend step that big
///    would stall the user's stream on MD, so hand it in chunks while RLD keeps the
///    stream going;
/// 3. otherwise One-Shot: a small backlog extends in about one decode step, and
///    stopping RLD at once is cheapest.
pub fn choose_mode(policy: &HandoffPolicy, rld_load: f64, backlog_tokens: u32) -> HandoffMode {
    // An unknown load (NaN) is treated as saturated: freeing RLD is the safe error.
    if rld_load.is_nan() || rld_load >= policy.one_shot_load {
        return HandoffMode::OneShot;
    }
    if backlog_tokens > policy.catch_up_threshold_tokens {
        HandoffMode::CatchUp
    } else {
        HandoffMode::OneShot
    }
}

/// The next step of a Catch-Up handoff, decided each time MD has caught up with
/// everything handed so far.
///
/// A backlog at or below `level_tokens` is level: hand it final. Otherwise hand the
/// oldest `min(backlog, chunk_tokens)` tokens non-final. Load is not consulted here;
/// [`choose_mode`] is re-run by RLD first, so a load spike turns the rest into
/// One-Shot.
pub fn catch_up_step(policy: &HandoffPolicy, backlog_tokens: u32) -> CatchUpStep {
    if backlog_tokens <= policy.level_tokens {
        CatchUpStep::Final
    } else {
        CatchUpStep::Chunk(backlog_tokens.min(policy.chunk_tokens))
    }
}

/// Retransmission and give-up bounds of both handoff sides.
///
/// The defaults suit a WAN with tens of ms of RTT: the first retransmission after
/// 200 ms, doubling to at most 2 s, abandoning after 10 s without an answer or
/// 12 transmissions of the same frame, whichever comes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandoffTimers {
    /// Wait before the first retransmission of an unanswered frame.
    pub rto_initial: Duration,
    /// Cap on the retransmission wait after doubling.
    pub rto_max: Duration,
    /// Most transmissions of one unanswered frame before giving up.
    pub max_attempts: u32,
    /// Longest wait for an answer from the peer (an ack that advances, a new handoff,
    /// progress past a chunk) before giving up.
    pub give_up_after: Duration,
    /// RelayDecode only: longest wait, from the handoff's creation, for MainDecode to
    /// report its KV complete. Covers the WAN KV transfer, so much longer than
    /// `give_up_after`.
    pub kv_wait_timeout: Duration,
    /// MainDecode only: how long it keeps answering retransmitted HANDOFFs with the
    /// final ack after it owns the request, so a lost final ack does not leave RLD
    /// retransmitting into the void. At least `give_up_after`, RLD's retransmit window.
    pub linger: Duration,
}

impl Default for HandoffTimers {
    fn default() -> Self {
        HandoffTimers {
            rto_initial: Duration::from_millis(200),
            rto_max: Duration::from_secs(2),
            max_attempts: 12,
            give_up_after: Duration::from_secs(10),
            kv_wait_timeout: Duration::from_secs(60),
            linger: Duration::from_secs(12),
        }
    }
}

impl HandoffTimers {
    /// Check the bounds are usable: non-zero RTO, `rto_initial <= rto_max`,
    /// `max_attempts >= 1`, non-zero `give_up_after` and `kv_wait_timeout`, and
    /// `linger >= give_up_after`.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::InvalidArgument(m.to_owned()));
        if self.rto_initial.is_zero() || self.rto_initial > self.rto_max {
            return bad("rto_initial must be non-zero and at most rto_max");
        }
        if self.max_attempts == 0 {
            return bad("max_attempts must be >= 1");
        }
        if self.give_up_after.is_zero() || self.kv_wait_timeout.is_zero() {
            return bad("give_up_after and kv_wait_timeout must be non-zero");
        }
        if self.linger < self.give_up_after {
            return bad("linger must be at least give_up_after");
        }
        Ok(())
    }

    /// Retransmission timeout after `attempts` transmissions (1 = the first send):
    /// `rto_initial * 2^(attempts-1)`, capped at `rto_max`.
    pub fn rto(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(31);
        self.rto_initial
            .checked_mul(1u32 << doublings)
            .map_or(self.rto_max, |d| d.min(self.rto_max))
    }
}
