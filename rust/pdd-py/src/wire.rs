//! Frames <-> Python dicts, for tests, tools and benchmarks.
//!
//! A frame is a `dict` with a `"kind"` key (`"HANDOFF"`, ...) and one key per field,
//! named as in docs/protocol.md. Encoding refuses missing and unknown keys, so a typo
//! is an error rather than a silently defaulted field.

use bytes::{Bytes, BytesMut};
use pdd_core::wire::handshake::{negotiate, LocalHello};
use pdd_core::wire::{
    self, capability, decode_frame as core_decode, decode_frame_shared,
    encode_frame as core_encode, Abort, AbortReason, Auth, CacheEvent, CacheEvents, Frame,
    FrameKind, Handoff, HandoffAck, Hello, KvDone, KvGrant, KvHeld, KvLayout, KvPages, KvPagesZ,
    LaneDelivered, LaneRevoke, LocalAddr, LocalDone, LocalGrant, LocalRegion, Ping, PrefixQuery,
    PrefixReply, Progress, Role, AUTH_LEN,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::convert::{u32_arg, u32s_from_py as token_ids_from_py, RequestId};
use crate::errors::{invalid, PddErr};

// Signatures spell the default payload limit as a literal so Python's introspection
// (and mypy stubtest) sees the value; this keeps the literal honest.
const _: () = assert!(wire::DEFAULT_MAX_PAYLOAD == 16777216);

/// Frames at least this big are encoded/decoded with the GIL released.
const DETACH_BYTES: usize = 64 << 10;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("HEADER_LEN", wire::HEADER_LEN)?;
    m.add("WIRE_VERSION", wire::WIRE_VERSION)?;
    m.add("DEFAULT_MAX_PAYLOAD", wire::DEFAULT_MAX_PAYLOAD)?;
    m.add("HARD_MAX_PAYLOAD", wire::HARD_MAX_PAYLOAD)?;
    m.add(
        "PROTOCOL_VERSIONS",
        (
            wire::handshake::PROTOCOL_MIN_VERSION,
            wire::handshake::PROTOCOL_MAX_VERSION,
        ),
    )?;
    let kinds = PyDict::new(py);
    for k in FrameKind::ALL {
        kinds.set_item(k.wire_name(), *k as u8)?;
    }
    m.add("FRAME_KINDS", kinds)?;
    let reasons = PyDict::new(py);
    for r in AbortReason::KNOWN {
        reasons.set_item(r.name(), r.code())?;
    }
    m.add("ABORT_REASONS", reasons)?;
    let roles = PyDict::new(py);
    for r in Role::ALL {
        roles.set_item(r.name(), *r as u8)?;
    }
    m.add("ROLES", roles)?;
    let caps = PyDict::new(py);
    for (name, bit) in [
        ("kv_stream", capability::KV_STREAM),
        ("handoff", capability::HANDOFF),
        ("prefix_cache", capability::PREFIX_CACHE),
        ("cache_events", capability::CACHE_EVENTS),
        ("aead", capability::AEAD),
        ("local_ucx", capability::LOCAL_UCX),
        ("lane_failover", capability::LANE_FAILOVER),
        ("empty_grant", capability::EMPTY_GRANT),
        ("sealed_lanes", capability::SEALED_LANES),
        ("lane_delivery", capability::LANE_DELIVERY),
        ("refusal", capability::REFUSAL),
        ("kv_compress", capability::KV_COMPRESS),
        ("kv_layout", capability::KV_LAYOUT),
        ("kv_resume", capability::KV_RESUME),
    ] {
        caps.set_item(name, bit)?;
    }
    m.add("CAPABILITIES", caps)?;
    m.add_function(wrap_pyfunction!(encode_frame, m)?)?;
    m.add_function(wrap_pyfunction!(decode_frame, m)?)?;
    m.add_function(wrap_pyfunction!(encode_handoff, m)?)?;
    m.add_function(wrap_pyfunction!(negotiate_hello, m)?)?;
    m.add_class::<FrameDecoder>()?;
    Ok(())
}

/// Check a peer's HELLO against our settings (the accepting side's decision).
///
/// Returns the agreed session parameters and, under `"reply"`, the HELLO to answer
/// with (once the AUTH exchange that follows has succeeded); raises `TransportError`
/// (reason `version_mismatch`, `auth_failed` or `role_refused`; `exc.abort_reason`
/// is the ABORT reason to send) otherwise.
#[pyfunction]
#[pyo3(signature = (role, peer_hello, *, capabilities = 0, accepted_roles = None, max_payload = 16777216))]
fn negotiate_hello<'py>(
    py: Python<'py>,
    role: &str,
    peer_hello: &Bound<'py, PyDict>,
    capabilities: u64,
    accepted_roles: Option<Vec<String>>,
    max_payload: u32,
) -> PyResult<Bound<'py, PyDict>> {
    let parse_role =
        |name: &str| Role::from_name(name).ok_or_else(|| invalid(format!("unknown role '{name}'")));
    let mut ours = LocalHello::new(parse_role(role)?, capabilities);
    ours.max_payload = max_payload;
    ours.accepted_roles = accepted_roles
        .unwrap_or_default()
        .iter()
        .map(|r| parse_role(r))
        .collect::<PyResult<_>>()?;
    let Frame::Hello(peer) = frame_from_dict(peer_hello)? else {
        return Err(invalid("peer_hello must be a HELLO frame dict"));
    };
    let agreed = negotiate(&ours, &peer).map_err(PddErr)?;
    let out = PyDict::new(py);
    out.set_item("version", agreed.version)?;
    out.set_item("peer_role", agreed.peer_role.name())?;
    out.set_item("capabilities", agreed.capabilities)?;
    out.set_item("peer_max_payload", agreed.peer_max_payload)?;
    out.set_item("session_id", agreed.session_id)?;
    out.set_item("lane", agreed.lane)?;
    out.set_item("resume", agreed.resume)?;
    out.set_item(
        "reply",
        frame_to_dict(py, &Frame::Hello(ours.reply(&agreed)))?,
    )?;
    Ok(out)
}

/// Encode a frame dict to bytes (header and payload).
#[pyfunction]
#[pyo3(signature = (frame, max_payload = 16777216))]
fn encode_frame<'py>(
    py: Python<'py>,
    frame: &Bound<'py, PyDict>,
    max_payload: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let frame = frame_from_dict(frame)?;
    encode_to_pybytes(py, &frame, max_payload)
}

/// Encode a HANDOFF straight from a token array (numpy int32/int64/uint32, or any
/// sequence of ints): the engine-side fast path.
#[pyfunction]
#[pyo3(signature = (request_id, seq, first_position, token_ids, final_ = false))]
fn encode_handoff<'py>(
    py: Python<'py>,
    request_id: RequestId,
    seq: i64,
    first_position: i64,
    token_ids: &Bound<'py, PyAny>,
    final_: bool,
) -> PyResult<Bound<'py, PyBytes>> {
    let request_id = request_id.0;
    let seq = u32_arg("seq", seq)?;
    let first_position = u32_arg("first_position", first_position)?;
    let token_ids = token_ids_from_py(token_ids, "token_ids")?;
    let frame = Frame::Handoff(Handoff {
        request_id,
        seq,
        first_position,
        token_ids,
        final_,
    });
    encode_to_pybytes(py, &frame, wire::DEFAULT_MAX_PAYLOAD)
}

fn encode_to_pybytes<'py>(
    py: Python<'py>,
    frame: &Frame,
    max_payload: u32,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut out = BytesMut::new();
    if matches!(frame, Frame::KvPages(p) if p.data.len() >= DETACH_BYTES) {
        py.detach(|| core_encode(frame, max_payload, &mut out))
            .map_err(PddErr)?;
    } else {
        core_encode(frame, max_payload, &mut out).map_err(PddErr)?;
    }
    Ok(PyBytes::new(py, &out))
}

/// Decode one frame from the front of `data`: `(frame_dict, bytes_consumed)`, or
/// `None` if `data` holds only part of a frame.
#[pyfunction]
#[pyo3(signature = (data, max_payload = 16777216))]
fn decode_frame<'py>(
    py: Python<'py>,
    data: PyBackedBytes,
    max_payload: u32,
) -> PyResult<Option<(Bound<'py, PyDict>, usize)>> {
    let decoded = if data.len() >= DETACH_BYTES {
        // Share the Python bytes object's buffer instead of copying it; the owner keeps
        // the object alive for as long as the frame's slices live.
        let shared = Bytes::from_owner(data);
        py.detach(|| decode_frame_shared(&shared, max_payload))
    } else {
        core_decode(&data, max_payload)
    };
    match decoded.map_err(PddErr)? {
        None => Ok(None),
        Some((frame, used)) => Ok(Some((frame_to_dict(py, &frame)?, used))),
    }
}

/// A streaming decoder: feed it bytes as they arrive, get whole frames back.
///
/// After an error it is poisoned (framing is lost): every later `feed` raises
/// `ProtocolError` with reason `decoder_poisoned`.
#[pyclass(module = "pdd_transport._native")]
struct FrameDecoder {
    decoder: wire::FrameDecoder,
    buf: BytesMut,
}

#[pymethods]
impl FrameDecoder {
    #[new]
    #[pyo3(signature = (max_payload = 16777216))]
    fn new(max_payload: u32) -> Self {
        FrameDecoder {
            decoder: wire::FrameDecoder::new(max_payload),
            buf: BytesMut::new(),
        }
    }

    /// Append `data` and return every frame now complete, in order.
    fn feed<'py>(&mut self, py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyList>> {
        self.buf.extend_from_slice(data);
        let out = PyList::empty(py);
        while let Some(frame) = self.decoder.decode(&mut self.buf).map_err(PddErr)? {
            out.append(frame_to_dict(py, &frame)?)?;
        }
        Ok(out)
    }

    /// Bytes held that do not yet form a whole frame.
    #[getter]
    fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Whether an earlier `feed` failed.
    #[getter]
    fn poisoned(&self) -> bool {
        self.decoder.is_poisoned()
    }

    /// The payload limit in force.
    #[getter]
    fn max_payload(&self) -> u32 {
        self.decoder.max_payload()
    }
}

/// Required-key access to a frame dict, with errors naming the frame and the field.
struct Fields<'a, 'py> {
    kind: FrameKind,
    dict: &'a Bound<'py, PyDict>,
    seen: Vec<&'static str>,
}

impl<'py> Fields<'_, 'py> {
    fn item(&mut self, name: &'static str) -> PyResult<Bound<'py, PyAny>> {
        self.seen.push(name);
        self.dict
            .get_item(name)?
            .ok_or_else(|| invalid(format!("{} frame needs field '{name}'", self.kind)))
    }

    fn finish(self) -> PyResult<()> {
        for key in self.dict.keys() {
            let key: String = key.extract()?;
            if key != "kind" && !self.seen.contains(&key.as_str()) {
                return Err(invalid(format!("{} frame has no field '{key}'", self.kind)));
            }
        }
        Ok(())
    }
}

/// `get!(fields, "name")` reads a required field with a type error that names it.
macro_rules! get {
    ($f:expr, $name:literal) => {
        $f.item($name)?
            .extract()
            .map_err(|e: PyErr| PyTypeError::new_err(format!("{}.{}: {}", $f.kind, $name, e)))?
    };
}

fn bytes_field(f: &mut Fields<'_, '_>, name: &'static str) -> PyResult<Bytes> {
    let v = f.item(name)?;
    let b: PyBackedBytes = v
        .extract()
        .map_err(|_| PyTypeError::new_err(format!("{}.{name}: expected bytes", f.kind)))?;
    Ok(Bytes::copy_from_slice(&b))
}

/// A grant's six fields (KV_GRANT's, and KV_HELD's first ones).
fn grant_from(f: &mut Fields<'_, '_>) -> PyResult<KvGrant> {
    Ok(KvGrant {
        transfer_id: get!(f, "transfer_id"),
        request_id: get!(f, "request_id"),
        layer_count: get!(f, "layer_count"),
        page_count: get!(f, "page_count"),
        page_bytes: get!(f, "page_bytes"),
        deadline_ms: get!(f, "deadline_ms"),
    })
}

fn grant_into(d: &Bound<'_, PyDict>, g: &KvGrant) -> PyResult<()> {
    d.set_item("transfer_id", g.transfer_id)?;
    d.set_item("request_id", g.request_id)?;
    d.set_item("layer_count", g.layer_count)?;
    d.set_item("page_count", g.page_count)?;
    d.set_item("page_bytes", g.page_bytes)?;
    d.set_item("deadline_ms", g.deadline_ms)
}

fn frame_from_dict(d: &Bound<'_, PyDict>) -> PyResult<Frame> {
    let kind_name: String = d
        .get_item("kind")?
        .ok_or_else(|| invalid("a frame dict needs a 'kind' key"))?
        .extract()
        .map_err(|_| PyTypeError::new_err("frame 'kind' must be a str"))?;
    let kind = FrameKind::from_wire_name(&kind_name)
        .ok_or_else(|| invalid(format!("unknown frame kind '{kind_name}'")))?;
    let mut f = Fields {
        kind,
        dict: d,
        seen: Vec::new(),
    };
    let frame = match kind {
        FrameKind::Hello => {
            let role_name: String = get!(f, "role");
            let role = Role::from_name(&role_name)
                .ok_or_else(|| invalid(format!("unknown role '{role_name}'")))?;
            Frame::Hello(Hello {
                min_version: get!(f, "min_version"),
                max_version: get!(f, "max_version"),
                role,
                lane: get!(f, "lane"),
                session_id: get!(f, "session_id"),
                capabilities: get!(f, "capabilities"),
                max_payload: get!(f, "max_payload"),
                auth: bytes_field(&mut f, "auth")?,
                resume: get!(f, "resume"),
            })
        }
        FrameKind::KvGrant => Frame::KvGrant(grant_from(&mut f)?),
        FrameKind::KvPages => Frame::KvPages(KvPages {
            transfer_id: get!(f, "transfer_id"),
            layer_start: get!(f, "layer_start"),
            layer_count: get!(f, "layer_count"),
            page_start: get!(f, "page_start"),
            page_count: get!(f, "page_count"),
            page_bytes: get!(f, "page_bytes"),
            data: bytes_field(&mut f, "data")?,
            // Optional: the RESENT flag of lane failover (absent = not resent).
            resent: match d.get_item("resent")? {
                None => false,
                Some(v) => {
                    f.seen.push("resent");
                    v.extract()
                        .map_err(|e: PyErr| PyTypeError::new_err(format!("KV_PAGES.resent: {e}")))?
                }
            },
        }),
        FrameKind::KvPagesZ => Frame::KvPagesZ(KvPagesZ {
            block: pdd_core::kv::KvBlock {
                transfer_id: get!(f, "transfer_id"),
                layer_start: get!(f, "layer_start"),
                layer_count: get!(f, "layer_count"),
                page_start: get!(f, "page_start"),
                page_count: get!(f, "page_count"),
                page_bytes: get!(f, "page_bytes"),
            },
            codec: get!(f, "codec"),
            raw_crc32c: get!(f, "raw_crc32c"),
            lengths: get!(f, "lengths"),
            data: bytes_field(&mut f, "data")?,
            resent: match d.get_item("resent")? {
                None => false,
                Some(v) => {
                    f.seen.push("resent");
                    v.extract().map_err(|e: PyErr| {
                        PyTypeError::new_err(format!("KV_PAGES_Z.resent: {e}"))
                    })?
                }
            },
        }),
        FrameKind::KvLayout => Frame::KvLayout(KvLayout {
            layout: bytes_field(&mut f, "layout")?,
        }),
        FrameKind::KvHeld => Frame::KvHeld(KvHeld {
            grant: grant_from(&mut f)?,
            done_seen: get!(f, "done_seen"),
            landed: bytes_field(&mut f, "landed")?,
        }),
        FrameKind::KvDone => Frame::KvDone(KvDone {
            transfer_id: get!(f, "transfer_id"),
            chunk_count: get!(f, "chunk_count"),
            byte_count: get!(f, "byte_count"),
        }),
        FrameKind::PrefixQuery => Frame::PrefixQuery(PrefixQuery {
            query_id: get!(f, "query_id"),
            request_id: get!(f, "request_id"),
            namespace: get!(f, "namespace"),
            page_size: get!(f, "page_size"),
            lease_ms: get!(f, "lease_ms"),
            tokens: token_ids_from_py(&f.item("tokens")?, "tokens")?,
        }),
        FrameKind::PrefixReply => Frame::PrefixReply(PrefixReply {
            query_id: get!(f, "query_id"),
            matched_tokens: get!(f, "matched_tokens"),
            prefix_hash: get!(f, "prefix_hash"),
            lease_id: get!(f, "lease_id"),
            lease_ms: get!(f, "lease_ms"),
        }),
        FrameKind::CacheEvents => {
            let source_id = get!(f, "source_id");
            let first_event_id = get!(f, "first_event_id");
            let list = f.item("events")?;
            let mut events = Vec::new();
            for item in list.try_iter()? {
                events.push(cache_event_from_py(&item?)?);
            }
            Frame::CacheEvents(CacheEvents {
                source_id,
                first_event_id,
                events,
            })
        }
        FrameKind::Handoff => Frame::Handoff(Handoff {
            request_id: get!(f, "request_id"),
            seq: get!(f, "seq"),
            first_position: get!(f, "first_position"),
            token_ids: token_ids_from_py(&f.item("token_ids")?, "token_ids")?,
            final_: get!(f, "final"),
        }),
        FrameKind::HandoffAck => Frame::HandoffAck(HandoffAck {
            request_id: get!(f, "request_id"),
            acked_seq: get!(f, "acked_seq"),
            next_position: get!(f, "next_position"),
            final_: get!(f, "final"),
        }),
        FrameKind::Progress => Frame::Progress(Progress {
            request_id: get!(f, "request_id"),
            position: get!(f, "position"),
            kv_complete: get!(f, "kv_complete"),
        }),
        FrameKind::Abort => {
            let request_id = get!(f, "request_id");
            let reason_obj = f.item("reason")?;
            let reason = if let Ok(code) = reason_obj.extract::<u16>() {
                AbortReason::from_code(code)
            } else {
                let name: String = reason_obj.extract().map_err(|_| {
                    PyTypeError::new_err("ABORT.reason: expected a reason name or an int code")
                })?;
                AbortReason::from_name(&name)
                    .ok_or_else(|| invalid(format!("unknown abort reason '{name}'")))?
            };
            Frame::Abort(Abort {
                request_id,
                reason,
                message: get!(f, "message"),
            })
        }
        FrameKind::LaneRevoke | FrameKind::LaneRevoked => {
            let r = LaneRevoke {
                lane: get!(f, "lane"),
            };
            if kind == FrameKind::LaneRevoke {
                Frame::LaneRevoke(r)
            } else {
                Frame::LaneRevoked(r)
            }
        }
        FrameKind::LaneDelivered => Frame::LaneDelivered(LaneDelivered {
            // A list of (lane, bytes) pairs; Frame::validate bounds and checks it.
            lanes: get!(f, "lanes"),
        }),
        FrameKind::Ping | FrameKind::Pong => {
            let p = Ping {
                nonce: get!(f, "nonce"),
                sent_at_ns: get!(f, "sent_at_ns"),
            };
            if kind == FrameKind::Ping {
                Frame::Ping(p)
            } else {
                Frame::Pong(p)
            }
        }
        FrameKind::Auth => {
            let fixed = |f: &mut Fields<'_, '_>, name: &'static str| -> PyResult<[u8; AUTH_LEN]> {
                let b = bytes_field(f, name)?;
                <[u8; AUTH_LEN]>::try_from(b.as_ref())
                    .map_err(|_| invalid(format!("AUTH.{name}: expected {AUTH_LEN} bytes")))
            };
            Frame::Auth(Auth {
                nonce: fixed(&mut f, "nonce")?,
                proof: fixed(&mut f, "proof")?,
            })
        }
        FrameKind::LocalAddr => Frame::LocalAddr(LocalAddr {
            memory_kind: get!(f, "memory_kind"),
            address: bytes_field(&mut f, "address")?,
        }),
        FrameKind::LocalGrant => {
            let transfer_id = get!(f, "transfer_id");
            let list = f.item("regions")?;
            let mut regions = Vec::new();
            for item in list.try_iter()? {
                let item = item?;
                let rd = item.cast::<PyDict>().map_err(|_| {
                    PyTypeError::new_err("LOCAL_GRANT.regions: each region must be a dict")
                })?;
                let field = |name: &str| -> PyResult<Bound<'_, PyAny>> {
                    rd.get_item(name)?
                        .ok_or_else(|| invalid(format!("a LOCAL_GRANT region needs '{name}'")))
                };
                let rkey: PyBackedBytes = field("rkey")?.extract().map_err(|_| {
                    PyTypeError::new_err("LOCAL_GRANT.regions.rkey: expected bytes")
                })?;
                if rd.len() != 5 {
                    return Err(invalid(
                        "a LOCAL_GRANT region has exactly the keys layer, page_start, \
                         page_count, remote_addr, rkey",
                    ));
                }
                regions.push(LocalRegion {
                    layer: field("layer")?.extract()?,
                    page_start: field("page_start")?.extract()?,
                    page_count: field("page_count")?.extract()?,
                    remote_addr: field("remote_addr")?.extract()?,
                    rkey: Bytes::copy_from_slice(&rkey),
                });
            }
            Frame::LocalGrant(LocalGrant {
                transfer_id,
                regions,
            })
        }
        FrameKind::LocalDone => Frame::LocalDone(LocalDone {
            transfer_id: get!(f, "transfer_id"),
            layer_start: get!(f, "layer_start"),
            layer_count: get!(f, "layer_count"),
            page_count: get!(f, "page_count"),
            byte_count: get!(f, "byte_count"),
        }),
    };
    f.finish()?;
    Ok(frame)
}

fn cache_event_from_py(obj: &Bound<'_, PyAny>) -> PyResult<CacheEvent> {
    let d = obj
        .cast::<PyDict>()
        .map_err(|_| PyTypeError::new_err("CACHE_EVENTS.events: each event must be a dict"))?;
    let ty: String = d
        .get_item("type")?
        .ok_or_else(|| invalid("a cache event needs a 'type' key"))?
        .extract()
        .map_err(|_| PyTypeError::new_err("cache event 'type' must be a str"))?;
    let hashes = |d: &Bound<'_, PyDict>| -> PyResult<Vec<u64>> {
        d.get_item("page_hashes")?
            .ok_or_else(|| invalid(format!("{ty} event needs 'page_hashes'")))?
            .extract()
            .map_err(|_| PyTypeError::new_err("page_hashes: expected a sequence of ints"))
    };
    match ty.as_str() {
        "stored" => {
            let parent: Option<u64> = match d.get_item("parent")? {
                None => None,
                Some(p) => p
                    .extract()
                    .map_err(|_| PyTypeError::new_err("parent: expected an int or None"))?,
            };
            Ok(CacheEvent::Stored {
                parent,
                page_hashes: hashes(d)?,
            })
        }
        "removed" => Ok(CacheEvent::Removed {
            page_hashes: hashes(d)?,
        }),
        "cleared" => Ok(CacheEvent::Cleared),
        other => Err(invalid(format!("unknown cache event type '{other}'"))),
    }
}

fn frame_to_dict<'py>(py: Python<'py>, frame: &Frame) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", frame.kind().wire_name())?;
    match frame {
        Frame::Hello(h) => {
            d.set_item("min_version", h.min_version)?;
            d.set_item("max_version", h.max_version)?;
            d.set_item("role", h.role.name())?;
            d.set_item("lane", h.lane)?;
            d.set_item("session_id", h.session_id)?;
            d.set_item("capabilities", h.capabilities)?;
            d.set_item("max_payload", h.max_payload)?;
            d.set_item("auth", PyBytes::new(py, &h.auth))?;
            d.set_item("resume", h.resume)?;
        }
        Frame::KvGrant(g) => grant_into(&d, g)?,
        Frame::KvPages(p) => {
            d.set_item("transfer_id", p.transfer_id)?;
            d.set_item("layer_start", p.layer_start)?;
            d.set_item("layer_count", p.layer_count)?;
            d.set_item("page_start", p.page_start)?;
            d.set_item("page_count", p.page_count)?;
            d.set_item("page_bytes", p.page_bytes)?;
            d.set_item("data", PyBytes::new(py, &p.data))?;
            if p.resent {
                d.set_item("resent", true)?;
            }
        }
        Frame::KvDone(k) => {
            d.set_item("transfer_id", k.transfer_id)?;
            d.set_item("chunk_count", k.chunk_count)?;
            d.set_item("byte_count", k.byte_count)?;
        }
        Frame::PrefixQuery(q) => {
            d.set_item("query_id", q.query_id)?;
            d.set_item("request_id", q.request_id)?;
            d.set_item("namespace", q.namespace)?;
            d.set_item("page_size", q.page_size)?;
            d.set_item("lease_ms", q.lease_ms)?;
            d.set_item("tokens", &q.tokens)?;
        }
        Frame::PrefixReply(r) => {
            d.set_item("query_id", r.query_id)?;
            d.set_item("matched_tokens", r.matched_tokens)?;
            d.set_item("prefix_hash", r.prefix_hash)?;
            d.set_item("lease_id", r.lease_id)?;
            d.set_item("lease_ms", r.lease_ms)?;
        }
        Frame::CacheEvents(c) => {
            d.set_item("source_id", c.source_id)?;
            d.set_item("first_event_id", c.first_event_id)?;
            let events = PyList::empty(py);
            for e in &c.events {
                let ed = PyDict::new(py);
                match e {
                    CacheEvent::Stored {
                        parent,
                        page_hashes,
                    } => {
                        ed.set_item("type", "stored")?;
                        ed.set_item("parent", *parent)?;
                        ed.set_item("page_hashes", page_hashes)?;
                    }
                    CacheEvent::Removed { page_hashes } => {
                        ed.set_item("type", "removed")?;
                        ed.set_item("page_hashes", page_hashes)?;
                    }
                    CacheEvent::Cleared => ed.set_item("type", "cleared")?,
                }
                events.append(ed)?;
            }
            d.set_item("events", events)?;
        }
        Frame::Handoff(h) => {
            d.set_item("request_id", h.request_id)?;
            d.set_item("seq", h.seq)?;
            d.set_item("first_position", h.first_position)?;
            d.set_item("token_ids", &h.token_ids)?;
            d.set_item("final", h.final_)?;
        }
        Frame::HandoffAck(a) => {
            d.set_item("request_id", a.request_id)?;
            d.set_item("acked_seq", a.acked_seq)?;
            d.set_item("next_position", a.next_position)?;
            d.set_item("final", a.final_)?;
        }
        Frame::Progress(p) => {
            d.set_item("request_id", p.request_id)?;
            d.set_item("position", p.position)?;
            d.set_item("kv_complete", p.kv_complete)?;
        }
        Frame::Abort(a) => {
            d.set_item("request_id", a.request_id)?;
            match a.reason {
                AbortReason::Other(code) => d.set_item("reason", code)?,
                r => d.set_item("reason", r.name())?,
            }
            d.set_item("message", &a.message)?;
        }
        Frame::Ping(p) | Frame::Pong(p) => {
            d.set_item("nonce", p.nonce)?;
            d.set_item("sent_at_ns", p.sent_at_ns)?;
        }
        Frame::Auth(a) => {
            d.set_item("nonce", PyBytes::new(py, &a.nonce))?;
            d.set_item("proof", PyBytes::new(py, &a.proof))?;
        }
        Frame::LocalAddr(a) => {
            d.set_item("memory_kind", a.memory_kind)?;
            d.set_item("address", PyBytes::new(py, &a.address))?;
        }
        Frame::LocalGrant(g) => {
            d.set_item("transfer_id", g.transfer_id)?;
            let regions = PyList::empty(py);
            for r in &g.regions {
                let rd = PyDict::new(py);
                rd.set_item("layer", r.layer)?;
                rd.set_item("page_start", r.page_start)?;
                rd.set_item("page_count", r.page_count)?;
                rd.set_item("remote_addr", r.remote_addr)?;
                rd.set_item("rkey", PyBytes::new(py, &r.rkey))?;
                regions.append(rd)?;
            }
            d.set_item("regions", regions)?;
        }
        Frame::LaneRevoke(r) | Frame::LaneRevoked(r) => {
            d.set_item("lane", r.lane)?;
        }
        Frame::LaneDelivered(l) => {
            d.set_item("lanes", l.lanes.clone())?;
        }
        Frame::KvPagesZ(p) => {
            d.set_item("transfer_id", p.block.transfer_id)?;
            d.set_item("layer_start", p.block.layer_start)?;
            d.set_item("layer_count", p.block.layer_count)?;
            d.set_item("page_start", p.block.page_start)?;
            d.set_item("page_count", p.block.page_count)?;
            d.set_item("page_bytes", p.block.page_bytes)?;
            d.set_item("codec", p.codec)?;
            d.set_item("raw_crc32c", p.raw_crc32c)?;
            d.set_item("lengths", p.lengths.clone())?;
            d.set_item("data", PyBytes::new(py, &p.data))?;
            if p.resent {
                d.set_item("resent", true)?;
            }
        }
        Frame::KvLayout(l) => {
            d.set_item("layout", PyBytes::new(py, &l.layout))?;
        }
        Frame::KvHeld(h) => {
            grant_into(&d, &h.grant)?;
            d.set_item("done_seen", h.done_seen)?;
            d.set_item("landed", PyBytes::new(py, &h.landed))?;
        }
        Frame::LocalDone(l) => {
            d.set_item("transfer_id", l.transfer_id)?;
            d.set_item("layer_start", l.layer_start)?;
            d.set_item("layer_count", l.layer_count)?;
            d.set_item("page_count", l.page_count)?;
            d.set_item("byte_count", l.byte_count)?;
        }
    }
    Ok(d)
}
