//! Unit tests of the layered stages and the stay-or-move comparison.

use super::*;
use crate::cost::CostModel;
use crate::hash::{InstanceKey, SessionKey};
use crate::pipeline::{Outcome, Pipeline};
use crate::prefix::{PrefixIndex, PrefixMatch};
use crate::session::SessionTable;
use rand::rngs::StdRng;
use rand::SeedableRng;

fn cand(i: usize, req: u64, tok: u64, waiting: u64) -> Candidate {
    Candidate {
        idx: i,
        inflight_requests: req,
        inflight_tokens: tok,
        waiting,
        key: InstanceKey::of(&format!("inst-{i}")),
        ..Default::default()
    }
}

fn idle(n: usize) -> Vec<Candidate> {
    (0..n).map(|i| cand(i, 0, 0, 0)).collect()
}

struct Fixture {
    sessions: Arc<SessionTable>,
    index: PrefixIndex,
    p: Pipeline,
}

impl Fixture {
    fn new(policy: LbPolicy, affinity: Option<AffinityMode>, prefix: bool) -> Self {
        let sessions = Arc::new(SessionTable::default());
        let mut fh = FirstHit::balance(policy);
        if let Some(mode) = affinity {
            fh = fh.then(AffinityStage::new(
                mode,
                Escape::Load(1.5),
                sessions.clone(),
            ));
        }
        if prefix {
            fh = fh.then(PrefixStage::default());
        }
        Fixture {
            sessions,
            index: PrefixIndex::default(),
            p: Pipeline::new(fh),
        }
    }

    /// Decides like the gateway does: match the prompt, pick, explain.
    fn decide(&self, req: &RequestView<'_>, cands: &[Candidate]) -> Option<Decision> {
        let m: PrefixMatch = self.index.match_prefix(req.blocks, req.now_ms);
        let r = RequestView {
            prefix: Some(&m),
            explain: true,
            ..*req
        };
        self.p.pick(&r, cands, &mut StdRng::seed_from_u64(0))
    }

    /// Dispatches like the gateway does: the pipeline learns, the index records.
    fn dispatch(&self, req: &RequestView<'_>, chosen: &Candidate) {
        self.p.on_dispatch(req, chosen);
        self.index.insert(req.blocks, chosen.key, req.now_ms);
    }
}

fn req<'a>(session: &str, blocks: &'a [u64], now_ms: u64, turn: u64) -> RequestView<'a> {
    RequestView {
        session: Some(SessionKey::of(session)),
        blocks,
        now_ms,
        turn,
        ..Default::default()
    }
}

fn blocks(b: &[u64]) -> RequestView<'_> {
    RequestView {
        blocks: b,
        ..Default::default()
    }
}

#[test]
fn least_cached_sends_a_cold_prompt_to_the_emptiest_cache_that_is_not_far_slower() {
    let fh = FirstHit::balance(LbPolicy::LeastToken)
        .then(PrefixStage::default())
        .then(LeastCachedStage(CostTolerance {
            tolerance: 0.5,
            slack_ms: 50.0,
        }));
    let p = Pipeline::new(fh);
    let pick = |cs: &[Candidate]| {
        // 1,000 uncached tokens: 125 ms at the prior 8,000 tokens/s (+ a 20 ms step).
        let r = RequestView {
            blocks: &[1, 2, 3],
            prompt_tokens: 1000,
            block_tokens: 16,
            explain: true,
            ..Default::default()
        };
        p.pick(&r, cs, &mut StdRng::seed_from_u64(0)).unwrap()
    };
    let mut cs = idle(3);
    for (c, held) in cs.iter_mut().zip([100, 10, 50]) {
        c.placed_blocks = held;
    }
    cs[2].inflight_tokens = 1; // least-token would pick 0 or 1 by rotation, never by cache
    let d = pick(&cs);
    assert_eq!((d.idx, d.reason.as_ref()), (1, "least-cached"));
    // Instance 1 has 1,000 ms of prefill queued: far above the best (145 ms): not eligible.
    cs[1].prefill_tokens = 8000;
    let d = pick(&cs);
    assert_eq!(d.idx, 2, "{d:?}");
    // Equal caches: the lower load.
    cs[0].placed_blocks = 50;
    cs[0].inflight_tokens = 5;
    assert_eq!(pick(&cs).idx, 2);
    cs[2].inflight_tokens = 9;
    assert_eq!(pick(&cs).idx, 0);
    // 60 ms queued on the emptiest (1) keeps it within 145 × 1.5 + 50 ms: still preferred.
    cs[1].prefill_tokens = 480;
    assert_eq!(pick(&cs).idx, 1);
}

/// Prefix, then least-cached with the default tolerance, both reading `cost`.
fn prefix_then_least_cached(cost: &Arc<CostModel>) -> Pipeline {
    Pipeline::new(
        FirstHit::balance(LbPolicy::LeastToken)
            .with_cost(cost.clone())
            .then(PrefixStage::default())
            .then(LeastCachedStage(CostTolerance::default())),
    )
}

#[test]
fn a_long_cold_prompt_goes_where_fewer_sessions_come_back_and_a_short_one_by_cache() {
    let cost = Arc::new(CostModel::default()); // 8,000 tokens/s, 20 ms steps
    let p = prefix_then_least_cached(&cost);
    let mut cs = idle(3);
    for (c, held) in cs.iter_mut().zip([10, 100, 100]) {
        c.placed_blocks = held;
    }
    cs[2].inflight_tokens = 1;
    // Instance 0, the emptiest cache, had 10 requests in the last second: its sessions come
    // back about once a second (10 within the 10-s time constant).
    let now = 60_000;
    for t in 0..10 {
        cost.dispatched(cs[0].key, now - 1000 + t * 100);
    }
    let pick = |tokens: u64| {
        let r = RequestView {
            blocks: &[7, 8, 9],
            prompt_tokens: tokens,
            block_tokens: 16,
            now_ms: now,
            explain: true,
            ..Default::default()
        };
        p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap()
    };
    // 12,000 cold tokens prefill 1.5 s: on 0 the warm turns arriving meanwhile wait ~0.75 s
    // each (~1.1 s in all); on 1 nobody does. The lower load of the two without arrivals.
    let d = pick(12_000);
    assert_eq!(
        (d.idx, d.reason.as_ref()),
        (1, "least-cached"),
        "{}",
        d.explain()
    );
    assert!(d.explain().contains("harm"), "{}", d.explain());
    // 1,000 tokens prefill 125 ms: ~8 ms for those behind, within the slack: the cache.
    let d = pick(1000);
    assert_eq!(
        (d.idx, d.reason.as_ref()),
        (0, "least-cached"),
        "{}",
        d.explain()
    );
    // Once instance 0's sessions are gone (a minute later), the long prompt goes there too.
    let r = RequestView {
        blocks: &[7, 8, 9],
        prompt_tokens: 12_000,
        block_tokens: 16,
        now_ms: now + 60_000,
        ..Default::default()
    };
    assert_eq!(
        p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap().idx,
        0
    );
}

#[test]
fn on_mixed_engines_a_cold_prompt_counts_what_its_followers_prefill_there() {
    use crate::cost::Observation;
    let cost = Arc::new(CostModel::default()); // 8,000 tokens/s prior, 20 ms steps
    let p = prefix_then_least_cached(&cost);
    let mut cs = idle(2);
    // Instance 0 prefills 8,000 tokens/s and has 300 ms queued; instance 1, an older GPU, is
    // idle at half the rate and holds less: on the prompt's own TTFT both are within the
    // room (820 vs 1,020 ms), and the emptier cache takes it.
    for (c, ttft_ms) in cs.iter().zip([1020.0, 2020.0]) {
        for _ in 0..3 {
            let o = Observation {
                queued_tokens: 0,
                uncached_tokens: 8000,
                ttft_ms,
                tpot_ms: None,
            };
            cost.observe(c.key, &o);
        }
    }
    cs[0].prefill_tokens = 2400;
    cs[0].placed_blocks = 100;
    cs[1].placed_blocks = 10;
    let pick = || {
        let r = RequestView {
            blocks: &[7, 8, 9],
            prompt_tokens: 4000,
            block_tokens: 16,
            now_ms: 60_000,
            explain: true,
            ..Default::default()
        };
        p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap()
    };
    let d = pick();
    assert_eq!(
        (d.idx, d.reason.as_ref()),
        (1, "least-cached"),
        "{}",
        d.explain()
    );
    // Sessions: seven of every eight requests find their prefix and prefill 500 new tokens
    // where it is. A placement's seven followers prefill 3.5k tokens: 438 ms on 0, 875 ms
    // on 1, which takes 1 out of the room.
    for i in 0..400 {
        if i % 8 == 7 {
            cost.routed(4000, 0);
        } else {
            cost.routed(4500, 4000);
        }
    }
    let d = pick();
    assert_eq!(
        (d.idx, d.reason.as_ref()),
        (0, "least-cached"),
        "{}",
        d.explain()
    );
    assert!(d.explain().contains("follow="), "{}", d.explain());
    // Equal engines: the followers cost the same everywhere and the emptier cache decides.
    let equal = Arc::new(CostModel::default());
    for i in 0..400 {
        equal.routed(4500, if i % 8 == 7 { 0 } else { 4000 });
    }
    let p = prefix_then_least_cached(&equal);
    let r = RequestView {
        blocks: &[7, 8, 9],
        prompt_tokens: 4000,
        block_tokens: 16,
        now_ms: 60_000,
        ..Default::default()
    };
    assert_eq!(
        p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap().idx,
        1
    );
}

#[test]
fn in_a_saturated_fleet_a_cold_prompt_skips_the_hot_home_whose_queue_is_short() {
    let cost = Arc::new(CostModel::default()); // 8,000 tokens/s, 20 ms steps
    let p = prefix_then_least_cached(&cost);
    // Every instance has requests waiting. Instance 0 is a hot tenant's home: its warm turns
    // are cheap (200 ms queued) and come back twice a second; 1 and 2 have 1 s queued and one
    // arrival a second. 0 also has the emptiest cache.
    let mut cs = idle(3);
    for (i, c) in cs.iter_mut().enumerate() {
        c.waiting = 2;
        c.placed_blocks = if i == 0 { 10 } else { 100 };
        c.prefill_tokens = if i == 0 { 1600 } else { 8000 };
        c.inflight_tokens = c.prefill_tokens;
    }
    let now = 60_000;
    for t in 0..20 {
        cost.dispatched(cs[0].key, now - 10_000 + t * 500);
        if t % 2 == 0 {
            cost.dispatched(cs[1].key, now - 10_000 + t * 500);
            cost.dispatched(cs[2].key, now - 10_000 + t * 500);
        }
    }
    let r = RequestView {
        blocks: &[7, 8, 9],
        prompt_tokens: 4000,
        block_tokens: 16,
        now_ms: now,
        explain: true,
        ..Default::default()
    };
    // The fleet's utilization is learned from the decisions (each finds every queue busy).
    let mut d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    for _ in 0..100 {
        d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    }
    // On 0 the prompt would start soonest (720 ms against 1,520), but every warm turn
    // arriving there for as long as the fleet stays busy would wait its 500 ms.
    assert_ne!(d.idx, 0, "{}", d.explain());
    assert_eq!(d.reason.as_ref(), "least-cached", "{}", d.explain());
    assert!(d.explain().contains("harm"), "{}", d.explain());
}

#[test]
fn empty_candidates_is_none() {
    let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Soft), true);
    assert!(f.decide(&RequestView::default(), &[]).is_none());
}

#[test]
fn only_load_balancing_when_no_layer_is_configured() {
    let f = Fixture::new(LbPolicy::LeastToken, None, false);
    assert_eq!(f.p.mode(), "balance");
    let mut cs = idle(3);
    cs[0].inflight_tokens = 50;
    let d = f.decide(&req("s", &[1, 2], 0, 0), &cs).unwrap();
    assert_eq!(
        (d.pos, d.layer, d.reason.as_ref()),
        (1, Layer::Balance, "least-token")
    );
    assert_eq!(d.affinity, AffinityOutcome::Off);
    assert_eq!(
        (d.prompt_blocks, d.matched_blocks, d.best_matched_blocks),
        (2, 0, 0)
    );
}

#[test]
fn a_new_session_falls_through_then_sticks() {
    let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Soft), true);
    assert_eq!(f.p.needs(), Needs::SESSION | Needs::PREFIX);
    let cs = idle(3);
    let r = req("conv", &[], 0, 1);
    let d = f.decide(&r, &cs).unwrap();
    assert_eq!(d.affinity, AffinityOutcome::Unbound);
    assert_eq!(d.reason, "least-request");
    f.dispatch(&r, &cs[d.pos]);
    for turn in 2..10 {
        let d2 = f.decide(&req("conv", &[], 1000, turn), &cs).unwrap();
        assert_eq!((d2.pos, d2.reason.as_ref()), (d.pos, "affinity"));
    }
}

#[test]
fn soft_affinity_escapes_an_overloaded_instance_and_rebinds() {
    let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Soft), true);
    let mut cs = idle(3);
    let r = req("conv", &[], 0, 0);
    f.dispatch(&r, &cs[0]);
    // avg = 4/3, limit 2.0: 2 in flight stays …
    cs[0].inflight_requests = 2;
    cs[1].inflight_requests = 2;
    let d = f.decide(&r, &cs).unwrap();
    assert_eq!((d.pos, d.reason.as_ref()), (0, "affinity"));
    // … 3 in flight (avg 1, limit 1.5) escapes to the least loaded.
    cs[0].inflight_requests = 3;
    cs[1].inflight_requests = 0;
    let d = f.decide(&r, &cs).unwrap();
    assert_eq!(d.affinity, AffinityOutcome::Escape);
    assert_eq!(d.reason, "affinity-escape");
    assert_ne!(d.pos, 0);
    assert!(
        d.explain().contains("then=least-request"),
        "{}",
        d.explain()
    );
    f.dispatch(&r, &cs[d.pos]);
    assert_eq!(
        f.sessions.get(SessionKey::of("conv"), 0),
        Some(cs[d.pos].key)
    );
}

#[test]
fn strict_affinity_ignores_load_and_rebinds_when_the_instance_is_gone() {
    let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Strict), true);
    let mut cs = idle(3);
    let r = req("conv", &[], 0, 0);
    f.dispatch(&r, &cs[2]);
    cs[2].inflight_requests = 100;
    let d = f.decide(&r, &cs).unwrap();
    assert_eq!((d.pos, d.reason.as_ref()), (2, "affinity"));
    // Instance 2 failed / left: it is not a candidate any more.
    let d = f.decide(&r, &cs[..2]).unwrap();
    assert_eq!(
        (d.reason.as_ref(), d.affinity),
        ("affinity-rebind", AffinityOutcome::Rebind)
    );
    f.dispatch(&r, &cs[d.pos]);
    let d2 = f.decide(&r, &cs).unwrap();
    assert_eq!((d2.pos, d2.reason.as_ref()), (d.pos, "affinity"));
}

#[test]
fn affinity_expires_after_the_ttl_and_refreshes_only_on_success() {
    let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Strict), true);
    let cs = idle(2);
    f.dispatch(&req("c", &[], 0, 0), &cs[1]);
    let d = f.decide(&req("c", &[], 1_800_000, 0), &cs).unwrap();
    assert_eq!(d.reason, "affinity");
    // A failed request does not refresh the binding …
    f.p.on_complete(
        &req("c", &[], 1_800_000, 0),
        &cs[1],
        &Completion::of(Outcome::Failed),
    );
    assert!(f.sessions.get(SessionKey::of("c"), 1_800_001).is_none());
    // … a completed one does.
    f.dispatch(&req("c", &[], 0, 0), &cs[1]);
    f.p.on_complete(
        &req("c", &[], 1_800_000, 0),
        &cs[1],
        &Completion::of(Outcome::Completed),
    );
    let d = f.decide(&req("c", &[], 3_600_000, 0), &cs).unwrap();
    assert_eq!(d.reason, "affinity");
    let d = f.decide(&req("c", &[], 5_400_001, 0), &cs).unwrap();
    assert_eq!(d.affinity, AffinityOutcome::Unbound);
}

#[test]
fn prefix_routes_to_the_longest_eligible_match() {
    let f = Fixture::new(LbPolicy::LeastRequest, None, true);
    let mut cs = idle(4);
    let prompt: Vec<u64> = (1..=12).collect();
    // inst 1 holds 10/12, inst 2 holds 12/12 but is overloaded, inst 3 holds 5/12.
    f.dispatch(&blocks(&prompt[..10]), &cs[1]);
    f.dispatch(&blocks(&prompt), &cs[2]);
    f.dispatch(&blocks(&prompt[..5]), &cs[3]);
    for (i, l) in [1, 2, 9, 0].iter().enumerate() {
        cs[i].inflight_requests = *l; // avg 3, limit 3.9
    }
    let r = blocks(&prompt);
    let d = f.decide(&r, &cs).unwrap();
    assert_eq!(
        (d.pos, d.layer, d.reason.as_ref()),
        (1, Layer::Prefix, "prefix(0.83)")
    );
    assert_eq!(
        (d.prompt_blocks, d.matched_blocks, d.best_matched_blocks),
        (12, 10, 12)
    );
    let e = d.explain();
    eprintln!("{e}");
    assert!(
        e.contains("#2:load=9,wait=0,match=12(1.00),ineligible"),
        "{e}"
    );
    assert!(e.contains("*#1:load=2"), "{e}");
    // Too many waiting also makes it ineligible.
    cs[1].waiting = 3;
    let d = f.decide(&r, &cs).unwrap();
    assert_eq!(d.reason, "least-request"); // inst 3's 5/12 < 0.50 → miss
    assert_eq!(d.pos, 3);
    assert_eq!(d.best_matched_blocks, 12);
}

#[test]
fn equal_matches_go_to_the_lower_load() {
    let f = Fixture::new(LbPolicy::LeastToken, None, true);
    let mut cs = idle(3);
    let prompt = [7u64, 8, 9, 10];
    for c in &cs {
        f.dispatch(&blocks(&prompt), c);
    }
    cs[0].inflight_tokens = 300;
    cs[1].inflight_tokens = 100;
    cs[2].inflight_tokens = 200;
    for turn in 0..3 {
        let r = RequestView {
            blocks: &prompt,
            turn,
            ..Default::default()
        };
        let d = f.decide(&r, &cs).unwrap();
        assert_eq!((d.pos, d.reason.as_ref()), (1, "prefix(1.00)"));
    }
}

#[test]
fn affinity_wins_over_prefix_but_reports_the_prefix_numbers() {
    let f = Fixture::new(LbPolicy::LeastRequest, Some(AffinityMode::Soft), true);
    let cs = idle(2);
    let prompt = [1u64, 2, 3, 4];
    f.dispatch(&req("x", &prompt, 0, 0), &cs[1]);
    f.dispatch(&req("y", &prompt[..1], 0, 0), &cs[0]);
    let d = f.decide(&req("y", &prompt, 0, 0), &cs).unwrap();
    assert_eq!((d.pos, d.reason.as_ref()), (0, "affinity"));
    assert_eq!(
        (d.matched_blocks, d.best_matched_blocks, d.prompt_blocks),
        (1, 4, 4)
    );
}

#[test]
fn filters_run_before_the_layers_and_say_what_they_dropped() {
    let sessions = Arc::new(SessionTable::default());
    let p = Pipeline::new(
        FirstHit::balance(LbPolicy::LeastRequest).then(AffinityStage::new(
            AffinityMode::Strict,
            Escape::Load(1.5),
            sessions.clone(),
        )),
    )
    .filter(crate::filter::Available)
    .filter(crate::filter::NotTried);
    let mut cs = idle(4);
    cs[0].available = false;
    let s = SessionKey::of("s");
    sessions.bind(s, cs[1].key, 0);
    let tried = [cs[1].key];
    let r = RequestView {
        session: Some(s),
        exclude: &tried,
        explain: true,
        ..Default::default()
    };
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    // The bound instance was tried: rebind to one of the two left.
    assert_eq!(d.reason, "affinity-rebind");
    assert!(d.pos == 2 || d.pos == 3, "{d:?}");
    let e = d.explain();
    assert!(e.contains("filtered out: #0(unavailable) #1(tried)"), "{e}");
    // Nothing left: no decision.
    cs[2].available = false;
    cs[3].available = false;
    assert!(p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).is_none());
}

fn cost_pipeline(model: &Arc<CostModel>, prefix: Option<CostTolerance>) -> Pipeline {
    let mut fh = FirstHit::balance(LbPolicy::PredictedTtft).with_cost(model.clone());
    if let Some(t) = prefix {
        fh = fh.then(PrefixStage(PrefixLayerConfig {
            min_hit_ratio: 0.0,
            eligibility: Eligibility::Cost(t),
        }));
    }
    Pipeline::new(fh)
}

fn with_queue(i: usize, prefill_tokens: u64) -> Candidate {
    Candidate {
        prefill_tokens,
        ..cand(i, 0, 0, 0)
    }
}

#[test]
fn predicted_ttft_balancing_picks_the_lowest_estimate_ties_at_random() {
    let model = Arc::new(CostModel::new(crate::cost::CostConfig {
        prior_prefill_tps: 1000.0,
        prior_step_ms: 10.0,
        ..Default::default()
    }));
    let p = cost_pipeline(&model, None);
    assert_eq!(p.needs(), Needs::PREFIX);
    let index = PrefixIndex::default();
    let prompt: Vec<u64> = (0..32).collect(); // 512 tokens
    let cs = [with_queue(0, 900), with_queue(1, 300), with_queue(2, 800)];
    index.insert(&prompt, cs[2].key, 0); // 2 holds it: 800 + 0 beats 300 + 512
    let m = index.match_prefix(&prompt, 0);
    let r = RequestView {
        blocks: &prompt,
        prefix: Some(&m),
        prompt_tokens: 512,
        block_tokens: 16,
        explain: true,
        ..Default::default()
    };
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    assert_eq!((d.pos, d.reason.as_ref()), (2, "predicted-ttft"));
    let e = d.explain();
    assert!(e.contains("best_est=810ms"), "{e}");
    assert!(
        e.contains("*#2:load=0,wait=0,match=32(1.00),est=810ms(q=800+own=0+dec=10"),
        "{e}"
    );
    // Equal estimates: every candidate is chosen sometimes.
    let idle = [with_queue(0, 0), with_queue(1, 0), with_queue(2, 0)];
    let r0 = RequestView {
        prompt_tokens: 512,
        block_tokens: 16,
        ..Default::default()
    };
    let mut seen = [0; 3];
    for seed in 0..60 {
        let d = p
            .pick(&r0, &idle, &mut StdRng::seed_from_u64(seed))
            .unwrap();
        seen[d.pos] += 1;
    }
    assert!(seen.iter().all(|&x| x > 5), "{seen:?}");
}

#[test]
fn the_cost_prefix_layer_keeps_a_prefix_home_within_the_tolerance() {
    let model = Arc::new(CostModel::new(crate::cost::CostConfig {
        prior_prefill_tps: 1000.0,
        prior_step_ms: 0.0,
        ..Default::default()
    }));
    let t = CostTolerance {
        tolerance: 0.5,
        slack_ms: 0.0,
    };
    let p = cost_pipeline(&model, Some(t));
    let index = PrefixIndex::default();
    let prompt: Vec<u64> = (0..64).collect(); // 1024 tokens
    let holder = cand(0, 0, 0, 0);
    index.insert(&prompt, holder.key, 0);
    let m = index.match_prefix(&prompt, 0);
    let r = RequestView {
        blocks: &prompt,
        prefix: Some(&m),
        prompt_tokens: 1024,
        block_tokens: 16,
        ..Default::default()
    };
    // The holder has 1,200 tokens queued (est 1.2 s); an idle other instance would need
    // 1.024 s: pure cost would move the prefix, the tolerance (≤ 1.54 s) keeps it home.
    let cs = [with_queue(0, 1200), with_queue(1, 0)];
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    assert_eq!((d.pos, d.reason.as_ref()), (0, "prefix(1.00)"));
    // A long queue (2 s > 1.54 s) does move it.
    let cs = [with_queue(0, 2000), with_queue(1, 0)];
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    assert_eq!((d.pos, d.reason.as_ref()), (1, "predicted-ttft"));
}

/// Soft affinity with `escape` before `lb`, on a cost model of 1,000 prefill tokens/s and
/// no decode step; the session table to bind sessions in.
fn affinity_pipeline(lb: LbPolicy, escape: Escape) -> (Pipeline, Arc<SessionTable>) {
    let model = Arc::new(CostModel::new(crate::cost::CostConfig {
        prior_prefill_tps: 1000.0,
        prior_step_ms: 0.0,
        ..Default::default()
    }));
    let sessions = Arc::new(SessionTable::default());
    let p = Pipeline::new(
        FirstHit::balance(lb)
            .with_cost(model)
            .then(AffinityStage::new(
                AffinityMode::Soft,
                escape,
                sessions.clone(),
            )),
    );
    (p, sessions)
}

#[test]
fn soft_affinity_can_escape_by_cost() {
    let t = CostTolerance {
        tolerance: 0.0,
        slack_ms: 100.0,
    };
    let (p, sessions) = affinity_pipeline(LbPolicy::PredictedTtft, Escape::Cost(t));
    let s = SessionKey::of("s");
    let cs = [with_queue(0, 50), with_queue(1, 0)];
    sessions.bind(s, cs[0].key, 0);
    let r = RequestView {
        session: Some(s),
        prompt_tokens: 100,
        block_tokens: 16,
        ..Default::default()
    };
    // 150 ms vs 100 ms: within the 100 ms slack, the session stays.
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    assert_eq!((d.pos, d.reason.as_ref()), (0, "affinity"));
    let cs = [with_queue(0, 500), with_queue(1, 0)];
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    assert_eq!((d.pos, d.reason.as_ref()), (1, "affinity-escape"));
}

#[test]
fn a_session_waits_for_its_instance_longer_the_more_history_it_holds_there() {
    let s = SessionKey::of("s");
    // The queue on the session's instance (#0) at which its next turn leaves it (a fresh
    // pipeline each time: the utilization the cost model learns starts at 0).
    let escape_at = |history_blocks: u64| -> u64 {
        let (p, sessions) = affinity_pipeline(
            LbPolicy::LeastToken,
            Escape::Adaptive(
                Adaptive::default(),
                CostTolerance {
                    tolerance: 0.0,
                    slack_ms: 0.0,
                },
            ),
        );
        let index = PrefixIndex::default();
        let prompt: Vec<u64> = (0..history_blocks + 4).collect();
        let bound = cand(0, 0, 0, 0);
        sessions.bind(s, bound.key, 0);
        index.insert(&prompt[..history_blocks as usize], bound.key, 0);
        let m = index.match_prefix(&prompt, 0);
        let r = RequestView {
            session: Some(s),
            blocks: &prompt,
            prefix: Some(&m),
            prompt_tokens: prompt.len() as u64 * 16,
            block_tokens: 16,
            explain: true,
            ..Default::default()
        };
        for q in (0..20_000).step_by(100) {
            let cs = [queued(0, q, q / 1000), queued(1, 0, 0), queued(2, 0, 0)];
            let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
            if d.pos != 0 {
                assert_eq!(d.reason, "affinity-escape", "{}", d.explain());
                assert!(
                    d.explain().contains("soft: bound moves (wait "),
                    "{}",
                    d.explain()
                );
                return q;
            }
            assert_eq!(d.reason, "affinity", "{}", d.explain());
        }
        panic!("never left the session's instance");
    };
    // Staying costs the queue + 4 new blocks (64 ms); moving recomputes the whole prompt
    // and copies the history over what the other instance holds: (h + 4 + h) × 16 ms.
    let short = escape_at(12); // 192 tokens of history: moving costs 448 ms
    let long = escape_at(252); // 4,032 tokens: 8,128 ms
    assert_eq!(short, 400, "the first queue above 448 - 64 ms");
    // #0 has had requests waiting at every decision since q = 1,000 (66 of them by 7,600:
    // utilization 1 - (31/32)^66 = 0.88), so staying also counts what its 64 ms add for
    // those arriving behind them: × 0.88 / 0.12 = 7.1, 455 ms. Without that term: 8,100.
    assert_eq!(long, 7600, "the first queue above 8,128 - 64 - 455 ms");
    // Nothing of the prompt there (the index forgot it): only the queues count.
    assert_eq!(escape_at(0), 100);
}

#[test]
fn a_session_whose_history_the_index_forgot_still_stays_within_the_ttft_tolerance() {
    let s = SessionKey::of("s");
    // A 1,024-token prompt the index holds nowhere: every instance recomputes all of it.
    let prompt: Vec<u64> = (0..64).collect();
    let escape_at = |t: CostTolerance| -> u64 {
        let (p, sessions) = affinity_pipeline(
            LbPolicy::LeastToken,
            Escape::Adaptive(Adaptive::default(), t),
        );
        sessions.bind(s, cand(0, 0, 0, 0).key, 0);
        let m = PrefixIndex::default().match_prefix(&prompt, 0);
        let r = RequestView {
            session: Some(s),
            blocks: &prompt,
            prefix: Some(&m),
            prompt_tokens: 1024,
            block_tokens: 16,
            explain: true,
            ..Default::default()
        };
        for q in (0..5_000).step_by(100) {
            let cs = [queued(0, q, q / 1000), queued(1, 0, 0)];
            let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
            if d.pos != 0 {
                assert_eq!(d.reason, "affinity-escape", "{}", d.explain());
                return q;
            }
        }
        panic!("never left");
    };
    // The comparison alone weighs only the queues here (no copy: nothing known held): the
    // session leaves at the first queue.
    let none = CostTolerance {
        tolerance: 0.0,
        slack_ms: 0.0,
    };
    assert_eq!(escape_at(none), 100);
    // The default keeps it while its TTFT is within × 1.25 + 25 ms of the best: 1,024 + q <=
    // 1,305 ms.
    let default = CostTolerance {
        tolerance: 0.25,
        slack_ms: 25.0,
    };
    assert_eq!(escape_at(default), 300);
    // Within the tolerance it stays even past the safety caps (as under the previous rule):
    // 17 waiting, 1,124 ms against the best's 1,024.
    let (p, sessions) = affinity_pipeline(
        LbPolicy::LeastToken,
        Escape::Adaptive(Adaptive::default(), default),
    );
    sessions.bind(s, cand(0, 0, 0, 0).key, 0);
    let m = PrefixIndex::default().match_prefix(&prompt, 0);
    let r = RequestView {
        session: Some(s),
        blocks: &prompt,
        prefix: Some(&m),
        prompt_tokens: 1024,
        block_tokens: 16,
        ..Default::default()
    };
    let cs = [queued(0, 100, COST_WAITING_CAP + 1), queued(1, 0, 0)];
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    assert_eq!((d.pos, d.reason.as_ref()), (0, "affinity"));
}

#[test]
fn the_cost_prefix_layer_skips_a_holder_above_the_load_caps() {
    let model = Arc::new(CostModel::new(crate::cost::CostConfig {
        prior_prefill_tps: 1000.0,
        prior_step_ms: 10.0,
        ..Default::default()
    }));
    let loose = CostTolerance {
        tolerance: 100.0,
        slack_ms: 1e6,
    };
    let p = cost_pipeline(&model, Some(loose));
    let index = PrefixIndex::default();
    let prompt: Vec<u64> = (0..32).collect();
    let m = |cs: &[Candidate]| {
        index.insert(&prompt, cs[0].key, 0);
        index.match_prefix(&prompt, 0)
    };
    // #0 holds the prompt; its estimate is within any tolerance. Under the caps: a hit.
    let cs = [
        cand(0, 3, 3000, 2),
        cand(1, 1, 1000, 0),
        cand(2, 1, 1000, 0),
    ];
    let pm = m(&cs);
    let r = RequestView {
        blocks: &prompt,
        prefix: Some(&pm),
        prompt_tokens: 512,
        block_tokens: 16,
        ..Default::default()
    };
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    assert_eq!(d.pos, 0);
    assert!(d.reason.starts_with("prefix"), "{}", d.reason);
    // In-flight tokens above the average × (1 + COST_LOAD_CAP): not chosen for its cache
    // (the balancing layer decides, by predicted TTFT).
    // (With n candidates one holds at most n × the average: six here.)
    let mut cs = vec![cand(0, 9, 90_000, 2)];
    cs.extend((1..6).map(|i| cand(i, 1, 1000, 0)));
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    assert!(!d.reason.starts_with("prefix"), "{}", d.reason);
    // More than COST_WAITING_CAP requests waiting: the same.
    let cs = [
        cand(0, 20, 3000, COST_WAITING_CAP + 1),
        cand(1, 1, 1000, 0),
        cand(2, 1, 1000, 0),
    ];
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    assert!(!d.reason.starts_with("prefix"), "{}", d.reason);
}

/// The default pipeline's layers over a cost model at 1,000 tokens/s and no decode step:
/// a predicted TTFT in ms is the number of tokens to prefill.
fn adaptive_pipeline() -> Pipeline {
    let model = Arc::new(CostModel::new(crate::cost::CostConfig {
        prior_prefill_tps: 1000.0,
        prior_step_ms: 0.0,
        ..Default::default()
    }));
    Pipeline::new(
        FirstHit::balance(LbPolicy::LeastToken)
            .with_cost(model)
            .then(PrefixStage(PrefixLayerConfig {
                min_hit_ratio: 0.1,
                eligibility: Eligibility::Adaptive(Adaptive::default()),
            }))
            .then(LeastCachedStage(CostTolerance::default())),
    )
}

/// An instance with `prefill_tokens` queued by `waiting` requests, whose cache (of unknown
/// size) holds 4,096 blocks of other prompts: a copy there evicts some of them.
fn queued(i: usize, prefill_tokens: u64, waiting: u64) -> Candidate {
    Candidate {
        prefill_tokens,
        waiting,
        inflight_tokens: prefill_tokens,
        inflight_requests: waiting,
        placed_blocks: 4096,
        ..cand(i, 0, 0, 0)
    }
}

#[test]
fn a_long_prompt_waits_longer_for_its_holder_than_a_short_one() {
    let p = adaptive_pipeline();
    // The queue on the holder (#0) at which a prompt it holds whole stops going there.
    let spill_at = |blocks: u64| -> u64 {
        let index = PrefixIndex::default();
        let prompt: Vec<u64> = (0..blocks).collect();
        let holder = cand(0, 0, 0, 0);
        index.insert(&prompt, holder.key, 0);
        let m = index.match_prefix(&prompt, 0);
        let r = RequestView {
            blocks: &prompt,
            prefix: Some(&m),
            prompt_tokens: blocks * 16,
            block_tokens: 16,
            explain: true,
            ..Default::default()
        };
        for q in (0..20_000).step_by(100) {
            let cs = [queued(0, q, q / 1000), queued(1, 0, 0), queued(2, 0, 0)];
            let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
            if d.pos != 0 {
                assert_eq!(d.reason, PREFIX_SPILL, "{}", d.explain());
                let e = d.explain();
                assert!(e.contains("#0:moves(recompute+placement: "), "{e}");
                return q;
            }
            assert_eq!(d.reason, "prefix(1.00)", "{}", d.explain());
        }
        panic!("never left the holder");
    };
    let short = spill_at(16); // 256 tokens: recompute 256 ms + placement 256 ms
    let long = spill_at(256); // 4,096 tokens
    assert_eq!(short, 600, "the first queue above 512 ms");
    assert_eq!(long, 8200, "the first queue above 8,192 ms");
    // (8 waiting there at the end: four times the old fixed limit of 2.)
    assert!(long > short);
}

#[test]
fn a_hot_tenants_second_home_opens_when_its_first_is_saturated_and_not_before() {
    let p = adaptive_pipeline();
    let index = PrefixIndex::default();
    // The tenant's system prompt: 128 blocks (2,048 tokens); each request adds 32 blocks
    // of its own (512 tokens), different every time.
    let system: Vec<u64> = (0..128).collect();
    let mut cs: Vec<Candidate> = (0..4).map(|i| queued(i, 0, 0)).collect();
    index.insert(&system, cs[0].key, 0);
    let mut next = 1_000u64;
    let mut send = |cs: &mut Vec<Candidate>| {
        let mut prompt = system.clone();
        prompt.extend(next..next + 32);
        next += 32;
        let m = index.match_prefix(&prompt, 0);
        let r = RequestView {
            blocks: &prompt,
            prefix: Some(&m),
            prompt_tokens: 160 * 16,
            block_tokens: 16,
            explain: true,
            ..Default::default()
        };
        let d = p.pick(&r, cs, &mut StdRng::seed_from_u64(0)).unwrap();
        // Dispatch: the chosen instance queues the tokens it does not hold.
        let c = &mut cs[d.pos];
        let own = r.uncached_tokens(c);
        c.prefill_tokens += own;
        c.inflight_tokens += own;
        c.waiting += 1;
        c.inflight_requests += 1;
        index.insert(&prompt, c.key, 0);
        (d.pos, d.reason.to_string(), d.explain())
    };
    // Moving costs 2,560 ms (the whole prompt elsewhere) + 2,048 ms (the copy of the
    // system prompt there): the holder keeps the tenant while waiting there (its queue +
    // 512 ms, + what those 512 ms add for the requests behind them at its utilization)
    // costs no more — 8 requests waiting, where the old fixed limit was 2.
    for k in 0..8 {
        let (pos, why, e) = send(&mut cs);
        assert_eq!((pos, why.as_str()), (0, "prefix(0.80)"), "request {k}: {e}");
    }
    assert_eq!(cs[0].prefill_tokens, 4096);
    assert!(cs[1..].iter().all(|c| c.waiting == 0));
    // Now the holder is saturated: 4,096 + 512 = 4,608 ms would tie with a move, and it
    // has had requests waiting at each of the last 7 decisions (utilization 1 - (31/32)^7
    // = 0.20: + 512 × 0.20 / 0.80 = 148 ms). The next request goes elsewhere (the
    // emptiest cache) and says why.
    let (home2, why, e) = send(&mut cs);
    assert_ne!(home2, 0, "{e}");
    assert_eq!(why, PREFIX_SPILL, "{e}");
    assert!(e.contains("then=least-cached"), "{e}");
    assert!(
        e.contains("#0:moves(recompute+placement: 4756ms vs #"),
        "{e}"
    );
    // The tenant has two homes now: its requests go to the second while the first drains,
    // by the prefix (not another spill), and no third home opens while the second's queue
    // costs less than a move (its 2,560 + 3 × 512 = 4,096 ms; one more request there and
    // it ties with the first, where the utilization term tips it to a third).
    for k in 0..3 {
        let (pos, why, e) = send(&mut cs);
        assert_eq!(
            (pos, why.as_str()),
            (home2, "prefix(0.80)"),
            "request {k}: {e}"
        );
    }
    let homes = cs.iter().filter(|c| c.waiting > 0).count();
    assert_eq!(homes, 2);
    // When the first home drains, the tenant uses it again (equal matches: lower load).
    cs[0].prefill_tokens = 0;
    cs[0].inflight_tokens = 0;
    cs[0].waiting = 0;
    let (pos, why, _) = send(&mut cs);
    assert_eq!((pos, why.as_str()), (0, "prefix(0.80)"));
}

/// `n` idle instances (of [`queued`]) and a 1,024-token prompt (64 blocks) the first holds
/// whole: the prompt, its match, the candidates.
fn held_by_first(n: usize) -> (Vec<u64>, PrefixMatch, Vec<Candidate>) {
    let index = PrefixIndex::default();
    let prompt: Vec<u64> = (0..64).collect();
    let cs: Vec<Candidate> = (0..n).map(|i| queued(i, 0, 0)).collect();
    index.insert(&prompt, cs[0].key, 0);
    let m = index.match_prefix(&prompt, 0);
    (prompt, m, cs)
}

/// The request of [`held_by_first`]'s prompt, explained.
fn held_request<'a>(prompt: &'a [u64], m: &'a PrefixMatch) -> RequestView<'a> {
    RequestView {
        blocks: prompt,
        prefix: Some(m),
        prompt_tokens: 1024,
        block_tokens: 16,
        explain: true,
        ..Default::default()
    }
}

#[test]
fn the_adaptive_prefix_layer_keeps_its_safety_caps_and_charges_the_copy() {
    let p = adaptive_pipeline();
    let (prompt, m, mut cs) = held_by_first(3);
    let r = held_request(&prompt, &m);
    let pick = |cs: &[Candidate]| p.pick(&r, cs, &mut StdRng::seed_from_u64(0)).unwrap();
    // 1,500 queued: below 1,024 + 1,024 → stays.
    cs[0] = queued(0, 1500, 3);
    assert_eq!(pick(&cs).reason, "prefix(1.00)");
    // 2,500 queued: more than moving with its copy → spills.
    cs[0] = queued(0, 2500, 3);
    let d = pick(&cs);
    assert_eq!(d.reason, PREFIX_SPILL, "{}", d.explain());
    assert!(d.explain().contains("+copy 1024ms"), "{}", d.explain());
    // Waiting above the cap: not chosen for its cache, whatever the costs (the layers
    // below decide; this is no spill).
    let mut cs: Vec<Candidate> = (0..3).map(|i| queued(i, 0, 0)).collect();
    cs[0] = queued(0, 100, COST_WAITING_CAP + 1);
    let d = pick(&cs);
    assert_eq!(d.reason, "least-cached", "{}", d.explain());
    let e = d.explain();
    assert!(e.contains("wait=17,match=64(1.00),est=100ms"), "{e}");
    assert!(
        e.contains("@1.0k/s prior busy=0.09 avg_wait=0.7),ineligible #1:"),
        "{e}"
    );
}

#[test]
fn decoding_load_alone_does_not_move_a_prompt_off_its_holder() {
    let p = adaptive_pipeline();
    let (prompt, m, mut cs) = held_by_first(8);
    let r = held_request(&prompt, &m);
    let pick = |cs: &[Candidate]| p.pick(&r, cs, &mut StdRng::seed_from_u64(0)).unwrap();
    // A hot tenant's home among idle engines: 40,000 tokens decoding (the average is
    // 5,000, the load rail 20,000), nothing waiting for a first token → its prefill starts
    // at once; it stays.
    cs[0].inflight_tokens = 40_000;
    cs[0].inflight_requests = 30;
    let d = p.pick(&r, &cs, &mut StdRng::seed_from_u64(0)).unwrap();
    assert_eq!(d.reason, "prefix(1.00)", "{}", d.explain());
    assert!(d.explain().contains("(with a queue)"), "{}", d.explain());
    // The same load with a request queued there (50 tokens: staying is still far cheaper
    // by the estimate) → over the rail, not chosen for its cache.
    cs[0].waiting = 1;
    cs[0].prefill_tokens = 50;
    let d = pick(&cs);
    assert_eq!(d.reason, "least-cached", "{}", d.explain());
}
