//! Request keys that are not u64.
//!
//! Engines name requests with strings (vLLM's `"cmpl-..."`) or UUIDs; the wire keeps
//! a 64-bit `request_id` (KV_GRANT, ABORT, PREFIX_QUERY). Both sides map a byte key to
//! the same id with [`request_id_of`], so neither has to send the key itself. The map
//! is SHA-256 under a fixed domain prefix, truncated to 64 bits: two live keys collide
//! with probability about n^2 / 2^65, and a receiver refuses a grant whose request id
//! is already live for the same peer rather than mixing two requests.

use sha2::{Digest, Sha256};

/// Domain separation: the id of a key is not the hash of the key in any other use.
const DOMAIN: &[u8] = b"pdd_transport request key v1\0";

/// The 64-bit wire id of the byte key `key` (a string key is its UTF-8 bytes): the
/// first 8 bytes, little-endian, of SHA-256(domain || key).
pub fn request_id_of(key: &[u8]) -> u64 {
    let digest = Sha256::new()
        .chain_update(DOMAIN)
        .chain_update(key)
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_distinct() {
        // Pinned: both ends of a deployment, and other languages, must agree.
        let a = request_id_of(b"cmpl-42");
        assert_eq!(a, request_id_of("cmpl-42".as_bytes()));
        assert_ne!(a, request_id_of(b"cmpl-43"));
        assert_ne!(request_id_of(b""), 0);
        let digest = Sha256::digest([DOMAIN, b"cmpl-42".as_slice()].concat());
        assert_eq!(a.to_le_bytes(), digest[..8]);
    }
}
