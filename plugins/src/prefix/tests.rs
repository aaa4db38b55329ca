use super::*;
use rand::{Rng, SeedableRng};

fn k(i: u64) -> InstanceKey {
    InstanceKey(i)
}
fn seq(range: std::ops::Range<u64>) -> Vec<u64> {
    range.collect()
}
fn idx() -> PrefixIndex {
    PrefixIndex::new(PrefixIndexConfig {
        ttl_ms: 50_000,
        shards: 4,
    })
}
fn check(ix: &PrefixIndex) {
    let (nodes, blocks, bytes) = ix.audit().expect("invariants");
    let g = ix.gauges();
    assert_eq!((g.nodes, g.blocks, g.bytes), (nodes, blocks, bytes));
}

#[test]
fn per_instance_match_lengths_with_splits() {
    let ix = idx();
    let a = seq(1..11); // 10 blocks
    let mut b = seq(1..6);
    b.push(99); // shares 5 blocks with a
    ix.insert(&a, k(1), 0);
    ix.insert(&b, k(2), 0);
    let m = ix.match_prefix(&a, 0);
    assert_eq!((m.prompt_blocks, m.best), (10, 10));
    assert_eq!(m.matched(k(1)), 10);
    assert_eq!(m.matched(k(2)), 5);
    assert_eq!(m.matched(k(3)), 0);
    assert!((m.ratio(k(2)) - 0.5).abs() < 1e-12);
    let m = ix.match_prefix(&b, 0);
    assert_eq!((m.matched(k(1)), m.matched(k(2)), m.best), (5, 6, 6));
    // A prompt that diverges inside an edge / ends inside an edge.
    let mut c = seq(1..4);
    c.push(1234);
    let m = ix.match_prefix(&c, 0);
    assert_eq!((m.matched(k(1)), m.matched(k(2))), (3, 3));
    let m = ix.match_prefix(&seq(1..3), 0);
    assert_eq!((m.matched(k(1)), m.best, m.prompt_blocks), (2, 2, 2));
    assert_eq!(
        ix.match_prefix(&[42, 43], 0),
        PrefixMatch {
            prompt_blocks: 2,
            ..Default::default()
        }
    );
    check(&ix);
    assert_eq!(ix.gauges().blocks, 11);
}

#[test]
fn a_shorter_prompt_splits_and_lists_only_its_part() {
    let ix = idx();
    ix.insert(&seq(1..11), k(1), 0);
    ix.insert(&seq(1..5), k(2), 0);
    let m = ix.match_prefix(&seq(1..11), 0);
    assert_eq!((m.matched(k(1)), m.matched(k(2))), (10, 4));
    assert_eq!(ix.gauges().nodes, 2);
    // Re-inserting an existing path is a pure refresh.
    let before = ix.gauges();
    ix.insert(&seq(1..11), k(1), 1000);
    ix.insert(&seq(1..3), k(2), 1000);
    assert_eq!(ix.gauges(), before);
    check(&ix);
}

#[test]
fn ttl_ignores_then_sweeps_idle_holders() {
    let ix = idx(); // ttl 50 s
    ix.insert(&seq(1..9), k(1), 0);
    ix.insert(&seq(1..5), k(2), 0);
    ix.touch(&seq(1..9), k(1), 40_000); // refreshed
                                        // At 60 s: k2 (last use 0 s) is stale, k1 (40 s) is fresh.
    let m = ix.match_prefix(&seq(1..9), 60_000);
    assert_eq!((m.matched(k(1)), m.matched(k(2))), (8, 0));
    assert_eq!(ix.sweep_expired(60_000), 0); // k2 only held a shared node: nothing freed
    check(&ix);
    assert_eq!(ix.match_prefix(&seq(1..9), 60_000).per_instance.len(), 1);
    // At 100 s everything is stale.
    assert_eq!(ix.match_prefix(&seq(1..9), 100_000).best, 0);
    assert_eq!(ix.sweep_expired(100_000), 2);
    assert_eq!(ix.gauges().nodes, 0);
    assert_eq!(ix.gauges().bytes, 0);
    assert_eq!(ix.gauges().expired_nodes, 2);
}

#[test]
fn held_blocks_follow_every_insert_split_trim_sweep_and_removal() {
    let ix = idx(); // ttl 50 s
    ix.insert(&seq(1..9), k(1), 0); // k1: 8
    ix.insert(&seq(1..5), k(2), 0); // splits the edge; k2: 4
    ix.insert(&seq(100..110), k(2), 0); // k2: 14
    ix.insert(&seq(1..9), k(1), 0); // a refresh adds nothing
    assert_eq!((ix.held_blocks(k(1)), ix.held_blocks(k(2))), (8, 14));
    assert_eq!(ix.held_blocks(k(3)), 0);
    check(&ix);
    // The engine k1 reported only 2 cached blocks of 1..9: it lost the other 6.
    assert_eq!(ix.trim(&seq(1..9), k(1), 2), 6);
    assert_eq!(ix.held_blocks(k(1)), 2);
    check(&ix);
    // k2's 100..110 goes stale; k1 refreshed 1..3 at 40 s.
    ix.touch(&seq(1..3), k(1), 40_000);
    ix.touch(&seq(1..5), k(2), 40_000);
    ix.sweep_expired(60_000);
    assert_eq!((ix.held_blocks(k(1)), ix.held_blocks(k(2))), (2, 4));
    check(&ix);
    ix.remove_instance(k(2));
    assert_eq!((ix.held_blocks(k(1)), ix.held_blocks(k(2))), (2, 0));
    check(&ix);
    ix.evict_to(0);
    assert_eq!(ix.held_blocks(k(1)), 0);
    check(&ix);
}

#[test]
fn an_instance_over_its_capacity_loses_its_least_recently_used_entries_first() {
    let ix = idx();
    let b: Vec<u64> = seq(1..5).into_iter().chain(seq(20..26)).collect();
    ix.insert(&seq(1..9), k(1), 0); // A at 0 s: 8 blocks
    ix.insert(&seq(1..9), k(2), 0); // k2 holds A too
    ix.insert(&b, k(1), 1_000); // B at 1 s shares A's first 4 (refreshed) and adds 6
    ix.insert(&seq(50..60), k(1), 2_000); // C at 2 s: 10
    assert_eq!(ix.held_blocks(k(1)), 24);
    // Under the target: nothing to do.
    assert_eq!(ix.evict_instance_to(k(1), 24), 0);
    // 4 over: A's tail (last used at 0 s) goes; k2 keeps all of A.
    assert_eq!(ix.evict_instance_to(k(1), 20), 4);
    let a = ix.match_prefix(&seq(1..9), 2_000);
    assert_eq!((a.matched(k(1)), a.matched(k(2))), (4, 8));
    check(&ix);
    // 8 over: the whole tick of 1 s goes (B, and the shared prefix under it); C stays.
    assert_eq!(ix.evict_instance_to(k(1), 12), 10);
    assert_eq!(ix.match_prefix(&b, 2_000).matched(k(1)), 0);
    assert_eq!(ix.match_prefix(&seq(50..60), 2_000).matched(k(1)), 10);
    assert_eq!(ix.held_blocks(k(2)), 8);
    assert_eq!(ix.gauges().capacity_evicted_blocks, 14);
    check(&ix);
    // What was used in the newest tick stays, even over the target: D lands 50 ms after
    // C, in the same tick.
    ix.insert(&seq(70..80), k(1), 2_050);
    assert_eq!(ix.evict_instance_to(k(1), 5), 0);
    assert_eq!(ix.held_blocks(k(1)), 20);
    // A tick later C and D are the oldest: both go, E stays.
    ix.insert(&seq(90..95), k(1), 2_100);
    assert_eq!(ix.evict_instance_to(k(1), 5), 20);
    assert_eq!(ix.held_blocks(k(1)), 5);
    check(&ix);
    // What the bound forgot still counts as placed there (4 + 10 + 20 blocks); k2 was
    // never bounded; an engine-reported eviction lowers both; leaving the service resets.
    assert_eq!(ix.placed_blocks(k(1)), 5 + 34);
    assert_eq!(ix.placed_blocks(k(2)), ix.held_blocks(k(2)));
    assert_eq!(ix.trim(&seq(90..95), k(1), 2), 3);
    assert_eq!((ix.held_blocks(k(1)), ix.placed_blocks(k(1))), (2, 36));
    ix.remove_instance(k(1));
    assert_eq!(ix.placed_blocks(k(1)), 0);
    // One eviction at a time: while another runs, a call does nothing.
    ix.insert(&seq(100..110), k(2), 3_000);
    let running = ix.evicting.lock();
    assert_eq!(ix.evict_instance_to(k(2), 5), 0);
    drop(running);
    assert!(ix.evict_instance_to(k(2), 5) > 0);
    assert_eq!(ix.held_blocks(k(2)), 10);
    check(&ix);
}

#[test]
fn touch_refreshes_only_what_the_instance_holds() {
    let ix = idx();
    ix.insert(&seq(1..9), k(1), 0);
    assert_eq!(ix.touch(&seq(1..9), k(1), 1000), 8);
    assert_eq!(ix.touch(&seq(1..5), k(1), 1000), 4);
    assert_eq!(ix.touch(&seq(1..9), k(2), 1000), 0);
    assert_eq!(ix.touch(&[77], k(1), 1000), 0);
    assert_eq!(ix.gauges().nodes, 1);
}

#[test]
fn remove_instance_keeps_the_others() {
    let ix = idx();
    ix.insert(&seq(1..9), k(1), 0);
    ix.insert(&seq(1..5), k(2), 0);
    ix.insert(&seq(100..110), k(2), 0);
    assert_eq!(ix.remove_instance(k(2)), 1);
    let m = ix.match_prefix(&seq(1..9), 0);
    assert_eq!((m.matched(k(1)), m.matched(k(2))), (8, 0));
    assert_eq!(ix.match_prefix(&seq(100..110), 0).best, 0);
    check(&ix);
    // Its held-blocks count goes too (instance ids churn: pods come and go).
    assert_eq!((ix.held_blocks(k(1)), ix.held_blocks(k(2))), (8, 0));
    assert!(!ix.held.read().contains_key(&k(2)));
    ix.remove_instance(k(1));
    assert_eq!(ix.gauges().nodes, 0);
    assert_eq!(ix.gauges().bytes, 0);
    assert!(ix.held.read().is_empty());
}

#[test]
fn lru_eviction_frees_the_oldest_first() {
    let ix = idx();
    for i in 0..100u64 {
        // Ten blocks each, distinct first blocks, one per second.
        ix.insert(&seq(i * 1000..i * 1000 + 10), k(i % 3), i * 1000);
    }
    check(&ix);
    let total = ix.approx_bytes();
    let freed = ix.evict_lru(total / 4);
    assert!(freed >= total / 4, "{freed} < {}", total / 4);
    assert!(
        freed < total / 2,
        "evicted far too much: {freed} of {total}"
    );
    assert_eq!(ix.approx_bytes(), total - freed);
    // Oldest gone, newest present.
    assert_eq!(ix.match_prefix(&seq(0..10), 100_000).best, 0);
    assert_eq!(ix.match_prefix(&seq(99_000..99_010), 100_000).best, 10);
    let g = ix.gauges();
    assert_eq!(g.evicted_bytes, freed);
    assert!(g.evicted_nodes >= 25);
    check(&ix);
    assert_eq!(ix.evict_to(0), total - freed);
    assert_eq!(ix.gauges().nodes, 0);
    assert_eq!(ix.evict_lru(10), 0);
}

#[test]
fn eviction_cuts_path_bottoms_not_middles() {
    let ix = idx();
    ix.insert(&seq(1..5), k(1), 0); // old prefix …
    ix.insert(&seq(1..20), k(1), 100_000); // … refreshed by a longer, newer prompt
    ix.insert(&[1, 2, 3, 4, 500, 501], k(2), 10_000); // an old branch
    ix.evict_lru(1);
    // The old branch went; the refreshed path is intact.
    assert_eq!(ix.match_prefix(&seq(1..20), 100_000).matched(k(1)), 19);
    assert_eq!(ix.match_prefix(&[1, 2, 3, 4, 500, 501], 100_000).best, 4);
    check(&ix);
}

#[test]
fn counters_match_a_recount_after_random_operations() {
    let ix = idx();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let systems: Vec<Vec<u64>> = (0..5)
        .map(|s| seq(s * 1_000_000..s * 1_000_000 + 8))
        .collect();
    for step in 0..3000u64 {
        let mut p = systems[rng.gen_range(0..5)].clone();
        p.truncate(rng.gen_range(1..9));
        for _ in 0..rng.gen_range(0..6) {
            p.push(rng.gen_range(0..20));
        }
        let now = step * 100;
        match rng.gen_range(0..100) {
            0..=79 => ix.insert(&p, k(rng.gen_range(0..4)), now),
            80..=89 => {
                ix.touch(&p, k(rng.gen_range(0..4)), now);
            }
            90..=94 => {
                ix.sweep_expired(now);
            }
            95..=97 => {
                ix.evict_lru(ix.approx_bytes() / 10);
            }
            _ => {
                ix.remove_instance(k(rng.gen_range(0..4)));
            }
        }
        if step % 100 == 0 {
            check(&ix);
        }
    }
    check(&ix);
}

#[test]
fn concurrent_inserts_and_matches_stay_consistent() {
    let ix = PrefixIndex::default();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let ix = &ix;
            s.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                for i in 0..2000u64 {
                    let mut p = seq(0..rng.gen_range(1..16));
                    p.extend(seq(1000 + i..1000 + i + rng.gen_range(0..4)));
                    ix.insert(&p, k(t), i);
                    let m = ix.match_prefix(&p, i);
                    assert!(m.matched(k(t)) as usize <= p.len());
                }
            });
        }
    });
    check(&ix);
}

#[test]
fn a_deep_tree_is_dropped_without_recursion() {
    let ix = idx();
    let base = seq(1..3001);
    ix.insert(&base, k(1), 0);
    for d in 1..3000 {
        let mut p = base[..d].to_vec();
        p.push(1_000_000 + d as u64);
        ix.insert(&p, k(2), 0);
    }
    assert!(ix.gauges().nodes > 5000);
    check(&ix);
    drop(ix);
}

#[test]
fn trimming_removes_what_the_engine_evicted_below_the_reported_depth() {
    let ix = idx();
    // Instance 1 served a system prompt (0..8) with two different tails; instance 2 the
    // first tail too.
    let a: Vec<u64> = seq(0..8).into_iter().chain(seq(100..108)).collect();
    let b: Vec<u64> = seq(0..8).into_iter().chain(seq(200..204)).collect();
    ix.insert(&a, k(1), 0);
    ix.insert(&b, k(1), 0);
    ix.insert(&a, k(2), 0);
    check(&ix);
    assert_eq!(ix.match_prefix(&a, 0).matched(k(1)), 16);
    // The engine behind instance 1 reports only 5 blocks of `a` cached: everything of
    // instance 1 below depth 5 on that path (both tails) is gone.
    let dropped = ix.trim(&a, k(1), 5);
    check(&ix);
    assert_eq!(dropped, 3 + 8 + 4);
    assert_eq!(ix.match_prefix(&a, 0).matched(k(1)), 5);
    assert_eq!(ix.match_prefix(&b, 0).matched(k(1)), 5);
    // Instance 2 is untouched.
    assert_eq!(ix.match_prefix(&a, 0).matched(k(2)), 16);
    assert_eq!(ix.gauges().trims, 1);
    // Re-inserting (the engine just recomputed `a`) restores it; trimming to 0 removes
    // instance 1 from the whole family; nodes nobody holds are freed.
    ix.insert(&a, k(1), 0);
    assert_eq!(ix.match_prefix(&a, 0).matched(k(1)), 16);
    ix.trim(&b, k(1), 0);
    check(&ix);
    assert_eq!(ix.match_prefix(&a, 0).matched(k(1)), 0);
    assert_eq!(ix.match_prefix(&a, 0).matched(k(2)), 16);
    ix.trim(&a, k(2), 0);
    check(&ix);
    assert_eq!(ix.gauges().nodes, 0, "{:?}", ix.gauges());
    // Nothing to trim: deeper than the prompt, or a path the instance does not hold.
    assert_eq!(ix.trim(&a, k(3), 2), 0);
    assert_eq!(ix.trim(&a, k(1), 99), 0);
}
