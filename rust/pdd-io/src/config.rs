//! Checks on endpoint settings, shared by every endpoint's `validate` and run by its
//! `connect` / `start` before anything is opened, so that a Rust caller and the Python
//! binding get the same `InvalidArgument` for the same mistake (the binding only
//! converts types and units).

use std::time::Duration;

use pdd_core::Error;

use crate::local::receiver::LocalReceiverConfig;
use crate::local::sender::LocalSenderConfig;
use crate::receiver::ReceiverConfig;
use crate::sender::SenderConfig;

/// Longest prefix lease a sender asks for; longer requests are cut to this (a lease
/// pins the receiver's cache pages, and the receiver bounds it again on its side).
pub const MAX_LEASE_REQUEST: Duration = Duration::from_secs(600);

/// A random non-zero session id (a sender's node id when the engine names none):
/// unique enough to tell senders apart at one receiver; not a secret (sessions are
/// authenticated separately).
pub fn random_session_id() -> u64 {
    loop {
        let id: u64 = rand::random();
        if id != 0 {
            return id;
        }
    }
}

fn invalid(message: impl Into<String>) -> Error {
    Error::InvalidArgument(message.into())
}

/// Session ids name a sender at the receiver; 0 means "none" on the wire.
pub(crate) fn check_session_id(id: u64) -> Result<(), Error> {
    if id == 0 {
        return Err(invalid("node_id (session id) 0 is reserved"));
    }
    Ok(())
}

/// A PING every `heartbeat`; a peer silent for `dead_after` is gone. Both non-zero, and
/// `dead_after` longer than one heartbeat, or a healthy peer is declared dead between
/// two PINGs.
pub(crate) fn check_liveness(heartbeat: Duration, dead_after: Duration) -> Result<(), Error> {
    if heartbeat.is_zero() {
        return Err(invalid("heartbeat must be non-zero"));
    }
    if dead_after <= heartbeat {
        return Err(invalid(format!(
            "dead_after ({dead_after:?}) must be longer than heartbeat ({heartbeat:?})"
        )));
    }
    Ok(())
}

fn check_non_zero(what: &str, d: Duration) -> Result<(), Error> {
    if d.is_zero() {
        return Err(invalid(format!("{what} must be non-zero")));
    }
    Ok(())
}

impl SenderConfig {
    /// Check the settings: a non-zero session id, at least one lane, blocks of at
    /// least one byte, a lane queue of at least one block, non-zero timers with
    /// `dead_after > heartbeat`.
    pub fn validate(&self) -> Result<(), Error> {
        check_session_id(self.session_id)?;
        if self.lanes == 0 {
            return Err(invalid(
                "a sender needs at least one data lane (lanes >= 1)",
            ));
        }
        if self.max_block_bytes == 0 {
            return Err(invalid("max_block_bytes (block_bytes) must be >= 1"));
        }
        if self.lane_queue == 0 {
            return Err(invalid("lane_queue must be >= 1"));
        }
        check_non_zero("connect_timeout", self.connect_timeout)?;
        check_liveness(self.heartbeat, self.dead_after)?;
        // A lane is revoked only while its session is alive: the stall bound must
        // come first (the default, 2 s or half of dead_after, always does).
        if let Some(stall) = self.lane_stall {
            check_non_zero("lane_stall", stall)?;
            if stall >= self.dead_after {
                return Err(invalid(format!(
                    "lane_stall ({stall:?}) must be shorter than dead_after ({:?})",
                    self.dead_after
                )));
            }
        }
        Ok(())
    }
}

impl ReceiverConfig {
    /// Check the settings: non-zero timers with `dead_after > heartbeat`.
    pub fn validate(&self) -> Result<(), Error> {
        check_non_zero("hello_timeout", self.hello_timeout)?;
        check_liveness(self.heartbeat, self.dead_after)
    }
}

impl LocalSenderConfig {
    /// Check the settings: a non-zero session id, non-zero timers with
    /// `dead_after > heartbeat`.
    pub fn validate(&self) -> Result<(), Error> {
        check_session_id(self.session_id)?;
        check_non_zero("connect_timeout", self.connect_timeout)?;
        check_non_zero("put_timeout", self.put_timeout)?;
        check_liveness(self.heartbeat, self.dead_after)
    }
}

impl LocalReceiverConfig {
    /// Check the settings: non-zero timers with `dead_after > heartbeat`, room for at
    /// least one connection.
    pub fn validate(&self) -> Result<(), Error> {
        check_non_zero("hello_timeout", self.hello_timeout)?;
        if self.max_connections == 0 {
            return Err(invalid("max_connections must be >= 1"));
        }
        check_liveness(self.heartbeat, self.dead_after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdd_core::wire::handshake::LocalHello;
    use pdd_core::wire::{capability, Role};

    fn sender() -> SenderConfig {
        let hello = LocalHello::new(Role::Prefill, capability::KV_STREAM);
        SenderConfig::new("127.0.0.1:1".parse().unwrap(), 7, hello)
    }

    #[test]
    fn defaults_are_valid() {
        sender().validate().unwrap();
        let hello = LocalHello::new(Role::MainDecode, capability::KV_STREAM);
        ReceiverConfig::new("127.0.0.1:0".parse().unwrap(), hello.clone())
            .validate()
            .unwrap();
        LocalSenderConfig::new("127.0.0.1:1".parse().unwrap(), 7, hello.clone())
            .validate()
            .unwrap();
        LocalReceiverConfig::new("127.0.0.1:0".parse().unwrap(), hello)
            .validate()
            .unwrap();
        assert_ne!(random_session_id(), 0);
    }

    #[test]
    fn each_bad_setting_is_named() {
        type Spoil = fn(&mut SenderConfig);
        let cases: [(&str, Spoil); 8] = [
            ("session id", |c| c.session_id = 0),
            ("lanes", |c| c.lanes = 0),
            ("block_bytes", |c| c.max_block_bytes = 0),
            ("lane_queue", |c| c.lane_queue = 0),
            ("heartbeat", |c| c.heartbeat = Duration::ZERO),
            ("dead_after", |c| c.dead_after = c.heartbeat),
            ("lane_stall", |c| c.lane_stall = Some(Duration::ZERO)),
            ("lane_stall", |c| c.lane_stall = Some(c.dead_after)),
        ];
        for (name, spoil) in cases {
            let mut c = sender();
            spoil(&mut c);
            let e = c.validate().unwrap_err();
            assert_eq!(e.reason(), "invalid_argument");
            assert!(e.to_string().contains(name), "{name}: {e}");
        }
    }
}
