//! The prefix handshake, sans-IO: a decoder answers PREFIX_QUERY from its radix cache
//! and pins the match with a lease; the prefill side checks the answer's prefix hash
//! against its own tokens before trusting it.
//!
//! Why a lease: between the reply and the KV transfer the decoder must not evict the
//! prefix it promised, but a prefill that vanishes must not pin it forever. The lease
//! holds a radix lock until the decoder's engine takes over (it locks the prefix for
//! the request itself and [`LeaseTable::take`]s the lease) or until it expires
//! ([`LeaseTable::expire`], driven by the caller's clock).
//!
//! Why the hash: a reply only says "I hold the first N tokens". If the two sides
//! disagree on tokens (a different tokenizer revision, namespace, or a chain-hash
//! collision), reusing the decoder's KV would be silent corruption. The prefill side
//! recomputes the chain hash of its own first N tokens ([`verify_reply`]); on a
//! mismatch it trusts nothing and sends the whole prompt's KV. A lease that expired
//! before the grant (pages evicted meanwhile) shows up as a smaller match when the
//! decoder re-matches at grant time: its grant then covers the larger missing suffix,
//! which the prefill side sends.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::radix::{hash, NodeRef, RadixCache};
use crate::time::Timestamp;
use crate::wire::{FrameKind, PrefixQuery, PrefixReply};

/// A pin on a matched prefix, held for a peer until taken or expired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Lease id (non-zero), as sent in PREFIX_REPLY.
    pub id: u64,
    /// The request it was granted for.
    pub request_id: u64,
    /// The node whose lock the lease holds.
    pub node: NodeRef,
    /// Tokens matched.
    pub matched_tokens: usize,
    /// When it lapses.
    pub expires: Timestamp,
}

/// Live leases, by id and by expiry.
#[derive(Debug, Default)]
pub struct LeaseTable {
    next_id: u64,
    leases: HashMap<u64, Lease>,
    by_expiry: BTreeSet<(Timestamp, u64)>,
}

/// Longest lease a query may ask for (a peer cannot pin a prefix for hours).
pub const MAX_LEASE: Duration = Duration::from_secs(600);

impl LeaseTable {
    /// An empty table.
    pub fn new() -> LeaseTable {
        LeaseTable {
            next_id: 1,
            ..LeaseTable::default()
        }
    }

    /// Record a lease on `node` (already locked by the caller) until `now + duration`
    /// (capped at [`MAX_LEASE`]).
    pub fn grant(
        &mut self,
        request_id: u64,
        node: NodeRef,
        matched_tokens: usize,
        now: Timestamp,
        duration: Duration,
    ) -> Lease {
        let id = self.next_id;
        self.next_id += 1;
        let expires = now.saturating_add(duration.min(MAX_LEASE));
        let lease = Lease {
            id,
            request_id,
            node,
            matched_tokens,
            expires,
        };
        self.by_expiry.insert((expires, id));
        self.leases.insert(id, lease.clone());
        lease
    }

    /// Remove a live lease (the engine took over the pin, or the session ended); the
    /// caller unlocks or keeps its node. `None` if it already expired or never was.
    pub fn take(&mut self, id: u64) -> Option<Lease> {
        let lease = self.leases.remove(&id)?;
        self.by_expiry.remove(&(lease.expires, id));
        Some(lease)
    }

    /// Remove and return every lease whose expiry is at or before `now`; the caller
    /// unlocks their nodes.
    pub fn expire(&mut self, now: Timestamp) -> Vec<Lease> {
        let mut out = Vec::new();
        while let Some(&(at, id)) = self.by_expiry.first() {
            if at > now {
                break;
            }
            self.by_expiry.pop_first();
            if let Some(l) = self.leases.remove(&id) {
                out.push(l);
            }
        }
        out
    }

    /// When the next lease lapses.
    pub fn next_expiry(&self) -> Option<Timestamp> {
        self.by_expiry.first().map(|&(at, _)| at)
    }

    /// Live leases.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// Whether no lease is live.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }
}

/// Answer a PREFIX_QUERY from `cache`: match, and if the query asks for a lease and
/// something matched, lock the match and record the lease. The reply carries the
/// matched length, the chain hash of the matched prefix and the lease.
///
/// Refused (nothing locked, nothing recorded) when the query's page size is not the
/// cache's: the two sides would count pages differently.
pub fn answer_query(
    cache: &mut RadixCache,
    leases: &mut LeaseTable,
    query: &PrefixQuery,
    now: Timestamp,
) -> Result<(PrefixReply, Option<Lease>)> {
    if usize::from(query.page_size) != cache.page_size() {
        return Err(Error::InvalidField {
            kind: FrameKind::PrefixQuery,
            field: "page_size",
            detail: format!(
                "query counts {}-token pages, this cache {}",
                query.page_size,
                cache.page_size()
            ),
        });
    }
    let m = cache.match_prefix(query.namespace, &query.tokens);
    let matched = u32::try_from(m.matched_tokens)
        .map_err(|_| Error::InvalidArgument("matched prefix longer than u32 tokens".into()))?;
    let lease = if query.lease_ms > 0 && m.matched_tokens > 0 {
        cache.lock(m.node)?;
        Some(leases.grant(
            query.request_id,
            m.node,
            m.matched_tokens,
            now,
            Duration::from_millis(u64::from(query.lease_ms)),
        ))
    } else {
        None
    };
    let (lease_id, lease_ms) = match &lease {
        Some(l) => {
            let ms = l.expires.saturating_duration_since(now).as_millis();
            (l.id, u32::try_from(ms).unwrap_or(u32::MAX).max(1))
        }
        None => (0, 0),
    };
    let reply = PrefixReply {
        query_id: query.query_id,
        matched_tokens: matched,
        prefix_hash: m.prefix_hash,
        lease_id,
        lease_ms,
    };
    Ok((reply, lease))
}

/// What the prefill side may rely on after checking a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifiedPrefix {
    /// Tokens of the prompt whose KV the decoder holds and agrees on (0 after a
    /// mismatch: send everything).
    pub matched_tokens: usize,
    /// Whether the reply's hash matched ours (false: the reply was not trusted).
    pub hash_ok: bool,
}

/// Check a reply against our own tokens: the matched length must be a whole number
/// of pages within the prompt, and the chain hash of those tokens in `namespace`
/// must equal the reply's `prefix_hash`.
pub fn verify_reply(
    namespace: u64,
    page_size: usize,
    tokens: &[u32],
    reply: &PrefixReply,
) -> VerifiedPrefix {
    let matched = reply.matched_tokens as usize;
    if page_size == 0 || matched > tokens.len() || !matched.is_multiple_of(page_size) {
        return VerifiedPrefix {
            matched_tokens: 0,
            hash_ok: false,
        };
    }
    let ours = match hash::chain_hashes(hash::root_seed(namespace), &tokens[..matched], page_size)
        .last()
    {
        Some(&h) => h,
        None => hash::root_seed(namespace),
    };
    if ours == reply.prefix_hash {
        VerifiedPrefix {
            matched_tokens: matched,
            hash_ok: true,
        }
    } else {
        VerifiedPrefix {
            matched_tokens: 0,
            hash_ok: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PS: usize = 4;

    fn query(tokens: Vec<u32>, lease_ms: u32) -> PrefixQuery {
        PrefixQuery {
            query_id: 9,
            request_id: 77,
            namespace: 5,
            page_size: PS as u16,
            lease_ms,
            tokens,
        }
    }

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_nanos(ms * 1_000_000)
    }

    #[test]
    fn a_leased_match_survives_eviction_until_it_expires() {
        let mut cache = RadixCache::new(PS).unwrap();
        let mut leases = LeaseTable::new();
        let prompt: Vec<u32> = (1..=14).collect();
        cache.insert(5, &prompt[..12], &[0, 1, 2]).unwrap();
        let (reply, lease) =
            answer_query(&mut cache, &mut leases, &query(prompt.clone(), 100), at(0)).unwrap();
        let lease = lease.unwrap();
        assert_eq!(
            (reply.matched_tokens, reply.lease_id, reply.lease_ms),
            (12, lease.id, 100)
        );
        // The prefill side agrees on the hash.
        let v = verify_reply(5, PS, &prompt, &reply);
        assert_eq!(
            v,
            VerifiedPrefix {
                matched_tokens: 12,
                hash_ok: true
            }
        );
        // Pinned: nothing can be evicted.
        assert!(cache.evict(10).is_empty());
        assert_eq!(leases.next_expiry(), Some(at(100)));
        assert!(leases.expire(at(99)).is_empty());
        let lapsed = leases.expire(at(100));
        assert_eq!(lapsed, vec![lease]);
        cache.unlock(lapsed[0].node).unwrap();
        assert_eq!(cache.evict(10).len(), 3);
        assert!(leases.is_empty());
    }

    #[test]
    fn a_taken_lease_does_not_expire() {
        let mut cache = RadixCache::new(PS).unwrap();
        let mut leases = LeaseTable::new();
        cache.insert(5, &[1, 2, 3, 4], &[0]).unwrap();
        let (_, lease) =
            answer_query(&mut cache, &mut leases, &query(vec![1, 2, 3, 4], 10), at(0)).unwrap();
        let id = lease.unwrap().id;
        assert!(leases.take(id).is_some());
        assert!(leases.take(id).is_none());
        assert!(leases.expire(at(1000)).is_empty());
    }

    #[test]
    fn no_lease_without_a_match_or_without_asking() {
        let mut cache = RadixCache::new(PS).unwrap();
        let mut leases = LeaseTable::new();
        let (reply, lease) =
            answer_query(&mut cache, &mut leases, &query(vec![1, 2, 3, 4], 10), at(0)).unwrap();
        assert_eq!(
            (reply.matched_tokens, reply.lease_id, reply.lease_ms),
            (0, 0, 0)
        );
        assert!(lease.is_none());
        assert_eq!(
            verify_reply(5, PS, &[1, 2, 3, 4], &reply),
            VerifiedPrefix {
                matched_tokens: 0,
                hash_ok: true
            }
        );
        cache.insert(5, &[1, 2, 3, 4], &[0]).unwrap();
        let (reply, lease) =
            answer_query(&mut cache, &mut leases, &query(vec![1, 2, 3, 4], 0), at(0)).unwrap();
        assert_eq!((reply.matched_tokens, reply.lease_id), (4, 0));
        assert!(lease.is_none());
        assert_eq!(cache.evict(1).len(), 1, "nothing was locked");
    }

    #[test]
    fn diverged_tokens_are_detected_and_nothing_is_trusted() {
        let mut cache = RadixCache::new(PS).unwrap();
        let mut leases = LeaseTable::new();
        cache.insert(5, &[1, 2, 3, 4, 5, 6, 7, 8], &[0, 1]).unwrap();
        let (reply, _) = answer_query(
            &mut cache,
            &mut leases,
            &query(vec![1, 2, 3, 4, 5, 6, 7, 8], 0),
            at(0),
        )
        .unwrap();
        // The prefill side's tokens differ in the second page (another tokenizer).
        let v = verify_reply(5, PS, &[1, 2, 3, 4, 5, 6, 7, 9], &reply);
        assert_eq!(
            v,
            VerifiedPrefix {
                matched_tokens: 0,
                hash_ok: false
            }
        );
        // Another namespace hashes differently too.
        assert!(!verify_reply(6, PS, &[1, 2, 3, 4, 5, 6, 7, 8], &reply).hash_ok);
        // A reply claiming more than the prompt, or a partial page, is not trusted.
        let long = PrefixReply {
            matched_tokens: 12,
            ..reply.clone()
        };
        assert!(!verify_reply(5, PS, &[1, 2, 3, 4, 5, 6, 7, 8], &long).hash_ok);
        let partial = PrefixReply {
            matched_tokens: 6,
            ..reply
        };
        assert!(!verify_reply(5, PS, &[1, 2, 3, 4, 5, 6, 7, 8], &partial).hash_ok);
    }

    #[test]
    fn a_page_size_mismatch_is_refused_and_locks_nothing() {
        let mut cache = RadixCache::new(PS).unwrap();
        let mut leases = LeaseTable::new();
        cache.insert(5, &[1, 2, 3, 4], &[0]).unwrap();
        let mut q = query(vec![1, 2, 3, 4], 10);
        q.page_size = 2;
        assert_eq!(
            answer_query(&mut cache, &mut leases, &q, at(0))
                .unwrap_err()
                .reason(),
            "invalid_field"
        );
        assert!(leases.is_empty());
        assert_eq!(cache.evict(1).len(), 1);
    }

    #[test]
    fn leases_are_capped() {
        let mut leases = LeaseTable::new();
        let l = leases.grant(
            1,
            RadixCache::new(PS).unwrap().match_prefix(0, &[]).node,
            0,
            at(0),
            Duration::from_secs(86_400),
        );
        assert_eq!(l.expires, at(0).saturating_add(MAX_LEASE));
    }
}
