//! Sub-page grants and grants from a first pool layer: the receiver's bookkeeping.

use crate::error::Error;
use crate::kv::TransferEvent;
use crate::kv::{BlockDisposition, GrantUnits, KvBlock, ReceiverState, SenderTransfer};

/// Units of 4 bytes in pages of 16 (4 units a page), layers from `first`.
fn units(first_layer: u16) -> GrantUnits {
    GrantUnits {
        unit_bytes: Some(4),
        first_layer,
    }
}

fn grant(
    rx: &mut ReceiverState,
    tid: u64,
    dest: &[u32],
    layers: u16,
    u: GrantUnits,
) -> crate::error::Result<crate::wire::KvGrant> {
    rx.grant_units_to(0, tid, tid, dest, layers, 0, u)
}

fn invalid(r: crate::error::Result<crate::wire::KvGrant>, naming: &str) {
    match r {
        Err(Error::InvalidArgument(m)) => assert!(m.contains(naming), "{m} does not name {naming}"),
        other => panic!("expected InvalidArgument naming {naming}, got {other:?}"),
    }
}

#[test]
fn units_land_at_their_pool_units_on_layers_from_first_layer() {
    let mut rx = ReceiverState::new(3, 4, 16).unwrap();
    let g = grant(&mut rx, 7, &[1, 6], 2, units(1)).unwrap();
    assert_eq!((g.page_bytes, g.page_count, g.layer_count), (4, 2, 2));
    // Units 1 and 6 touch pool pages 0 and 1: both held.
    assert_eq!(rx.pages_held(), 2);
    let mut tx = SenderTransfer::new(g.clone());
    let mut events = Vec::new();
    for layer in 0..2 {
        for b in tx.send_layer(layer, 1 << 20).unwrap() {
            let Ok(BlockDisposition::Land(t)) = rx.begin_block(0, &b, false) else {
                panic!("not landed")
            };
            assert_eq!(t.page_bytes, 4);
            assert_eq!(t.pages, vec![(layer + 1, 1), (layer + 1, 6)]);
            events.extend(rx.finish_block(&b, Ok(())));
        }
    }
    events.extend(rx.sender_done(0, &tx.finish().unwrap()).unwrap());
    let layers: Vec<u16> = events
        .iter()
        .filter_map(|e| match e {
            TransferEvent::LayerComplete { layer, .. } => Some(*layer),
            _ => None,
        })
        .collect();
    assert_eq!(layers, vec![1, 2], "LayerComplete names pool layers");
    assert!(matches!(
        events.last(),
        Some(TransferEvent::Complete { bytes: 16, .. })
    ));
    assert_eq!(rx.pages_held(), 0);
}

#[test]
fn the_unit_must_divide_the_pool_page() {
    let mut rx = ReceiverState::new(2, 4, 16).unwrap();
    for bad in [0, 3, 5, 32] {
        let u = GrantUnits {
            unit_bytes: Some(bad),
            first_layer: 0,
        };
        invalid(grant(&mut rx, 1, &[0], 1, u), "page_bytes");
    }
    for good in [1, 2, 8, 16] {
        let u = GrantUnits {
            unit_bytes: Some(good),
            first_layer: 0,
        };
        let g = grant(&mut rx, u64::from(good), &[0], 1, u).unwrap();
        assert_eq!(g.page_bytes, good);
        rx.fail(g.transfer_id, Error::Cancelled { detail: "t".into() });
    }
    assert_eq!(rx.pages_held(), 0);
}

#[test]
fn first_layer_and_layer_count_stay_inside_the_pool() {
    let mut rx = ReceiverState::new(3, 4, 16).unwrap();
    invalid(grant(&mut rx, 1, &[0], 3, units(1)), "first_layer");
    invalid(grant(&mut rx, 1, &[0], 1, units(3)), "first_layer");
    invalid(grant(&mut rx, 1, &[0], 0, units(0)), "layer_count");
    assert!(grant(&mut rx, 1, &[0], 1, units(2)).is_ok());
}

#[test]
fn units_outside_the_pool_or_listed_twice_are_refused_changing_nothing() {
    let mut rx = ReceiverState::new(2, 4, 16).unwrap();
    // 4 pages of 4 units: units 0..16.
    invalid(
        grant(&mut rx, 1, &[3, 16], 1, units(0)),
        "unit 16 outside the pool",
    );
    invalid(
        grant(&mut rx, 1, &[3, 5, 3], 1, units(0)),
        "unit 3 appears twice",
    );
    invalid(grant(&mut rx, 1, &[u32::MAX], 1, units(0)), "pages");
    assert_eq!(rx.pages_held(), 0);
    assert_eq!(rx.live_transfers(), 0);
    assert!(!rx.id_in_use(1));
    // Two units of one page in one grant are fine.
    assert!(grant(&mut rx, 1, &[15, 12], 1, units(0)).is_ok());
    assert_eq!(rx.pages_held(), 1);
}

#[test]
fn unit_grants_share_a_page_only_where_their_bytes_differ() {
    let mut rx = ReceiverState::new(2, 4, 16).unwrap();
    grant(&mut rx, 1, &[1, 6], 1, units(0)).unwrap();
    // Units 1 (page 0, bytes 4..8) and 6 (page 1, bytes 8..12) are transfer 1's; the
    // same units, also on another layer and mixed with free ones, are busy.
    for (dest, layer) in [(&[1][..], 0), (&[6][..], 1), (&[12, 5, 6][..], 0)] {
        match grant(&mut rx, 2, dest, 1, units(layer)) {
            Err(Error::PagesBusy { detail }) => assert!(detail.contains("transfer 1"), "{detail}"),
            other => panic!("{other:?}"),
        }
    }
    // A page of which a unit grant holds part is busy for a whole-page grant.
    assert!(matches!(
        rx.grant_to(0, 3, 3, &[1], 1, 0),
        Err(Error::PagesBusy { .. })
    ));
    assert_eq!(rx.pages_held(), 2);
    // Other bytes of the same pages go to another grant (a second TP rank's heads);
    // a whole-page grant holds a free page, which unit grants then cannot share.
    grant(&mut rx, 4, &[0, 2, 3, 4, 5, 7], 1, units(0)).unwrap();
    rx.grant_to(0, 5, 5, &[3], 2, 0).unwrap();
    assert!(matches!(
        grant(&mut rx, 6, &[13], 1, units(0)),
        Err(Error::PagesBusy { .. })
    ));
    assert_eq!(rx.pages_held(), 3);
    // A page is free once every grant holding part of it ended.
    rx.fail(1, Error::Cancelled { detail: "t".into() });
    assert_eq!(rx.pages_held(), 3);
    assert!(grant(&mut rx, 7, &[1], 1, units(0)).is_ok());
    rx.fail(4, Error::Cancelled { detail: "t".into() });
    rx.fail(7, Error::Cancelled { detail: "t".into() });
    assert_eq!(rx.pages_held(), 1);
    assert!(rx.grant_to(0, 8, 8, &[0, 1], 2, 0).is_ok());
}

#[test]
fn duplicates_resends_and_late_blocks_count_units() {
    let mut rx = ReceiverState::new(2, 4, 16).unwrap();
    let g = grant(&mut rx, 9, &[1, 6, 11], 1, units(1)).unwrap();
    let block = |page_start, page_count| KvBlock {
        transfer_id: 9,
        layer_start: 0,
        layer_count: 1,
        page_start,
        page_count,
        page_bytes: 4,
    };
    // The pool's page size is not the grant's.
    let mut whole = block(0, 1);
    whole.page_bytes = 16;
    assert!(matches!(
        rx.begin_block(0, &whole, false),
        Err(Error::GrantViolation { .. })
    ));
    // Unit 3 of the grant does not exist.
    assert!(matches!(
        rx.begin_block(0, &block(2, 2), false),
        Err(Error::GrantViolation { .. })
    ));
    let b = block(0, 2);
    let Ok(BlockDisposition::Land(t)) = rx.begin_block(0, &b, false) else {
        panic!()
    };
    assert_eq!(t.pages, vec![(1, 1), (1, 6)]);
    assert!(rx.finish_block(&b, Ok(())).is_empty());
    // Written twice: refused; a whole RESENT block that landed: a duplicate.
    assert!(matches!(
        rx.begin_block(0, &block(1, 1), false),
        Err(Error::GrantViolation { .. })
    ));
    assert_eq!(
        rx.begin_block(0, &b, true).unwrap(),
        BlockDisposition::Duplicate
    );
    // An abandoned block's units go back to pending and land again.
    let last = block(2, 1);
    assert!(matches!(
        rx.begin_block(0, &last, false),
        Ok(BlockDisposition::Land(_))
    ));
    rx.abandon_block(&last);
    let Ok(BlockDisposition::Land(t)) = rx.begin_block(0, &last, true) else {
        panic!()
    };
    assert_eq!(t.pages, vec![(1, 11)]);
    // The transfer fails with the block in flight: its pages stay held until it
    // finishes, and late blocks drain.
    rx.fail(g.transfer_id, Error::Cancelled { detail: "t".into() });
    assert_eq!(rx.pages_held(), 3);
    assert_eq!(
        rx.begin_block(0, &block(0, 1), false).unwrap(),
        BlockDisposition::Drain
    );
    rx.finish_block(&last, Ok(()));
    assert_eq!(rx.pages_held(), 0);
}
