//! Which RelayDecode sessions a MainDecode link knows, and who may open or resume
//! one: the admission half of handoff ownership. (The [`Router`](super::router::Router)
//! enforces the other half: a request's frames go to, and come from, the session that
//! owns it only.)
//!
//! MainDecode serves one RelayDecode connection at a time. A connecting peer either
//! opens a new session (keyed with the root secret) or resumes a known one by proving
//! that session's own secret, which only the two ends of its opening exchange hold.
//! The book keeps every session that still owns a handoff, not only the latest, so
//! that an RLD whose connection dropped, and in whose absence another peer opened a
//! session, can still resume its own and finish its handoffs. Rules:
//!
//! - resume: only a known session, proving its secret (the caller authenticates with
//!   the key [`SessionBook::admit`] returns), and with TLS only from the certificate
//!   that opened it; allowed whether or not a connection is live (the owner takes the
//!   connection back; a half-dead connection of its own is replaced);
//! - open: only while no connection is live (nobody can push the connected peer
//!   aside), and not under the id of a known session (nobody can shadow a session
//!   that owns handoffs by naming it).
//!
//! Sans-IO: the caller authenticates, and tells the book what was installed. Nothing
//! here reads a clock or touches a socket.

use crate::error::{Error, Result};
use crate::wire::handshake::AuthBytes;

/// A session the book knows.
#[derive(Clone)]
struct Known {
    tag: u64,
    session_id: u64,
    secret: AuthBytes,
    identity: Option<[u8; 32]>,
}

/// What a connecting peer may do, decided from its HELLO before authentication.
#[derive(Clone, PartialEq, Eq)]
pub enum Admission {
    /// Resume the known session `tag`: authenticate with its `secret`.
    Resume {
        /// The session's tag (as the router knows it).
        tag: u64,
        /// The session's own secret, the key the lane must prove.
        secret: AuthBytes,
    },
    /// Open a new session: authenticate with the root secret.
    Open,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // The secret stays out of logs.
            Admission::Resume { tag, .. } => f.debug_struct("Resume").field("tag", tag).finish(),
            Admission::Open => f.write_str("Open"),
        }
    }
}

/// The sessions a MainDecode link knows; see the module docs.
#[derive(Default)]
pub struct SessionBook {
    known: Vec<Known>,
    current: Option<u64>,
    next_tag: u64,
}

impl std::fmt::Debug for SessionBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<(u64, u64)> = self.known.iter().map(|k| (k.tag, k.session_id)).collect();
        f.debug_struct("SessionBook")
            .field("current", &self.current)
            .field("known (tag, session id)", &ids)
            .finish()
    }
}

fn refused(detail: &'static str) -> Error {
    Error::AuthFailed { detail }
}

impl SessionBook {
    /// An empty book.
    pub fn new() -> SessionBook {
        SessionBook::default()
    }

    /// The tag of the session installed last.
    pub fn current(&self) -> Option<u64> {
        self.current
    }

    /// Sessions known.
    pub fn len(&self) -> usize {
        self.known.len()
    }

    /// No session known.
    pub fn is_empty(&self) -> bool {
        self.known.is_empty()
    }

    /// Whether the book knows a session under this wire id.
    pub fn knows_id(&self, session_id: u64) -> bool {
        self.known.iter().any(|k| k.session_id == session_id)
    }

    /// What a peer whose HELLO names `session_id` (`resume`: with the RESUME flag),
    /// from TLS certificate `identity` (its hash; `None` without TLS), may do while a
    /// connection is (`live`) or is not up. An `AuthFailed` error says why not.
    pub fn admit(
        &self,
        session_id: u64,
        resume: bool,
        identity: Option<[u8; 32]>,
        live: bool,
    ) -> Result<Admission> {
        let known = self.known.iter().find(|k| k.session_id == session_id);
        match (known, resume) {
            (Some(k), true) if k.identity != identity => {
                Err(refused("that session belongs to another TLS identity"))
            }
            (Some(k), true) => Ok(Admission::Resume {
                tag: k.tag,
                secret: k.secret,
            }),
            (None, true) => Err(refused("no session to resume")),
            (_, false) if live => Err(refused(
                "a RelayDecode is connected; only it may resume its session",
            )),
            (Some(_), false) => Err(refused(
                "that session id belongs to a session that still owns handoffs; \
                 only it may resume it",
            )),
            (None, false) => Ok(Admission::Open),
        }
    }

    /// A new session authenticated and is about to be installed: record it and make
    /// it current. Re-checks what [`SessionBook::admit`] checked, since another
    /// connection may have been installed meanwhile. Returns its tag.
    pub fn open(
        &mut self,
        session_id: u64,
        secret: AuthBytes,
        identity: Option<[u8; 32]>,
        live: bool,
    ) -> Result<u64> {
        if self.admit(session_id, false, identity, live)? != Admission::Open {
            return Err(refused("the session cannot be opened"));
        }
        self.next_tag += 1;
        let tag = self.next_tag;
        self.known.push(Known {
            tag,
            session_id,
            secret,
            identity,
        });
        self.current = Some(tag);
        Ok(tag)
    }

    /// A known session was resumed and is about to be installed: make it current.
    /// Fails if the book forgot it since [`SessionBook::admit`].
    pub fn resume(&mut self, tag: u64) -> Result<u64> {
        if !self.known.iter().any(|k| k.tag == tag) {
            return Err(refused("no session to resume"));
        }
        self.current = Some(tag);
        Ok(tag)
    }

    /// Forget every session but the current one for which `owns` is false (it owns
    /// no handoff any more): what the book holds stays bounded by the requests held.
    pub fn retain(&mut self, mut owns: impl FnMut(u64) -> bool) {
        let current = self.current;
        self.known.retain(|k| Some(k.tag) == current || owns(k.tag));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_known_session_resumes_even_while_another_is_connected() {
        let mut book = SessionBook::new();
        assert_eq!(book.admit(7, false, None, false).unwrap(), Admission::Open);
        let owner = book.open(7, [1; 32], None, false).unwrap();
        // The owner dropped; a second session opened while none was connected.
        let other = book.open(8, [2; 32], None, false).unwrap();
        assert_ne!(owner, other);
        assert_eq!(book.current(), Some(other));
        // The owner comes back while the other is connected: it may resume.
        assert_eq!(
            book.admit(7, true, None, true).unwrap(),
            Admission::Resume {
                tag: owner,
                secret: [1; 32]
            }
        );
        assert_eq!(book.resume(owner).unwrap(), owner);
        assert_eq!(book.current(), Some(owner));
    }

    #[test]
    fn opening_is_refused_while_live_or_under_a_known_id() {
        let mut book = SessionBook::new();
        let tag = book.open(7, [1; 32], None, false).unwrap();
        assert_eq!(
            book.admit(9, false, None, true).unwrap_err().reason(),
            "auth_failed"
        );
        assert!(book.open(9, [3; 32], None, true).is_err());
        // Not connected, but 7 is known: naming it does not shadow it.
        assert!(book.admit(7, false, None, false).is_err());
        assert!(book.open(7, [4; 32], None, false).is_err());
        assert_eq!(book.len(), 1);
        assert_eq!(book.current(), Some(tag));
        // Unknown sessions cannot be resumed, nor with another certificate.
        assert!(book.admit(9, true, None, false).is_err());
        let mut tls = SessionBook::new();
        tls.open(5, [1; 32], Some([9; 32]), false).unwrap();
        assert!(tls.admit(5, true, Some([8; 32]), false).is_err());
        assert!(tls.admit(5, true, None, false).is_err());
        assert!(tls.admit(5, true, Some([9; 32]), false).is_ok());
    }

    #[test]
    fn sessions_that_own_nothing_are_forgotten_but_the_current_one() {
        let mut book = SessionBook::new();
        let a = book.open(1, [1; 32], None, false).unwrap();
        let b = book.open(2, [2; 32], None, false).unwrap();
        let c = book.open(3, [3; 32], None, false).unwrap();
        book.retain(|t| t == a);
        assert!(book.knows_id(1) && !book.knows_id(2) && book.knows_id(3));
        assert!(book.resume(b).is_err());
        assert_eq!(book.current(), Some(c));
        // A forgotten id may be opened again, as a new session.
        let b2 = book.open(2, [5; 32], None, false).unwrap();
        assert!(b2 > c);
        assert!(!format!("{book:?}").contains("[5"), "no secret in Debug");
    }
}
