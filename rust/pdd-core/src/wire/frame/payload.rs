//! Each frame's payload bytes: `put_payload` writes them, `parse` reads them back.
//! Field order here is the byte order on the wire (docs/protocol.md).

use bytes::{BufMut, Bytes};

use crate::error::{Error, Result};
use crate::wire::reader::{PayloadReader, PayloadWriter};
use crate::wire::tokens::{put_tokens, read_tokens};
use crate::wire::{
    AbortReason, FrameKind, Role, AUTH_LEN, FLAG_FINAL, FLAG_KV_COMPLETE, FLAG_RESENT, FLAG_RESUME,
    HARD_MAX_PAYLOAD, MAX_ABORT_MESSAGE_LEN, MAX_HELLO_AUTH_LEN, MAX_KV_LAYOUT_LEN,
    MAX_LOCAL_ADDRESS_LEN, MAX_LOCAL_RKEY_LEN, MAX_PAGE_SIZE, MEMORY_KIND_CUDA, MEMORY_KIND_HOST,
    MIN_MAX_PAYLOAD,
};

use super::{
    check_delivered, check_held, check_local_done, check_page_block, check_region, Abort, Auth,
    CacheEvent, CacheEvents, Frame, Handoff, HandoffAck, Hello, KvDone, KvGrant, KvHeld, KvLayout,
    KvPages, KvPagesZ, LaneDelivered, LaneRevoke, LocalAddr, LocalDone, LocalGrant, LocalRegion,
    Ping, PrefixQuery, PrefixReply, Progress, ZRest, LOCAL_REGION_MIN_LEN, MAX_DELIVERED_LANES,
};

const EVENT_STORED: u8 = 1;
const EVENT_REMOVED: u8 = 2;
const EVENT_CLEARED: u8 = 3;

impl Frame {
    /// Append the payload (no header). Call after [`Frame::validate`].
    pub(crate) fn put_payload(&self, out: &mut impl BufMut) -> Result<()> {
        match self {
            Frame::Hello(h) => {
                out.put_u16_le(h.min_version);
                out.put_u16_le(h.max_version);
                out.put_u8(h.role as u8);
                out.put_u16_le(h.lane);
                out.put_u64_le(h.session_id);
                out.put_u64_le(h.capabilities);
                out.put_u32_le(h.max_payload);
                out.put_u16_le(h.auth.len() as u16);
                out.put_slice(&h.auth);
            }
            Frame::KvGrant(g) => put_grant(out, g),
            Frame::KvPages(p) => {
                out.put_slice(&crate::kv::KvBlock::of(p).to_fixed());
                out.put_slice(&p.data);
            }
            Frame::KvPagesZ(p) => {
                out.put_slice(&p.block.to_fixed());
                super::put_z_head(out, &p.block, p.codec, p.raw_crc32c, &p.lengths);
                out.put_slice(&p.data);
            }
            Frame::KvDone(d) => {
                out.put_u64_le(d.transfer_id);
                out.put_u32_le(d.chunk_count);
                out.put_u64_le(d.byte_count);
            }
            Frame::PrefixQuery(q) => {
                out.put_u64_le(q.query_id);
                out.put_u64_le(q.request_id);
                out.put_u64_le(q.namespace);
                out.put_u16_le(q.page_size);
                out.put_u32_le(q.lease_ms);
                put_tokens(out, &q.tokens)?;
            }
            Frame::PrefixReply(r) => {
                out.put_u64_le(r.query_id);
                out.put_u32_le(r.matched_tokens);
                out.put_u64_le(r.prefix_hash);
                out.put_u64_le(r.lease_id);
                out.put_u32_le(r.lease_ms);
            }
            Frame::CacheEvents(c) => {
                out.put_u64_le(c.source_id);
                out.put_u64_le(c.first_event_id);
                out.put_u32_le(len_u32(c.events.len(), "events")?);
                for e in &c.events {
                    match e {
                        CacheEvent::Stored {
                            parent,
                            page_hashes,
                        } => {
                            out.put_u8(EVENT_STORED);
                            out.bool_byte(parent.is_some());
                            if let Some(p) = parent {
                                out.put_u64_le(*p);
                            }
                            put_hashes(out, page_hashes)?;
                        }
                        CacheEvent::Removed { page_hashes } => {
                            out.put_u8(EVENT_REMOVED);
                            put_hashes(out, page_hashes)?;
                        }
                        CacheEvent::Cleared => out.put_u8(EVENT_CLEARED),
                    }
                }
            }
            Frame::Handoff(h) => {
                out.put_u64_le(h.request_id);
                out.put_u32_le(h.seq);
                out.put_u32_le(h.first_position);
                put_tokens(out, &h.token_ids)?;
            }
            Frame::HandoffAck(a) => {
                out.put_u64_le(a.request_id);
                out.put_u32_le(a.acked_seq);
                out.put_u32_le(a.next_position);
            }
            Frame::Progress(p) => {
                out.put_u64_le(p.request_id);
                out.put_u32_le(p.position);
            }
            Frame::Abort(a) => {
                out.put_u64_le(a.request_id);
                out.put_u16_le(a.reason.code());
                out.put_u16_le(a.message.len() as u16);
                out.put_slice(a.message.as_bytes());
            }
            Frame::Ping(p) | Frame::Pong(p) => {
                out.put_u64_le(p.nonce);
                out.put_u64_le(p.sent_at_ns);
            }
            Frame::Auth(a) => {
                out.put_slice(&a.nonce);
                out.put_slice(&a.proof);
            }
            Frame::KvHeld(h) => {
                // KV_GRANT's fields first, as the grant was sent.
                put_grant(out, &h.grant);
                out.put_u8(u8::from(h.done_seen));
                out.put_u32_le(len_u32(h.landed.len(), "landed")?);
                out.put_slice(&h.landed);
            }
            Frame::KvLayout(l) => {
                // validate() bounds the length to MAX_KV_LAYOUT_LEN.
                out.put_u16_le(l.layout.len() as u16);
                out.put_slice(&l.layout);
            }
            Frame::LocalAddr(a) => {
                out.put_u8(a.memory_kind);
                out.put_u16_le(a.address.len() as u16);
                out.put_slice(&a.address);
            }
            Frame::LocalGrant(g) => {
                out.put_u64_le(g.transfer_id);
                out.put_u32_le(len_u32(g.regions.len(), "regions")?);
                for reg in &g.regions {
                    out.put_u16_le(reg.layer);
                    out.put_u32_le(reg.page_start);
                    out.put_u32_le(reg.page_count);
                    out.put_u64_le(reg.remote_addr);
                    out.put_u16_le(reg.rkey.len() as u16);
                    out.put_slice(&reg.rkey);
                }
            }
            Frame::LaneRevoke(r) | Frame::LaneRevoked(r) => {
                out.put_u16_le(r.lane);
            }
            Frame::LaneDelivered(d) => {
                // validate() bounds the count to MAX_DELIVERED_LANES.
                out.put_u16_le(d.lanes.len() as u16);
                for &(lane, bytes) in &d.lanes {
                    out.put_u16_le(lane);
                    out.put_u64_le(bytes);
                }
            }
            Frame::LocalDone(d) => {
                out.put_u64_le(d.transfer_id);
                out.put_u16_le(d.layer_start);
                out.put_u16_le(d.layer_count);
                out.put_u64_le(d.page_count);
                out.put_u64_le(d.byte_count);
            }
        }
        Ok(())
    }

    /// Parse a payload whose header (kind, flags) was already validated.
    pub(crate) fn parse(kind: FrameKind, flags: u16, payload: Bytes) -> Result<Frame> {
        let mut r = PayloadReader::new(kind, payload);
        let frame = match kind {
            FrameKind::Hello => {
                let min_version = r.u16("min_version")?;
                let max_version = r.u16("max_version")?;
                if min_version == 0 || min_version > max_version {
                    return Err(r.invalid(
                        "min_version",
                        format!(
                            "version range {min_version}..={max_version} is empty or starts at 0"
                        ),
                    ));
                }
                let role_code = r.u8("role")?;
                let role = Role::from_code(role_code)
                    .ok_or_else(|| r.invalid("role", format!("unknown role {role_code}")))?;
                let lane = r.u16("lane")?;
                let session_id = r.u64("session_id")?;
                let capabilities = r.u64("capabilities")?;
                let max_payload = r.u32("max_payload")?;
                if !(MIN_MAX_PAYLOAD..=HARD_MAX_PAYLOAD).contains(&max_payload) {
                    return Err(r.invalid(
                        "max_payload",
                        format!("{max_payload} outside {MIN_MAX_PAYLOAD}..={HARD_MAX_PAYLOAD}"),
                    ));
                }
                let auth_len = r.u16("auth_len")? as usize;
                if auth_len > MAX_HELLO_AUTH_LEN {
                    return Err(r.invalid(
                        "auth_len",
                        format!("{auth_len} exceeds {MAX_HELLO_AUTH_LEN}"),
                    ));
                }
                let auth = r.bytes(auth_len, "auth")?;
                Frame::Hello(Hello {
                    min_version,
                    max_version,
                    role,
                    lane,
                    session_id,
                    capabilities,
                    max_payload,
                    auth,
                    resume: flags & FLAG_RESUME != 0,
                })
            }
            FrameKind::KvGrant => {
                let g = read_grant(&mut r)?;
                // page_count may be 0 (an empty grant, capability EMPTY_GRANT).
                for (field, v) in [
                    ("layer_count", u32::from(g.layer_count)),
                    ("page_bytes", g.page_bytes),
                ] {
                    if v == 0 {
                        return Err(r.invalid(field, "must be >= 1"));
                    }
                }
                Frame::KvGrant(g)
            }
            FrameKind::KvPages => {
                let mut p = KvPages {
                    transfer_id: r.u64("transfer_id")?,
                    layer_start: r.u16("layer_start")?,
                    layer_count: r.u16("layer_count")?,
                    page_start: r.u32("page_start")?,
                    page_count: r.u32("page_count")?,
                    page_bytes: r.u32("page_bytes")?,
                    data: Bytes::new(),
                    resent: flags & FLAG_RESENT != 0,
                };
                p.data = r.rest();
                check_page_block(&p).map_err(|detail| Error::InvalidField {
                    kind,
                    field: "data",
                    detail,
                })?;
                Frame::KvPages(p)
            }
            FrameKind::KvDone => Frame::KvDone(KvDone {
                transfer_id: r.u64("transfer_id")?,
                chunk_count: r.u32("chunk_count")?,
                byte_count: r.u64("byte_count")?,
            }),
            FrameKind::PrefixQuery => {
                let query_id = r.u64("query_id")?;
                let request_id = r.u64("request_id")?;
                let namespace = r.u64("namespace")?;
                let page_size = r.u16("page_size")?;
                if page_size == 0 || page_size > MAX_PAGE_SIZE {
                    return Err(r.invalid(
                        "page_size",
                        format!("{page_size} outside 1..={MAX_PAGE_SIZE}"),
                    ));
                }
                let lease_ms = r.u32("lease_ms")?;
                let tokens = read_tokens(&mut r, "tokens")?;
                Frame::PrefixQuery(PrefixQuery {
                    query_id,
                    request_id,
                    namespace,
                    page_size,
                    lease_ms,
                    tokens,
                })
            }
            FrameKind::PrefixReply => {
                let reply = PrefixReply {
                    query_id: r.u64("query_id")?,
                    matched_tokens: r.u32("matched_tokens")?,
                    prefix_hash: r.u64("prefix_hash")?,
                    lease_id: r.u64("lease_id")?,
                    lease_ms: r.u32("lease_ms")?,
                };
                if (reply.lease_id == 0) != (reply.lease_ms == 0) {
                    return Err(r.invalid(
                        "lease_ms",
                        "lease_id and lease_ms must both be 0 or both non-zero",
                    ));
                }
                Frame::PrefixReply(reply)
            }
            FrameKind::CacheEvents => {
                let source_id = r.u64("source_id")?;
                let first_event_id = r.u64("first_event_id")?;
                let count = r.u32("event_count")?;
                // Every event takes at least one byte: bound the allocation by what is left.
                r.check_room(u64::from(count), 1, "events")?;
                if count > 0 && first_event_id.checked_add(u64::from(count) - 1).is_none() {
                    return Err(r.invalid("first_event_id", "event ids overflow u64"));
                }
                let mut events = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    let tag = r.u8("event_tag")?;
                    events.push(match tag {
                        EVENT_STORED => {
                            let parent = if r.bool("has_parent")? {
                                Some(r.u64("parent_hash")?)
                            } else {
                                None
                            };
                            CacheEvent::Stored {
                                parent,
                                page_hashes: read_hashes(&mut r)?,
                            }
                        }
                        EVENT_REMOVED => CacheEvent::Removed {
                            page_hashes: read_hashes(&mut r)?,
                        },
                        EVENT_CLEARED => CacheEvent::Cleared,
                        t => return Err(r.invalid("event_tag", format!("unknown event tag {t}"))),
                    });
                }
                Frame::CacheEvents(CacheEvents {
                    source_id,
                    first_event_id,
                    events,
                })
            }
            FrameKind::Handoff => {
                let request_id = r.u64("request_id")?;
                let seq = r.u32("seq")?;
                let first_position = r.u32("first_position")?;
                let token_ids = read_tokens(&mut r, "token_ids")?;
                let final_ = flags & FLAG_FINAL != 0;
                if token_ids.is_empty() && !final_ {
                    return Err(r.invalid(
                        "token_ids",
                        "a non-final HANDOFF must carry at least one token",
                    ));
                }
                if u64::from(first_position) + token_ids.len() as u64 > u64::from(u32::MAX) {
                    return Err(r.invalid("first_position", "positions overflow u32"));
                }
                Frame::Handoff(Handoff {
                    request_id,
                    seq,
                    first_position,
                    token_ids,
                    final_,
                })
            }
            FrameKind::HandoffAck => Frame::HandoffAck(HandoffAck {
                request_id: r.u64("request_id")?,
                acked_seq: r.u32("acked_seq")?,
                next_position: r.u32("next_position")?,
                final_: flags & FLAG_FINAL != 0,
            }),
            FrameKind::Progress => Frame::Progress(Progress {
                request_id: r.u64("request_id")?,
                position: r.u32("position")?,
                kv_complete: flags & FLAG_KV_COMPLETE != 0,
            }),
            FrameKind::Abort => {
                let request_id = r.u64("request_id")?;
                let reason = AbortReason::from_code(r.u16("reason")?);
                let len = r.u16("message_len")? as usize;
                if len > MAX_ABORT_MESSAGE_LEN {
                    return Err(r.invalid(
                        "message_len",
                        format!("{len} exceeds {MAX_ABORT_MESSAGE_LEN}"),
                    ));
                }
                let raw = r.bytes(len, "message")?;
                let message = std::str::from_utf8(&raw)
                    .map_err(|e| r.invalid("message", format!("not UTF-8: {e}")))?
                    .to_owned();
                Frame::Abort(Abort {
                    request_id,
                    reason,
                    message,
                })
            }
            FrameKind::Ping | FrameKind::Pong => {
                let p = Ping {
                    nonce: r.u64("nonce")?,
                    sent_at_ns: r.u64("sent_at_ns")?,
                };
                if kind == FrameKind::Ping {
                    Frame::Ping(p)
                } else {
                    Frame::Pong(p)
                }
            }
            FrameKind::Auth => {
                let mut a = Auth {
                    nonce: [0; AUTH_LEN],
                    proof: [0; AUTH_LEN],
                };
                a.nonce.copy_from_slice(&r.bytes(AUTH_LEN, "nonce")?);
                a.proof.copy_from_slice(&r.bytes(AUTH_LEN, "proof")?);
                Frame::Auth(a)
            }
            FrameKind::KvHeld => {
                let grant = read_grant(&mut r)?;
                let done_seen = match r.u8("done_seen")? {
                    0 => false,
                    1 => true,
                    other => {
                        return Err(r.invalid("done_seen", format!("{other} is neither 0 nor 1")))
                    }
                };
                // The length is checked against the grant before a byte is taken.
                let len = r.u32("landed_len")? as usize;
                let want = if grant.transfer_id == 0 {
                    Some(0)
                } else {
                    crate::wire::frame::held_bitmap_len(grant.layer_count, grant.page_count)
                };
                if want != Some(len) {
                    return Err(r.invalid(
                        "landed_len",
                        format!(
                            "{len} bytes for {} layers x {} pages",
                            grant.layer_count, grant.page_count
                        ),
                    ));
                }
                let h = KvHeld {
                    grant,
                    done_seen,
                    landed: r.bytes(len, "landed")?,
                };
                check_held(&h).map_err(|d| r.invalid("transfer_id", d))?;
                Frame::KvHeld(h)
            }
            FrameKind::KvLayout => {
                // The length is checked before a byte of the blob is taken.
                let len = usize::from(r.u16("layout_len")?);
                if len == 0 || len > MAX_KV_LAYOUT_LEN {
                    return Err(r.invalid(
                        "layout_len",
                        format!("{len} outside 1..={MAX_KV_LAYOUT_LEN}"),
                    ));
                }
                Frame::KvLayout(KvLayout {
                    layout: r.bytes(len, "layout")?,
                })
            }
            FrameKind::LocalAddr => {
                let memory_kind = r.u8("memory_kind")?;
                if memory_kind != MEMORY_KIND_HOST && memory_kind != MEMORY_KIND_CUDA {
                    return Err(r.invalid("memory_kind", format!("unknown kind {memory_kind}")));
                }
                let len = r.u16("address_len")? as usize;
                if len == 0 || len > MAX_LOCAL_ADDRESS_LEN {
                    return Err(r.invalid(
                        "address_len",
                        format!("{len} outside 1..={MAX_LOCAL_ADDRESS_LEN}"),
                    ));
                }
                Frame::LocalAddr(LocalAddr {
                    memory_kind,
                    address: r.bytes(len, "address")?,
                })
            }
            FrameKind::LocalGrant => {
                let transfer_id = r.u64("transfer_id")?;
                let count = r.u32("region_count")?;
                if count == 0 {
                    return Err(r.invalid("region_count", "must be >= 1"));
                }
                // Every region takes at least LOCAL_REGION_MIN_LEN bytes.
                r.check_room(u64::from(count), LOCAL_REGION_MIN_LEN, "regions")?;
                let mut regions = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    let layer = r.u16("layer")?;
                    let page_start = r.u32("page_start")?;
                    let page_count = r.u32("page_count")?;
                    let remote_addr = r.u64("remote_addr")?;
                    let rkey_len = r.u16("rkey_len")? as usize;
                    if rkey_len == 0 || rkey_len > MAX_LOCAL_RKEY_LEN {
                        return Err(r.invalid(
                            "rkey_len",
                            format!("{rkey_len} outside 1..={MAX_LOCAL_RKEY_LEN}"),
                        ));
                    }
                    let reg = LocalRegion {
                        layer,
                        page_start,
                        page_count,
                        remote_addr,
                        rkey: r.bytes(rkey_len, "rkey")?,
                    };
                    check_region(&reg).map_err(|detail| Error::InvalidField {
                        kind,
                        field: "page_count",
                        detail,
                    })?;
                    regions.push(reg);
                }
                Frame::LocalGrant(LocalGrant {
                    transfer_id,
                    regions,
                })
            }
            FrameKind::LocalDone => {
                let d = LocalDone {
                    transfer_id: r.u64("transfer_id")?,
                    layer_start: r.u16("layer_start")?,
                    layer_count: r.u16("layer_count")?,
                    page_count: r.u64("page_count")?,
                    byte_count: r.u64("byte_count")?,
                };
                check_local_done(&d).map_err(|detail| Error::InvalidField {
                    kind,
                    field: "layer_count",
                    detail,
                })?;
                Frame::LocalDone(d)
            }
            FrameKind::LaneRevoke | FrameKind::LaneRevoked => {
                let lane = r.u16("lane")?;
                if lane == 0 {
                    return Err(r.invalid("lane", "lane 0 is the control lane"));
                }
                let l = LaneRevoke { lane };
                if kind == FrameKind::LaneRevoke {
                    Frame::LaneRevoke(l)
                } else {
                    Frame::LaneRevoked(l)
                }
            }
            FrameKind::LaneDelivered => {
                let count = usize::from(r.u16("count")?);
                if count > MAX_DELIVERED_LANES {
                    return Err(r.invalid("count", "more lanes than a LANE_DELIVERED names"));
                }
                let mut lanes = Vec::with_capacity(count);
                for _ in 0..count {
                    lanes.push((r.u16("lane")?, r.u64("bytes")?));
                }
                check_delivered(&lanes).map_err(|detail| Error::InvalidField {
                    kind,
                    field: "lane",
                    detail,
                })?;
                Frame::LaneDelivered(LaneDelivered { lanes })
            }
            FrameKind::KvPagesZ => {
                let block = crate::kv::KvBlock {
                    transfer_id: r.u64("transfer_id")?,
                    layer_start: r.u16("layer_start")?,
                    layer_count: r.u16("layer_count")?,
                    page_start: r.u32("page_start")?,
                    page_count: r.u32("page_count")?,
                    page_bytes: r.u32("page_bytes")?,
                };
                let rest = r.rest();
                let z =
                    ZRest::parse(&block, &rest).map_err(|(field, detail)| Error::InvalidField {
                        kind,
                        field,
                        detail,
                    })?;
                let table = 16 + 4 * z.page_total();
                Frame::KvPagesZ(KvPagesZ {
                    block,
                    codec: z.codec,
                    raw_crc32c: z.raw_crc32c,
                    lengths: rest[16..table]
                        .chunks_exact(4)
                        .map(|l| u32::from_le_bytes([l[0], l[1], l[2], l[3]]))
                        .collect(),
                    data: rest.slice(table..),
                    resent: flags & FLAG_RESENT != 0,
                })
            }
        };
        r.finish()?;
        Ok(frame)
    }
}

fn len_u32(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::InvalidArgument(format!("too many {what}: {n}")))
}

/// A grant's six fields, in KV_GRANT's order (KV_HELD repeats them).
fn put_grant(out: &mut impl BufMut, g: &KvGrant) {
    out.put_u64_le(g.transfer_id);
    out.put_u64_le(g.request_id);
    out.put_u16_le(g.layer_count);
    out.put_u32_le(g.page_count);
    out.put_u32_le(g.page_bytes);
    out.put_u32_le(g.deadline_ms);
}

fn read_grant(r: &mut PayloadReader) -> Result<KvGrant> {
    Ok(KvGrant {
        transfer_id: r.u64("transfer_id")?,
        request_id: r.u64("request_id")?,
        layer_count: r.u16("layer_count")?,
        page_count: r.u32("page_count")?,
        page_bytes: r.u32("page_bytes")?,
        deadline_ms: r.u32("deadline_ms")?,
    })
}

fn put_hashes(out: &mut impl BufMut, hashes: &[u64]) -> Result<()> {
    out.put_u32_le(len_u32(hashes.len(), "page hashes")?);
    for &h in hashes {
        out.put_u64_le(h);
    }
    Ok(())
}

fn read_hashes(r: &mut PayloadReader) -> Result<Vec<u64>> {
    let n = r.u32("hash_count")?;
    if n == 0 {
        return Err(r.invalid("hash_count", "an event must name at least one page"));
    }
    r.check_room(u64::from(n), 8, "page_hashes")?;
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        out.push(r.u64("page_hashes")?);
    }
    Ok(out)
}
