//! Sealed data lanes: KV bytes on a TLS data lane, protected so that the receiver
//! decrypts them inside the granted pages themselves.
//!
//! rustls's record layer copies every received byte three times before it reaches a
//! page (read buffer -> deframer -> plaintext queue -> page) and cuts a block into
//! 16 KiB records that ignore page boundaries, so nothing can be decrypted in place.
//! Once both ends of a TLS data lane offered `capability::SEALED_LANES`, the lane
//! leaves TLS's record layer right after its HELLO (nothing else travels on it before):
//! both ends export a secret from the lane's TLS session (RFC 8446 section 7.5: bound
//! to this handshake, the certificates both sides proved and our label) and seal each
//! block in page-aligned records with the AEAD the handshake chose:
//!
//! ```text
//! block  = head-record page-record*
//! record = tag (16 bytes) || ciphertext   tag first: one readv puts the tag in scratch
//!                                         and the ciphertext straight into its page
//! head   = the plain path's frame header and KV_PAGES fixed fields (crc32c 0)
//! pages  = each page of the block, in wire order, cut into chunks of at most
//!          SEAL_CHUNK bytes: a chunk never spans two pages
//! ```
//!
//! Record n of a lane uses epoch `n / RECORDS_PER_EPOCH`'s key and the nonce
//! `iv XOR (n mod RECORDS_PER_EPOCH)`: both ends count records, so no key, nonce or
//! length travels, nonces never repeat under one key, and a record replayed, dropped or
//! moved fails its tag. An epoch's key and iv are HKDF-Expand(exported secret,
//! label || epoch): a key protects at most 2^20 records of at most 256 KiB (2^38
//! bytes), inside the AES-GCM limit TLS 1.3 sets (2^24.5 records of 2^14 bytes), so a
//! lane re-keys as it goes with no message, where TLS would need KeyUpdate. The
//! receiver then copies nothing in user space: the kernel writes the ciphertext into the
//! page and the AEAD decrypts it there.

// The AEAD and HKDF: aws-lc-rs with the `aws-lc` feature (the Python package's builds:
// its AES-GCM is about 2x ring's on this AVX-512 host), ring otherwise. Same API, same
// wire format and keys: the two interoperate.
#[cfg(feature = "aws-lc")]
use aws_lc_rs as crypto;
#[cfg(not(feature = "aws-lc"))]
use ring as crypto;

use crypto::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey, NONCE_LEN};
use crypto::hkdf;

/// Which library seals and opens the records in this build.
pub const CRYPTO: &str = if cfg!(feature = "aws-lc") {
    "aws-lc-rs"
} else {
    "ring"
};

use pdd_core::wire::{HEADER_LEN, KV_PAGES_FIXED_LEN};
use pdd_core::Error;

/// Bytes of an AEAD tag (AES-GCM and ChaCha20-Poly1305 alike).
pub const TAG_LEN: usize = 16;

/// Largest chunk of a page one record carries.
pub const SEAL_CHUNK: usize = 256 << 10;

/// Records sealed under one key before the lane moves to the next epoch's.
pub const RECORDS_PER_EPOCH: u64 = 1 << 20;

/// Plaintext bytes of a block's head record.
pub const HEAD_LEN: usize = HEADER_LEN + KV_PAGES_FIXED_LEN;

/// The TLS exporter label (RFC 8446 section 7.5) of a sealed lane's secret.
pub const EXPORTER_LABEL: &[u8] = b"EXPORTER-pdd-sealed-kv-lane";

/// The exporter context: the one direction a data lane carries KV.
pub const EXPORTER_CONTEXT: &[u8] = b"kv sender to kv receiver";

/// Records that carry a page of `page_bytes` bytes.
pub fn records_per_page(page_bytes: u64) -> u64 {
    page_bytes.div_ceil(SEAL_CHUNK as u64)
}

/// The AEAD a TLS 1.3 cipher suite names, for the lane to keep using.
pub fn algorithm_of(suite: rustls::CipherSuite) -> Result<&'static aead::Algorithm, Error> {
    match suite {
        rustls::CipherSuite::TLS13_AES_128_GCM_SHA256 => Ok(&aead::AES_128_GCM),
        rustls::CipherSuite::TLS13_AES_256_GCM_SHA384 => Ok(&aead::AES_256_GCM),
        rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256 => Ok(&aead::CHACHA20_POLY1305),
        other => Err(Error::InvalidArgument(format!(
            "sealed lanes: no AEAD for the cipher suite {other:?}"
        ))),
    }
}

/// One end's record keys of one sealed lane, and the number of the next record.
pub struct LaneKeys {
    secret: hkdf::Prk,
    algorithm: &'static aead::Algorithm,
    next_record: u64,
    epoch: Option<(u64, LessSafeKey, [u8; NONCE_LEN])>,
}

impl std::fmt::Debug for LaneKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret or the keys.
        f.debug_struct("LaneKeys")
            .field("algorithm", self.algorithm)
            .field("next_record", &self.next_record)
            .finish_non_exhaustive()
    }
}

/// HKDF output length of an iv.
struct IvLen;

impl hkdf::KeyType for IvLen {
    fn len(&self) -> usize {
        NONCE_LEN
    }
}

/// A record failed its AEAD check: corrupted or forged, never the peer's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forged;

/// What a record that failed its AEAD check ends its lane with.
pub const FORGED_DETAIL: &str =
    "sealed data lane: a record failed its AEAD check (corrupted or forged)";

impl From<Forged> for Error {
    fn from(_: Forged) -> Error {
        Error::ConnectionLost {
            detail: FORGED_DETAIL.into(),
        }
    }
}

/// Whether `e` is a sealed record's failed AEAD check (not a lost connection: its
/// block's transfer fails, it is never resumed).
pub fn is_forged(e: &Error) -> bool {
    matches!(e, Error::ConnectionLost { detail } if detail == FORGED_DETAIL)
}

impl LaneKeys {
    /// Keys from a secret both ends exported from the lane's TLS session.
    pub fn new(secret: &[u8; 32], algorithm: &'static aead::Algorithm) -> LaneKeys {
        LaneKeys {
            secret: hkdf::Prk::new_less_safe(hkdf::HKDF_SHA256, secret),
            algorithm,
            next_record: 0,
            epoch: None,
        }
    }

    /// The key and nonce of the next record (and count it).
    fn next(&mut self) -> (&LessSafeKey, Nonce) {
        let n = self.next_record;
        // 2^64 records do not happen; wrapping would repeat a nonce, so stop instead.
        self.next_record = n.checked_add(1).expect("2^64 records on one lane");
        let epoch = n / RECORDS_PER_EPOCH;
        if self.epoch.as_ref().map(|e| e.0) != Some(epoch) {
            let number = epoch.to_be_bytes();
            let key_info: [&[u8]; 2] = [b"pdd sealed lane key", &number];
            let iv_info: [&[u8]; 2] = [b"pdd sealed lane iv", &number];
            // Infallible: both lengths are far below HKDF-SHA256's 255 * 32 bytes.
            let okm = self
                .secret
                .expand(&key_info, self.algorithm)
                .expect("key length");
            let key = LessSafeKey::new(UnboundKey::from(okm));
            let mut iv = [0u8; NONCE_LEN];
            self.secret
                .expand(&iv_info, IvLen)
                .and_then(|okm| okm.fill(&mut iv))
                .expect("iv length");
            self.epoch = Some((epoch, key, iv));
        }
        let (_, key, iv) = self.epoch.as_ref().expect("set above");
        let mut nonce = *iv;
        let counter = (n % RECORDS_PER_EPOCH).to_be_bytes();
        for (b, c) in nonce[NONCE_LEN - 8..].iter_mut().zip(counter) {
            *b ^= c;
        }
        (key, Nonce::assume_unique_for_key(nonce))
    }

    /// Append one record sealing `plain` to `out`: the tag, then the ciphertext.
    pub fn push_record(&mut self, out: &mut Vec<u8>, plain: &[u8]) {
        let at = out.len();
        out.resize(at + TAG_LEN, 0);
        out.extend_from_slice(plain);
        let (key, nonce) = self.next();
        // Infallible for in-range lengths (ring refuses only > 2^36 bytes per record).
        let tag = key
            .seal_in_place_separate_tag(nonce, Aad::empty(), &mut out[at + TAG_LEN..])
            .expect("record length within the AEAD's limit");
        out[at..at + TAG_LEN].copy_from_slice(tag.as_ref());
    }

    /// Open the next record in place: `in_out` holds its ciphertext and becomes its
    /// plaintext. A failed check is the lane's end (the bytes are not the peer's).
    pub fn open(&mut self, tag: &[u8; TAG_LEN], in_out: &mut [u8]) -> Result<(), Forged> {
        let (key, nonce) = self.next();
        #[cfg(feature = "aws-lc")]
        let opened = key.open_in_place_separate_tag(nonce, Aad::empty(), tag, in_out);
        #[cfg(not(feature = "aws-lc"))]
        let opened =
            key.open_in_place_separate_tag(nonce, Aad::empty(), aead::Tag::from(*tag), in_out, 0..);
        opened.map(|_| ()).map_err(|_| Forged)
    }

    /// Count `records` records that were read past, not opened (a drained block's).
    pub fn skip(&mut self, records: u64) {
        self.next_record = self
            .next_record
            .checked_add(records)
            .expect("2^64 records on one lane");
    }

    /// Number of the next record.
    pub fn next_record(&self) -> u64 {
        self.next_record
    }
}

/// A page cut into the chunks its records carry, in order (none for an empty page).
pub fn page_chunks(page: &[u8]) -> std::slice::Chunks<'_, u8> {
    page.chunks(SEAL_CHUNK)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (LaneKeys, LaneKeys) {
        let secret = [7u8; 32];
        (
            LaneKeys::new(&secret, &aead::AES_128_GCM),
            LaneKeys::new(&secret, &aead::AES_128_GCM),
        )
    }

    fn open_all(keys: &mut LaneKeys, mut wire: &[u8], lens: &[usize]) -> Result<Vec<u8>, Forged> {
        let mut plain = Vec::new();
        for &len in lens {
            let mut tag = [0u8; TAG_LEN];
            tag.copy_from_slice(&wire[..TAG_LEN]);
            let mut body = wire[TAG_LEN..TAG_LEN + len].to_vec();
            keys.open(&tag, &mut body)?;
            plain.extend_from_slice(&body);
            wire = &wire[TAG_LEN + len..];
        }
        assert!(wire.is_empty());
        Ok(plain)
    }

    #[test]
    fn records_open_in_order_and_never_out_of_it() {
        let (mut tx, mut rx) = pair();
        let mut wire = Vec::new();
        tx.push_record(&mut wire, b"first");
        tx.push_record(&mut wire, b"second!");
        assert_eq!(open_all(&mut rx, &wire, &[5, 7]).unwrap(), b"firstsecond!");
        // The same two records again: the receiver is at record 2 now, so replaying
        // them fails.
        assert!(open_all(&mut rx, &wire[..TAG_LEN + 5], &[5]).is_err());
        // Swapped records fail too.
        let (mut tx, mut rx) = pair();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        tx.push_record(&mut a, b"aaaa");
        tx.push_record(&mut b, b"bbbb");
        b.extend_from_slice(&a);
        assert!(open_all(&mut rx, &b, &[4, 4]).is_err());
    }

    #[test]
    fn every_flipped_bit_fails_the_record() {
        let (mut tx, _) = pair();
        let mut wire = Vec::new();
        tx.push_record(&mut wire, &[0x5a; 40]);
        for bit in 0..wire.len() * 8 {
            let mut bad = wire.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            let (_, mut rx) = pair();
            assert!(open_all(&mut rx, &bad, &[40]).is_err(), "bit {bit}");
        }
    }

    #[test]
    fn another_secret_opens_nothing() {
        let (mut tx, _) = pair();
        let mut wire = Vec::new();
        tx.push_record(&mut wire, b"kv bytes");
        let mut other = LaneKeys::new(&[8u8; 32], &aead::AES_128_GCM);
        assert!(open_all(&mut other, &wire, &[8]).is_err());
    }

    #[test]
    fn a_new_epoch_takes_a_new_key_on_both_ends() {
        let (mut tx, mut rx) = pair();
        tx.skip(RECORDS_PER_EPOCH - 1);
        rx.skip(RECORDS_PER_EPOCH - 1);
        let mut wire = Vec::new();
        tx.push_record(&mut wire, b"last of epoch 0");
        tx.push_record(&mut wire, b"first of epoch 1");
        assert_eq!(
            open_all(&mut rx, &wire, &[15, 16]).unwrap(),
            b"last of epoch 0first of epoch 1"
        );
        // Record 0 of epoch 1 and record 0 of epoch 0 share the counter, not the key.
        let (mut a, mut b) = pair();
        b.skip(RECORDS_PER_EPOCH);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        a.push_record(&mut x, &[0; 32]);
        b.push_record(&mut y, &[0; 32]);
        assert_ne!(x, y);
    }

    #[test]
    fn pages_are_cut_at_page_and_chunk_bounds() {
        let (mut tx, mut rx) = pair();
        let pages: Vec<Vec<u8>> = vec![
            (0..SEAL_CHUNK + 3).map(|i| i as u8).collect(),
            vec![9; 10],
            vec![],
        ];
        let mut wire = Vec::new();
        for page in &pages {
            for chunk in page_chunks(page) {
                tx.push_record(&mut wire, chunk);
            }
        }
        assert_eq!(records_per_page((SEAL_CHUNK + 3) as u64), 2);
        assert_eq!(records_per_page(0), 0);
        assert_eq!(tx.next_record(), 3);
        let plain = open_all(&mut rx, &wire, &[SEAL_CHUNK, 3, 10]).unwrap();
        assert_eq!(plain, pages.concat());
    }
}

#[cfg(test)]
mod known_answer {
    use super::*;

    /// The wire format pinned: record 0 and record 2^20 (the first of epoch 1) under a
    /// fixed secret. Both crypto builds (ring, aws-lc-rs) must give these bytes, so
    /// they interoperate; a change to the labels, the nonce layout or the epoch rule
    /// breaks this test.
    #[test]
    fn records_match_the_pinned_bytes_in_every_build() {
        let mut keys = LaneKeys::new(&[0x42; 32], &aead::AES_128_GCM);
        let mut first = Vec::new();
        keys.push_record(&mut first, b"pdd sealed lane");
        keys.skip(RECORDS_PER_EPOCH - 1);
        let mut next_epoch = Vec::new();
        keys.push_record(&mut next_epoch, b"pdd sealed lane");
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(
            hex(&first),
            "3f19b3d918195046336988795b415cc72508ed063c0533d0fd7882076a753f"
        );
        assert_eq!(
            hex(&next_epoch),
            "db69cec2230cc8546ff32ca5ef0d3175bda0882cc4d50ca394b70b4a7dcb7e"
        );
    }
}
