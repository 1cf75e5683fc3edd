//! What the emulator is asked to do: addresses, per-direction link profiles, limits.

use std::net::SocketAddr;
use std::time::Duration;

use rand::Rng;

use super::WanemError;

/// Largest delay or jitter a profile accepts; beyond this it is a typo, not a WAN.
pub const MAX_DELAY: Duration = Duration::from_secs(600);

/// Largest per-connection, per-direction in-flight limit accepted (1 GiB).
pub const MAX_IN_FLIGHT: usize = 1 << 30;

/// Smallest per-connection, per-direction in-flight limit accepted (4 KiB).
pub const MIN_IN_FLIGHT: usize = 4 << 10;

/// In-flight limit used when the profile has no rate cap and none is configured (32 MiB).
pub const DEFAULT_UNSHAPED_IN_FLIGHT: usize = 32 << 20;

/// One direction of the emulated line.
///
/// `ClientToUpstream` carries what the accepted (client) socket sends to the upstream
/// server; `UpstreamToClient` carries the replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Bytes read from the accepted connection, written to the upstream server.
    ClientToUpstream,
    /// Bytes read from the upstream server, written back to the accepted connection.
    UpstreamToClient,
}

impl Direction {
    /// Both directions, for loops such as "stall the whole line".
    pub const ALL: [Direction; 2] = [Direction::ClientToUpstream, Direction::UpstreamToClient];

    pub(crate) fn index(self) -> usize {
        match self {
            Direction::ClientToUpstream => 0,
            Direction::UpstreamToClient => 1,
        }
    }
}

/// Variation added to the one-way delay of each chunk.
///
/// Whatever the sample, bytes of one TCP stream are never reordered: a chunk is
/// released no earlier than the chunk before it (see [`LinkProfile`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Jitter {
    /// No variation.
    #[default]
    None,
    /// Uniform in `[-j, +j]`.
    Uniform(Duration),
    /// Normal with standard deviation `sigma`, clamped to `±3 sigma`.
    Normal(Duration),
}

impl Jitter {
    /// The largest deviation a sample can take (`j` for uniform, `3 sigma` for normal).
    pub fn bound(&self) -> Duration {
        match *self {
            Jitter::None => Duration::ZERO,
            Jitter::Uniform(j) => j,
            Jitter::Normal(sigma) => sigma.saturating_mul(3),
        }
    }

    /// One sample in seconds (may be negative).
    fn sample_secs<R: Rng + ?Sized>(&self, rng: &mut R) -> f64 {
        match *self {
            Jitter::None => 0.0,
            Jitter::Uniform(j) => {
                let j = j.as_secs_f64();
                if j == 0.0 {
                    0.0
                } else {
                    rng.random_range(-j..=j)
                }
            }
            Jitter::Normal(sigma) => {
                let sigma = sigma.as_secs_f64();
                // Box-Muller; u1 in (0, 1] so ln(u1) is finite.
                let u1 = 1.0 - rng.random::<f64>();
                let u2 = rng.random::<f64>();
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                (z * sigma).clamp(-3.0 * sigma, 3.0 * sigma)
            }
        }
    }
}

/// What one direction of the line does to the bytes that cross it.
///
/// * `delay`: one-way propagation delay added to every chunk.
/// * `jitter`: variation of that delay, sampled per chunk from the seeded RNG; the
///   release time of a chunk is `max(departure + delay + sample, previous release)`,
///   so a stream is delayed but never reordered (and never released early: the sum is
///   floored at zero extra delay).
/// * `rate_bps`: bandwidth cap in bits per second for this direction, shared by every
///   connection of the emulator (a token bucket in front of the delay, like the
///   bottleneck of a real line). `None` means no cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LinkProfile {
    /// One-way delay.
    pub delay: Duration,
    /// Variation of the delay.
    pub jitter: Jitter,
    /// Cap in bits per second, shared by all connections of this direction.
    pub rate_bps: Option<u64>,
}

impl LinkProfile {
    /// A transparent link: no delay, no jitter, no cap.
    pub const UNSHAPED: LinkProfile = LinkProfile {
        delay: Duration::ZERO,
        jitter: Jitter::None,
        rate_bps: None,
    };

    /// A link with only a one-way delay.
    pub fn with_delay(delay: Duration) -> Self {
        LinkProfile {
            delay,
            ..LinkProfile::UNSHAPED
        }
    }

    /// Rejects values no real line has: a zero rate, a delay or jitter above [`MAX_DELAY`].
    pub fn validate(&self) -> Result<(), WanemError> {
        if self.rate_bps == Some(0) {
            return Err(WanemError::InvalidConfig(
                "rate_bps must be positive (use None for no cap)".into(),
            ));
        }
        if self.delay > MAX_DELAY {
            return Err(WanemError::InvalidConfig(format!(
                "delay {:?} is above the maximum {MAX_DELAY:?}",
                self.delay
            )));
        }
        if self.jitter.bound() > MAX_DELAY {
            return Err(WanemError::InvalidConfig(format!(
                "jitter {:?} is above the maximum {MAX_DELAY:?}",
                self.jitter
            )));
        }
        Ok(())
    }

    /// The delay of one chunk: `delay + jitter sample`, never below zero.
    pub(crate) fn sample_delay<R: Rng + ?Sized>(&self, rng: &mut R) -> Duration {
        let extra = self.jitter.sample_secs(rng);
        if extra >= 0.0 {
            self.delay.saturating_add(Duration::from_secs_f64(extra))
        } else {
            self.delay.saturating_sub(Duration::from_secs_f64(-extra))
        }
    }

    /// The in-flight limit used when the config does not set one: twice the
    /// bandwidth-delay product at the worst-case delay, plus 1 MiB, within
    /// [`MIN_IN_FLIGHT`]..=[`MAX_IN_FLIGHT`]; [`DEFAULT_UNSHAPED_IN_FLIGHT`] without a cap.
    pub fn default_in_flight(&self) -> usize {
        match self.rate_bps {
            None => DEFAULT_UNSHAPED_IN_FLIGHT,
            Some(rate) => {
                let worst = self.delay.saturating_add(self.jitter.bound());
                let bdp = (rate as u128 / 8).saturating_mul(worst.as_nanos()) / 1_000_000_000;
                let want = bdp.saturating_mul(2).saturating_add(1 << 20);
                usize::try_from(want)
                    .unwrap_or(MAX_IN_FLIGHT)
                    .clamp(MIN_IN_FLIGHT, MAX_IN_FLIGHT)
            }
        }
    }
}

/// Everything [`Wanem::start`](super::Wanem::start) needs.
///
/// Build it with [`WanemConfig::new`] and set the public fields you care about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WanemConfig {
    /// Where to listen; port 0 picks a free port (read it back from
    /// [`WanemHandle::local_addr`](super::WanemHandle::local_addr)).
    pub listen: SocketAddr,
    /// Where each accepted connection is relayed to (no name resolution here).
    pub upstream: SocketAddr,
    /// The client-to-upstream direction.
    pub client_to_upstream: LinkProfile,
    /// The upstream-to-client direction.
    pub upstream_to_client: LinkProfile,
    /// Seed of the jitter and corruption RNGs; each connection and direction derives
    /// its own stream from it, so a run is reproducible given the same connection order.
    pub seed: u64,
    /// Bytes one connection may hold in one direction (read from the sender, not yet
    /// written to the receiver). When it is full the proxy stops reading, so the
    /// sender feels TCP backpressure. `None`: [`LinkProfile::default_in_flight`] of
    /// the initial profile. This is the emulated line's buffer, i.e. it bounds the
    /// throughput of one connection to about `max_in_flight / delay`.
    pub max_in_flight: Option<usize>,
    /// `SO_SNDBUF`/`SO_RCVBUF` for both sockets of each connection. `None` leaves the
    /// kernel's autotuning alone (usually what you want).
    pub socket_buffer: Option<usize>,
    /// How long to wait for the upstream connection before resetting the client.
    pub connect_timeout: Duration,
}

impl WanemConfig {
    /// A transparent proxy from `listen` to `upstream`: no shaping, seed 0.
    pub fn new(listen: SocketAddr, upstream: SocketAddr) -> Self {
        WanemConfig {
            listen,
            upstream,
            client_to_upstream: LinkProfile::UNSHAPED,
            upstream_to_client: LinkProfile::UNSHAPED,
            seed: 0,
            max_in_flight: None,
            socket_buffer: None,
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// Sets the same profile on both directions.
    pub fn symmetric(mut self, profile: LinkProfile) -> Self {
        self.client_to_upstream = profile;
        self.upstream_to_client = profile;
        self
    }

    /// The profile of one direction.
    pub fn profile(&self, dir: Direction) -> &LinkProfile {
        match dir {
            Direction::ClientToUpstream => &self.client_to_upstream,
            Direction::UpstreamToClient => &self.upstream_to_client,
        }
    }

    /// Checks the profiles and limits.
    pub fn validate(&self) -> Result<(), WanemError> {
        self.client_to_upstream.validate()?;
        self.upstream_to_client.validate()?;
        if let Some(n) = self.max_in_flight {
            if !(MIN_IN_FLIGHT..=MAX_IN_FLIGHT).contains(&n) {
                return Err(WanemError::InvalidConfig(format!(
                    "max_in_flight {n} is outside {MIN_IN_FLIGHT}..={MAX_IN_FLIGHT}"
                )));
            }
        }
        if let Some(n) = self.socket_buffer {
            if n == 0 || u32::try_from(n).is_err() {
                return Err(WanemError::InvalidConfig(format!(
                    "socket_buffer {n} must be in 1..=4294967295"
                )));
            }
        }
        if self.connect_timeout.is_zero() {
            return Err(WanemError::InvalidConfig(
                "connect_timeout must be positive".into(),
            ));
        }
        Ok(())
    }

    /// The in-flight limit of one direction, as used for each new connection.
    pub(crate) fn in_flight(&self, dir: Direction) -> usize {
        self.max_in_flight
            .unwrap_or_else(|| self.profile(dir).default_in_flight())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn jitter_samples_stay_within_bounds_and_are_reproducible() {
        for jitter in [
            Jitter::Uniform(Duration::from_millis(5)),
            Jitter::Normal(Duration::from_millis(2)),
        ] {
            let p = LinkProfile {
                delay: Duration::from_millis(4),
                jitter,
                rate_bps: None,
            };
            let mut a = StdRng::seed_from_u64(7);
            let mut b = StdRng::seed_from_u64(7);
            for _ in 0..10_000 {
                let d = p.sample_delay(&mut a);
                assert_eq!(d, p.sample_delay(&mut b));
                assert!(d <= p.delay + jitter.bound() + Duration::from_nanos(1));
            }
        }
    }

    #[test]
    fn validation_rejects_nonsense() {
        let zero_rate = LinkProfile {
            rate_bps: Some(0),
            ..LinkProfile::UNSHAPED
        };
        assert!(zero_rate.validate().is_err());
        assert!(LinkProfile::with_delay(Duration::from_secs(3600))
            .validate()
            .is_err());
        let addr = "127.0.0.1:0".parse().unwrap();
        let mut cfg = WanemConfig::new(addr, addr);
        cfg.max_in_flight = Some(1);
        assert!(cfg.validate().is_err());
        cfg.max_in_flight = None;
        assert!(cfg.validate().is_ok());
    }

    #[test]
    fn default_in_flight_follows_the_bdp() {
        // 10 Gbit/s at 20 ms one way: BDP 25 MB, limit 2 * 25 MB + 1 MiB.
        let p = LinkProfile {
            delay: Duration::from_millis(20),
            jitter: Jitter::None,
            rate_bps: Some(10_000_000_000),
        };
        assert_eq!(p.default_in_flight(), 50_000_000 + (1 << 20));
        assert_eq!(
            LinkProfile::UNSHAPED.default_in_flight(),
            DEFAULT_UNSHAPED_IN_FLIGHT
        );
    }
}
