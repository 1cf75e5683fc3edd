//! Eviction microbenchmark with the shape of `pdd-transport bench radix`'s eviction
//! workload (python/pdd_transport/radix_bench.py, `_evict_workload`): about 20,000
//! evictable leaves of 1 to 4 pages (page size 64) under 512 one-page stems; each
//! round times `evict(64)` (about 26 leaves freed), then adds leaves untimed back to 20,000.
//! Ignored by default; run in release:
//!
//! ```text
//! cargo test --release -p pdd-core --test radix_evict_bench -- --ignored --nocapture
//! ```
//!
//! Between rounds the Python benchmark runs the interpreter and numpy, which pushes
//! the tree out of the CPU caches. The `cold` pass imitates that by streaming over a
//! buffer larger than L2 before each timed call; the `warm` pass does not. Prints
//! p50/p90/p99 and asserts nothing about time. `PDD_EVICT_ROUNDS` sets the rounds
//! (default 20,000); `PDD_EVICT_LEAVES` the leaf count (default 20,000).

use std::hint::black_box;
use std::time::{Duration, Instant};

use pdd_core::radix::RadixCache;

const PAGE: usize = 64;
const VOCAB: u64 = 129_280;
const STEMS: usize = 512;

/// xorshift64*: a fixed, dependency-free source of token IDs and lengths.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Workload {
    rng: Rng,
    stems: Vec<Vec<u32>>,
    next_handle: u32,
    seq: Vec<u32>,
    handles: Vec<u32>,
}

impl Workload {
    fn new(seed: u64) -> Workload {
        let mut rng = Rng(seed);
        let stems = (0..STEMS)
            .map(|_| (0..PAGE).map(|_| rng.below(VOCAB) as u32).collect())
            .collect();
        Workload {
            rng,
            stems,
            next_handle: 0,
            seq: Vec::new(),
            handles: Vec::new(),
        }
    }

    /// One leaf of 1 to 4 pages under a random stem (the stem page itself is cached
    /// after its first use).
    fn add_leaves(&mut self, cache: &mut RadixCache, n: usize) {
        for _ in 0..n {
            let pages = 1 + self.rng.below(4) as usize;
            let stem = self.rng.below(STEMS as u64) as usize;
            self.seq.clear();
            self.seq.extend_from_slice(&self.stems[stem]);
            for _ in 0..pages * PAGE {
                let t = self.rng.below(VOCAB) as u32;
                self.seq.push(t);
            }
            self.handles.clear();
            self.handles
                .extend(self.next_handle..self.next_handle + pages as u32 + 1);
            self.next_handle += pages as u32 + 1;
            cache
                .insert(0, &self.seq, &self.handles)
                .expect("insert leaf");
        }
    }
}

fn pct(samples: &mut [Duration], q: f64) -> Duration {
    samples.sort_unstable();
    samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)]
}

fn run(leaves: usize, rounds: usize, cold: bool) {
    let mut cache = RadixCache::new(PAGE).expect("cache");
    let mut w = Workload::new(0x5eed_0001);
    w.add_leaves(&mut cache, leaves);
    // Bigger than L2 (2 MiB here), smaller than L3: roughly what an interpreter and
    // numpy touch between two Python calls.
    let mut scratch = vec![0u64; 4 << 20 >> 3];
    let mut samples = Vec::with_capacity(rounds);
    let mut leaf_counts = Vec::with_capacity(rounds);
    let mut freed_total = 0usize;
    for round in 0..rounds {
        leaf_counts.push(cache.stats().evictable_leaves);
        if cold {
            for (i, x) in scratch.iter_mut().enumerate().step_by(8) {
                *x = x.wrapping_add(i as u64 ^ round as u64);
            }
            black_box(&scratch);
        }
        let t0 = Instant::now();
        let freed = cache.evict(black_box(64));
        let dt = t0.elapsed();
        samples.push(dt);
        assert_eq!(freed.len(), 64);
        freed_total += freed.len();
        drop(black_box(freed));
        cache.drain_events();
        // Python adds 26 leaves per round for 300 rounds; over many more rounds that
        // drifts, so top back up to the leaf count instead (about 26 a round).
        let missing = leaves.saturating_sub(cache.stats().evictable_leaves);
        w.add_leaves(&mut cache, missing);
    }
    let bytes = cache.heap_bytes() as f64 / (cache.stats().pages * PAGE) as f64;
    leaf_counts.sort_unstable();
    println!(
        "evict(64) {:>4} leaves~{:>6}: p50 {:>8.2?}  p90 {:>8.2?}  p99 {:>8.2?}  (n={rounds}, {} pages freed, {:.2} B/token)",
        if cold { "cold" } else { "warm" },
        leaf_counts[leaf_counts.len() / 2],
        pct(&mut samples, 0.5),
        pct(&mut samples, 0.9),
        pct(&mut samples, 0.99),
        freed_total,
        bytes,
    );
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The workload's own checks (64 pages freed per call, the tree as built) at a size
/// every `cargo test` can afford.
#[test]
fn radix_evict_workload_does_what_it_claims() {
    run(300, 20, false);
    run(300, 20, true);
}

#[test]
#[ignore = "benchmark: run in release with --ignored --nocapture"]
fn radix_evict_figures() {
    let leaves = env("PDD_EVICT_LEAVES", 20_000);
    let rounds = env("PDD_EVICT_ROUNDS", 20_000);
    run(leaves, rounds, false);
    run(leaves, rounds, true);
}
