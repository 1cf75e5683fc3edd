//! Typed frames and their payload layouts. Field order here is the byte order on the
//! wire; docs/protocol.md lists the same fields with their offsets. Here: the frame
//! types, their checks (`validate`) and sizes; `payload.rs`: their bytes.

use bytes::Bytes;

use super::tokens::encoded_len;
use super::{
    AbortReason, FrameKind, Role, AUTH_LEN, FLAG_FINAL, FLAG_KV_COMPLETE, FLAG_RESENT, FLAG_RESUME,
    HARD_MAX_PAYLOAD, MAX_ABORT_MESSAGE_LEN, MAX_HELLO_AUTH_LEN, MAX_KV_LAYOUT_LEN,
    MAX_LOCAL_ADDRESS_LEN, MAX_LOCAL_RKEY_LEN, MAX_PAGE_SIZE, MEMORY_KIND_CUDA, MEMORY_KIND_HOST,
    MIN_MAX_PAYLOAD,
};
use crate::error::{Error, Result};

mod payload;
mod z;

pub use z::{put_z_head, z_payload_bounds, KvPagesZ, ZRest, KV_PAGES_Z_FIXED_LEN};

/// HELLO: the first frame on every connection, in both directions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// Lowest protocol version the sender speaks (>= 1).
    pub min_version: u16,
    /// Highest protocol version the sender speaks (>= `min_version`).
    pub max_version: u16,
    /// The sender's role.
    pub role: Role,
    /// Lane index inside the session: 0 is the control lane, 1.. are bulk lanes.
    pub lane: u16,
    /// Session the lane belongs to (chosen by the connecting side; lanes of one
    /// session share it).
    pub session_id: u64,
    /// Capability bits (see [`super::capability`]); unknown bits are allowed.
    pub capabilities: u64,
    /// Largest payload the sender is willing to receive.
    pub max_payload: u32,
    /// Authentication data, at most 512 bytes. Protocol v2: the connecting side's
    /// 32-byte random nonce; empty in the accepting side's reply. (v1 carried a
    /// plain credential here; the field keeps its place so that a v1 HELLO still
    /// decodes and can be refused by version.)
    pub auth: Bytes,
    /// Header flag RESUME: this lane joins the live session `session_id` and proves
    /// that session's secret, not the root secret (every data lane; a control lane
    /// that reconnects).
    pub resume: bool,
}

/// AUTH: the challenge-response that follows HELLO (protocol v2). The accepting
/// side sends its nonce and its proof; the connecting side answers with its own
/// proof (and its nonce from HELLO again). Proofs are HMAC-SHA256 over the
/// exchange (`handshake::proof`); no secret ever travels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    /// The sender's nonce.
    pub nonce: [u8; AUTH_LEN],
    /// HMAC-SHA256 proof of the key this lane is keyed with.
    pub proof: [u8; AUTH_LEN],
}

/// KV_GRANT: a receiver grants a sender `layer_count x page_count` pages of
/// `page_bytes` each for one transfer. Pages are then addressed relative to the
/// grant; the receiver alone knows where they live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGrant {
    /// Transfer this grant is for (chosen by the sender, unique per session).
    pub transfer_id: u64,
    /// The request the KV belongs to.
    pub request_id: u64,
    /// Layers in the grant (>= 1).
    pub layer_count: u16,
    /// Pages per layer in the grant: >= 1, or 0 for an empty grant (nothing to send;
    /// only on a session that agreed [`capability::EMPTY_GRANT`]).
    ///
    /// [`capability::EMPTY_GRANT`]: crate::wire::capability::EMPTY_GRANT
    pub page_count: u32,
    /// Bytes of one page of one layer (>= 1).
    pub page_bytes: u32,
    /// Milliseconds the receiver will wait for the transfer; 0 = no deadline.
    pub deadline_ms: u32,
}

/// Fixed part of a KV_PAGES payload, before the page data.
pub const KV_PAGES_FIXED_LEN: usize = 24;

/// KV_PAGES: a block of pages inside a grant, layer-major (all pages of
/// `layer_start`, then of the next layer...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPages {
    /// Transfer (and so grant) the pages belong to.
    pub transfer_id: u64,
    /// First layer, relative to the grant.
    pub layer_start: u16,
    /// Number of layers (>= 1).
    pub layer_count: u16,
    /// First page, relative to the grant.
    pub page_start: u32,
    /// Number of pages per layer (>= 1).
    pub page_count: u32,
    /// Bytes per page (>= 1); must equal the grant's.
    pub page_bytes: u32,
    /// `layer_count * page_count * page_bytes` bytes of KV.
    pub data: Bytes,
    /// Header flag RESENT (capability `lane_failover`): sent again after the lane
    /// that first carried it was revoked.
    pub resent: bool,
}

/// KV_DONE: the sender has sent every KV_PAGES of a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvDone {
    /// Transfer that is complete.
    pub transfer_id: u64,
    /// KV_PAGES frames sent for it, over all lanes.
    pub chunk_count: u32,
    /// Page bytes sent for it, over all lanes.
    pub byte_count: u64,
}

/// PREFIX_QUERY: match a prompt against the decoder's radix cache, and pin the match
/// for `lease_ms` if non-zero.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixQuery {
    /// Correlates the reply.
    pub query_id: u64,
    /// The request being planned.
    pub request_id: u64,
    /// Cache namespace (LoRA adapter, salt); 0 = none.
    pub namespace: u64,
    /// Radix page size in tokens (1..=256).
    pub page_size: u16,
    /// Lease to pin the match for, in ms; 0 = match only, pin nothing.
    pub lease_ms: u32,
    /// The prompt's token IDs.
    pub tokens: Vec<u32>,
}

/// PREFIX_REPLY: the decoder's answer to a PREFIX_QUERY.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixReply {
    /// The query answered.
    pub query_id: u64,
    /// Tokens of the prompt the decoder holds KV for (a multiple of the page size).
    pub matched_tokens: u32,
    /// Hash of the matched prefix, so the sender can check both sides mean the same.
    pub prefix_hash: u64,
    /// Lease pinning the match; 0 = nothing pinned.
    pub lease_id: u64,
    /// Lease duration granted, in ms (0 when `lease_id` is 0).
    pub lease_ms: u32,
}

/// One radix cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Pages stored under `parent` (None: at the root).
    Stored {
        /// Hash of the page the new pages hang from.
        parent: Option<u64>,
        /// Hashes of the stored pages, in order (>= 1).
        page_hashes: Vec<u64>,
    },
    /// Pages evicted (>= 1).
    Removed {
        /// Hashes of the removed pages.
        page_hashes: Vec<u64>,
    },
    /// The whole cache was cleared.
    Cleared,
}

/// CACHE_EVENTS: consecutive events of one cache, ids `first_event_id..`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEvents {
    /// The cache (decoder instance) the events come from.
    pub source_id: u64,
    /// Id of the first event; the rest follow consecutively.
    pub first_event_id: u64,
    /// The events.
    pub events: Vec<CacheEvent>,
}

/// HANDOFF: token IDs RelayDecode generated, for MainDecode to extend-decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handoff {
    /// The request.
    pub request_id: u64,
    /// Handoff sequence number within the request, from 0.
    pub seq: u32,
    /// Sequence position of `token_ids[0]`.
    pub first_position: u32,
    /// The token IDs (non-empty unless `final_`).
    pub token_ids: Vec<u32>,
    /// Last handoff: MainDecode owns the request afterwards.
    pub final_: bool,
}

/// HANDOFF_ACK: cumulative acknowledgement of handoffs `0..=acked_seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandoffAck {
    /// The request.
    pub request_id: u64,
    /// Highest handoff sequence number received in order.
    pub acked_seq: u32,
    /// Position after the last token received.
    pub next_position: u32,
    /// The final handoff is received; RelayDecode may free the request.
    pub final_: bool,
}

/// PROGRESS: MainDecode reached `position` (its KV covers positions `< position`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// The request.
    pub request_id: u64,
    /// First position MainDecode has no KV for yet.
    pub position: u32,
    /// MainDecode holds the complete prompt KV (handoffs may start).
    pub kv_complete: bool,
}

/// ABORT: ends one request (`request_id != 0`) or the whole connection (`0`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abort {
    /// Request aborted, or 0 for the connection.
    pub request_id: u64,
    /// Why.
    pub reason: AbortReason,
    /// Human-readable detail, UTF-8, at most 1024 bytes.
    pub message: String,
}

/// PING and PONG: a PONG echoes the PING's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ping {
    /// Matches a PONG to its PING.
    pub nonce: u64,
    /// The PING sender's clock, in ns (opaque to the peer).
    pub sent_at_ns: u64,
}

/// LOCAL_ADDR (local path): the KV receiver's UCX worker address, from which the
/// sender creates its endpoint, and the memory kind of the receiver's pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalAddr {
    /// [`MEMORY_KIND_HOST`] or [`MEMORY_KIND_CUDA`].
    pub memory_kind: u8,
    /// The worker address, 1..=[`MAX_LOCAL_ADDRESS_LEN`] bytes, opaque.
    pub address: Bytes,
}

/// One region of a LOCAL_GRANT: grant pages `page_start..page_start + page_count`
/// of grant layer `layer`, contiguous in the receiver's memory from `remote_addr`,
/// registered for remote access with the packed key `rkey`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRegion {
    /// Grant-relative layer.
    pub layer: u16,
    /// First grant page.
    pub page_start: u32,
    /// Pages (>= 1).
    pub page_count: u32,
    /// The receiver's address of the first page (receiver -> sender only; a
    /// receiver never acts on an address it is sent).
    pub remote_addr: u64,
    /// Packed remote key (ucp_rkey_pack), 1..=[`MAX_LOCAL_RKEY_LEN`] bytes.
    pub rkey: Bytes,
}

/// LANE_REVOKE (sender -> receiver) and LANE_REVOKED (receiver -> sender), on the
/// control lane, capability `lane_failover`: data lane `lane` is given up; the reply
/// says the receiver's reader of it has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneRevoke {
    /// The data lane's index (its HELLO's `lane`; >= 1).
    pub lane: u16,
}

/// The most data lanes one LANE_DELIVERED names.
pub const MAX_DELIVERED_LANES: usize = 256;

/// LANE_DELIVERED (receiver -> sender, on the control lane, capability
/// `lane_delivery`): per data lane, the KV_PAGES bytes (header and payload of every
/// frame whose header was read) the receiver has read on its current connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneDelivered {
    /// `(lane, bytes)`: each lane >= 1, at most once, at most
    /// [`MAX_DELIVERED_LANES`] of them.
    pub lanes: Vec<(u16, u64)>,
}

/// KV_LAYOUT (capability `kv_layout`, both ways, on the control lane, once, before
/// any grant or KV data): the sending side's pool layout. Opaque here: the session
/// carries it to the other side's engine, which maps or refuses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    /// The layout's bytes, 1 ..= [`MAX_KV_LAYOUT_LEN`].
    pub layout: Bytes,
}

/// KV_HELD (receiver -> sender, on the control lane, capability `kv_resume`): after
/// the sender resumed its session, one per transfer of the replaced instance that the
/// receiver still holds, then one with transfer id 0 (every other field zero, no
/// bitmap): the end of the list. The sender sends again only what `landed` lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvHeld {
    /// The transfer's grant, as first sent (so that a grant whose KV_GRANT was lost
    /// with the old control lane reaches the sender after all).
    pub grant: KvGrant,
    /// The sender's KV_DONE for it came.
    pub done_seen: bool,
    /// One bit per (grant layer, grant page), layer-major, least significant bit
    /// first: the page landed and was verified. Exactly
    /// [`held_bitmap_len`]`(layer_count, page_count)` bytes, unused bits zero.
    pub landed: Bytes,
}

impl KvHeld {
    /// The end of a KV_HELD list.
    pub fn end() -> KvHeld {
        KvHeld {
            grant: KvGrant {
                transfer_id: 0,
                request_id: 0,
                layer_count: 0,
                page_count: 0,
                page_bytes: 0,
                deadline_ms: 0,
            },
            done_seen: false,
            landed: Bytes::new(),
        }
    }

    /// Whether this is the end of the list.
    pub fn is_end(&self) -> bool {
        self.grant.transfer_id == 0
    }

    /// Whether grant page `page` of grant layer `layer` landed (false outside the
    /// grant).
    pub fn has(&self, layer: u16, page: u32) -> bool {
        if layer >= self.grant.layer_count || page >= self.grant.page_count {
            return false;
        }
        let bit = u64::from(layer) * u64::from(self.grant.page_count) + u64::from(page);
        let byte = usize::try_from(bit / 8).unwrap_or(usize::MAX);
        self.landed
            .get(byte)
            .is_some_and(|b| b & (1 << (bit % 8)) != 0)
    }
}

/// Bytes of a KV_HELD bitmap for a grant of `layers x pages` (None: more than a
/// frame can carry).
pub fn held_bitmap_len(layers: u16, pages: u32) -> Option<usize> {
    let bits = u64::from(layers) * u64::from(pages);
    let len = bits.div_ceil(8);
    (len <= u64::from(HARD_MAX_PAYLOAD)).then_some(len as usize)
}

/// A KV_HELD is the end marker (all zero) or a grant of >= 1 layer and page byte
/// whose bitmap has exactly its length and no bit past its pages.
pub(crate) fn check_held(h: &KvHeld) -> std::result::Result<(), String> {
    let g = &h.grant;
    if h.is_end() {
        if g.request_id != 0
            || g.layer_count != 0
            || g.page_count != 0
            || g.page_bytes != 0
            || g.deadline_ms != 0
            || h.done_seen
            || !h.landed.is_empty()
        {
            return Err("the end of the list (transfer 0) carries nothing else".into());
        }
        return Ok(());
    }
    if g.layer_count == 0 || g.page_bytes == 0 {
        return Err("a held grant needs >= 1 layer and page byte".into());
    }
    let want = held_bitmap_len(g.layer_count, g.page_count)
        .ok_or_else(|| "a bitmap larger than any frame".to_string())?;
    if h.landed.len() != want {
        return Err(format!(
            "a bitmap of {} bytes for {} layers x {} pages (want {want})",
            h.landed.len(),
            g.layer_count,
            g.page_count
        ));
    }
    let bits = u64::from(g.layer_count) * u64::from(g.page_count);
    if bits % 8 != 0 {
        let last = h.landed[want - 1];
        if last >> (bits % 8) != 0 {
            return Err("bits set past the grant's last page".into());
        }
    }
    Ok(())
}

/// A KV_LAYOUT blob's length is 1 ..= [`MAX_KV_LAYOUT_LEN`]: one rule for the
/// encoder, the decoder and the sessions that keep it.
pub fn check_kv_layout(layout: &[u8]) -> std::result::Result<(), String> {
    if layout.is_empty() || layout.len() > MAX_KV_LAYOUT_LEN {
        return Err(format!(
            "a layout of {} bytes, outside 1..={MAX_KV_LAYOUT_LEN}",
            layout.len()
        ));
    }
    Ok(())
}

/// Fixed bytes of one LOCAL_GRANT region before its key, plus at least one key byte.
pub const LOCAL_REGION_MIN_LEN: u64 = 2 + 4 + 4 + 8 + 2 + 1;

/// LOCAL_GRANT (local path): for the transfer a KV_GRANT just granted, the regions
/// the receiver registered: exactly the granted pages, nothing else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalGrant {
    /// The transfer (its KV_GRANT came first).
    pub transfer_id: u64,
    /// Regions (>= 1).
    pub regions: Vec<LocalRegion>,
}

/// LOCAL_DONE (local path): the sender put every page of grant layers
/// `layer_start..layer_start + layer_count` and its flush completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalDone {
    /// The transfer.
    pub transfer_id: u64,
    /// First grant layer.
    pub layer_start: u16,
    /// Layers (>= 1).
    pub layer_count: u16,
    /// Pages put, over all these layers.
    pub page_count: u64,
    /// Bytes put, over all these layers.
    pub byte_count: u64,
}

/// Any frame of wire protocol v1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// HELLO
    Hello(Hello),
    /// KV_GRANT
    KvGrant(KvGrant),
    /// KV_PAGES
    KvPages(KvPages),
    /// KV_DONE
    KvDone(KvDone),
    /// PREFIX_QUERY
    PrefixQuery(PrefixQuery),
    /// PREFIX_REPLY
    PrefixReply(PrefixReply),
    /// CACHE_EVENTS
    CacheEvents(CacheEvents),
    /// HANDOFF
    Handoff(Handoff),
    /// HANDOFF_ACK
    HandoffAck(HandoffAck),
    /// PROGRESS
    Progress(Progress),
    /// ABORT
    Abort(Abort),
    /// PING
    Ping(Ping),
    /// PONG
    Pong(Ping),
    /// AUTH
    Auth(Auth),
    /// LOCAL_ADDR
    LocalAddr(LocalAddr),
    /// LOCAL_GRANT
    LocalGrant(LocalGrant),
    /// LOCAL_DONE
    LocalDone(LocalDone),
    /// LANE_REVOKE
    LaneRevoke(LaneRevoke),
    /// LANE_REVOKED
    LaneRevoked(LaneRevoke),
    /// LANE_DELIVERED
    LaneDelivered(LaneDelivered),
    /// KV_PAGES_Z
    KvPagesZ(KvPagesZ),
    /// KV_LAYOUT
    KvLayout(KvLayout),
    /// KV_HELD
    KvHeld(KvHeld),
}

impl Frame {
    /// The frame's kind.
    pub fn kind(&self) -> FrameKind {
        match self {
            Frame::Hello(_) => FrameKind::Hello,
            Frame::KvGrant(_) => FrameKind::KvGrant,
            Frame::KvPages(_) => FrameKind::KvPages,
            Frame::KvDone(_) => FrameKind::KvDone,
            Frame::PrefixQuery(_) => FrameKind::PrefixQuery,
            Frame::PrefixReply(_) => FrameKind::PrefixReply,
            Frame::CacheEvents(_) => FrameKind::CacheEvents,
            Frame::Handoff(_) => FrameKind::Handoff,
            Frame::HandoffAck(_) => FrameKind::HandoffAck,
            Frame::Progress(_) => FrameKind::Progress,
            Frame::Abort(_) => FrameKind::Abort,
            Frame::Ping(_) => FrameKind::Ping,
            Frame::Pong(_) => FrameKind::Pong,
            Frame::Auth(_) => FrameKind::Auth,
            Frame::LocalAddr(_) => FrameKind::LocalAddr,
            Frame::LocalGrant(_) => FrameKind::LocalGrant,
            Frame::LocalDone(_) => FrameKind::LocalDone,
            Frame::LaneRevoke(_) => FrameKind::LaneRevoke,
            Frame::LaneRevoked(_) => FrameKind::LaneRevoked,
            Frame::LaneDelivered(_) => FrameKind::LaneDelivered,
            Frame::KvPagesZ(_) => FrameKind::KvPagesZ,
            Frame::KvLayout(_) => FrameKind::KvLayout,
            Frame::KvHeld(_) => FrameKind::KvHeld,
        }
    }

    /// Header flag bits this frame encodes with.
    pub fn flags(&self) -> u16 {
        match self {
            Frame::Handoff(h) if h.final_ => FLAG_FINAL,
            Frame::HandoffAck(a) if a.final_ => FLAG_FINAL,
            Frame::Progress(p) if p.kv_complete => FLAG_KV_COMPLETE,
            Frame::Hello(h) if h.resume => FLAG_RESUME,
            Frame::KvPages(p) if p.resent => FLAG_RESENT,
            Frame::KvPagesZ(p) if p.resent => FLAG_RESENT,
            _ => 0,
        }
    }

    /// Check the invariants the decoder enforces, so that nothing un-decodable is
    /// ever sent.
    pub fn validate(&self) -> Result<()> {
        let arg = |m: String| Err(Error::InvalidArgument(m));
        match self {
            Frame::Hello(h) => {
                if h.min_version == 0 || h.min_version > h.max_version {
                    return arg(format!(
                        "HELLO version range {}..={} is empty or starts at 0",
                        h.min_version, h.max_version
                    ));
                }
                if !(MIN_MAX_PAYLOAD..=HARD_MAX_PAYLOAD).contains(&h.max_payload) {
                    return arg(format!(
                        "HELLO max_payload {} outside {MIN_MAX_PAYLOAD}..={HARD_MAX_PAYLOAD}",
                        h.max_payload
                    ));
                }
                if h.auth.len() > MAX_HELLO_AUTH_LEN {
                    return arg(format!("HELLO auth longer than {MAX_HELLO_AUTH_LEN} bytes"));
                }
            }
            Frame::KvGrant(g) => {
                // page_count 0 is an empty grant: whether the session allows it is
                // the session's business (capability EMPTY_GRANT), not the codec's.
                if g.layer_count == 0 || g.page_bytes == 0 {
                    return arg("KV_GRANT layer_count and page_bytes must be >= 1".into());
                }
            }
            Frame::KvPages(p) => {
                check_page_block(p).or_else(arg)?;
            }
            Frame::KvPagesZ(p) => {
                // The block's own fields first: nothing below multiplies them unchecked.
                z_payload_bounds(&p.block)
                    .map_err(|(f, d)| Error::InvalidArgument(format!("KV_PAGES_Z {f}: {d}")))?;
                let mut rest = Vec::with_capacity(16 + 4 * p.lengths.len() + p.data.len());
                put_z_head(&mut rest, &p.block, p.codec, p.raw_crc32c, &p.lengths);
                rest.extend_from_slice(&p.data);
                ZRest::parse(&p.block, &rest)
                    .map_err(|(f, d)| Error::InvalidArgument(format!("KV_PAGES_Z {f}: {d}")))?;
            }
            Frame::PrefixQuery(q) => {
                if q.page_size == 0 || q.page_size > MAX_PAGE_SIZE {
                    return arg(format!(
                        "page_size {} outside 1..={MAX_PAGE_SIZE}",
                        q.page_size
                    ));
                }
            }
            Frame::PrefixReply(r) => {
                if (r.lease_id == 0) != (r.lease_ms == 0) {
                    return arg(
                        "PREFIX_REPLY lease_id and lease_ms must both be 0 or both non-zero".into(),
                    );
                }
            }
            Frame::CacheEvents(c) => {
                for e in &c.events {
                    match e {
                        CacheEvent::Stored { page_hashes, .. }
                        | CacheEvent::Removed { page_hashes }
                            if page_hashes.is_empty() =>
                        {
                            return arg("a cache event must name at least one page".into());
                        }
                        _ => {}
                    }
                }
                let last = (c.events.len() as u64).saturating_sub(1);
                if c.first_event_id.checked_add(last).is_none() {
                    return arg("event ids overflow u64".into());
                }
            }
            Frame::Handoff(h) => {
                if h.token_ids.is_empty() && !h.final_ {
                    return arg("a non-final HANDOFF must carry at least one token".into());
                }
                if u64::from(h.first_position) + h.token_ids.len() as u64 > u64::from(u32::MAX) {
                    return arg("HANDOFF positions overflow u32".into());
                }
            }
            Frame::Abort(a) => {
                if a.message.len() > MAX_ABORT_MESSAGE_LEN {
                    return arg(format!(
                        "ABORT message longer than {MAX_ABORT_MESSAGE_LEN} bytes"
                    ));
                }
            }
            Frame::LocalAddr(a) => {
                if a.memory_kind != MEMORY_KIND_HOST && a.memory_kind != MEMORY_KIND_CUDA {
                    return arg(format!("LOCAL_ADDR memory_kind {} unknown", a.memory_kind));
                }
                if a.address.is_empty() || a.address.len() > MAX_LOCAL_ADDRESS_LEN {
                    return arg(format!(
                        "LOCAL_ADDR address of {} bytes outside 1..={MAX_LOCAL_ADDRESS_LEN}",
                        a.address.len()
                    ));
                }
            }
            Frame::LocalGrant(g) => {
                if g.regions.is_empty() {
                    return arg("LOCAL_GRANT needs at least one region".into());
                }
                for reg in &g.regions {
                    check_region(reg).or_else(arg)?;
                }
            }
            Frame::LocalDone(d) => {
                check_local_done(d).or_else(arg)?;
            }
            Frame::LaneRevoke(r) | Frame::LaneRevoked(r) => {
                if r.lane == 0 {
                    return arg("lane 0 is the control lane and cannot be revoked".into());
                }
            }
            Frame::LaneDelivered(d) => {
                check_delivered(&d.lanes).or_else(arg)?;
            }
            Frame::KvLayout(l) => {
                check_kv_layout(&l.layout)
                    .map_err(|d| Error::InvalidArgument(format!("KV_LAYOUT: {d}")))?;
            }
            Frame::KvHeld(h) => {
                check_held(h).map_err(|d| Error::InvalidArgument(format!("KV_HELD: {d}")))?;
            }
            Frame::KvDone(_)
            | Frame::HandoffAck(_)
            | Frame::Progress(_)
            | Frame::Ping(_)
            | Frame::Pong(_)
            | Frame::Auth(_) => {}
        }
        Ok(())
    }

    /// Payload length in bytes (header excluded). Call after [`Frame::validate`].
    pub fn payload_len(&self) -> Result<usize> {
        Ok(match self {
            Frame::Hello(h) => 2 + 2 + 1 + 2 + 8 + 8 + 4 + 2 + h.auth.len(),
            Frame::KvGrant(_) => 8 + 8 + 2 + 4 + 4 + 4,
            Frame::KvPages(p) => KV_PAGES_FIXED_LEN + p.data.len(),
            Frame::KvDone(_) => 8 + 4 + 8,
            Frame::PrefixQuery(q) => 8 + 8 + 8 + 2 + 4 + encoded_len(&q.tokens)?,
            Frame::PrefixReply(_) => 8 + 4 + 8 + 8 + 4,
            Frame::CacheEvents(c) => {
                let mut n = 8 + 8 + 4;
                for e in &c.events {
                    n += match e {
                        CacheEvent::Stored {
                            parent,
                            page_hashes,
                        } => {
                            1 + 1 + if parent.is_some() { 8 } else { 0 } + 4 + 8 * page_hashes.len()
                        }
                        CacheEvent::Removed { page_hashes } => 1 + 4 + 8 * page_hashes.len(),
                        CacheEvent::Cleared => 1,
                    };
                }
                n
            }
            Frame::Handoff(h) => 8 + 4 + 4 + encoded_len(&h.token_ids)?,
            Frame::HandoffAck(_) => 8 + 4 + 4,
            Frame::Progress(_) => 8 + 4,
            Frame::Abort(a) => 8 + 2 + 2 + a.message.len(),
            Frame::Ping(_) | Frame::Pong(_) => 16,
            Frame::Auth(_) => 2 * AUTH_LEN,
            Frame::LocalAddr(a) => 1 + 2 + a.address.len(),
            Frame::LocalGrant(g) => {
                4 + 8
                    + g.regions
                        .iter()
                        .map(|r| LOCAL_REGION_MIN_LEN as usize - 1 + r.rkey.len())
                        .sum::<usize>()
            }
            Frame::LocalDone(_) => 8 + 2 + 2 + 8 + 8,
            Frame::LaneRevoke(_) | Frame::LaneRevoked(_) => 2,
            Frame::LaneDelivered(d) => 2 + 10 * d.lanes.len(),
            Frame::KvPagesZ(p) => KV_PAGES_Z_FIXED_LEN + 4 * p.lengths.len() + p.data.len(),
            Frame::KvLayout(l) => 2 + l.layout.len(),
            Frame::KvHeld(h) => 8 + 8 + 2 + 4 + 4 + 4 + 1 + 4 + h.landed.len(),
        })
    }
}

/// Counts >= 1, ranges inside u16/u32, and data length == product, all checked.
fn check_page_block(p: &KvPages) -> std::result::Result<(), String> {
    // One rule for the whole-frame decoder and the receiver's header-first path.
    crate::kv::KvBlock::of(p).check(p.data.len() as u64)
}

/// LANE_DELIVERED's list: at most [`MAX_DELIVERED_LANES`] data lanes (>= 1), each once.
pub(crate) fn check_delivered(lanes: &[(u16, u64)]) -> std::result::Result<(), String> {
    if lanes.len() > MAX_DELIVERED_LANES {
        return Err(format!(
            "{} lanes, more than {MAX_DELIVERED_LANES}",
            lanes.len()
        ));
    }
    let mut seen = std::collections::HashSet::with_capacity(lanes.len());
    for &(lane, _) in lanes {
        if lane == 0 {
            return Err("lane 0 is the control lane, not a data lane".into());
        }
        if !seen.insert(lane) {
            return Err(format!("lane {lane} named twice"));
        }
    }
    Ok(())
}

/// A region names >= 1 page, its page range fits u32, its key 1..=1024 bytes.
fn check_region(r: &LocalRegion) -> std::result::Result<(), String> {
    if r.page_count == 0 {
        return Err("a region needs at least one page".into());
    }
    if r.page_start.checked_add(r.page_count).is_none() {
        return Err("page_start + page_count overflows u32".into());
    }
    if r.rkey.is_empty() || r.rkey.len() > MAX_LOCAL_RKEY_LEN {
        return Err(format!(
            "remote key of {} bytes outside 1..={MAX_LOCAL_RKEY_LEN}",
            r.rkey.len()
        ));
    }
    Ok(())
}

/// A completion notice names >= 1 layer and its layer range fits u16.
fn check_local_done(d: &LocalDone) -> std::result::Result<(), String> {
    if d.layer_count == 0 {
        return Err("layer_count must be >= 1".into());
    }
    if u32::from(d.layer_start) + u32::from(d.layer_count) > u32::from(u16::MAX) + 1 {
        return Err("layer_start + layer_count overflows u16".into());
    }
    Ok(())
}
