//! proptest strategies that generate every valid frame (feature `testing`). Used by
//! the round-trip property tests and as seeds by the `pdd-fuzz` mutation fuzzer.

use bytes::Bytes;
use proptest::collection::vec;
use proptest::prelude::*;

use super::*;

fn tokens(max_len: usize) -> impl Strategy<Value = Vec<u32>> {
    // Mix vocabularies so every packed width 1..=32 gets exercised.
    (0u32..=32).prop_flat_map(move |bits| {
        let max = if bits == 32 {
            u32::MAX
        } else {
            (1u32 << bits).saturating_sub(1)
        };
        vec(0..=max, 0..max_len)
    })
}

fn hashes() -> impl Strategy<Value = Vec<u64>> {
    vec(any::<u64>(), 1..8)
}

fn role() -> impl Strategy<Value = Role> {
    prop::sample::select(Role::ALL)
}

fn cache_event() -> impl Strategy<Value = CacheEvent> {
    prop_oneof![
        (proptest::option::of(any::<u64>()), hashes()).prop_map(|(parent, page_hashes)| {
            CacheEvent::Stored {
                parent,
                page_hashes,
            }
        }),
        hashes().prop_map(|page_hashes| CacheEvent::Removed { page_hashes }),
        Just(CacheEvent::Cleared),
    ]
}

/// Any valid frame of wire protocol v1.
pub fn any_frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (
            1u16..4,
            0u16..4,
            role(),
            any::<u16>(),
            any::<u64>(),
            any::<u64>(),
            MIN_MAX_PAYLOAD..=HARD_MAX_PAYLOAD,
            vec(any::<u8>(), 0..=MAX_HELLO_AUTH_LEN),
            any::<bool>()
        )
            .prop_map(
                |(
                    min_version,
                    extra,
                    role,
                    lane,
                    session_id,
                    capabilities,
                    max_payload,
                    auth,
                    resume,
                )| {
                    Frame::Hello(Hello {
                        min_version,
                        max_version: min_version + extra,
                        role,
                        lane,
                        session_id,
                        capabilities,
                        max_payload,
                        auth: Bytes::from(auth),
                        resume,
                    })
                }
            ),
        (
            any::<u64>(),
            any::<u64>(),
            1u16..,
            // 0 pages: an empty grant (capability EMPTY_GRANT).
            0u32..,
            1u32..,
            any::<u32>()
        )
            .prop_map(
                |(transfer_id, request_id, layer_count, page_count, page_bytes, deadline_ms)| {
                    Frame::KvGrant(KvGrant {
                        transfer_id,
                        request_id,
                        layer_count,
                        page_count,
                        page_bytes,
                        deadline_ms,
                    })
                }
            ),
        (
            any::<u64>(),
            any::<u16>(),
            1u16..4,
            any::<u32>(),
            1u32..4,
            1u32..64,
            any::<bool>()
        )
            .prop_filter("ranges fit", |(_, ls, lc, ps, pc, _, _)| {
                ls.checked_add(lc - 1).is_some() && ps.checked_add(pc - 1).is_some()
            })
            .prop_flat_map(
                |(
                    transfer_id,
                    layer_start,
                    layer_count,
                    page_start,
                    page_count,
                    page_bytes,
                    resent,
                )| {
                    let n = layer_count as usize * page_count as usize * page_bytes as usize;
                    vec(any::<u8>(), n).prop_map(move |data| {
                        Frame::KvPages(KvPages {
                            transfer_id,
                            layer_start,
                            layer_count,
                            page_start,
                            page_count,
                            page_bytes,
                            data: Bytes::from(data),
                            resent,
                        })
                    })
                }
            ),
        (any::<u64>(), any::<u32>(), any::<u64>()).prop_map(
            |(transfer_id, chunk_count, byte_count)| Frame::KvDone(KvDone {
                transfer_id,
                chunk_count,
                byte_count
            })
        ),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            1..=MAX_PAGE_SIZE,
            any::<u32>(),
            tokens(300)
        )
            .prop_map(
                |(query_id, request_id, namespace, page_size, lease_ms, tokens)| {
                    Frame::PrefixQuery(PrefixQuery {
                        query_id,
                        request_id,
                        namespace,
                        page_size,
                        lease_ms,
                        tokens,
                    })
                }
            ),
        (
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            proptest::option::of((1u64.., 1u32..))
        )
            .prop_map(|(query_id, matched_tokens, prefix_hash, lease)| {
                let (lease_id, lease_ms) = lease.unwrap_or((0, 0));
                Frame::PrefixReply(PrefixReply {
                    query_id,
                    matched_tokens,
                    prefix_hash,
                    lease_id,
                    lease_ms,
                })
            }),
        (any::<u64>(), 0u64..u64::MAX / 2, vec(cache_event(), 0..6)).prop_map(
            |(source_id, first_event_id, events)| {
                Frame::CacheEvents(CacheEvents {
                    source_id,
                    first_event_id,
                    events,
                })
            }
        ),
        (
            any::<u64>(),
            any::<u32>(),
            0u32..u32::MAX / 2,
            tokens(300),
            any::<bool>()
        )
            .prop_map(|(request_id, seq, first_position, mut token_ids, final_)| {
                if token_ids.is_empty() && !final_ {
                    token_ids.push(1);
                }
                Frame::Handoff(Handoff {
                    request_id,
                    seq,
                    first_position,
                    token_ids,
                    final_,
                })
            }),
        (any::<u64>(), any::<u32>(), any::<u32>(), any::<bool>()).prop_map(
            |(request_id, acked_seq, next_position, final_)| {
                Frame::HandoffAck(HandoffAck {
                    request_id,
                    acked_seq,
                    next_position,
                    final_,
                })
            }
        ),
        (any::<u64>(), any::<u32>(), any::<bool>()).prop_map(
            |(request_id, position, kv_complete)| Frame::Progress(Progress {
                request_id,
                position,
                kv_complete
            })
        ),
        (any::<u64>(), any::<u16>(), "\\PC{0,64}").prop_map(|(request_id, code, message)| {
            Frame::Abort(Abort {
                request_id,
                reason: AbortReason::from_code(code),
                message,
            })
        }),
        (any::<u64>(), any::<u64>())
            .prop_map(|(nonce, sent_at_ns)| Frame::Ping(Ping { nonce, sent_at_ns })),
        (any::<u64>(), any::<u64>())
            .prop_map(|(nonce, sent_at_ns)| Frame::Pong(Ping { nonce, sent_at_ns })),
        (any::<[u8; AUTH_LEN]>(), any::<[u8; AUTH_LEN]>())
            .prop_map(|(nonce, proof)| Frame::Auth(Auth { nonce, proof })),
        (
            prop_oneof![Just(MEMORY_KIND_HOST), Just(MEMORY_KIND_CUDA)],
            vec(any::<u8>(), 1..300)
        )
            .prop_map(|(memory_kind, address)| Frame::LocalAddr(LocalAddr {
                memory_kind,
                address: Bytes::from(address),
            })),
        (any::<u64>(), vec(local_region(), 1..8)).prop_map(|(transfer_id, regions)| {
            Frame::LocalGrant(LocalGrant {
                transfer_id,
                regions,
            })
        }),
        (
            any::<u64>(),
            any::<u16>(),
            1u16..,
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(transfer_id, start, count, page_count, byte_count)| {
                // Keep layer_start + layer_count <= 65536.
                let layer_start = start.min(u16::MAX - count + 1);
                Frame::LocalDone(LocalDone {
                    transfer_id,
                    layer_start,
                    layer_count: count,
                    page_count,
                    byte_count,
                })
            }),
        (1u16..).prop_map(|lane| Frame::LaneRevoke(LaneRevoke { lane })),
        (1u16..).prop_map(|lane| Frame::LaneRevoked(LaneRevoke { lane })),
        proptest::collection::btree_map(1u16.., any::<u64>(), 0..8).prop_map(|m| {
            Frame::LaneDelivered(LaneDelivered {
                lanes: m.into_iter().collect(),
            })
        }),
        kv_pages_z(),
        vec(any::<u8>(), 1..=crate::wire::MAX_KV_LAYOUT_LEN).prop_map(|layout| {
            Frame::KvLayout(crate::wire::KvLayout {
                layout: Bytes::from(layout),
            })
        }),
        kv_held(),
    ]
}

/// KV_HELD: the end marker, or a grant of at most 8 x 40 pages with any landed set.
fn kv_held() -> impl Strategy<Value = Frame> {
    prop_oneof![
        Just(Frame::KvHeld(crate::wire::KvHeld::end())),
        (
            1u64..,
            any::<u64>(),
            1u16..8,
            0u32..40,
            1u32..,
            any::<u32>(),
            any::<bool>(),
            any::<u64>(),
        )
            .prop_map(
                |(
                    transfer_id,
                    request_id,
                    layers,
                    pages,
                    page_bytes,
                    deadline_ms,
                    done_seen,
                    seed,
                )| {
                    let bits = u64::from(layers) * u64::from(pages);
                    let mut landed = vec![0u8; bits.div_ceil(8) as usize];
                    for bit in 0..bits {
                        if seed.rotate_left((bit % 64) as u32) & 1 == 1 {
                            landed[(bit / 8) as usize] |= 1 << (bit % 8);
                        }
                    }
                    Frame::KvHeld(crate::wire::KvHeld {
                        grant: KvGrant {
                            transfer_id,
                            request_id,
                            layer_count: layers,
                            page_count: pages,
                            page_bytes,
                            deadline_ms,
                        },
                        done_seen,
                        landed: Bytes::from(landed),
                    })
                }
            ),
    ]
}

/// KV_PAGES_Z: any block of at most 9 pages, each stored raw or as 1..page_bytes
/// bytes (the frame codec does not decode pages; the data lane does).
fn kv_pages_z() -> impl Strategy<Value = Frame> {
    (
        any::<u64>(),
        any::<u16>(),
        1u16..4,
        any::<u32>(),
        1u32..4,
        1u32..64,
        any::<bool>(),
        any::<u32>(),
    )
        .prop_filter("ranges fit", |(_, ls, lc, ps, pc, _, _, _)| {
            ls.checked_add(lc - 1).is_some() && ps.checked_add(pc - 1).is_some()
        })
        .prop_flat_map(
            |(
                transfer_id,
                layer_start,
                layer_count,
                page_start,
                page_count,
                page_bytes,
                resent,
                crc,
            )| {
                let block = crate::kv::KvBlock {
                    transfer_id,
                    layer_start,
                    layer_count,
                    page_start,
                    page_count,
                    page_bytes,
                };
                let pages = usize::from(layer_count) * page_count as usize;
                vec(1..=page_bytes, pages).prop_flat_map(move |lengths| {
                    let n: usize = lengths.iter().map(|l| *l as usize).sum();
                    vec(any::<u8>(), n).prop_map(move |data| {
                        Frame::KvPagesZ(KvPagesZ {
                            block,
                            codec: crate::codec::CODEC_PLANE_ZSTD,
                            raw_crc32c: crc,
                            lengths: lengths.clone(),
                            data: Bytes::from(data),
                            resent,
                        })
                    })
                })
            },
        )
}

fn local_region() -> impl Strategy<Value = LocalRegion> {
    (
        any::<u16>(),
        0u32..u32::MAX / 2,
        1u32..u32::MAX / 2,
        any::<u64>(),
        vec(any::<u8>(), 1..64),
    )
        .prop_map(
            |(layer, page_start, page_count, remote_addr, rkey)| LocalRegion {
                layer,
                page_start,
                page_count,
                remote_addr,
                rkey: Bytes::from(rkey),
            },
        )
}
