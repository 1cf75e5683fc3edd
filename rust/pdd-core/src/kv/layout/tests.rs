//! Layout checks, the encoding, and the plan against an element-wise reference in
//! simulated pools with guard bytes.

use proptest::prelude::*;

use super::*;

fn fields(tpb: u32, heads: (u16, u16), arrangement: Arrangement) -> LayoutFields {
    LayoutFields {
        model: "tiny-llama".into(),
        dtype: KvDtype::Bf16,
        total_layers: 4,
        layers: (0, 4),
        tokens_per_block: tpb,
        total_kv_heads: 8,
        heads,
        head_size: 4,
        arrangement,
        page_bytes: 2 * u32::from(heads.1 - heads.0) * tpb * 4 * 2,
    }
}

fn layout(f: LayoutFields) -> KvLayout {
    KvLayout::new(f).expect("valid layout")
}

fn invalid_field(f: LayoutFields) -> &'static str {
    match KvLayout::new(f) {
        Err(LayoutError::InvalidField { field, .. }) => field,
        Ok(l) => panic!("accepted {l:?}"),
    }
}

#[test]
fn every_invalid_field_is_named() {
    let ok = fields(16, (0, 8), Arrangement::KvHeadToken);
    let with = |edit: &dyn Fn(&mut LayoutFields)| {
        let mut f = ok.clone();
        edit(&mut f);
        invalid_field(f)
    };
    assert_eq!(with(&|f| f.model.clear()), "model");
    assert_eq!(with(&|f| f.model = "é".repeat(65)), "model");
    assert_eq!(with(&|f| f.total_layers = 0), "total_layers");
    assert_eq!(with(&|f| f.layers = (2, 2)), "layers");
    assert_eq!(with(&|f| f.layers = (0, 5)), "layers");
    assert_eq!(with(&|f| f.tokens_per_block = 0), "tokens_per_block");
    assert_eq!(with(&|f| f.total_kv_heads = 0), "total_kv_heads");
    assert_eq!(with(&|f| f.heads = (3, 2)), "heads");
    assert_eq!(with(&|f| f.heads = (0, 9)), "heads");
    assert_eq!(with(&|f| f.head_size = 0), "head_size");
    assert_eq!(with(&|f| f.page_bytes -= 1), "page_bytes");
    // A page whose data would not fit in u32 bytes at all.
    assert_eq!(
        with(&|f| {
            f.tokens_per_block = u32::MAX;
            f.head_size = u32::MAX;
        }),
        "page_bytes"
    );
    let mut max = ok.clone();
    max.model = "m".repeat(MAX_MODEL_LEN);
    assert!(KvLayout::new(max).is_ok());
}

#[test]
fn names_and_codes_round_trip() {
    for d in KvDtype::ALL {
        assert_eq!(KvDtype::from_name(d.name()), Some(d));
        assert_eq!(KvDtype::from_code(d.code()), Some(d));
    }
    for a in Arrangement::ALL {
        assert_eq!(Arrangement::from_name(a.name()), Some(a));
        assert_eq!(Arrangement::from_code(a.code()), Some(a));
        let mut dims = a.dims().map(|d| d as usize);
        dims.sort_unstable();
        assert_eq!(dims, [0, 1, 2]);
    }
    assert_eq!(KvDtype::from_code(5), None);
    assert_eq!(Arrangement::from_code(7), None);
}

#[test]
fn the_digest_covers_the_model_geometry_only() {
    let a = layout(fields(16, (0, 8), Arrangement::KvHeadToken));
    let mut f = fields(32, (2, 4), Arrangement::TokenHeadKv);
    f.layers = (1, 3);
    f.page_bytes += 64;
    assert_eq!(a.digest(), layout(f).digest());
    for edit in [
        |f: &mut LayoutFields| f.model.push('x'),
        |f: &mut LayoutFields| f.dtype = KvDtype::F16,
        |f: &mut LayoutFields| {
            f.total_layers = 5;
        },
        |f: &mut LayoutFields| f.total_kv_heads = 9,
        |f: &mut LayoutFields| {
            f.head_size = 2;
        },
    ] {
        let mut f = fields(16, (0, 8), Arrangement::KvHeadToken);
        edit(&mut f);
        assert_ne!(a.digest(), layout(f).digest());
    }
}

#[test]
fn a_mismatch_names_the_first_differing_field() {
    let base = fields(16, (0, 8), Arrangement::KvHeadToken);
    let src = layout(base.clone());
    type Edit = fn(&mut LayoutFields);
    let cases: [(&str, Edit); 7] = [
        ("model", |f| f.model = "other".into()),
        ("dtype", |f| f.dtype = KvDtype::F16),
        ("total_layers", |f| f.total_layers = 8),
        ("total_kv_heads", |f| {
            f.total_kv_heads = 16;
        }),
        ("head_size", |f| {
            f.head_size = 2;
        }),
        ("layers", |f| {
            f.total_layers = 4;
            f.layers = (0, 2);
        }),
        ("heads", |f| f.heads = (0, 4)),
    ];
    let mut src_f = base.clone();
    src_f.layers = (2, 4);
    src_f.heads = (4, 8);
    src_f.page_bytes /= 2;
    let narrow = layout(src_f);
    for (field, edit) in cases {
        let mut f = base.clone();
        edit(&mut f);
        let dst = layout(f);
        let against = if matches!(field, "layers" | "heads") {
            &narrow
        } else {
            &src
        };
        let err = check_compatible(against, &dst).expect_err(field);
        assert_eq!(err.field(), field, "{err}");
        assert_eq!(err.reason(), "layout_mismatch");
        assert!(matches!(
            plan(against, &dst, 0, 16),
            Err(PlanError::Mismatch(m)) if m.field() == field
        ));
    }
    // Model and dtype both differ: the model is named.
    let mut f = base;
    f.model = "x".into();
    f.dtype = KvDtype::F32;
    f.page_bytes *= 2;
    assert_eq!(
        check_compatible(&src, &layout(f)).unwrap_err().field(),
        "model"
    );
}

#[test]
fn identical_layouts_move_whole_pages() {
    let l = layout(fields(16, (0, 8), Arrangement::KvHeadToken));
    let p = plan(&l, &l, 0, 48).unwrap();
    assert_eq!(p.unit_bytes, l.fields().page_bytes);
    assert_eq!(p.src_units, vec![0, 1, 2]);
    assert_eq!(p.dst_units, p.src_units);
    assert_eq!(
        (p.layers, p.src_first_layer, p.dst_first_layer),
        ((0, 4), 0, 0)
    );
}

#[test]
fn tp_two_into_one_moves_half_pages() {
    let src = layout(fields(16, (4, 8), Arrangement::KvHeadToken));
    let dst = layout(fields(16, (0, 8), Arrangement::KvHeadToken));
    let p = plan(&src, &dst, 0, 32).unwrap();
    // [2][4 heads][16 tokens] of a source page is two runs of 4x16 vectors.
    assert_eq!(p.unit_bytes, src.fields().page_bytes / 2);
    assert_eq!(p.src_units, vec![0, 1, 2, 3]);
    assert_eq!(p.dst_units, vec![1, 3, 5, 7]);
}

#[test]
fn block_sizes_48_and_32_map_through_units_of_16_tokens() {
    let src = layout(fields(48, (0, 8), Arrangement::KvHeadToken));
    let dst = layout(fields(32, (0, 8), Arrangement::KvHeadToken));
    let p = plan(&src, &dst, 0, 96).unwrap();
    assert_eq!(p.unit_bytes, 16 * 4 * 2);
    assert_eq!(p.src_units.len(), 96 / 16 * 2 * 8);
    assert_eq!(p.src_units_per_page, 3 * 16);
    assert_eq!(p.dst_units_per_page, 2 * 16);
}

#[test]
fn an_empty_range_or_a_backwards_one() {
    let l = layout(fields(16, (0, 8), Arrangement::KvHeadToken));
    let p = plan(&l, &l, 7, 7).unwrap();
    assert!(p.src_units.is_empty() && p.dst_units.is_empty());
    assert_eq!(
        plan(&l, &l, 8, 7),
        Err(PlanError::TokenRange { first: 8, end: 7 })
    );
}

#[test]
fn the_work_is_bounded() {
    let mut f = fields(1, (0, 8), Arrangement::KvHeadToken);
    f.total_kv_heads = 1024;
    f.heads = (0, 1024);
    f.page_bytes = 2 * 1024 * 4 * 2;
    let l = layout(f);
    assert!(matches!(
        plan(&l, &l, 0, u32::MAX),
        Err(PlanError::TooLarge {
            what: "head vectors",
            ..
        })
    ));
    // Fewer vectors, but a 1-byte unit (odd padding): too many units.
    let mut f = fields(16, (0, 8), Arrangement::KvHeadToken);
    f.page_bytes += 1;
    let odd = layout(f);
    assert!(matches!(
        plan(&odd, &odd, 0, 16 * 16384),
        Err(PlanError::TooLarge { what: "units", .. })
    ));
}

// ---- the plan against an element-wise reference ----

/// Byte offset of element `e` of head vector (kv, head held index, token slot) in a
/// page, from explicit strides: written apart from `KvLayout::vector_offset`.
fn reference_offset(l: &LayoutFields, kv: u64, h: u64, t: u64, e: u64) -> u64 {
    let (hs, eb) = (u64::from(l.head_size), u64::from(l.dtype.bytes()));
    let (nh, nt) = (
        u64::from(l.heads.1 - l.heads.0),
        u64::from(l.tokens_per_block),
    );
    let vector = match l.arrangement {
        Arrangement::KvHeadToken => kv * nh * nt + h * nt + t,
        Arrangement::KvTokenHead => kv * nt * nh + t * nh + h,
        Arrangement::TokenKvHead => t * 2 * nh + kv * nh + h,
        Arrangement::HeadKvToken => h * 2 * nt + kv * nt + t,
        Arrangement::TokenHeadKv => t * nh * 2 + h * 2 + kv,
        Arrangement::HeadTokenKv => h * nt * 2 + t * 2 + kv,
        // Keys as [head_size][tokens] in the head's first half, values as usual.
        Arrangement::HeadKeysTransposed if kv == 0 => {
            return (h * 2 * nt * hs + e * nt + t) * eb;
        }
        Arrangement::HeadKeysTransposed => h * 2 * nt + nt + t,
    };
    (vector * hs + e) * eb
}

const GUARD: usize = 7;
const GUARD_ID: u32 = u32::MAX;
const UNTOUCHED_ID: u32 = u32::MAX - 1;

/// A pool of `pages` pages, each between guard bytes; every byte a u32 id.
struct Pool {
    page: usize,
    bytes: Vec<u32>,
}

impl Pool {
    fn new(page: u32, pages: usize, fill: impl Fn(usize) -> u32) -> Pool {
        let page = page as usize;
        let mut bytes = vec![GUARD_ID; GUARD + pages * (page + GUARD)];
        for p in 0..pages {
            for i in 0..page {
                let at = GUARD + p * (page + GUARD) + i;
                bytes[at] = fill(at);
            }
        }
        Pool { page, bytes }
    }

    /// Index of byte `off` of page `p`.
    fn at(&self, p: usize, off: usize) -> usize {
        assert!(off < self.page);
        GUARD + p * (self.page + GUARD) + off
    }
}

/// Applies `p` between pools of `end` tokens' blocks and compares with the reference.
fn check_plan(src: &KvLayout, dst: &KvLayout, first: u32, end: u32) -> Result<(), TestCaseError> {
    let p = plan(src, dst, first, end).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let (s, d) = (src.fields(), dst.fields());
    prop_assert_eq!(p.src_units.len(), p.dst_units.len());
    prop_assert_eq!(s.page_bytes % p.unit_bytes, 0);
    prop_assert_eq!(d.page_bytes % p.unit_bytes, 0);
    let s_pages = end.div_ceil(s.tokens_per_block) as usize;
    let d_pages = end.div_ceil(d.tokens_per_block) as usize;
    let sp = Pool::new(s.page_bytes, s_pages, |i| i as u32);
    let mut dp = Pool::new(d.page_bytes, d_pages, |_| UNTOUCHED_ID);
    let mut expect = dp.bytes.clone();
    let mut written = vec![0u8; dp.bytes.len()];
    let unit = p.unit_bytes as usize;
    let (sk, dk) = (p.src_units_per_page as usize, p.dst_units_per_page as usize);
    for (&su, &du) in p.src_units.iter().zip(&p.dst_units) {
        let (su, du) = (su as usize, du as usize);
        prop_assert!(
            su / sk < s_pages && du / dk < d_pages,
            "unit outside the request's pages"
        );
        for i in 0..unit {
            let from = sp.at(su / sk, (su % sk) * unit + i);
            let to = dp.at(du / dk, (du % dk) * unit + i);
            dp.bytes[to] = sp.bytes[from];
            written[to] += 1;
        }
    }
    // The reference: every byte of every (kv, common head, token) vector.
    let mut moved = 0u64;
    let heads = (s.heads.0.max(d.heads.0), s.heads.1.min(d.heads.1));
    for t in first..end {
        for h in heads.0..heads.1 {
            for kv in 0..2 {
                for e in 0..u64::from(d.head_size) {
                    for b in 0..u64::from(d.dtype.bytes()) {
                        let (st, dt) = (t % s.tokens_per_block, t % d.tokens_per_block);
                        let so =
                            reference_offset(s, kv, u64::from(h - s.heads.0), u64::from(st), e);
                        let dof =
                            reference_offset(d, kv, u64::from(h - d.heads.0), u64::from(dt), e);
                        let from = sp.at((t / s.tokens_per_block) as usize, (so + b) as usize);
                        let to = dp.at((t / d.tokens_per_block) as usize, (dof + b) as usize);
                        prop_assert_eq!(expect[to], UNTOUCHED_ID, "reference lands twice");
                        expect[to] = sp.bytes[from];
                        moved += 1;
                    }
                }
            }
        }
    }
    prop_assert_eq!(moved, p.src_units.len() as u64 * p.unit_bytes as u64);
    prop_assert!(written.iter().all(|w| *w <= 1), "a byte written twice");
    if let Some(i) = (0..expect.len()).find(|&i| expect[i] != dp.bytes[i]) {
        return Err(TestCaseError::fail(format!(
            "byte {i} of the destination: {} expected, {} found",
            expect[i], dp.bytes[i]
        )));
    }
    prop_assert_eq!(
        p.layers,
        (s.layers.0.max(d.layers.0), s.layers.1.min(d.layers.1))
    );
    prop_assert_eq!(s.layers.0 + p.src_first_layer, p.layers.0);
    prop_assert_eq!(d.layers.0 + p.dst_first_layer, p.layers.0);
    Ok(())
}

fn side(total_layers: u16, total_heads: u16) -> impl Strategy<Value = LayoutFields> {
    (
        prop::sample::select(vec![1u32, 2, 4, 8, 16, 32, 48, 64, 128]),
        (0..total_layers).prop_flat_map(move |a| (Just(a), a + 1..=total_layers)),
        (0..total_heads).prop_flat_map(move |a| (Just(a), a + 1..=total_heads)),
        prop::sample::select(Arrangement::ALL.to_vec()),
        prop::sample::select(vec![0u32, 1, 2, 6, 64]),
    )
        .prop_map(move |(tpb, layers, heads, arrangement, pad)| LayoutFields {
            model: "m".into(),
            dtype: KvDtype::Bf16,
            total_layers,
            layers,
            tokens_per_block: tpb,
            total_kv_heads: total_heads,
            heads,
            head_size: 1,
            arrangement,
            page_bytes: pad,
        })
}

/// Two compatible layouts (common layers and heads), page padding added, and a token
/// range.
fn pair() -> impl Strategy<Value = (KvLayout, KvLayout, u32, u32)> {
    (
        1u16..4,
        1u16..5,
        prop::sample::select(KvDtype::ALL.to_vec()),
        1u32..4,
    )
        .prop_flat_map(|(layers, heads, dtype, head_size)| {
            (
                side(layers, heads),
                side(layers, heads),
                Just((dtype, head_size)),
                0u32..200,
                0u32..200,
            )
        })
        .prop_filter_map(
            "layers or heads do not meet",
            |(mut s, mut d, (dtype, hs), a, b)| {
                for f in [&mut s, &mut d] {
                    f.dtype = dtype;
                    f.head_size = hs;
                    let data = 2
                        * u32::from(f.heads.1 - f.heads.0)
                        * f.tokens_per_block
                        * hs
                        * dtype.bytes();
                    f.page_bytes += data;
                }
                let (s, d) = (KvLayout::new(s).ok()?, KvLayout::new(d).ok()?);
                check_compatible(&s, &d).ok()?;
                Some((s, d, a.min(b), a.max(b)))
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_moved_byte_lands_once_where_the_reference_says((src, dst, first, end) in pair()) {
        check_plan(&src, &dst, first, end)?;
    }

    #[test]
    fn the_sender_finds_the_grants_first_token((src, dst, _first, end) in pair()) {
        let tpb = dst.fields().tokens_per_block;
        for h in 0..=end / tpb {
            let first = h * tpb;
            let p = plan(&src, &dst, first, end).unwrap();
            let n = p.src_units.len() as u64;
            prop_assert_eq!(
                first_token_for_units(&src, &dst, end, n, Some(p.unit_bytes)).unwrap(),
                Some(first)
            );
            // Without the unit size: right, or None where two boundaries tie.
            let guess = first_token_for_units(&src, &dst, end, n, None).unwrap();
            prop_assert!(guess.is_none() || guess == Some(first), "{:?} for {}", guess, first);
        }
    }

    #[test]
    fn encoding_round_trips((src, _dst, _a, _b) in pair(), model in "\\PC{1,32}") {
        let mut f = src.fields().clone();
        f.model = model.chars().take(32).collect();
        if let Ok(l) = KvLayout::new(f) {
            let bytes = l.encode();
            prop_assert!(bytes.len() <= MAX_ENCODED_LEN);
            prop_assert_eq!(decode(&bytes).unwrap(), l);
        }
    }

    #[test]
    fn hostile_bytes_are_refused_by_name_or_round_trip(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        check_decoded(&bytes)?;
    }

    #[test]
    fn mutated_encodings_are_refused_by_name_or_round_trip(
        (src, _dst, _a, _b) in pair(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let mut bytes = src.encode();
        for (at, v) in edits {
            let i = at.index(bytes.len());
            bytes[i] = v;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        check_decoded(&bytes)?;
    }
}

/// Every field a refusal may name.
const FIELDS: [&str; 12] = [
    "length",
    "version",
    "dtype",
    "arrangement",
    "model",
    "total_layers",
    "layers",
    "tokens_per_block",
    "total_kv_heads",
    "heads",
    "head_size",
    "page_bytes",
];

fn check_decoded(bytes: &[u8]) -> Result<(), TestCaseError> {
    match decode(bytes) {
        Ok(l) => prop_assert_eq!(l.encode(), bytes.to_vec()),
        Err(LayoutError::InvalidField { field, .. }) => {
            prop_assert!(FIELDS.contains(&field), "unnamed field {}", field)
        }
    }
    Ok(())
}

#[test]
fn oversized_and_short_inputs_are_length_errors() {
    let l = layout(fields(16, (0, 8), Arrangement::KvHeadToken));
    let bytes = l.encode();
    for bad in [
        vec![0u8; 257],
        bytes[..27].to_vec(),
        [bytes.clone(), vec![0]].concat(),
    ] {
        assert!(matches!(
            decode(&bad),
            Err(LayoutError::InvalidField {
                field: "length",
                ..
            })
        ));
    }
    let mut v2 = bytes.clone();
    v2[0] = 2;
    assert!(matches!(
        decode(&v2),
        Err(LayoutError::InvalidField {
            field: "version",
            ..
        })
    ));
    let mut bad_utf8 = bytes;
    let n = bad_utf8.len();
    bad_utf8[n - 1] = 0xff;
    assert!(matches!(
        decode(&bad_utf8),
        Err(LayoutError::InvalidField { field: "model", .. })
    ));
}

#[test]
fn transposed_keys_map_between_block_sizes_in_runs_of_one_key_element() {
    // vLLM's CPU cache, 32-token blocks into 64-token ones: a key element's run of one
    // source block (32 tokens x 2 bytes) is the unit; values move in those units too.
    let src = layout(fields(32, (0, 8), Arrangement::HeadKeysTransposed));
    let dst = layout(fields(64, (0, 8), Arrangement::HeadKeysTransposed));
    let p = plan(&src, &dst, 64, 192).unwrap();
    assert_eq!(p.unit_bytes, 32 * 2);
    check_plan(&src, &dst, 64, 192).unwrap();
    check_plan(&dst, &src, 64, 192).unwrap();
    // Into or out of an arrangement whose keys are not transposed: element by element.
    let plain = layout(fields(64, (0, 8), Arrangement::HeadKvToken));
    check_plan(&src, &plain, 0, 128).unwrap();
    check_plan(&plain, &src, 0, 128).unwrap();
    // TP 2 -> 1 with transposed keys on both sides: whole halves of each page.
    let rank = layout(fields(32, (4, 8), Arrangement::HeadKeysTransposed));
    let all = layout(fields(32, (0, 8), Arrangement::HeadKeysTransposed));
    assert_eq!(
        plan(&rank, &all, 0, 64).unwrap().unit_bytes,
        4 * 2 * 32 * 4 * 2
    );
    check_plan(&rank, &all, 0, 64).unwrap();
}
