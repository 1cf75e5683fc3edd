//! The KV layout decoder (`pdd_core::kv::layout::decode`, what a peer's layout blob
//! goes through): encodings of random valid layouts, mutated, must decode to a layout
//! that re-encodes to exactly the input, or be refused with a named field; never panic.

use pdd_core::kv::layout::{
    decode, Arrangement, KvDtype, KvLayout, LayoutError, LayoutFields, MAX_ENCODED_LEN,
};
use rand::rngs::SmallRng;
use rand::Rng;

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

fn random_layout(rng: &mut SmallRng) -> Option<KvLayout> {
    let total_layers = rng.random_range(1..=128u16);
    let l0 = rng.random_range(0..total_layers);
    let total_kv_heads = rng.random_range(1..=64u16);
    let h0 = rng.random_range(0..total_kv_heads);
    let model_len = rng.random_range(1..=40usize);
    let mut f = LayoutFields {
        model: (0..model_len)
            .map(|_| {
                *['a', 'é', '€', '😀', '/']
                    .get(rng.random_range(0..5))
                    .unwrap_or(&'a')
            })
            .collect(),
        dtype: KvDtype::ALL[rng.random_range(0..KvDtype::ALL.len())],
        total_layers,
        layers: (l0, rng.random_range(l0 + 1..=total_layers)),
        tokens_per_block: rng.random_range(1..=256),
        total_kv_heads,
        heads: (h0, rng.random_range(h0 + 1..=total_kv_heads)),
        head_size: rng.random_range(1..=256),
        arrangement: Arrangement::ALL[rng.random_range(0..Arrangement::ALL.len())],
        page_bytes: 0,
    };
    let data = 2
        * u64::from(f.heads.1 - f.heads.0)
        * u64::from(f.tokens_per_block)
        * u64::from(f.head_size)
        * u64::from(f.dtype.bytes());
    f.page_bytes = u32::try_from(data + rng.random_range(0..4096)).ok()?;
    // A model name cut at 40 characters of up to 4 bytes may pass 128 bytes: skip it.
    KvLayout::new(f).ok()
}

fn mutate(base: &[u8], rng: &mut SmallRng) -> Vec<u8> {
    let mut b = base.to_vec();
    for _ in 0..rng.random_range(1..=4) {
        let len = b.len();
        match rng.random_range(0..6) {
            0 if len > 0 => {
                let i = rng.random_range(0..len);
                b[i] ^= 1 << rng.random_range(0..8);
            }
            1 if len > 0 => {
                let i = rng.random_range(0..len);
                b[i] = [0u8, 1, 0x7f, 0x80, 0xff][rng.random_range(0..5)];
            }
            2 if len >= 4 => {
                let i = rng.random_range(0..=len - 4);
                let v: u32 = if rng.random() {
                    rng.random()
                } else {
                    rng.random_range(0..300)
                };
                b[i..i + 4].copy_from_slice(&v.to_le_bytes());
            }
            3 => b.truncate(rng.random_range(0..=len)),
            4 => {
                let extra = rng.random_range(1..=MAX_ENCODED_LEN);
                b.extend((0..extra).map(|_| rng.random::<u8>()));
            }
            _ => {}
        }
    }
    b
}

/// One layout, encoded, maybe mutated, decoded: `Err` (the input and why) if a
/// decoded layout does not re-encode to the input, an unmutated one does not come
/// back, or a refusal names no field of the encoding.
pub fn check_layout_decoder(rng: &mut SmallRng) -> Result<(), (Vec<u8>, String)> {
    let Some(layout) = random_layout(rng) else {
        return Ok(());
    };
    let encoded = layout.encode();
    if encoded.len() > MAX_ENCODED_LEN {
        return Err((encoded, "encoding over its bound".into()));
    }
    let mutated = rng.random_bool(0.8);
    let input = if mutated {
        mutate(&encoded, rng)
    } else {
        encoded
    };
    match decode(&input) {
        Ok(got) if got.encode() != input => {
            Err((input, "decoded layout re-encodes differently".into()))
        }
        Ok(got) if !mutated && got != layout => Err((input, "layout did not round-trip".into())),
        Ok(_) => Ok(()),
        Err(_) if !mutated => Err((input, "a valid encoding was refused".into())),
        Err(LayoutError::InvalidField { field, .. }) if !FIELDS.contains(&field) => {
            Err((input, format!("refusal names an unknown field {field}")))
        }
        Err(_) => Ok(()),
    }
}
