//! Wire protocol v1: a fixed 16-byte header followed by a kind-specific payload.
//!
//! The byte-level specification is `docs/protocol.md`; this module is its
//! implementation, and `tests/test_protocol_doc.py` checks the two agree.
//!
//! Design rules (all enforced here, for every frame kind):
//! - little-endian integers, no padding, no memory addresses: KV data is addressed
//!   by page indices relative to a grant the receiver made;
//! - the payload length is checked against a maximum before any byte is buffered;
//! - all arithmetic on lengths and offsets is checked;
//! - encodings are canonical: a successful decode re-encodes to the same bytes;
//! - every malformed input is a typed [`Error`](crate::Error), never a panic.

mod codec;
mod frame;
pub mod handshake;
mod reader;
#[cfg(feature = "testing")]
pub mod testing;
pub mod text;
pub mod tokens;

pub use codec::{
    decode_frame, decode_frame_shared, encode_frame, encode_frame_to_vec, FrameDecoder,
};
pub use frame::{check_kv_layout, held_bitmap_len, put_z_head, z_payload_bounds};
pub use frame::{
    Abort, Auth, CacheEvent, CacheEvents, Frame, Handoff, HandoffAck, Hello, KvDone, KvGrant,
    KvHeld, KvLayout, KvPages, KvPagesZ, LaneDelivered, LaneRevoke, LocalAddr, LocalDone,
    LocalGrant, LocalRegion, Ping, PrefixQuery, PrefixReply, Progress, ZRest, KV_PAGES_FIXED_LEN,
    KV_PAGES_Z_FIXED_LEN, LOCAL_REGION_MIN_LEN, MAX_DELIVERED_LANES,
};

use std::fmt;

use crate::error::{Error, Result};

/// First two bytes of every frame: ASCII `PD`.
pub const MAGIC: [u8; 2] = *b"PD";
/// The header format version this build reads and writes.
pub const WIRE_VERSION: u8 = 1;
/// Header length in bytes.
pub const HEADER_LEN: usize = 16;
/// Default maximum payload a decoder accepts (16 MiB).
pub const DEFAULT_MAX_PAYLOAD: u32 = 16 << 20;
/// No configuration may raise the payload limit above this (1 GiB).
pub const HARD_MAX_PAYLOAD: u32 = 1 << 30;
/// No peer may advertise a payload limit below this (64 KiB).
pub const MIN_MAX_PAYLOAD: u32 = 64 << 10;
/// Maximum length of HELLO's `auth` field (v2 sends a 32-byte nonce; the bound
/// stays 512 so that a v1 HELLO with its credential still decodes and is refused by
/// version, with an ABORT).
pub const MAX_HELLO_AUTH_LEN: usize = 512;
/// Bytes of an AUTH nonce, of an AUTH proof (HMAC-SHA256), and of a session secret.
pub const AUTH_LEN: usize = 32;
/// Maximum ABORT message length in bytes (UTF-8).
pub const MAX_ABORT_MESSAGE_LEN: usize = 1024;
/// Largest radix page size a PREFIX_QUERY may name.
pub const MAX_PAGE_SIZE: u16 = 256;
/// Longest UCX worker address LOCAL_ADDR carries.
pub const MAX_LOCAL_ADDRESS_LEN: usize = 16 << 10;
/// Longest KV_LAYOUT blob (bytes); the shortest is 1. A layout descriptor is a small
/// fixed header and a model name: this bound keeps a peer's frame small and the
/// copy both sides keep per session cheap.
pub const MAX_KV_LAYOUT_LEN: usize = 256;
/// Longest packed remote key of one LOCAL_GRANT region.
pub const MAX_LOCAL_RKEY_LEN: usize = 1024;
/// LOCAL_ADDR memory kind: host memory.
pub const MEMORY_KIND_HOST: u8 = 1;
/// LOCAL_ADDR memory kind: CUDA device memory (not registered by this build yet).
pub const MEMORY_KIND_CUDA: u8 = 2;

/// Flag bit of HANDOFF: the last handoff of this request; MD owns it afterwards.
pub const FLAG_FINAL: u16 = 0x0001;
/// Flag bit of PROGRESS: MD holds the request's complete prompt KV.
pub const FLAG_KV_COMPLETE: u16 = 0x0001;
/// Flag bit of HELLO: the lane joins a live session and proves its secret.
pub const FLAG_RESUME: u16 = 0x0001;
/// Flag bit of KV_PAGES (capability `lane_failover` only): the block is sent again
/// because the lane that first carried it was revoked; its pages may already have
/// landed, and then it is a duplicate to discard, not a violation.
pub const FLAG_RESENT: u16 = 0x0001;

macro_rules! frame_kinds {
    ($( $(#[$doc:meta])* $name:ident = $code:literal, $wire:literal, flags = $flags:expr; )*) => {
        /// The kind byte of the header.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u8)]
        pub enum FrameKind {
            $( $(#[$doc])* $name = $code, )*
        }

        impl FrameKind {
            /// Every kind, in code order.
            pub const ALL: &'static [FrameKind] = &[$(FrameKind::$name,)*];

            /// Parse a kind byte.
            pub fn from_code(code: u8) -> Option<FrameKind> {
                match code {
                    $( $code => Some(FrameKind::$name), )*
                    _ => None,
                }
            }

            /// The upper-case name used in docs/protocol.md (`KV_PAGES`).
            pub fn wire_name(self) -> &'static str {
                match self {
                    $( FrameKind::$name => $wire, )*
                }
            }

            /// Parse a wire name (`"HANDOFF"`).
            pub fn from_wire_name(name: &str) -> Option<FrameKind> {
                match name {
                    $( $wire => Some(FrameKind::$name), )*
                    _ => None,
                }
            }

            /// Flag bits this kind defines; any other bit set is an error.
            pub fn allowed_flags(self) -> u16 {
                match self {
                    $( FrameKind::$name => $flags, )*
                }
            }
        }
    };
}

frame_kinds! {
    /// Session opening: role, version range, capabilities, the connector's nonce.
    Hello = 0x01, "HELLO", flags = FLAG_RESUME;
    /// Receiver grants a sender a region of pages for one transfer.
    KvGrant = 0x02, "KV_GRANT", flags = 0;
    /// Pages of KV data for a grant.
    KvPages = 0x03, "KV_PAGES", flags = FLAG_RESENT;
    /// Sender finished a transfer.
    KvDone = 0x04, "KV_DONE", flags = 0;
    /// Prefill asks a decoder to match (and pin) a prompt prefix.
    PrefixQuery = 0x05, "PREFIX_QUERY", flags = 0;
    /// Decoder's answer: matched length, prefix hash, lease.
    PrefixReply = 0x06, "PREFIX_REPLY", flags = 0;
    /// Ordered radix cache events (stored, removed, cleared).
    CacheEvents = 0x07, "CACHE_EVENTS", flags = 0;
    /// Token IDs decoded by RelayDecode, handed to MainDecode.
    Handoff = 0x08, "HANDOFF", flags = FLAG_FINAL;
    /// MainDecode acknowledges handoffs cumulatively.
    HandoffAck = 0x09, "HANDOFF_ACK", flags = FLAG_FINAL;
    /// MainDecode reports it has reached a position.
    Progress = 0x0A, "PROGRESS", flags = FLAG_KV_COMPLETE;
    /// Ends a request or the whole connection, with a reason.
    Abort = 0x0B, "ABORT", flags = 0;
    /// Liveness probe; carries a nonce and the sender's clock.
    Ping = 0x0C, "PING", flags = 0;
    /// Answer to PING, echoing its fields.
    Pong = 0x0D, "PONG", flags = 0;
    /// Challenge-response after HELLO: nonce and HMAC proof (protocol v2).
    Auth = 0x0E, "AUTH", flags = 0;
    /// Local path (capability `local_ucx`): the receiver's UCX worker address and
    /// its pool's memory kind.
    LocalAddr = 0x0F, "LOCAL_ADDR", flags = 0;
    /// Local path: remote keys and addresses of exactly the pages of one grant.
    LocalGrant = 0x10, "LOCAL_GRANT", flags = 0;
    /// Local path: the sender's completion notice for a range of a grant's layers,
    /// sent after its puts were flushed.
    LocalDone = 0x11, "LOCAL_DONE", flags = 0;
    /// Lane failover (capability `lane_failover`): the KV sender gave up on a data
    /// lane and asks the receiver to stop reading it.
    LaneRevoke = 0x12, "LANE_REVOKE", flags = 0;
    /// Lane failover: the receiver's reader of that lane has ended; no byte of it
    /// can land any more.
    LaneRevoked = 0x13, "LANE_REVOKED", flags = 0;
    /// Lane delivery (capability `lane_delivery`): how many KV_PAGES bytes the
    /// receiver has read on each data lane, in answer to every PING, so that the
    /// sender can tell a lane that TCP acknowledges but that delivers nothing.
    LaneDelivered = 0x14, "LANE_DELIVERED", flags = 0;
    /// KV compression (capability `kv_compress`), on data lanes: a KV_PAGES block
    /// whose pages may each be compressed (codec, raw length and the CRC32C of the
    /// decoded pages in the frame). 0x15 is unassigned.
    KvPagesZ = 0x16, "KV_PAGES_Z", flags = FLAG_RESENT;
    /// KV layout (capability `kv_layout`), on the control lane, both ways, once,
    /// first: the sending side's pool layout as an opaque blob, so that each side
    /// can map (or refuse) the other's before any grant or KV byte.
    KvLayout = 0x17, "KV_LAYOUT", flags = 0;
    /// Transfer resume (capability `kv_resume`), on the control lane, receiver to
    /// sender, after a session was resumed: what the receiver holds of one transfer
    /// of the replaced instance (its grant, the pages that landed and were verified,
    /// whether the sender's KV_DONE came); transfer id 0 ends the list.
    KvHeld = 0x18, "KV_HELD", flags = 0;
}

impl fmt::Display for FrameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.wire_name())
    }
}

macro_rules! abort_reasons {
    ($( $(#[$doc:meta])* $name:ident = $code:literal, $text:literal; )*) => {
        /// Reason code carried by ABORT. Unknown codes from newer peers are kept as
        /// [`AbortReason::Other`] so they can still be reported.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum AbortReason {
            $( $(#[$doc])* $name, )*
            /// A code this build does not know.
            Other(u16),
        }

        impl AbortReason {
            /// Every known reason, in code order.
            pub const KNOWN: &'static [AbortReason] = &[$(AbortReason::$name,)*];

            /// Wire code.
            pub fn code(self) -> u16 {
                match self {
                    $( AbortReason::$name => $code, )*
                    AbortReason::Other(c) => c,
                }
            }

            /// Reason from a wire code (canonical: known codes never become `Other`).
            pub fn from_code(code: u16) -> AbortReason {
                match code {
                    $( $code => AbortReason::$name, )*
                    c => AbortReason::Other(c),
                }
            }

            /// snake_case name, as in docs/protocol.md.
            pub fn name(self) -> &'static str {
                match self {
                    $( AbortReason::$name => $text, )*
                    AbortReason::Other(_) => "other",
                }
            }

            /// Parse a snake_case name.
            pub fn from_name(name: &str) -> Option<AbortReason> {
                match name {
                    $( $text => Some(AbortReason::$name), )*
                    _ => None,
                }
            }
        }
    };
}

abort_reasons! {
    /// No reason given.
    Unspecified = 0, "unspecified";
    /// A malformed frame or a frame out of sequence.
    ProtocolError = 1, "protocol_error";
    /// No common wire or protocol version.
    UnsupportedVersion = 2, "unsupported_version";
    /// A frame kind this peer does not know.
    UnknownKind = 3, "unknown_kind";
    /// Credentials or role refused.
    AuthFailed = 4, "auth_failed";
    /// A frame over the negotiated payload limit.
    FrameTooLarge = 5, "frame_too_large";
    /// CRC32C mismatch.
    ChecksumMismatch = 6, "checksum_mismatch";
    /// Pages outside the transfer's grant; a frame for a transfer or a handoff
    /// request another session owns.
    GrantViolation = 7, "grant_violation";
    /// A deadline ran out.
    DeadlineExceeded = 8, "deadline_exceeded";
    /// The application cancelled the request or transfer.
    Cancelled = 9, "cancelled";
    /// The peer is shutting down.
    Shutdown = 10, "shutdown";
    /// A bug or an unexpected local failure.
    Internal = 11, "internal";
    /// A prefix lease expired before it was used.
    LeaseExpired = 12, "lease_expired";
    /// Out of pages, memory or slots.
    ResourceExhausted = 13, "resource_exhausted";
    /// The peer's prefix hash did not match ours.
    PrefixMismatch = 14, "prefix_mismatch";
    /// The peer will not take part in this request (ABORT with its request id, before
    /// or after a grant): the decoder ended it before its KV arrived, or the prefill
    /// side will not send it. The message says why.
    Refused = 15, "refused";
}

impl fmt::Display for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbortReason::Other(c) => write!(f, "other({c})"),
            r => f.write_str(r.name()),
        }
    }
}

/// What a peer is in the PDD picture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Role {
    /// P: computes the prompt KV, in datacenter A.
    Prefill = 1,
    /// RLD: decodes eagerly next to P, then hands off token IDs.
    RelayDecode = 2,
    /// MD: the bulk of decoding, in datacenter B.
    MainDecode = 3,
}

impl Role {
    /// Every role, in code order.
    pub const ALL: &'static [Role] = &[Role::Prefill, Role::RelayDecode, Role::MainDecode];

    /// Parse a role byte.
    pub fn from_code(code: u8) -> Option<Role> {
        match code {
            1 => Some(Role::Prefill),
            2 => Some(Role::RelayDecode),
            3 => Some(Role::MainDecode),
            _ => None,
        }
    }

    /// snake_case name.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::RelayDecode => "relay_decode",
            Role::MainDecode => "main_decode",
        }
    }

    /// Parse a snake_case name.
    pub fn from_name(name: &str) -> Option<Role> {
        Role::ALL.iter().copied().find(|r| r.name() == name)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Capability bits advertised in HELLO; the session uses their intersection.
pub mod capability {
    /// Peer accepts KV_PAGES (a KV receiver or sender).
    pub const KV_STREAM: u64 = 1 << 0;
    /// Peer speaks the token-ID handoff (HANDOFF / HANDOFF_ACK / PROGRESS).
    pub const HANDOFF: u64 = 1 << 1;
    /// Peer answers PREFIX_QUERY.
    pub const PREFIX_CACHE: u64 = 1 << 2;
    /// Peer publishes CACHE_EVENTS.
    pub const CACHE_EVENTS: u64 = 1 << 3;
    /// The lane runs inside TLS, whose AEAD authenticates every byte: when both
    /// sides offer it, KV_PAGES carry no CRC32C (the header's `crc32c` is 0 and is
    /// not checked). Offered only on TLS lanes.
    pub const AEAD: u64 = 1 << 4;
    /// The local (UCX) path: LOCAL_ADDR, LOCAL_GRANT and LOCAL_DONE on the control
    /// lane, KV written by one-sided puts. Offered only by the local path's
    /// endpoints (`pdd_io::local`).
    pub const LOCAL_UCX: u64 = 1 << 5;
    /// A stalled data lane is revoked (LANE_REVOKE / LANE_REVOKED on the control
    /// lane) and its blocks are sent again, flagged RESENT, on the other lanes.
    /// Offered by KV senders and receivers of this build.
    pub const LANE_FAILOVER: u64 = 1 << 6;
    /// A KV_GRANT may name zero pages: the receiver has every page already (its own
    /// prefix cache holds them) and tells the sender there is nothing to send; the
    /// sender answers with KV_DONE at once and the transfer completes with no data.
    /// Without it a sender that waits for a grant can only time out. Offered by KV
    /// senders and receivers of this build (not by the local path).
    pub const EMPTY_GRANT: u64 = 1 << 7;
    /// Data lanes of a TLS session leave TLS's record layer after their HELLO and
    /// carry KV_PAGES sealed in page-aligned AEAD records, under keys both sides
    /// export from the lane's TLS session, so the receiver decrypts inside the pages
    /// (docs/protocol.md, "Sealed data lanes"). Meaningful only with [`AEAD`]: offered
    /// on TLS lanes by KV senders and receivers of this build.
    pub const SEALED_LANES: u64 = 1 << 8;
    /// The KV receiver answers every PING with LANE_DELIVERED too (KV_PAGES bytes it
    /// read per data lane), and the sender measures a lane's progress by what the
    /// receiver read rather than by what TCP acknowledged: lane failover then covers
    /// a lane whose bytes a middlebox acknowledges and drops. Meaningful only with
    /// [`LANE_FAILOVER`]; offered by KV senders and receivers of this build.
    pub const LANE_DELIVERY: u64 = 1 << 9;
    /// An ABORT `refused` for a request is a notice both ways, before or after any
    /// grant: a KV sender remembers the receiver's refusal (its wait for that grant
    /// fails at once with the reason) and a KV receiver remembers the sender's
    /// (a grant of that request fails at once). Without it a receiver tells an
    /// older sender it wants nothing with an empty grant. Offered by KV senders and
    /// receivers of this build, on both paths.
    pub const REFUSAL: u64 = 1 << 10;
    /// KV compression: a KV sender may send a block as KV_PAGES_Z (pages compressed
    /// one by one) on a data lane; the receiver decodes each page into its granted
    /// page and checks the decoded bytes.
    pub const KV_COMPRESS: u64 = 1 << 11;
    /// KV layout: the side offers it exactly when it was given a pool layout, and
    /// then sends one KV_LAYOUT on the control lane right after the session opens,
    /// before any grant or KV data; where both offered it, each side counts the
    /// session as up only once the peer's KV_LAYOUT arrived. A side without a layout
    /// (or an older build) does not offer it: nothing is sent either way.
    pub const KV_LAYOUT: u64 = 1 << 12;
    /// Transfer resume: a KV session whose connections drop keeps its transfers on
    /// both ends for the resume window; a sender that resumes the session (HELLO
    /// RESUME) is told by KV_HELD what landed of each, and sends only the rest.
    /// Where either side did not offer it, a lost session fails its transfers.
    pub const KV_RESUME: u64 = 1 << 13;
    /// Every bit defined by this build.
    pub const ALL_KNOWN: u64 = KV_STREAM
        | HANDOFF
        | PREFIX_CACHE
        | CACHE_EVENTS
        | AEAD
        | LOCAL_UCX
        | LANE_FAILOVER
        | EMPTY_GRANT
        | SEALED_LANES
        | LANE_DELIVERY
        | REFUSAL
        | KV_COMPRESS
        | KV_LAYOUT
        | KV_RESUME;
}

/// The fixed header in front of every payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Frame kind.
    pub kind: FrameKind,
    /// Kind-specific flag bits.
    pub flags: u16,
    /// Payload length in bytes (header excluded).
    pub payload_len: u32,
    /// CRC32C (Castagnoli) over header bytes 0..12, then the payload.
    pub crc: u32,
}

impl FrameHeader {
    /// Parse and validate a header. `max_payload` is checked before the caller
    /// buffers a single payload byte.
    pub fn parse(bytes: &[u8; HEADER_LEN], max_payload: u32) -> Result<FrameHeader> {
        if bytes[0..2] != MAGIC {
            return Err(Error::BadMagic {
                found: [bytes[0], bytes[1]],
            });
        }
        if bytes[2] != WIRE_VERSION {
            return Err(Error::UnsupportedWireVersion {
                found: bytes[2],
                supported: WIRE_VERSION,
            });
        }
        let kind = FrameKind::from_code(bytes[3]).ok_or(Error::UnknownKind { kind: bytes[3] })?;
        let flags = u16::from_le_bytes([bytes[4], bytes[5]]);
        let reserved = u16::from_le_bytes([bytes[6], bytes[7]]);
        let payload_len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        let crc = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
        if payload_len > max_payload {
            return Err(Error::FrameTooLarge {
                len: payload_len.into(),
                max: max_payload,
            });
        }
        if flags & !kind.allowed_flags() != 0 {
            return Err(Error::InvalidFlags { kind, flags });
        }
        if reserved != 0 {
            return Err(Error::ReservedNonZero);
        }
        Ok(FrameHeader {
            kind,
            flags,
            payload_len,
            crc,
        })
    }

    /// The 16 header bytes, with `crc` as given.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..2].copy_from_slice(&MAGIC);
        out[2] = WIRE_VERSION;
        out[3] = self.kind as u8;
        out[4..6].copy_from_slice(&self.flags.to_le_bytes());
        // bytes 6..8 reserved, zero
        out[8..12].copy_from_slice(&self.payload_len.to_le_bytes());
        out[12..16].copy_from_slice(&self.crc.to_le_bytes());
        out
    }

    /// CRC32C of a frame whose header (CRC field excluded) and payload are given.
    /// The payload may come in pieces (a vectored write of KV pages).
    pub fn compute_crc<'a>(&self, payload: impl IntoIterator<Item = &'a [u8]>) -> u32 {
        let head = self.to_bytes();
        let mut crc = crc32c::crc32c(&head[..12]);
        for piece in payload {
            crc = crc32c::crc32c_append(crc, piece);
        }
        crc
    }
}
