//! The one error enum of `pdd-core`.
//!
//! Each variant has a stable snake_case [`Error::reason`] (what Python sees as
//! `exc.reason`), an [`ErrorClass`] that picks the Python exception type, and the
//! [`AbortReason`] a peer is told when the error ends a connection.

use crate::wire::{AbortReason, FrameKind};

/// How an [`Error`] should surface to a caller. The binding crate maps each class to
/// one Python exception type (`ProtocolError`, `InvalidArgument`, `TransportError`,
/// `DeadlineExceeded`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Bytes from a peer broke the protocol (malformed, corrupted, unknown).
    Protocol,
    /// The local caller asked for something impossible (bad argument, out of range).
    InvalidArgument,
    /// The peer or the connection failed (aborted, refused, authentication).
    Connection,
    /// A bounded wait ran out.
    Timeout,
}

/// Everything that can go wrong in `pdd-core`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The first two bytes of a frame are not `PD`.
    #[error("bad magic {found:02x?}: not a pdd_transport frame")]
    BadMagic {
        /// The two bytes found.
        found: [u8; 2],
    },
    /// The header's wire version is not one this build can parse.
    #[error("unsupported wire version {found} (this build speaks {supported})")]
    UnsupportedWireVersion {
        /// Version byte found.
        found: u8,
        /// Version this build speaks.
        supported: u8,
    },
    /// The header's kind byte names no frame kind of this version.
    #[error("unknown frame kind 0x{kind:02x}")]
    UnknownKind {
        /// Kind byte found.
        kind: u8,
    },
    /// The payload length exceeds the configured maximum; nothing was allocated.
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge {
        /// Length found (or requested when encoding).
        len: u64,
        /// The limit in force.
        max: u32,
    },
    /// Flag bits set that the frame kind does not define.
    #[error("flags 0x{flags:04x} are not valid for {kind}")]
    InvalidFlags {
        /// Frame kind.
        kind: FrameKind,
        /// Flags found.
        flags: u16,
    },
    /// Reserved header bytes are not zero.
    #[error("reserved header bytes are not zero")]
    ReservedNonZero,
    /// CRC32C over header and payload does not match.
    #[error("checksum mismatch: header says {expected:08x}, computed {computed:08x}")]
    ChecksumMismatch {
        /// CRC in the header.
        expected: u32,
        /// CRC computed over the bytes received.
        computed: u32,
    },
    /// The payload ended inside a field.
    #[error("{kind} payload truncated in field {field}")]
    Truncated {
        /// Frame kind.
        kind: FrameKind,
        /// Field being read.
        field: &'static str,
    },
    /// The payload has bytes after its last field.
    #[error("{kind} payload has {extra} trailing bytes")]
    TrailingBytes {
        /// Frame kind.
        kind: FrameKind,
        /// How many bytes were left over.
        extra: u64,
    },
    /// A field holds a value the protocol forbids.
    #[error("{kind}.{field}: {detail}")]
    InvalidField {
        /// Frame kind.
        kind: FrameKind,
        /// Field name as in docs/protocol.md.
        field: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// A stream decoder is used again after it returned an error; framing is lost and
    /// the connection must be closed.
    #[error("the decoder failed earlier; this stream must be closed")]
    DecoderPoisoned,
    /// HELLO: the peers' version ranges do not overlap.
    #[error(
        "no common protocol version: ours {ours_min}..={ours_max}, peer's {peer_min}..={peer_max}"
    )]
    VersionMismatch {
        /// Our lowest version.
        ours_min: u16,
        /// Our highest version.
        ours_max: u16,
        /// Peer's lowest version.
        peer_min: u16,
        /// Peer's highest version.
        peer_max: u16,
    },
    /// HELLO/AUTH: a proof of the lane's key failed, or the lane may not open or
    /// join the session it names.
    #[error("authentication failed: {detail}")]
    AuthFailed {
        /// Which check failed (never the secret itself).
        detail: &'static str,
    },
    /// HELLO: the peer's role may not connect to ours.
    #[error("role {peer} may not connect to role {ours}")]
    RoleRefused {
        /// Our role.
        ours: crate::wire::Role,
        /// The peer's role.
        peer: crate::wire::Role,
    },
    /// The peer sent ABORT.
    #[error("peer aborted ({reason}): {message}")]
    PeerAborted {
        /// The peer's reason code.
        reason: AbortReason,
        /// The peer's message.
        message: String,
    },
    /// The peer will not take part in this request (its ABORT `refused`, remembered),
    /// or this side refused it: the message names the request and the reason.
    #[error("{message}")]
    Refused {
        /// Who refused which request, and why.
        message: String,
    },
    /// A local caller passed an argument the protocol cannot carry.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// KV pages named outside the transfer's grant, or written twice.
    #[error("transfer {transfer_id}: {detail}")]
    GrantViolation {
        /// The transfer.
        transfer_id: u64,
        /// What was out of bounds.
        detail: String,
    },
    /// A frame names a transfer this side does not know (never granted, or finished).
    #[error("unknown transfer {transfer_id}")]
    UnknownTransfer {
        /// The transfer id found.
        transfer_id: u64,
    },
    /// A grant asks for pool pages another live grant holds.
    #[error("pages busy: {detail}")]
    PagesBusy {
        /// Which pages.
        detail: String,
    },
    /// The sender's KV_DONE disagrees with what arrived.
    #[error("transfer {transfer_id} incomplete: {detail}")]
    TransferIncomplete {
        /// The transfer.
        transfer_id: u64,
        /// What is missing.
        detail: String,
    },
    /// A bound on what a peer may make us hold was exceeded: replies it does not
    /// read, leases, tokens in a handoff, sessions. The peer is told
    /// `resource_exhausted`; nothing past the bound was taken in.
    #[error("limit exceeded: {what} (limit {limit})")]
    LimitExceeded {
        /// Which bound.
        what: String,
        /// Its value.
        limit: u64,
    },
    /// A bounded wait ran out.
    #[error("deadline exceeded: {what}")]
    DeadlineExceeded {
        /// What was being waited for.
        what: String,
    },
    /// The connection to the peer failed or the peer stopped answering.
    #[error("connection lost: {detail}")]
    ConnectionLost {
        /// How it was lost.
        detail: String,
    },
    /// The operation was cancelled locally.
    #[error("cancelled: {detail}")]
    Cancelled {
        /// By whom or why.
        detail: String,
    },
    /// A handoff machine got a frame addressed to another request; the router that
    /// passed it on is wrong, or the peer is.
    #[error("frame for request {found} given to the handoff of request {expected}")]
    WrongRequest {
        /// The request this machine serves.
        expected: u64,
        /// The request id in the frame.
        found: u64,
    },
    /// A frame kind that this side of the handoff never receives (HANDOFF at
    /// RelayDecode, PROGRESS at MainDecode, a KV frame, ...), or one out of sequence.
    #[error("unexpected {kind} in the handoff of request {request_id}: {detail}")]
    UnexpectedFrame {
        /// The request.
        request_id: u64,
        /// The frame's kind.
        kind: FrameKind,
        /// Why it is unexpected.
        detail: &'static str,
    },
    /// A HANDOFF or HANDOFF_ACK contradicts what this side already sent or delivered
    /// (positions not contiguous, different tokens under a seen sequence number, an
    /// ack for a handoff never sent).
    #[error("handoff of request {request_id} contradicts earlier frames: {detail}")]
    HandoffConflict {
        /// The request.
        request_id: u64,
        /// What contradicts what.
        detail: String,
    },
    /// MainDecode's progress went backwards (position lower than reported before, or
    /// KV complete withdrawn).
    #[error("progress of request {request_id} went backwards: {previous} then {found}")]
    ProgressRegressed {
        /// The request.
        request_id: u64,
        /// The position reported before.
        previous: u32,
        /// The position now reported.
        found: u32,
    },
    /// The handoff peer stayed silent, or never acknowledged, beyond the configured
    /// bound; the handoff is abandoned.
    #[error(
        "handoff of request {request_id} timed out waiting for {waiting_for} \
         after {waited_ms} ms and {attempts} transmissions"
    )]
    HandoffTimedOut {
        /// The request.
        request_id: u64,
        /// What was awaited (`"handoff_ack"`, `"progress"`, `"kv_complete"`, `"handoff"`).
        waiting_for: &'static str,
        /// How long it waited, in milliseconds.
        waited_ms: u64,
        /// How many times the unanswered frame was sent (0 if nothing was sent).
        attempts: u32,
    },
    /// A local call on a handoff that has already ended (finished, aborted, failed).
    #[error("handoff of request {request_id} is {state}; {operation} is not possible")]
    HandoffClosed {
        /// The request.
        request_id: u64,
        /// The state it is in.
        state: &'static str,
        /// What the caller tried.
        operation: &'static str,
    },
    /// A handoff frame for a request whose handoff belongs to another session of
    /// the peer (MainDecode's side: the session that request is bound to is away, or
    /// never was this one). The frame changed nothing; the sender is told with an
    /// ABORT `grant_violation`, as for KV pages of a transfer granted to another
    /// session.
    #[error("request {request_id}: its handoff belongs to another session")]
    HandoffNotOwned {
        /// The request.
        request_id: u64,
    },
    /// Radix insert: the tokens are not a whole number of pages.
    #[error("{tokens} tokens are not a whole number of {page_size}-token pages")]
    RadixMisaligned {
        /// Tokens passed.
        tokens: usize,
        /// The cache's page size.
        page_size: usize,
    },
    /// Radix insert: the number of page handles is not the number of pages.
    #[error("expected {expected} page handles (one per page), got {found}")]
    RadixHandleCount {
        /// Pages in the tokens passed.
        expected: usize,
        /// Handles passed.
        found: usize,
    },
    /// Radix: the node reference names a node that was evicted (or whose last pages
    /// were) since the reference was issued; match from the root again.
    #[error("stale radix node reference: the node was evicted")]
    RadixStaleNode,
    /// Radix unlock: the node holds no lock of its own.
    #[error("radix node is not locked")]
    RadixNotLocked,
    /// Radix clear: refused while pages are locked by requests in flight.
    #[error("radix cache has {locked_pages} locked pages")]
    RadixLocked {
        /// Pages locked.
        locked_pages: usize,
    },
    /// Radix insert: two different pages under one parent have the same 64-bit chain
    /// hash, so the tree cannot key both; nothing was inserted.
    #[error("radix page hash collision")]
    RadixHashCollision,
    /// Mirror: an instance's event ids skipped some; resync it from a snapshot.
    #[error("cache events of source {source_id}: expected event {expected}, got {found}; resync from a snapshot")]
    CacheEventGap {
        /// The instance.
        source_id: u64,
        /// Next id the mirror can apply.
        expected: u64,
        /// Id received.
        found: u64,
    },
    /// The local (UCX) path cannot run here: the library is missing or unusable, or
    /// the peer did not negotiate it.
    #[error("local path unavailable: {detail}")]
    LocalPathUnavailable {
        /// What is missing, naming the library or the peer.
        detail: String,
    },
    /// A UCX operation of the local path failed.
    #[error("local transport: {op} failed: {detail}")]
    LocalTransport {
        /// The UCX call.
        op: &'static str,
        /// UCX's status string.
        detail: String,
    },
    /// Memory of a kind this build does not register (CUDA memory until a GPU
    /// machine tests it).
    #[error("unsupported memory kind '{kind}': {detail}")]
    UnsupportedMemoryKind {
        /// The kind (`cuda`, ...).
        kind: String,
        /// Why, and what to use instead.
        detail: String,
    },
    /// Mirror: an event (or snapshot) contradicts the mirrored state; resync from a
    /// snapshot.
    #[error("cache event {event_id} of source {source_id} does not fit the mirror: {detail}; resync from a snapshot")]
    CacheEventMismatch {
        /// The instance.
        source_id: u64,
        /// The event (for a snapshot: its last event id).
        event_id: u64,
        /// What does not fit.
        detail: &'static str,
    },
}

impl Error {
    /// Stable snake_case code for this error, exposed to Python as `exc.reason`.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::BadMagic { .. } => "bad_magic",
            Error::UnsupportedWireVersion { .. } => "unsupported_version",
            Error::UnknownKind { .. } => "unknown_kind",
            Error::FrameTooLarge { .. } => "frame_too_large",
            Error::InvalidFlags { .. } => "invalid_flags",
            Error::ReservedNonZero => "reserved_nonzero",
            Error::ChecksumMismatch { .. } => "checksum_mismatch",
            Error::Truncated { .. } => "truncated",
            Error::TrailingBytes { .. } => "trailing_bytes",
            Error::InvalidField { .. } => "invalid_field",
            Error::DecoderPoisoned => "decoder_poisoned",
            Error::VersionMismatch { .. } => "version_mismatch",
            Error::AuthFailed { .. } => "auth_failed",
            Error::RoleRefused { .. } => "role_refused",
            Error::PeerAborted { .. } => "peer_aborted",
            Error::Refused { .. } => "refused",
            Error::InvalidArgument(_) => "invalid_argument",
            Error::GrantViolation { .. } | Error::HandoffNotOwned { .. } => "grant_violation",
            Error::UnknownTransfer { .. } => "unknown_transfer",
            Error::PagesBusy { .. } => "pages_busy",
            Error::TransferIncomplete { .. } => "transfer_incomplete",
            Error::LimitExceeded { .. } => "limit_exceeded",
            Error::DeadlineExceeded { .. } => "deadline_exceeded",
            Error::ConnectionLost { .. } => "connection_lost",
            Error::Cancelled { .. } => "cancelled",
            Error::WrongRequest { .. } => "wrong_request",
            Error::UnexpectedFrame { .. } => "unexpected_frame",
            Error::HandoffConflict { .. } => "handoff_conflict",
            Error::ProgressRegressed { .. } => "progress_regressed",
            Error::HandoffTimedOut { .. } => "handoff_timed_out",
            Error::HandoffClosed { .. } => "handoff_closed",
            Error::RadixMisaligned { .. } => "radix_misaligned",
            Error::RadixHandleCount { .. } => "radix_handle_count",
            Error::RadixStaleNode => "radix_stale_node",
            Error::RadixNotLocked => "radix_not_locked",
            Error::RadixLocked { .. } => "radix_locked",
            Error::RadixHashCollision => "radix_hash_collision",
            Error::CacheEventGap { .. } => "cache_event_gap",
            Error::CacheEventMismatch { .. } => "cache_event_mismatch",
            Error::LocalPathUnavailable { .. } => "local_path_unavailable",
            Error::LocalTransport { .. } => "local_transport_error",
            Error::UnsupportedMemoryKind { .. } => "unsupported_memory_kind",
        }
    }

    /// Which kind of Python exception this becomes.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::VersionMismatch { .. }
            | Error::AuthFailed { .. }
            | Error::RoleRefused { .. }
            | Error::PeerAborted { .. }
            | Error::Refused { .. }
            | Error::ConnectionLost { .. }
            | Error::Cancelled { .. }
            | Error::LocalPathUnavailable { .. }
            | Error::LocalTransport { .. } => ErrorClass::Connection,
            Error::UnsupportedMemoryKind { .. } => ErrorClass::InvalidArgument,
            Error::InvalidArgument(_) | Error::PagesBusy { .. } | Error::HandoffClosed { .. } => {
                ErrorClass::InvalidArgument
            }
            Error::DeadlineExceeded { .. } | Error::HandoffTimedOut { .. } => ErrorClass::Timeout,
            Error::RadixMisaligned { .. }
            | Error::RadixHandleCount { .. }
            | Error::RadixStaleNode
            | Error::RadixNotLocked
            | Error::RadixLocked { .. }
            | Error::RadixHashCollision => ErrorClass::InvalidArgument,
            // Events that do not follow from what a peer sent before.
            Error::CacheEventGap { .. } | Error::CacheEventMismatch { .. } => ErrorClass::Protocol,
            // Every variant is named: a new one must choose its class here.
            Error::BadMagic { .. }
            | Error::UnsupportedWireVersion { .. }
            | Error::UnknownKind { .. }
            | Error::FrameTooLarge { .. }
            | Error::InvalidFlags { .. }
            | Error::ReservedNonZero
            | Error::ChecksumMismatch { .. }
            | Error::Truncated { .. }
            | Error::TrailingBytes { .. }
            | Error::InvalidField { .. }
            | Error::DecoderPoisoned
            | Error::GrantViolation { .. }
            | Error::HandoffNotOwned { .. }
            | Error::UnknownTransfer { .. }
            | Error::TransferIncomplete { .. }
            | Error::LimitExceeded { .. }
            | Error::WrongRequest { .. }
            | Error::UnexpectedFrame { .. }
            | Error::HandoffConflict { .. }
            | Error::ProgressRegressed { .. } => ErrorClass::Protocol,
        }
    }

    /// The reason code to put in the ABORT frame that this error ends a connection with.
    pub fn abort_reason(&self) -> AbortReason {
        match self {
            Error::UnsupportedWireVersion { .. } | Error::VersionMismatch { .. } => {
                AbortReason::UnsupportedVersion
            }
            Error::UnknownKind { .. } => AbortReason::UnknownKind,
            Error::FrameTooLarge { .. } => AbortReason::FrameTooLarge,
            Error::ChecksumMismatch { .. } => AbortReason::ChecksumMismatch,
            Error::AuthFailed { .. } | Error::RoleRefused { .. } => AbortReason::AuthFailed,
            Error::PeerAborted { reason, .. } => *reason,
            Error::Refused { .. } => AbortReason::Refused,
            Error::InvalidArgument(_) | Error::PagesBusy { .. } | Error::HandoffClosed { .. } => {
                AbortReason::Internal
            }
            Error::GrantViolation { .. }
            | Error::UnknownTransfer { .. }
            | Error::HandoffNotOwned { .. } => AbortReason::GrantViolation,
            Error::DeadlineExceeded { .. } | Error::HandoffTimedOut { .. } => {
                AbortReason::DeadlineExceeded
            }
            Error::Cancelled { .. } => AbortReason::Cancelled,
            Error::ConnectionLost { .. } => AbortReason::Shutdown,
            Error::LocalPathUnavailable { .. }
            | Error::LocalTransport { .. }
            | Error::UnsupportedMemoryKind { .. } => AbortReason::Internal,
            Error::RadixMisaligned { .. }
            | Error::RadixHandleCount { .. }
            | Error::RadixStaleNode
            | Error::RadixNotLocked
            | Error::RadixLocked { .. }
            | Error::RadixHashCollision => AbortReason::Internal,
            Error::LimitExceeded { .. } => AbortReason::ResourceExhausted,
            // Every variant is named: a new one must choose its reason here.
            Error::BadMagic { .. }
            | Error::InvalidFlags { .. }
            | Error::ReservedNonZero
            | Error::Truncated { .. }
            | Error::TrailingBytes { .. }
            | Error::InvalidField { .. }
            | Error::DecoderPoisoned
            | Error::TransferIncomplete { .. }
            | Error::WrongRequest { .. }
            | Error::UnexpectedFrame { .. }
            | Error::HandoffConflict { .. }
            | Error::ProgressRegressed { .. }
            | Error::CacheEventGap { .. }
            | Error::CacheEventMismatch { .. } => AbortReason::ProtocolError,
        }
    }
}

/// Shorthand for `Result<T, pdd_core::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;
