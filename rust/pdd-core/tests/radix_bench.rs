//! Timing and memory figures for docs/radix.md. Ignored by default; run in release:
//!
//! ```text
//! cargo test --release -p pdd-core --test radix_bench -- --ignored --nocapture
//! ```
//!
//! It prints figures and asserts nothing about time (timings on a shared machine are
//! noisy); it only checks that each workload did what it claims. Those checks also run
//! on every `cargo test`, at a small scale (`radix_workloads_do_what_they_claim`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use pdd_core::radix::{Mirror, NodeRef, RadixCache};

const PAGE: usize = 64;
const VOCAB: u32 = 150_000;

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
    fn tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| self.below(u64::from(VOCAB)) as u32)
            .collect()
    }
    /// A turn of 500..=2000 tokens, rounded down to whole pages.
    fn turn(&mut self) -> Vec<u32> {
        let len = 500 + self.below(1501) as usize;
        self.tokens(len / PAGE * PAGE)
    }
}

struct Handles(u32);

impl Handles {
    fn take(&mut self, pages: usize) -> Vec<u32> {
        let start = self.0;
        self.0 += pages as u32;
        (start..self.0).collect()
    }
}

fn stats(mut samples: Vec<Duration>) -> String {
    samples.sort_unstable();
    let n = samples.len();
    let mean = samples.iter().sum::<Duration>() / n as u32;
    format!(
        "median {:>8.2?}  mean {:>8.2?}  p90 {:>8.2?}  (n={n})",
        samples[n / 2],
        mean,
        samples[n * 9 / 10]
    )
}

struct Session {
    context: Vec<u32>,
    node: NodeRef,
}

/// `sessions` multi-turn sessions under one shared 4,096-token system prompt, each
/// grown turn by turn (resumed inserts) to at least `target` tokens.
fn build_sessions(
    cache: &mut RadixCache,
    rng: &mut Rng,
    handles: &mut Handles,
    sessions: usize,
    target: usize,
) -> Vec<Session> {
    let system = rng.tokens(4096);
    cache
        .insert(0, &system, &handles.take(system.len() / PAGE))
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..sessions {
        let mut m = cache.match_prefix(0, &system);
        let mut context = system.clone();
        while context.len() < target {
            let turn = rng.turn();
            let r = cache
                .insert_from(m.node, &turn, &handles.take(turn.len() / PAGE))
                .unwrap();
            context.extend_from_slice(&turn);
            m.node = r.node;
        }
        out.push(Session {
            context,
            node: m.node,
        });
        cache.drain_events();
    }
    out
}

/// How big each workload is.
struct Scale {
    sessions: usize,
    context_tokens: usize,
    match_rounds: usize,
    repeats: usize,
    evictions: usize,
    leaves: usize,
}

#[test]
#[ignore = "benchmark: run in release with --ignored --nocapture"]
fn radix_figures() {
    figures(&Scale {
        sessions: 100,
        context_tokens: 41_000,
        match_rounds: 20,
        repeats: 1000,
        evictions: 100,
        leaves: 20_000,
    });
}

/// The same workloads and checks at a size every `cargo test` can afford.
#[test]
fn radix_workloads_do_what_they_claim() {
    figures(&Scale {
        sessions: 4,
        context_tokens: 3_000,
        match_rounds: 1,
        repeats: 2,
        evictions: 2,
        leaves: 200,
    });
}

fn figures(scale: &Scale) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut handles = Handles(0);
    let mut cache = RadixCache::new(PAGE).unwrap();

    // --- sessions of >= context_tokens tokens (page size 64) ----------------------------
    let mut sessions = build_sessions(
        &mut cache,
        &mut rng,
        &mut handles,
        scale.sessions,
        scale.context_tokens,
    );
    let stats_now = cache.stats();
    let tokens = stats_now.pages * PAGE;
    let bytes = cache.heap_bytes();
    println!(
        "tree: {} sessions, {} nodes, {} pages, {} cached tokens; heap {} bytes = {:.3} bytes/token",
        sessions.len(),
        stats_now.nodes,
        stats_now.pages,
        tokens,
        bytes,
        bytes as f64 / tokens as f64
    );
    let context_len = sessions[0].context.len();

    // match_prefix of a whole ~41K-token context, from the root.
    let mut samples = Vec::new();
    for round in 0..scale.match_rounds {
        for s in &sessions {
            let t = Instant::now();
            let m = cache.match_prefix(0, black_box(&s.context));
            samples.push(t.elapsed());
            if round == 0 {
                assert_eq!(m.matched_tokens, s.context.len());
            }
        }
    }
    println!(
        "match_prefix  {context_len:>6}-token context, {} sessions in turn: {}",
        sessions.len(),
        stats(samples)
    );

    // The same context again and again: the tree's path and the prompt stay in cache.
    let mut samples = Vec::new();
    for _ in 0..scale.repeats {
        let t = Instant::now();
        black_box(cache.match_prefix(0, black_box(&sessions[0].context)));
        samples.push(t.elapsed());
    }
    println!(
        "match_prefix  {context_len:>6}-token context, same one repeated: {}",
        stats(samples)
    );

    // peek_prefix of the same (read-only walk).
    let mut samples = Vec::new();
    for s in &sessions {
        let t = Instant::now();
        black_box(cache.peek_prefix(0, black_box(&s.context)));
        samples.push(t.elapsed());
    }
    println!(
        "peek_prefix   {context_len:>6}-token context: {}",
        stats(samples)
    );

    // Next turn: match_from + insert_from of 500-2000 new tokens.
    let mut match_from = Vec::new();
    let mut insert_from = Vec::new();
    let mut turn_tokens = 0;
    for s in &mut sessions {
        let turn = rng.turn();
        turn_tokens += turn.len();
        let hs = handles.take(turn.len() / PAGE);
        let t = Instant::now();
        let m = cache.match_from(s.node, black_box(&turn)).unwrap();
        match_from.push(t.elapsed());
        assert_eq!(m.matched_tokens, 0);
        let t = Instant::now();
        let r = cache.insert_from(s.node, black_box(&turn), &hs).unwrap();
        insert_from.push(t.elapsed());
        assert_eq!(r.cached_tokens, 0);
        s.node = r.node;
        s.context.extend_from_slice(&turn);
        cache.drain_events();
    }
    let avg_turn = turn_tokens / sessions.len();
    println!(
        "match_from    new turn (avg {avg_turn} tokens): {}",
        stats(match_from)
    );
    println!(
        "insert_from   new turn (avg {avg_turn} tokens): {}",
        stats(insert_from)
    );

    // The same kind of turn inserted from the root: O(whole context) token compares.
    let mut insert_full = Vec::new();
    for s in &mut sessions {
        let turn = rng.turn();
        let mut all = cache.match_prefix(0, &s.context).handles;
        all.extend(handles.take(turn.len() / PAGE));
        s.context.extend_from_slice(&turn);
        let t = Instant::now();
        let r = cache.insert(0, black_box(&s.context), &all).unwrap();
        insert_full.push(t.elapsed());
        assert!(r.duplicates.is_empty());
        cache.drain_events();
    }
    println!(
        "insert        whole context + turn (~{} tokens): {}",
        sessions[0].context.len(),
        stats(insert_full)
    );

    // Mirror: the same tree's events, one instance; match the whole context.
    let mut mirror = Mirror::new(PAGE).unwrap();
    mirror.resync(1, &cache.snapshot()).unwrap();
    let mut samples = Vec::new();
    for s in &sessions {
        let t = Instant::now();
        let m = mirror.match_prefix(0, black_box(&s.context));
        samples.push(t.elapsed());
        assert_eq!(m[0].matched_pages * PAGE, s.context.len());
    }
    println!(
        "mirror match  {:>6}-token context, 1 instance: {}",
        sessions[0].context.len(),
        stats(samples)
    );
    println!(
        "mirror: {} pages, heap {} bytes = {:.1} bytes/page",
        mirror.pages(1).unwrap(),
        mirror.heap_bytes(),
        mirror.heap_bytes() as f64 / mirror.pages(1).unwrap() as f64
    );

    // Eviction in the session tree: 64 pages come from the tail of one or two
    // session leaves (each ~20 pages), so few nodes are freed.
    let mut samples = Vec::new();
    for _ in 0..scale.evictions {
        let t = Instant::now();
        let freed = cache.evict(black_box(64));
        samples.push(t.elapsed());
        assert_eq!(freed.len(), 64);
        cache.drain_events();
    }
    println!(
        "evict(64)     session tree (large leaves): {}",
        stats(samples)
    );

    // --- eviction with 20K leaves -------------------------------------------------
    let mut cache = RadixCache::new(PAGE).unwrap();
    let mut handles = Handles(0);
    let system = rng.tokens(2048);
    cache
        .insert(0, &system, &handles.take(system.len() / PAGE))
        .unwrap();
    for _ in 0..scale.leaves {
        let mut seq = system.clone();
        let pages = 1 + rng.below(4) as usize;
        seq.extend(rng.tokens(pages * PAGE));
        let mut hs = cache.match_prefix(0, &system).handles;
        hs.extend(handles.take(pages));
        cache.insert(0, &seq, &hs).unwrap();
    }
    cache.drain_events();
    let before = cache.stats();
    println!(
        "evict tree: {} evictable leaves, {} pages; heap {:.3} bytes/token",
        before.evictable_leaves,
        before.pages,
        cache.heap_bytes() as f64 / (before.pages * PAGE) as f64
    );
    assert!(before.evictable_leaves >= scale.leaves);
    let mut samples = Vec::new();
    for _ in 0..scale.evictions {
        let t = Instant::now();
        let freed = cache.evict(black_box(64));
        samples.push(t.elapsed());
        assert_eq!(freed.len(), 64);
        cache.drain_events();
    }
    println!(
        "evict(64)     with ~{}K leaves: {}",
        cache.stats().evictable_leaves / 1000,
        stats(samples)
    );
}
