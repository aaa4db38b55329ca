//! Prefix index benchmark: match + insert of an 8 KiB prompt into an index that already
//! holds 100 000 prompts.
//!
//! Workload: 64-byte blocks (16 tokens × 4 bytes), so an 8 KiB prompt is 128 blocks. 200
//! system prompts of 1–4 KiB, picked with a skew (a few are hot); each prompt is a system
//! prompt followed by a unique user part up to 8 KiB. 8 instances; a prompt goes to the
//! instance its system prompt hashes to 80 % of the time, elsewhere 20 %. Clock: 10 ms per
//! prompt. A counting allocator measures the real heap bytes of the index, printed once as
//! bytes per cached block next to `approx_bytes()`.
//!
//! Run: `CARGO_TARGET_DIR=/work/main/target-plugins cargo bench -p tokengate-plugins --bench prefix`
// Counts allocations with a global allocator of its own: unsafe by nature.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use tokengate_plugins::{block_hashes, InstanceKey, PrefixIndex, PrefixIndexConfig};

struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new, Relaxed);
        LIVE.fetch_sub(l.size(), Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const BLOCK: usize = 64;
const PROMPT: usize = 8 * 1024;
const SYSTEMS: usize = 200;
const PROMPTS: usize = 100_000;
const INSTANCES: u64 = 8;

struct World {
    index: PrefixIndex,
    /// Chained hashes of each system prompt.
    sys: Vec<Vec<u64>>,
    rng: SmallRng,
    now_ms: u64,
    /// Some of the prompts inserted, to re-send.
    seen: Vec<(Vec<u64>, InstanceKey)>,
}

impl World {
    fn new() -> World {
        let mut rng = SmallRng::seed_from_u64(42);
        let sys_text: Vec<Vec<u8>> = (0..SYSTEMS)
            .map(|_| {
                let mut t = vec![0u8; rng.gen_range(16..=64) * BLOCK];
                rng.fill_bytes(&mut t);
                t
            })
            .collect();
        let sys = sys_text.iter().map(|t| block_hashes(t, BLOCK)).collect();
        let before = LIVE.load(Relaxed);
        let mut w = World {
            index: PrefixIndex::new(PrefixIndexConfig::default()),
            sys,
            rng,
            now_ms: 0,
            seen: Vec::new(),
        };
        let mut buf = vec![0u8; PROMPT];
        for i in 0..PROMPTS {
            let s = w.pick_system();
            let t = &sys_text[s];
            buf[..t.len()].copy_from_slice(t);
            w.rng.fill_bytes(&mut buf[t.len()..]);
            let h = block_hashes(&buf, BLOCK);
            let inst = w.instance_for(s);
            w.now_ms += 10;
            w.index.insert(&h, inst, w.now_ms);
            if i % 100 == 0 {
                w.seen.push((h, inst));
            }
        }
        let seen_bytes: usize = w.seen.iter().map(|(h, _)| h.capacity() * 8 + 32).sum();
        let real = LIVE.load(Relaxed) - before - seen_bytes;
        let g = w.index.gauges();
        eprintln!(
            "index: {PROMPTS} prompts of {PROMPT} B, {} blocks cached in {} nodes; heap {:.1} MiB real \
             = {:.2} B/block; approx_bytes {:.1} MiB = {:.2} B/block",
            g.blocks,
            g.nodes,
            real as f64 / 1048576.0,
            real as f64 / g.blocks as f64,
            g.bytes as f64 / 1048576.0,
            g.bytes as f64 / g.blocks as f64,
        );
        w
    }

    /// Skewed: u² makes low ids hot.
    fn pick_system(&mut self) -> usize {
        let u: f64 = self.rng.gen();
        ((u * u) * SYSTEMS as f64) as usize
    }

    fn instance_for(&mut self, s: usize) -> InstanceKey {
        if self.rng.gen_bool(0.8) {
            InstanceKey(s as u64 % INSTANCES)
        } else {
            InstanceKey(self.rng.gen_range(0..INSTANCES))
        }
    }

    /// A new prompt: a system prompt plus a unique tail (a unique tail's chained hashes are
    /// just fresh random numbers).
    fn fresh(&mut self) -> Vec<u64> {
        let s = self.pick_system();
        let mut h = self.sys[s].clone();
        while h.len() < PROMPT / BLOCK {
            h.push(self.rng.next_u64());
        }
        h
    }
}

fn bench(c: &mut Criterion) {
    let mut w = World::new();
    let base_bytes = w.index.approx_bytes();

    let mut text = vec![0u8; PROMPT];
    w.rng.fill_bytes(&mut text);
    c.bench_function("block_hashes 8KiB/64B blocks", |b| {
        b.iter(|| block_hashes(black_box(&text), BLOCK))
    });

    let probes: Vec<Vec<u64>> = (0..4096).map(|_| w.fresh()).collect();
    let mut i = 0;
    c.bench_function("match fresh 8KiB prompt (100k index)", |b| {
        b.iter(|| {
            i = (i + 1) % probes.len();
            black_box(w.index.match_prefix(&probes[i], w.now_ms))
        })
    });

    let mut j = 0;
    c.bench_function("match+insert repeated 8KiB prompt (100k index)", |b| {
        b.iter(|| {
            j = (j + 1) % w.seen.len();
            let (h, inst) = &w.seen[j];
            let m = w.index.match_prefix(h, w.now_ms);
            w.index.insert(h, *inst, w.now_ms);
            black_box(m)
        })
    });

    // Fresh prompts grow the index: batches of prompts are prepared outside the timing, and
    // the index is evicted back to its starting size between batches (also untimed).
    c.bench_function("match+insert fresh 8KiB prompt (100k index)", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(2000);
                let batch: Vec<(Vec<u64>, InstanceKey)> = (0..n)
                    .map(|_| {
                        let h = w.fresh();
                        let inst = InstanceKey(w.rng.gen_range(0..INSTANCES));
                        (h, inst)
                    })
                    .collect();
                w.now_ms += 10;
                let now = w.now_ms;
                let start = Instant::now();
                for (h, inst) in &batch {
                    let m = w.index.match_prefix(h, now);
                    w.index.insert(h, *inst, now);
                    black_box(m);
                }
                total += start.elapsed();
                left -= n;
                if w.index.approx_bytes() > base_bytes + (64 << 20) {
                    w.index.evict_to(base_bytes);
                }
            }
            total
        })
    });

    let g = w.index.gauges();
    eprintln!(
        "after: {} nodes, {} blocks, {:.1} MiB approx, {} nodes evicted",
        g.nodes,
        g.blocks,
        g.bytes as f64 / 1048576.0,
        g.evicted_nodes
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    targets = bench
}
criterion_main!(benches);
