//! HELLO negotiation as a pure function.
//!
//! The connecting side sends HELLO with its version range; the accepting side calls
//! [`negotiate`] on it and either answers with its own HELLO narrowed to the chosen
//! version ([`LocalHello::reply`]) or with ABORT carrying
//! [`Error::abort_reason`](crate::Error::abort_reason). The connecting side then
//! calls [`negotiate`] on the reply, which must name exactly one version.

use bytes::Bytes;
use subtle::ConstantTimeEq;

use super::{Hello, Role, DEFAULT_MAX_PAYLOAD};
use crate::error::{Error, Result};

/// Lowest protocol version this build speaks.
pub const PROTOCOL_MIN_VERSION: u16 = 1;
/// Highest protocol version this build speaks.
pub const PROTOCOL_MAX_VERSION: u16 = 1;

/// What this endpoint says about itself, and what it requires of a peer.
#[derive(Debug, Clone)]
pub struct LocalHello {
    /// Our role.
    pub role: Role,
    /// Our lowest protocol version.
    pub min_version: u16,
    /// Our highest protocol version.
    pub max_version: u16,
    /// Capability bits we offer.
    pub capabilities: u64,
    /// Largest payload we accept.
    pub max_payload: u32,
    /// Credential we present.
    pub credential: Bytes,
    /// Credential a peer must present; `None` accepts any.
    pub expected_credential: Option<Bytes>,
    /// Roles allowed to connect; empty accepts every role.
    pub accepted_roles: Vec<Role>,
}

impl LocalHello {
    /// Defaults for `role`: this build's version range, 16 MiB payloads, no credential.
    pub fn new(role: Role, capabilities: u64) -> Self {
        LocalHello {
            role,
            min_version: PROTOCOL_MIN_VERSION,
            max_version: PROTOCOL_MAX_VERSION,
            capabilities,
            max_payload: DEFAULT_MAX_PAYLOAD,
            credential: Bytes::new(),
            expected_credential: None,
            accepted_roles: Vec::new(),
        }
    }

    /// The HELLO a connecting side sends for lane `lane` of session `session_id`.
    pub fn offer(&self, session_id: u64, lane: u16) -> Hello {
        Hello {
            min_version: self.min_version,
            max_version: self.max_version,
            role: self.role,
            lane,
            session_id,
            capabilities: self.capabilities,
            max_payload: self.max_payload,
            credential: self.credential.clone(),
        }
    }

    /// The accepting side's answer once [`negotiate`] succeeded.
    pub fn reply(&self, agreed: &Negotiated) -> Hello {
        Hello {
            min_version: agreed.version,
            max_version: agreed.version,
            role: self.role,
            lane: agreed.lane,
            session_id: agreed.session_id,
            capabilities: self.capabilities,
            max_payload: self.max_payload,
            credential: self.credential.clone(),
        }
    }
}

/// The outcome of a successful HELLO exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// Protocol version both sides use.
    pub version: u16,
    /// The peer's role.
    pub peer_role: Role,
    /// Capabilities both sides have.
    pub capabilities: u64,
    /// Largest payload we may send to the peer.
    pub peer_max_payload: u32,
    /// Session id.
    pub session_id: u64,
    /// Lane index.
    pub lane: u16,
}

/// Check a peer's HELLO against ours: credential (constant-time), role, versions.
pub fn negotiate(ours: &LocalHello, peer: &Hello) -> Result<Negotiated> {
    if let Some(expected) = &ours.expected_credential {
        // ct_eq on slices of different lengths is false without looking at the bytes.
        if !bool::from(expected.as_ref().ct_eq(peer.credential.as_ref())) {
            return Err(Error::AuthFailed {
                detail: "credential does not match",
            });
        }
    }
    if !ours.accepted_roles.is_empty() && !ours.accepted_roles.contains(&peer.role) {
        return Err(Error::RoleRefused {
            ours: ours.role,
            peer: peer.role,
        });
    }
    let low = ours.min_version.max(peer.min_version);
    let high = ours.max_version.min(peer.max_version);
    if low > high {
        return Err(Error::VersionMismatch {
            ours_min: ours.min_version,
            ours_max: ours.max_version,
            peer_min: peer.min_version,
            peer_max: peer.max_version,
        });
    }
    Ok(Negotiated {
        version: high,
        peer_role: peer.role,
        capabilities: ours.capabilities & peer.capabilities,
        peer_max_payload: peer.max_payload,
        session_id: peer.session_id,
        lane: peer.lane,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::capability;

    fn md() -> LocalHello {
        LocalHello::new(Role::MainDecode, capability::ALL_KNOWN)
    }

    #[test]
    fn picks_highest_common_version_and_intersects_capabilities() {
        let mut p = LocalHello::new(
            Role::Prefill,
            capability::KV_STREAM | capability::PREFIX_CACHE,
        );
        p.max_version = 3;
        let mut ours = md();
        ours.max_version = 2;
        let agreed = negotiate(&ours, &p.offer(7, 1)).unwrap();
        assert_eq!(agreed.version, 2);
        assert_eq!(
            agreed.capabilities,
            capability::KV_STREAM | capability::PREFIX_CACHE
        );
        assert_eq!(
            (agreed.session_id, agreed.lane, agreed.peer_role),
            (7, 1, Role::Prefill)
        );
        let reply = ours.reply(&agreed);
        assert_eq!((reply.min_version, reply.max_version), (2, 2));
        assert_eq!(negotiate(&p, &reply).unwrap().version, 2);
    }

    #[test]
    fn disjoint_versions_are_refused_with_unsupported_version() {
        let mut p = LocalHello::new(Role::Prefill, 0);
        p.min_version = 5;
        p.max_version = 6;
        let err = negotiate(&md(), &p.offer(1, 0)).unwrap_err();
        assert_eq!(err.reason(), "version_mismatch");
        assert_eq!(
            err.abort_reason(),
            crate::wire::AbortReason::UnsupportedVersion
        );
    }

    #[test]
    fn credential_and_role_are_checked() {
        let mut ours = md();
        ours.expected_credential = Some(Bytes::from_static(b"s3cret"));
        ours.accepted_roles = vec![Role::RelayDecode];
        let mut p = LocalHello::new(Role::RelayDecode, 0);
        assert_eq!(
            negotiate(&ours, &p.offer(1, 0)).unwrap_err().reason(),
            "auth_failed"
        );
        p.credential = Bytes::from_static(b"s3cret!");
        assert_eq!(
            negotiate(&ours, &p.offer(1, 0)).unwrap_err().reason(),
            "auth_failed"
        );
        p.credential = Bytes::from_static(b"s3cret");
        assert!(negotiate(&ours, &p.offer(1, 0)).is_ok());
        p.role = Role::Prefill;
        assert_eq!(
            negotiate(&ours, &p.offer(1, 0)).unwrap_err().reason(),
            "role_refused"
        );
    }
}
