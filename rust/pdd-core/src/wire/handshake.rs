//! HELLO negotiation and the AUTH challenge-response, as pure functions (protocol v2).
//!
//! Every lane opens with four frames:
//!
//! 1. connector -> acceptor: HELLO (version range, role, lane, session id, a fresh
//!    32-byte nonce in `auth`, flag RESUME when the lane joins a live session);
//! 2. acceptor -> connector: AUTH (its own fresh nonce, and its proof);
//! 3. connector -> acceptor: AUTH (the connector's proof), sent only once the
//!    acceptor's proof checked out, so a connector never talks to an impostor;
//! 4. acceptor -> connector: HELLO narrowed to one version once the lane is admitted
//!    (or ABORT saying why).
//!
//! A proof is HMAC-SHA256 under the lane's key over a label (which side), the
//! connector's whole HELLO frame and the acceptor's nonce: both sides prove they
//! hold the key, both nonces make every proof fresh, and no secret travels.
//!
//! The key: a lane that opens a session is keyed with the root secret (the
//! pre-shared secret of both ends; empty where none is configured). That exchange
//! also derives the session's own secret ([`session_secret`]), which never travels
//! either; every data lane and every control-lane reconnect (flag RESUME) is keyed
//! with it. So a peer can join or take over a session only if it opened it, even
//! when every peer shares the root secret, and a transfer granted to one session
//! can never be fed from another.
//!
//! A peer speaking another version range is refused first, before anything else is
//! checked, with `version_mismatch` (ABORT `unsupported_version` naming both
//! ranges). `negotiate` runs on the acceptor; `check_reply` on the connector.

use bytes::Bytes;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

use super::{encode_frame_to_vec, Auth, Frame, Hello, Role, AUTH_LEN, DEFAULT_MAX_PAYLOAD};
use crate::error::{Error, Result};

/// Lowest protocol version this build speaks. v1 (plain-text credentials, sessions
/// anyone could join) is refused.
pub const PROTOCOL_MIN_VERSION: u16 = 2;
/// Highest protocol version this build speaks.
pub const PROTOCOL_MAX_VERSION: u16 = 2;

/// The largest payload a frame of the opening can have: HELLO (with the longest
/// `auth`), AUTH, or the ABORT that refuses (with the longest message). Both sides
/// read the opening's frames with this bound, whatever their `max_payload`: a peer
/// that has proved nothing yet and announces a larger frame is refused
/// (`frame_too_large`) before a byte of it is buffered, so a connection that sends a
/// 16-byte header and then stalls holds about a kilobyte, not `max_payload`.
pub const MAX_OPENING_PAYLOAD: u32 = {
    let hello = 29 + super::MAX_HELLO_AUTH_LEN;
    let auth = 2 * AUTH_LEN;
    let abort = 12 + super::MAX_ABORT_MESSAGE_LEN;
    let mut max = hello;
    if auth > max {
        max = auth;
    }
    if abort > max {
        max = abort;
    }
    max as u32
};

/// A random nonce, or a proof, or a session secret: 32 bytes.
pub type AuthBytes = [u8; AUTH_LEN];

/// What this endpoint says about itself, and what it requires of a peer.
#[derive(Clone)]
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
    /// The root secret both ends must prove they hold before a session opens
    /// (pre-shared, never sent). `None`: no root secret, so any peer may open a
    /// session (insecure; for loopback and tests), but lanes joining a session still
    /// prove that session's own secret.
    pub secret: Option<Bytes>,
    /// Roles allowed to connect; empty accepts every role.
    pub accepted_roles: Vec<Role>,
}

impl std::fmt::Debug for LocalHello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("LocalHello")
            .field("role", &self.role)
            .field("min_version", &self.min_version)
            .field("max_version", &self.max_version)
            .field("capabilities", &self.capabilities)
            .field("max_payload", &self.max_payload)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("accepted_roles", &self.accepted_roles)
            .finish()
    }
}

impl LocalHello {
    /// Defaults for `role`: this build's version range, 16 MiB payloads, no secret.
    pub fn new(role: Role, capabilities: u64) -> Self {
        LocalHello {
            role,
            min_version: PROTOCOL_MIN_VERSION,
            max_version: PROTOCOL_MAX_VERSION,
            capabilities,
            max_payload: DEFAULT_MAX_PAYLOAD,
            secret: None,
            accepted_roles: Vec::new(),
        }
    }

    /// The root key: the configured secret, or empty.
    pub fn root_key(&self) -> &[u8] {
        self.secret.as_deref().unwrap_or(&[])
    }

    /// The HELLO a connecting side sends for lane `lane` of session `session_id`,
    /// with its fresh `nonce`; `resume` when the lane joins a live session.
    pub fn offer(&self, session_id: u64, lane: u16, nonce: AuthBytes, resume: bool) -> Hello {
        Hello {
            min_version: self.min_version,
            max_version: self.max_version,
            role: self.role,
            lane,
            session_id,
            capabilities: self.capabilities,
            max_payload: self.max_payload,
            auth: Bytes::copy_from_slice(&nonce),
            resume,
        }
    }

    /// The accepting side's answer once the lane is admitted.
    pub fn reply(&self, agreed: &Negotiated) -> Hello {
        Hello {
            min_version: agreed.version,
            max_version: agreed.version,
            role: self.role,
            lane: agreed.lane,
            session_id: agreed.session_id,
            capabilities: self.capabilities,
            max_payload: self.max_payload,
            auth: Bytes::new(),
            resume: agreed.resume,
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
    /// The lane joins a live session (keyed with that session's secret).
    pub resume: bool,
}

fn version_check(ours: &LocalHello, peer: &Hello) -> Result<u16> {
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
    Ok(high)
}

/// Acceptor: check a connector's HELLO (versions first, then role, then the
/// shape of its nonce). Authentication follows ([`challenge`], [`verify_answer`]).
pub fn negotiate(ours: &LocalHello, peer: &Hello) -> Result<Negotiated> {
    let version = version_check(ours, peer)?;
    if !ours.accepted_roles.is_empty() && !ours.accepted_roles.contains(&peer.role) {
        return Err(Error::RoleRefused {
            ours: ours.role,
            peer: peer.role,
        });
    }
    if peer.auth.len() != AUTH_LEN {
        return Err(Error::AuthFailed {
            detail: "HELLO must carry a 32-byte nonce",
        });
    }
    if peer.lane > 0 && !peer.resume {
        return Err(Error::AuthFailed {
            detail: "a data lane must join its session (flag RESUME)",
        });
    }
    Ok(Negotiated {
        version,
        peer_role: peer.role,
        capabilities: ours.capabilities & peer.capabilities,
        peer_max_payload: peer.max_payload,
        session_id: peer.session_id,
        lane: peer.lane,
        resume: peer.resume,
    })
}

/// Connector: check the acceptor's HELLO reply to our `offer`: exactly one version
/// inside our range, and the lane it names is ours.
pub fn check_reply(ours: &LocalHello, offer: &Hello, reply: &Hello) -> Result<Negotiated> {
    if reply.min_version != reply.max_version {
        return Err(Error::InvalidField {
            kind: super::FrameKind::Hello,
            field: "max_version",
            detail: "a HELLO reply must name exactly one version".into(),
        });
    }
    let version = version_check(ours, reply)?;
    if reply.session_id != offer.session_id
        || reply.lane != offer.lane
        || reply.resume != offer.resume
    {
        return Err(Error::InvalidField {
            kind: super::FrameKind::Hello,
            field: "session_id",
            detail: "the HELLO reply names another session, lane or resume flag".into(),
        });
    }
    Ok(Negotiated {
        version,
        peer_role: reply.role,
        capabilities: ours.capabilities & reply.capabilities,
        peer_max_payload: reply.max_payload,
        session_id: reply.session_id,
        lane: reply.lane,
        resume: reply.resume,
    })
}

const ACCEPTOR_LABEL: &[u8] = b"pdd_transport v2 acceptor proof\0";
const CONNECTOR_LABEL: &[u8] = b"pdd_transport v2 connector proof";
const SESSION_LABEL: &[u8] = b"pdd_transport v2 session secret\0";

fn mac(key: &[u8], label: &[u8], offer: &Hello, acceptor_nonce: &AuthBytes) -> AuthBytes {
    // The transcript is the connector's whole HELLO frame (canonical, so both sides
    // encode the same bytes) and the acceptor's nonce.
    let offer_bytes =
        encode_frame_to_vec(&Frame::Hello(offer.clone()), u32::MAX).unwrap_or_default();
    // HMAC takes keys of any length (an empty root key included).
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts any key length");
    m.update(label);
    m.update(&(offer_bytes.len() as u64).to_le_bytes());
    m.update(&offer_bytes);
    m.update(acceptor_nonce);
    m.finalize().into_bytes().into()
}

/// Acceptor: the AUTH it sends after a HELLO it agreed with: its fresh `nonce` and
/// its proof of `key` (the root key for a new session, the session's secret for a
/// RESUME lane).
pub fn challenge(key: &[u8], offer: &Hello, nonce: AuthBytes) -> Auth {
    Auth {
        nonce,
        proof: mac(key, ACCEPTOR_LABEL, offer, &nonce),
    }
}

/// Connector: check the acceptor's AUTH against the key we expect it to hold and,
/// if it holds it, return the AUTH that proves we hold it too.
pub fn answer_challenge(key: &[u8], offer: &Hello, challenge: &Auth) -> Result<Auth> {
    let expected = mac(key, ACCEPTOR_LABEL, offer, &challenge.nonce);
    if !bool::from(expected.ct_eq(&challenge.proof)) {
        return Err(Error::AuthFailed {
            detail: "the accepting peer did not prove it holds the secret",
        });
    }
    let mut nonce = [0u8; AUTH_LEN];
    nonce.copy_from_slice(&offer.auth);
    Ok(Auth {
        nonce,
        proof: mac(key, CONNECTOR_LABEL, offer, &challenge.nonce),
    })
}

/// Acceptor: check the connector's answer to our challenge.
pub fn verify_answer(
    key: &[u8],
    offer: &Hello,
    acceptor_nonce: &AuthBytes,
    answer: &Auth,
) -> Result<()> {
    let expected = mac(key, CONNECTOR_LABEL, offer, acceptor_nonce);
    let nonce_ok = answer.nonce.ct_eq(offer.auth.as_ref());
    if !bool::from(expected.ct_eq(&answer.proof) & nonce_ok) {
        return Err(Error::AuthFailed {
            detail: "the connecting peer did not prove it holds the secret",
        });
    }
    Ok(())
}

/// Both sides, after a session-opening exchange: the session's own secret, derived
/// from the root key and both nonces. Only the two ends of that exchange know it
/// (and, without a root secret, whoever saw the exchange on the wire).
pub fn session_secret(root_key: &[u8], offer: &Hello, acceptor_nonce: &AuthBytes) -> AuthBytes {
    mac(root_key, SESSION_LABEL, offer, acceptor_nonce)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::capability;

    fn md() -> LocalHello {
        LocalHello::new(Role::MainDecode, capability::ALL_KNOWN)
    }

    fn with_secret(mut h: LocalHello, s: &'static [u8]) -> LocalHello {
        h.secret = Some(Bytes::from_static(s));
        h
    }

    /// The whole exchange between `c` (connector) and `a` (acceptor) keyed with
    /// `ck` and `ak`: Ok(session secret both derived) or the failing side's error.
    fn exchange(c: &LocalHello, ck: &[u8], a: &LocalHello, ak: &[u8]) -> Result<AuthBytes> {
        let offer = c.offer(7, 0, [1; AUTH_LEN], false);
        let agreed = negotiate(a, &offer)?;
        let ch = challenge(ak, &offer, [2; AUTH_LEN]);
        let answer = answer_challenge(ck, &offer, &ch)?;
        verify_answer(ak, &offer, &ch.nonce, &answer)?;
        let reply = a.reply(&agreed);
        check_reply(c, &offer, &reply)?;
        let ours = session_secret(ck, &offer, &ch.nonce);
        assert_eq!(ours, session_secret(ak, &offer, &ch.nonce));
        Ok(ours)
    }

    #[test]
    fn picks_highest_common_version_and_intersects_capabilities() {
        let mut p = LocalHello::new(
            Role::Prefill,
            capability::KV_STREAM | capability::PREFIX_CACHE,
        );
        p.max_version = 3;
        let mut ours = md();
        ours.max_version = 3;
        ours.min_version = 2;
        let offer = p.offer(7, 1, [9; AUTH_LEN], true);
        let agreed = negotiate(&ours, &offer).unwrap();
        assert_eq!(agreed.version, 3);
        assert_eq!(
            agreed.capabilities,
            capability::KV_STREAM | capability::PREFIX_CACHE
        );
        assert_eq!(
            (
                agreed.session_id,
                agreed.lane,
                agreed.peer_role,
                agreed.resume
            ),
            (7, 1, Role::Prefill, true)
        );
        let reply = ours.reply(&agreed);
        assert_eq!((reply.min_version, reply.max_version), (3, 3));
        assert_eq!(check_reply(&p, &offer, &reply).unwrap().version, 3);
    }

    #[test]
    fn a_v1_peer_is_refused_by_version_before_anything_else() {
        // A v1 HELLO carried a plain credential where v2 has its nonce.
        let mut v1 = LocalHello::new(Role::Prefill, 0).offer(1, 0, [0; AUTH_LEN], false);
        v1.min_version = 1;
        v1.max_version = 1;
        v1.auth = Bytes::from_static(b"s3cret");
        let mut ours = md();
        ours.accepted_roles = vec![Role::RelayDecode];
        let err = negotiate(&ours, &v1).unwrap_err();
        assert_eq!(err.reason(), "version_mismatch");
        assert_eq!(
            err.abort_reason(),
            crate::wire::AbortReason::UnsupportedVersion
        );
        assert!(err.to_string().contains("1..=1"), "{err}");
    }

    #[test]
    fn both_sides_prove_the_same_root_secret() {
        let c = with_secret(LocalHello::new(Role::Prefill, 0), b"s3cret");
        let a = with_secret(md(), b"s3cret");
        let s = exchange(&c, c.root_key(), &a, a.root_key()).unwrap();
        // Another exchange (other nonces) gives another session secret.
        let offer = c.offer(7, 0, [3; AUTH_LEN], false);
        assert_ne!(s, session_secret(b"s3cret", &offer, &[2; AUTH_LEN]));
    }

    #[test]
    fn an_impostor_acceptor_is_caught_by_the_connector() {
        let c = with_secret(LocalHello::new(Role::Prefill, 0), b"s3cret");
        let impostor = md();
        let err = exchange(&c, c.root_key(), &impostor, impostor.root_key()).unwrap_err();
        assert_eq!(err.reason(), "auth_failed");
        assert!(err.to_string().contains("accepting peer"), "{err}");
        let wrong = with_secret(md(), b"s3cret!");
        assert_eq!(
            exchange(&c, c.root_key(), &wrong, wrong.root_key())
                .unwrap_err()
                .reason(),
            "auth_failed"
        );
    }

    #[test]
    fn a_connector_without_the_secret_is_refused() {
        let a = with_secret(md(), b"s3cret");
        let offer = LocalHello::new(Role::Prefill, 0).offer(7, 0, [1; AUTH_LEN], false);
        negotiate(&a, &offer).unwrap();
        let ch = challenge(a.root_key(), &offer, [2; AUTH_LEN]);
        // It cannot check our proof, so it answers blindly with a proof of its own key.
        let forged = Auth {
            nonce: [1; AUTH_LEN],
            proof: mac(b"guess", CONNECTOR_LABEL, &offer, &ch.nonce),
        };
        let err = verify_answer(a.root_key(), &offer, &ch.nonce, &forged).unwrap_err();
        assert_eq!(err.reason(), "auth_failed");
        // A replayed answer for another acceptor nonce fails too.
        let honest = answer_challenge(b"s3cret", &offer, &ch).unwrap();
        assert!(verify_answer(a.root_key(), &offer, &[5; AUTH_LEN], &honest).is_err());
        verify_answer(a.root_key(), &offer, &ch.nonce, &honest).unwrap();
    }

    #[test]
    fn resume_lanes_prove_the_session_secret_not_the_root() {
        let c = LocalHello::new(Role::Prefill, 0);
        let a = md();
        // No root secret: anyone can open a session, but joining one needs its secret.
        let secret = exchange(&c, c.root_key(), &a, a.root_key()).unwrap();
        let offer = c.offer(7, 1, [4; AUTH_LEN], true);
        negotiate(&a, &offer).unwrap();
        let ch = challenge(&secret, &offer, [6; AUTH_LEN]);
        let answer = answer_challenge(&secret, &offer, &ch).unwrap();
        verify_answer(&secret, &offer, &ch.nonce, &answer).unwrap();
        // An intruder that knows the (empty) root key but not the session secret.
        assert!(answer_challenge(c.root_key(), &offer, &ch).is_err());
    }

    #[test]
    fn data_lanes_must_resume_and_hellos_must_carry_a_nonce() {
        let c = LocalHello::new(Role::Prefill, 0);
        let err = negotiate(&md(), &c.offer(1, 2, [0; AUTH_LEN], false)).unwrap_err();
        assert_eq!(err.reason(), "auth_failed");
        let mut offer = c.offer(1, 0, [0; AUTH_LEN], false);
        offer.auth = Bytes::from_static(b"short");
        assert_eq!(
            negotiate(&md(), &offer).unwrap_err().reason(),
            "auth_failed"
        );
    }

    #[test]
    fn roles_are_checked() {
        let mut ours = md();
        ours.accepted_roles = vec![Role::RelayDecode];
        let p = LocalHello::new(Role::Prefill, 0);
        assert_eq!(
            negotiate(&ours, &p.offer(1, 0, [0; AUTH_LEN], false))
                .unwrap_err()
                .reason(),
            "role_refused"
        );
    }

    #[test]
    fn a_reply_for_another_lane_is_refused() {
        let c = LocalHello::new(Role::Prefill, 0);
        let a = md();
        let offer = c.offer(7, 0, [1; AUTH_LEN], false);
        let mut agreed = negotiate(&a, &offer).unwrap();
        agreed.session_id = 8;
        assert!(check_reply(&c, &offer, &a.reply(&agreed)).is_err());
    }

    #[test]
    fn the_opening_bound_fits_the_largest_opening_frames() {
        use crate::wire::{decode_frame, Abort, AbortReason, HEADER_LEN, MAX_ABORT_MESSAGE_LEN};
        let mut offer = md().offer(1, 0, [0; AUTH_LEN], false);
        offer.auth = Bytes::from(vec![1; crate::wire::MAX_HELLO_AUTH_LEN]);
        let abort = Abort {
            request_id: 0,
            reason: AbortReason::AuthFailed,
            message: "x".repeat(MAX_ABORT_MESSAGE_LEN),
        };
        let frames = [
            Frame::Auth(challenge(b"k", &offer, [2; AUTH_LEN])),
            Frame::Hello(offer),
            Frame::Abort(abort),
        ];
        let mut largest = 0;
        for f in frames {
            let bytes = encode_frame_to_vec(&f, u32::MAX).unwrap();
            largest = largest.max(bytes.len() - HEADER_LEN);
            assert!(decode_frame(&bytes, MAX_OPENING_PAYLOAD).unwrap().is_some());
        }
        assert_eq!(largest, MAX_OPENING_PAYLOAD as usize);
    }

    #[test]
    fn debug_never_prints_the_secret() {
        let h = with_secret(md(), b"hunter2");
        assert!(!format!("{h:?}").contains("hunter2"));
    }
}
