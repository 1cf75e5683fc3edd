//! Unit tests of the receiver's and sender's bookkeeping.

use super::*;

fn land(rx: &mut ReceiverState, b: &KvBlock) -> Vec<TransferEvent> {
    match rx.begin_block(0, b, false).unwrap() {
        BlockDisposition::Land(_) => rx.finish_block(b, Ok(())),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn a_transfer_completes_layer_by_layer() {
    let mut rx = ReceiverState::new(3, 16, 8).unwrap();
    let grant = rx.grant(77, &[9, 3, 12], 3, 0).unwrap();
    let mut tx = SenderTransfer::new(grant.clone());
    let mut events = Vec::new();
    for layer in 0..3 {
        for b in tx.send_layer(layer, 16).unwrap() {
            let Ok(BlockDisposition::Land(target)) = rx.begin_block(0, &b, false) else {
                panic!()
            };
            assert!(target
                .pages
                .iter()
                .all(|&(l, p)| l == layer && [9, 3, 12].contains(&p)));
            events.extend(rx.finish_block(&b, Ok(())));
        }
    }
    assert_eq!(events.len(), 3);
    let done = tx.finish().unwrap();
    assert_eq!(done.chunk_count, 6);
    let ev = rx.sender_done(0, &done).unwrap();
    assert_eq!(
        ev,
        vec![TransferEvent::Complete {
            transfer_id: grant.transfer_id,
            request_id: 77,
            bytes: 72,
            blocks: 6
        }]
    );
    // The pages are free again, and late frames for the transfer are drained.
    assert!(rx.grant(78, &[9, 3, 12], 1, 0).is_ok());
    let late = KvBlock {
        transfer_id: grant.transfer_id,
        layer_start: 0,
        layer_count: 1,
        page_start: 0,
        page_count: 1,
        page_bytes: 8,
    };
    assert_eq!(
        rx.begin_block(0, &late, false).unwrap(),
        BlockDisposition::Drain
    );
}

#[test]
fn another_session_can_neither_fill_nor_finish_a_grant() {
    let mut rx = ReceiverState::new(1, 4, 8).unwrap();
    let (victim, intruder) = (11, 22);
    let grant = rx.grant_to(victim, 0xDEAD_BEEF, 1, &[0, 1], 1, 0).unwrap();
    let mut tx = SenderTransfer::new(grant.clone());
    let blocks = tx.send_layer(0, 16).unwrap();
    let done = tx.finish().unwrap();
    // The intruder names the right transfer id: refused as unknown, nothing moves.
    assert_eq!(
        rx.begin_block(intruder, &blocks[0], false)
            .unwrap_err()
            .reason(),
        "unknown_transfer"
    );
    assert_eq!(
        rx.sender_done(intruder, &done).unwrap_err().reason(),
        "unknown_transfer"
    );
    assert_eq!(rx.live_transfers(), 1);
    // The owner's own blocks still land: the intruder marked no page.
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(victim, &blocks[0], false) else {
        panic!("owner's block refused");
    };
    assert!(rx.finish_block(&blocks[0], Ok(())).len() == 1);
    let ev = rx.sender_done(victim, &done).unwrap();
    assert!(matches!(ev.last(), Some(TransferEvent::Complete { .. })));
    // After the end, a late block from the intruder is still not drained for it.
    assert_eq!(
        rx.begin_block(intruder, &blocks[0], false)
            .unwrap_err()
            .reason(),
        "unknown_transfer"
    );
    assert_eq!(
        rx.begin_block(victim, &blocks[0], false).unwrap(),
        BlockDisposition::Drain
    );
    // Ids in use cannot be granted again; 0 never.
    assert!(rx.grant_to(victim, 0xDEAD_BEEF, 2, &[2], 1, 0).is_err());
    assert!(rx.grant_to(victim, 0, 2, &[2], 1, 0).is_err());
}

#[test]
fn done_may_overtake_data() {
    let mut rx = ReceiverState::new(1, 4, 8).unwrap();
    let grant = rx.grant(1, &[0, 1], 1, 0).unwrap();
    let mut tx = SenderTransfer::new(grant);
    let blocks = tx.send_layer(0, 8).unwrap();
    let done = tx.finish().unwrap();
    assert!(land(&mut rx, &blocks[0]).is_empty());
    assert!(rx.sender_done(0, &done).unwrap().is_empty());
    let ev = land(&mut rx, &blocks[1]);
    assert!(matches!(ev.last(), Some(TransferEvent::Complete { .. })));
}

#[test]
fn blocks_outside_the_grant_are_violations() {
    let mut rx = ReceiverState::new(2, 8, 4).unwrap();
    let g = rx.grant(1, &[5, 6], 2, 0).unwrap();
    let b = |layer_start, page_start, page_count, page_bytes| KvBlock {
        transfer_id: g.transfer_id,
        layer_start,
        layer_count: 1,
        page_start,
        page_count,
        page_bytes,
    };
    for bad in [b(0, 1, 2, 4), b(2, 0, 1, 4), b(0, 0, 1, 8), b(0, 2, 1, 4)] {
        assert_eq!(
            rx.begin_block(0, &bad, false).unwrap_err().reason(),
            "grant_violation",
            "{bad:?}"
        );
    }
    assert!(matches!(
        rx.begin_block(0, &b(0, 0, 1, 4), false),
        Ok(BlockDisposition::Land(_))
    ));
    // In flight: a second writer of the same page is refused.
    assert_eq!(
        rx.begin_block(0, &b(0, 0, 1, 4), false)
            .unwrap_err()
            .reason(),
        "grant_violation"
    );
    let unknown = KvBlock {
        transfer_id: 999,
        ..b(0, 0, 1, 4)
    };
    assert_eq!(
        rx.begin_block(0, &unknown, false).unwrap_err().reason(),
        "unknown_transfer"
    );
}

#[test]
fn grants_never_overlap_and_bad_grants_change_nothing() {
    let mut rx = ReceiverState::new(1, 4, 4).unwrap();
    rx.grant(1, &[0, 1], 1, 0).unwrap();
    assert_eq!(
        rx.grant(2, &[1, 2], 1, 0).unwrap_err().reason(),
        "pages_busy"
    );
    assert_eq!(
        rx.grant(2, &[2, 2], 1, 0).unwrap_err().reason(),
        "invalid_argument"
    );
    assert_eq!(
        rx.grant(2, &[4], 1, 0).unwrap_err().reason(),
        "invalid_argument"
    );
    assert_eq!(
        rx.grant(2, &[2], 2, 0).unwrap_err().reason(),
        "invalid_argument"
    );
    assert!(rx.grant(2, &[2, 3], 1, 0).is_ok());
    assert_eq!(rx.live_transfers(), 2);
}

#[test]
fn a_bad_checksum_fails_the_transfer_and_frees_its_pages() {
    let mut rx = ReceiverState::new(1, 4, 4).unwrap();
    let g = rx.grant(5, &[0, 1], 1, 0).unwrap();
    let mut tx = SenderTransfer::new(g.clone());
    let blocks = tx.send_layer(0, 4).unwrap();
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(0, &blocks[0], false) else {
        panic!()
    };
    let err = Error::ChecksumMismatch {
        expected: 1,
        computed: 2,
    };
    let ev = rx.finish_block(&blocks[0], Err(err.clone()));
    assert_eq!(
        ev,
        vec![TransferEvent::Failed {
            transfer_id: g.transfer_id,
            request_id: 5,
            error: err
        }]
    );
    assert_eq!(rx.live_transfers(), 0);
    assert!(rx.grant(6, &[0, 1], 1, 0).is_ok());
    assert_eq!(
        rx.begin_block(0, &blocks[1], false).unwrap(),
        BlockDisposition::Drain
    );
}

#[test]
fn pages_of_a_failed_transfer_stay_held_while_a_block_lands() {
    let mut rx = ReceiverState::new(1, 4, 4).unwrap();
    let g = rx.grant(5, &[0, 1], 1, 0).unwrap();
    let mut tx = SenderTransfer::new(g.clone());
    let blocks = tx.send_layer(0, 4).unwrap();
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(0, &blocks[0], false) else {
        panic!()
    };
    // The deadline fires while block 0 is still being written by a lane.
    let ev = rx.fail(
        g.transfer_id,
        Error::DeadlineExceeded {
            what: "test".into(),
        },
    );
    assert!(matches!(&ev[0], TransferEvent::Failed { .. }));
    assert_eq!(rx.pages_held(), 2);
    assert_eq!(rx.grant(6, &[0], 1, 0).unwrap_err().reason(), "pages_busy");
    // Further blocks are drained; the lane's finish releases the pages.
    assert_eq!(
        rx.begin_block(0, &blocks[1], false).unwrap(),
        BlockDisposition::Drain
    );
    assert!(rx.finish_block(&blocks[0], Ok(())).is_empty());
    assert_eq!(rx.pages_held(), 0);
    assert!(rx.grant(6, &[0, 1], 1, 0).is_ok());
}

#[test]
fn a_short_transfer_is_incomplete_not_complete() {
    let mut rx = ReceiverState::new(1, 4, 4).unwrap();
    let g = rx.grant(5, &[0, 1], 1, 0).unwrap();
    let mut tx = SenderTransfer::new(g);
    let blocks = tx.send_layer(0, 4).unwrap();
    let done = tx.finish().unwrap();
    land(&mut rx, &blocks[0]);
    let lying = KvDone {
        chunk_count: 1,
        byte_count: 4,
        ..done
    };
    let ev = rx.sender_done(0, &lying).unwrap();
    assert!(
        matches!(&ev[0], TransferEvent::Failed { error, .. } if error.reason() == "transfer_incomplete")
    );
}

#[test]
fn sender_refuses_misuse() {
    let g = KvGrant {
        transfer_id: 1,
        request_id: 1,
        layer_count: 2,
        page_count: 5,
        page_bytes: 3,
        deadline_ms: 0,
    };
    let mut tx = SenderTransfer::new(g);
    assert!(tx.finish().is_err());
    assert!(tx.send_layer(2, 100).is_err());
    let blocks = tx.send_layer(0, 7).unwrap();
    assert_eq!(
        blocks.iter().map(|b| b.page_count).collect::<Vec<_>>(),
        vec![2, 2, 1]
    );
    assert!(tx.send_layer(0, 7).is_err());
    tx.send_layer(1, 1).unwrap();
    assert!(tx.finish().is_ok());
    assert!(tx.finish().is_err());
}

#[test]
fn block_header_parse_matches_the_frame_decoder() {
    let b = KvBlock {
        transfer_id: 9,
        layer_start: 1,
        layer_count: 2,
        page_start: 3,
        page_count: 4,
        page_bytes: 5,
    };
    let fixed = b.to_fixed();
    assert_eq!(KvBlock::parse(&fixed, 24 + 40).unwrap(), b);
    assert_eq!(
        KvBlock::parse(&fixed, 24 + 39).unwrap_err().reason(),
        "invalid_field"
    );
    assert_eq!(
        KvBlock::parse(&fixed, 10).unwrap_err().reason(),
        "truncated"
    );
}

// Lane failover: RESENT blocks, duplicates, abandoned blocks.

/// A grant of 1 layer x 4 pages of 4 bytes, planned as 4 one-page blocks.
fn four_blocks(rx: &mut ReceiverState) -> (KvGrant, Vec<KvBlock>, KvDone) {
    let g = rx.grant(5, &[0, 1, 2, 3], 1, 0).unwrap();
    let mut tx = SenderTransfer::new(g.clone());
    let blocks = tx.send_layer(0, 4).unwrap();
    assert_eq!(blocks.len(), 4);
    let done = tx.finish().unwrap();
    (g, blocks, done)
}

fn states(rx: &ReceiverState, id: u64) -> Vec<u8> {
    rx.live[&id].page_state.clone()
}

#[test]
fn a_resent_block_on_pending_pages_lands() {
    let mut rx = ReceiverState::new(1, 4, 4).unwrap();
    let (g, blocks, done) = four_blocks(&mut rx);
    for b in &blocks {
        let Ok(BlockDisposition::Land(_)) = rx.begin_block(0, b, true) else {
            panic!("refused")
        };
        rx.finish_block(b, Ok(()));
    }
    let ev = rx.sender_done(0, &done).unwrap();
    assert!(
        matches!(ev[..], [TransferEvent::Complete { transfer_id, blocks: 4, .. }] if transfer_id == g.transfer_id)
    );
}

#[test]
fn a_resent_block_that_landed_is_a_duplicate_and_changes_nothing() {
    let mut rx = ReceiverState::new(1, 4, 4).unwrap();
    let (g, blocks, done) = four_blocks(&mut rx);
    assert!(land(&mut rx, &blocks[0]).is_empty());
    let before = states(&rx, g.transfer_id);
    let progress = rx.progress_of(g.transfer_id);
    assert_eq!(
        rx.begin_block(0, &blocks[0], true).unwrap(),
        BlockDisposition::Duplicate
    );
    assert_eq!(states(&rx, g.transfer_id), before);
    assert_eq!(rx.progress_of(g.transfer_id), progress);
    // Not RESENT: the same block is a violation, as ever.
    assert_eq!(
        rx.begin_block(0, &blocks[0], false).unwrap_err().reason(),
        "grant_violation"
    );
    assert_eq!(states(&rx, g.transfer_id), before);
    // The duplicate is not counted: KV_DONE's unique counts still match.
    for b in &blocks[1..] {
        land(&mut rx, b);
    }
    let ev = rx.sender_done(0, &done).unwrap();
    assert!(matches!(
        ev[..],
        [TransferEvent::Complete {
            blocks: 4,
            bytes: 16,
            ..
        }]
    ));
}

#[test]
fn a_resent_block_landed_in_part_or_in_flight_is_a_violation() {
    let mut rx = ReceiverState::new(1, 4, 4).unwrap();
    let (g, blocks, _) = four_blocks(&mut rx);
    land(&mut rx, &blocks[0]);
    // Pages 0..2: page 0 landed, page 1 pending.
    let straddling = KvBlock {
        page_count: 2,
        ..blocks[0]
    };
    assert_eq!(
        rx.begin_block(0, &straddling, true).unwrap_err().reason(),
        "grant_violation"
    );
    // Page 2 in flight on another lane: RESENT or not, refused.
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(0, &blocks[2], false) else {
        panic!()
    };
    assert_eq!(
        rx.begin_block(0, &blocks[2], true).unwrap_err().reason(),
        "grant_violation"
    );
    assert_eq!(
        states(&rx, g.transfer_id),
        vec![PAGE_LANDED, PAGE_PENDING, PAGE_IN_FLIGHT, PAGE_PENDING]
    );
}

#[test]
fn an_abandoned_block_goes_back_to_pending_and_its_resend_completes() {
    let mut rx = ReceiverState::new(1, 4, 4).unwrap();
    let (g, blocks, done) = four_blocks(&mut rx);
    land(&mut rx, &blocks[0]);
    // Block 1 was being read from the lane that is revoked.
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(0, &blocks[1], false) else {
        panic!()
    };
    rx.abandon_block(&blocks[1]);
    assert_eq!(rx.live_transfers(), 1, "abandoning fails nothing");
    assert_eq!(
        states(&rx, g.transfer_id),
        vec![PAGE_LANDED, PAGE_PENDING, PAGE_PENDING, PAGE_PENDING]
    );
    assert_eq!(rx.live[&g.transfer_id].in_flight, 0);
    // KV_DONE overtakes the resends: nothing yet.
    assert!(rx.sender_done(0, &done).unwrap().is_empty());
    // The sender resends everything it had logged for the lane: block 0 (landed:
    // a duplicate) and block 1 (abandoned: lands), then the rest arrives.
    assert_eq!(
        rx.begin_block(0, &blocks[0], true).unwrap(),
        BlockDisposition::Duplicate
    );
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(0, &blocks[1], true) else {
        panic!()
    };
    assert!(rx.finish_block(&blocks[1], Ok(())).is_empty());
    land(&mut rx, &blocks[2]);
    let ev = land(&mut rx, &blocks[3]);
    assert_eq!(
        ev,
        vec![
            TransferEvent::LayerComplete {
                transfer_id: g.transfer_id,
                request_id: 5,
                layer: 0
            },
            TransferEvent::Complete {
                transfer_id: g.transfer_id,
                request_id: 5,
                bytes: 16,
                blocks: 4
            }
        ]
    );
    assert_eq!(rx.pages_held(), 0);
}

#[test]
fn abandoning_a_block_of_an_ended_transfer_releases_its_pages() {
    let mut rx = ReceiverState::new(1, 4, 4).unwrap();
    let (g, blocks, _) = four_blocks(&mut rx);
    let Ok(BlockDisposition::Land(_)) = rx.begin_block(0, &blocks[0], false) else {
        panic!()
    };
    rx.fail(
        g.transfer_id,
        Error::Cancelled {
            detail: "test".into(),
        },
    );
    assert_eq!(rx.pages_held(), 4, "held while the block lands");
    rx.abandon_block(&blocks[0]);
    assert_eq!(rx.pages_held(), 0);
    // Late RESENT blocks of the ended transfer are drained.
    assert_eq!(
        rx.begin_block(0, &blocks[0], true).unwrap(),
        BlockDisposition::Drain
    );
}

#[test]
fn an_empty_grant_holds_nothing_takes_no_block_and_completes_on_an_empty_done() {
    let mut rx = ReceiverState::new(2, 4, 4).unwrap();
    let g = rx.grant(9, &[], 2, 0).unwrap();
    assert_eq!((g.page_count, g.layer_count), (0, 2));
    assert_eq!(rx.pages_held(), 0);
    // Every page stays grantable while it is live.
    let other = rx.grant(10, &[0, 1, 2, 3], 2, 0).unwrap();
    // No block can land in it: page 0 of it is outside its 0 pages.
    let block = KvBlock {
        transfer_id: g.transfer_id,
        layer_start: 0,
        layer_count: 1,
        page_start: 0,
        page_count: 1,
        page_bytes: 4,
    };
    assert_eq!(
        rx.begin_block(0, &block, false).unwrap_err().reason(),
        "grant_violation"
    );
    // The sender: each layer is no blocks, finish says 0 and 0.
    let mut tx = SenderTransfer::new(g.clone());
    assert!(tx.send_layer(0, 16).unwrap().is_empty());
    assert!(tx.send_layer(1, 16).unwrap().is_empty());
    assert_eq!(
        tx.send_layer(2, 16).unwrap_err().reason(),
        "invalid_argument"
    );
    assert_eq!(
        tx.send_pages(0..1, &[0], 16).unwrap_err().reason(),
        "invalid_argument"
    );
    let done = tx.finish().unwrap();
    assert_eq!((done.chunk_count, done.byte_count), (0, 0));
    assert_eq!(
        rx.sender_done(0, &done).unwrap(),
        vec![TransferEvent::Complete {
            transfer_id: g.transfer_id,
            request_id: 9,
            bytes: 0,
            blocks: 0
        }]
    );
    assert_eq!(rx.live_transfers(), 1);
    assert_eq!(rx.request_of(other.transfer_id), Some(10));
}

#[test]
fn an_empty_grant_with_a_done_that_claims_data_fails() {
    let mut rx = ReceiverState::new(1, 4, 4).unwrap();
    let g = rx.grant(9, &[], 1, 0).unwrap();
    let claims = KvDone {
        transfer_id: g.transfer_id,
        chunk_count: 1,
        byte_count: 4,
    };
    let ev = rx.sender_done(0, &claims).unwrap();
    assert!(
        matches!(&ev[0], TransferEvent::Failed { error, .. } if error.reason() == "transfer_incomplete"),
        "{ev:?}"
    );
}

fn notice(
    transfer_id: u64,
    layers: std::ops::Range<u16>,
    pages: u64,
    page_bytes: u64,
) -> LocalDone {
    LocalDone {
        transfer_id,
        layer_start: layers.start,
        layer_count: layers.end - layers.start,
        page_count: pages,
        byte_count: pages * page_bytes,
    }
}

#[test]
fn layer_notices_complete_a_one_sided_transfer_in_any_layer_order() {
    let mut rx = ReceiverState::new(3, 16, 8).unwrap();
    let g = rx.grant(7, &[4, 9], 3, 0).unwrap();
    let id = g.transfer_id;
    // Layer 2, then layers 0..2 in one notice: the second notice completes it.
    let ev = rx.layers_written(0, &notice(id, 2..3, 2, 8)).unwrap();
    assert_eq!(
        ev,
        vec![TransferEvent::LayerComplete {
            transfer_id: id,
            request_id: 7,
            layer: 2
        }]
    );
    assert!(rx.progress_of(id).unwrap() > 0, "a notice is progress");
    let ev = rx.layers_written(0, &notice(id, 0..2, 4, 8)).unwrap();
    assert_eq!(ev.len(), 3, "{ev:?}");
    assert_eq!(
        ev[2],
        TransferEvent::Complete {
            transfer_id: id,
            request_id: 7,
            bytes: 48,
            blocks: 2
        }
    );
    assert_eq!(rx.pages_held(), 0);
    // A late notice of the ended transfer, from its session, changes nothing.
    assert!(rx
        .layers_written(0, &notice(id, 0..1, 2, 8))
        .unwrap()
        .is_empty());
}

#[test]
fn a_layer_notice_outside_twice_or_foreign_is_a_violation_and_wrong_counts_fail() {
    let mut rx = ReceiverState::new(2, 16, 8).unwrap();
    let g = rx.grant_to(1, 40, 7, &[4, 9], 2, 0).unwrap();
    let id = g.transfer_id;
    for bad in [notice(id, 2..3, 2, 8), notice(id, 1..3, 4, 8)] {
        assert_eq!(
            rx.layers_written(1, &bad).unwrap_err().reason(),
            "grant_violation"
        );
    }
    // Another session: as if the transfer did not exist, and nothing changed.
    assert_eq!(
        rx.layers_written(2, &notice(id, 0..1, 2, 8))
            .unwrap_err()
            .reason(),
        "unknown_transfer"
    );
    assert_eq!(rx.progress_of(id), Some(0));
    rx.layers_written(1, &notice(id, 0..1, 2, 8)).unwrap();
    assert_eq!(
        rx.layers_written(1, &notice(id, 0..1, 2, 8))
            .unwrap_err()
            .reason(),
        "grant_violation",
        "a layer announced twice"
    );
    // One page short on layer 1: the transfer fails, the session goes on.
    let ev = rx.layers_written(1, &notice(id, 1..2, 1, 8)).unwrap();
    assert!(
        matches!(&ev[..], [TransferEvent::Failed { error, .. }] if error.reason() == "transfer_incomplete"),
        "{ev:?}"
    );
    assert_eq!(rx.pages_held(), 0);
}

#[test]
fn an_empty_grant_completes_on_one_notice_naming_all_its_layers() {
    let mut rx = ReceiverState::new(3, 4, 4).unwrap();
    let g = rx.grant(9, &[], 3, 0).unwrap();
    let id = g.transfer_id;
    assert_eq!(
        rx.layers_written(0, &notice(id, 0..1, 0, 4))
            .unwrap_err()
            .reason(),
        "grant_violation",
        "an empty grant's notice names every layer"
    );
    assert_eq!(
        rx.layers_written(0, &notice(id, 0..3, 0, 4)).unwrap(),
        vec![TransferEvent::Complete {
            transfer_id: id,
            request_id: 9,
            bytes: 0,
            blocks: 0
        }]
    );
    let g = rx.grant(10, &[], 1, 0).unwrap();
    let claims = LocalDone {
        page_count: 0,
        byte_count: 4,
        ..notice(g.transfer_id, 0..1, 0, 4)
    };
    let ev = rx.layers_written(0, &claims).unwrap();
    assert!(
        matches!(&ev[..], [TransferEvent::Failed { error, .. }] if error.reason() == "transfer_incomplete"),
        "{ev:?}"
    );
}
