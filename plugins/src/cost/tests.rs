use super::*;

fn cand(i: u64, queued: u64) -> Candidate {
    Candidate {
        idx: i as usize,
        key: InstanceKey(i),
        prefill_tokens: queued,
        ..Default::default()
    }
}

/// A model with these priors (tokens/s, ms per decode step).
fn model(prior_prefill_tps: f64, prior_step_ms: f64) -> CostModel {
    CostModel::new(CostConfig {
        prior_prefill_tps,
        prior_step_ms,
        ..CostConfig::default()
    })
}

fn est(m: &CostModel, req: &RequestView<'_>, cs: &[Candidate]) -> Vec<Estimate> {
    let mut out = vec![Estimate::default(); cs.len()];
    m.estimate_all(req, cs, &mut out);
    out
}

fn req(prompt_tokens: u64) -> RequestView<'static> {
    RequestView {
        prompt_tokens,
        block_tokens: 16,
        ..Default::default()
    }
}

#[test]
fn known_queues_and_matches_give_the_expected_order() {
    let m = model(1000.0, 10.0);
    let index = crate::prefix::PrefixIndex::default();
    let blocks: Vec<u64> = (0..64).collect(); // 64 blocks of 16 = 1024 tokens
    index.insert(&blocks, InstanceKey(0), 0); // 0 holds the whole prompt …
    let cs = [cand(0, 3000), cand(1, 0), cand(2, 500)]; // … but has 3 s queued
    let pm = index.match_prefix(&blocks, 0);
    let r = RequestView {
        prefix: Some(&pm),
        blocks: &blocks,
        ..req(1024)
    };
    let e = est(&m, &r, &cs);
    // 0: 3000/1000 s + 0 + 10 ms; 1: 1024 ms + 10; 2: 500 + 1024 + 10.
    assert_eq!(e[0].ms, 3010.0);
    assert_eq!(e[1].ms, 1034.0);
    assert_eq!(e[2].ms, 1534.0);
    // With a short queue the holder wins.
    let cs = [cand(0, 200), cand(1, 0), cand(2, 0)];
    let e = est(&m, &r, &cs);
    assert!(e[0].ms < e[1].ms && e[1].ms == e[2].ms, "{e:?}");
    // A miss penalty makes the holder's lead larger.
    m.set_config(CostConfig {
        miss_penalty: 1.0,
        ..m.config()
    });
    let e2 = est(&m, &r, &cs);
    assert_eq!(e2[0].ms, e[0].ms);
    assert_eq!(e2[1].ms, 10.0 + 2048.0);
}

#[test]
fn a_cold_placement_counts_its_followers_prefill_at_each_instances_rate() {
    let m = model(8000.0, 20.0);
    // Instance 0 prefills 8,000 tokens/s, instance 1 half that (8,000 tokens in 1 s or
    // 2 s, + the 20 ms step).
    for (k, ttft_ms) in [(0, 1020.0), (1, 2020.0)] {
        for _ in 0..3 {
            let o = Observation {
                queued_tokens: 0,
                uncached_tokens: 8000,
                ttft_ms,
                tpot_ms: None,
            };
            m.observe(InstanceKey(k), &o);
        }
    }
    let cs = [cand(0, 0), cand(1, 0)];
    // Nothing routed yet: no followers known, no term.
    assert!(est(&m, &req(4000), &cs).iter().all(|e| e.follow_ms == 0.0));
    // Three of every four requests went where their 4,000-token prefix was held and
    // prefilled 500 new tokens; the fourth was a new 4,000-token prompt.
    for i in 0..200 {
        if i % 4 == 3 {
            m.routed(4000, 0);
        } else {
            m.routed(4500, 4000);
        }
        if i == FOLLOW_MIN_DECISIONS as usize - 2 {
            assert_eq!(m.follow().followers(), 0.0, "too few decisions yet");
        }
    }
    let f = m.follow();
    assert!((2.5..3.5).contains(&f.followers()), "{f:?}");
    assert!((f.warm_uncached - 500.0).abs() < 1e-6, "{f:?}");
    // Three followers × 500 tokens: 1,500 tokens at 8,000/s, or at 4,000/s.
    let e = est(&m, &req(4000), &cs);
    let per = |tps: f64| f.followers() * 500.0 * 1000.0 / tps;
    assert!((e[0].follow_ms - per(8000.0)).abs() < 1e-6, "{e:?}");
    assert!((e[1].follow_ms - per(4000.0)).abs() < 1e-6, "{e:?}");
    assert!(e[1].follow_ms > 2.0 * 180.0, "{e:?}");
    let mut said = String::new();
    e[1].describe(&mut said);
    assert!(said.contains("follow="), "{said}");
    // One-shots only: nobody follows a placement.
    let solo = model(8000.0, 20.0);
    for _ in 0..200 {
        solo.routed(4000, 0);
    }
    assert_eq!(solo.follow().followers(), 0.0);
}

#[test]
fn rates_are_learned_per_instance_and_new_instances_get_the_fleets() {
    let m = model(8000.0, 10.0);
    // Instance 1 prefills 1000 tok/s: 1000 own tokens took 1 s + one 10 ms step.
    for _ in 0..5 {
        m.observe(
            InstanceKey(1),
            &Observation {
                queued_tokens: 0,
                uncached_tokens: 1000,
                ttft_ms: 1010.0,
                tpot_ms: Some(10.0),
            },
        );
    }
    let l = m.learned(InstanceKey(1));
    assert!((l.prefill_tps - 1000.0).abs() < 1.0, "{l:?}");
    assert_eq!(l.step_ms, 10.0);
    // A cache hit (little work) teaches nothing about the prefill rate.
    m.observe(
        InstanceKey(1),
        &Observation {
            queued_tokens: 0,
            uncached_tokens: 16,
            ttft_ms: 12.0,
            tpot_ms: None,
        },
    );
    assert_eq!(m.learned(InstanceKey(1)).prefill_samples, 5);
    // Nor does a request with work queued ahead of it: how much of that work the engine
    // had done when it was sent is unknown (sent near the end of a 12k prefill, it waited
    // a moment and would teach 13 times the rate).
    m.observe(
        InstanceKey(1),
        &Observation {
            queued_tokens: 12_000,
            uncached_tokens: 1000,
            ttft_ms: 1010.0,
            tpot_ms: None,
        },
    );
    let l = m.learned(InstanceKey(1));
    assert_eq!(l.prefill_samples, 5);
    assert!((l.prefill_tps - 1000.0).abs() < 1.0, "{l:?}");
    // Instance 2 has no history: it gets the fleet's learned 1000 tok/s, not the
    // optimistic prior (and not a pessimistic one that would starve it).
    let e = est(&m, &req(1000), &[cand(1, 0), cand(2, 0)]);
    assert!((e[0].ms - e[1].ms).abs() < 1.0, "{e:?}");
    assert!((e[1].tps - 1000.0).abs() < 1.0);
    // The explanation says whose rate each one is: instance 2's is borrowed (a saturated
    // engine that never found its queue empty shows the same — on a mixed fleet the reader
    // must not take it for its own).
    assert_eq!(
        (e[0].tps_from, e[1].tps_from),
        (RateFrom::Own, RateFrom::Fleet)
    );
    let said = |e: &Estimate| {
        let mut s = String::new();
        e.describe(&mut s);
        s
    };
    assert!(said(&e[0]).contains("@1.0k/s)"), "{}", said(&e[0]));
    assert!(said(&e[1]).contains("@1.0k/s fleet)"), "{}", said(&e[1]));
    // The engine queue's own-prefill prediction reads the same rule.
    assert!((m.prefill_tps(InstanceKey(1)) - 1000.0).abs() < 1.0);
    assert!((m.prefill_tps(InstanceKey(2)) - 1000.0).abs() < 1.0);
    // Before any instance has its own, every one runs on the prior and says so.
    let fresh = model(8000.0, 10.0);
    let e = est(&fresh, &req(1000), &[cand(1, 0)]);
    assert!(said(&e[0]).contains("@8.0k/s prior)"), "{}", said(&e[0]));
    assert_eq!(fresh.prefill_tps(InstanceKey(1)), 8000.0);
}

#[test]
fn an_idle_restarted_instance_gets_traffic() {
    let m = CostModel::new(CostConfig::default());
    for k in 0..3 {
        for _ in 0..3 {
            m.observe(
                InstanceKey(k),
                &Observation {
                    queued_tokens: 0,
                    uncached_tokens: 8000,
                    ttft_ms: 1000.0,
                    tpot_ms: Some(20.0),
                },
            );
        }
    }
    // Instance 3 restarted: empty cache, no history. Everyone else holds the prompt but
    // has a queue; the idle one is cheapest.
    let blocks: Vec<u64> = (0..32).collect();
    let index = crate::prefix::PrefixIndex::default();
    for k in 0..3 {
        index.insert(&blocks, InstanceKey(k), 0);
    }
    let pm = index.match_prefix(&blocks, 0);
    let r = RequestView {
        prefix: Some(&pm),
        blocks: &blocks,
        ..req(512)
    };
    let cs = [cand(0, 6000), cand(1, 7000), cand(2, 9000), cand(3, 0)];
    let e = est(&m, &r, &cs);
    let best = (0..4).min_by(|&a, &b| e[a].ms.total_cmp(&e[b].ms)).unwrap();
    assert_eq!(best, 3, "{e:?}");
}

#[test]
fn arrivals_decay_and_a_prefills_harm_is_quadratic_in_its_length() {
    let m = model(1000.0, 0.0);
    let (busy, quiet) = (cand(1, 0), cand(2, 0));
    for _ in 0..10 {
        m.dispatched(busy.key, 50_000);
    }
    let harm = |tokens: u64, now: u64| {
        let mut e = est(&m, &req(tokens), &[busy, quiet]);
        m.arrivals(&[busy, quiet], now, &mut e);
        (e[0].lambda, e[0].harm_ms(), e[1].harm_ms())
    };
    // 10 requests within the 10-s time constant: 1 per second.
    let (lambda, h1, q1) = harm(1000, 50_000);
    assert!((lambda - 1.0).abs() < 1e-9, "{lambda}");
    // 1,000 tokens prefill 1 s: those arriving meanwhile (1) wait 0.5 s on average.
    assert!((h1 - 500.0).abs() < 1e-6, "{h1}");
    assert_eq!(q1, 0.0);
    // Twice the prompt, four times the harm.
    let (_, h2, _) = harm(2000, 50_000);
    assert!((h2 - 4.0 * h1).abs() < 1e-6, "{h2}");
    // A time constant later, a third of the rate is left.
    let (lambda, _, _) = harm(1000, 60_000);
    assert!((lambda - (-1.0f64).exp()).abs() < 1e-9, "{lambda}");
    // Work queued ahead: those arriving during it wait the whole prefill more.
    let mut q = busy;
    q.prefill_tokens = 1000;
    let mut e = est(&m, &req(1000), &[q]);
    m.arrivals(&[q], 50_000, &mut e);
    assert!((e[0].harm_ms() - 1500.0).abs() < 1e-6, "{:?}", e[0]);
    // The explanation says it (the term that decides a cold placement).
    let mut said = String::new();
    e[0].describe(&mut said);
    assert!(said.contains(" harm=1500ms"), "{said}");
}

#[test]
fn sessions_placed_a_moment_ago_count_by_their_requests_in_flight() {
    let m = model(1000.0, 0.0);
    let (mut home, mut new) = (cand(1, 0), cand(2, 0));
    // `home`'s sessions have come back all along (1 per second over the last 10 s); `new`
    // was given a tenant's first two turns a moment ago.
    for t in 0..10 {
        m.dispatched(home.key, 40_500 + t * 1000);
    }
    m.dispatched(new.key, 49_900);
    m.dispatched(new.key, 49_950);
    let lambdas = |home: Candidate, new: Candidate| {
        let mut e = est(&m, &req(4000), &[home, new]);
        m.arrivals(&[home, new], 50_000, &mut e);
        (e[0].lambda, e[1].lambda, e[0].harm_ms(), e[1].harm_ms())
    };
    // Nothing in flight: the decayed counts alone (the new tenant's 0.2/s against 0.63/s).
    let (h0, n0, hh0, nh0) = lambdas(home, new);
    assert!(n0 < 0.21 && h0 > 0.6, "{h0} {n0}");
    assert!(nh0 < hh0 / 3.0, "{hh0} {nh0}");
    // Those two are in flight (`home`'s sessions are between turns): the fleet's 0.83/s
    // turns its 2 requests in flight over at 0.42/s each, so `new` counts at least 2 × that
    // before the rates are scaled back to the decayed total (`home` 0.36/s, `new` 0.47/s).
    new.inflight_requests = 2;
    let (h1, n1, hh1, nh1) = lambdas(home, new);
    assert!(
        ((h1 + n1) - (h0 + n0)).abs() < 1e-9,
        "{h0}+{n0} → {h1}+{n1}"
    );
    assert!(n1 > h1 && n1 > 2.0 * n0, "{h1} {n1}");
    assert!(nh1 > 2.0 * nh0 && hh1 < hh0, "{hh0}/{nh0} → {hh1}/{nh1}");
    // Everything in flight on `home` instead: the rate moves there, the total stays.
    home.inflight_requests = 4;
    new.inflight_requests = 0;
    let (h2, n2, _, _) = lambdas(home, new);
    assert!(h2 > h0 && n2 < n0, "{h0} {n0} → {h2} {n2}");
    assert!(((h2 + n2) - (h0 + n0)).abs() < 1e-9, "{h2} {n2}");
}

/// Two instances the gateway sent requests to in the 10 s before 50 s, `fast` every
/// 500 ms and `slow` every second, then 200 decisions at 50 s that find them as they are
/// (their `waiting`, their queue): the estimates of a `prompt`-token cold request.
fn sampled_pair(m: &CostModel, fast: Candidate, slow: Candidate, prompt: u64) -> Vec<Estimate> {
    for t in 0..20 {
        m.dispatched(fast.key, 40_000 + t * 500);
        if t % 2 == 0 {
            m.dispatched(slow.key, 40_000 + t * 500);
        }
    }
    let mut e = est(m, &req(prompt), &[fast, slow]);
    for _ in 0..200 {
        m.utilization(&[fast, slow], 50_000, &mut e);
    }
    e
}

#[test]
fn in_a_saturated_fleet_a_cold_prefill_harms_most_where_sessions_come_back_most() {
    let m = model(1000.0, 0.0);
    // A hot tenant's home drains its cheap warm turns fast (200 ms queued) while its
    // sessions come back 2 times a second; the other engine has 2 s queued and 1 arrival
    // a second. Both have requests waiting at every decision (the fleet is saturated):
    // 3 cheap ones on the hot home, 2 on the other.
    let (mut hot, mut cold) = (cand(1, 200), cand(2, 2000));
    hot.waiting = 3;
    cold.waiting = 2;
    let e = sampled_pair(&m, hot, cold, 1000);
    assert!(e[0].rho > 0.9 && e[1].rho > 0.9, "{e:?}");
    assert!((e[0].waiting - 3.0).abs() < 1e-2, "{e:?}");
    assert!((e[0].busy_factor() - 4.0).abs() < 1e-2, "{e:?}");
    assert!((e[0].pool_queue_ms - 1100.0).abs() < 1e-6, "{e:?}");
    // Its own wait is shorter on the hot home ...
    assert!(e[0].ms < e[1].ms, "{e:?}");
    // ... but the work it adds there stalls twice as many requests for as long as the
    // fleet stays busy (its queue is refilled to the fleet's), more than the shorter
    // queue saves.
    let (h0, h1) = (e[0].harm_ms(), e[1].harm_ms());
    assert!(h0 > h1, "{h0} vs {h1}");
    assert!(e[0].ms + h0 > e[1].ms + h1, "{e:?}");
    // An idle fleet: no persistence, and the hot home's own short queue is all it counts.
    let m2 = model(1000.0, 0.0);
    let idle = cand(1, 0);
    m2.dispatched(idle.key, 50_000);
    let mut e = est(&m2, &req(1000), &[idle]);
    m2.utilization(&[idle], 50_000, &mut e);
    assert!(e[0].rho < 0.05, "{e:?}");
    assert!((e[0].harm_ms() - 0.1 * 500.0).abs() < 1e-6);
}

#[test]
fn a_busy_instance_with_few_waiting_is_not_priced_like_a_saturated_queue() {
    // The overload cell (`many-4k-agents-half-overload`, seed 4): sessions that wait for
    // their answers keep both engines busy at every decision. e2 drains its sessions'
    // warm turns with 1 request waiting (1.3 s queued, 2.1 arrivals/s); e4 has 16 waiting
    // (23 s queued) and half the arrivals, because its sessions are stuck in that queue.
    let m = model(1000.0, 0.0);
    let (mut e2, mut e4) = (cand(2, 1300), cand(4, 23_000));
    e2.waiting = 1;
    e4.waiting = 16;
    let e = sampled_pair(&m, e2, e4, 4800);
    assert!(e[0].rho > 0.9 && e[1].rho > 0.9, "{e:?}");
    assert!(e[0].lambda > 1.5 * e[1].lambda, "{e:?}");
    // The busy period outlasts the backlog by the requests found there: × (1 + 1) on e2
    // and × (1 + 16) on e4, where 1 / (1 − ρ) would be × 20 on both (ρ at its cap).
    assert!((e[0].busy_factor() - 2.0).abs() < 1e-2, "{e:?}");
    assert!(e[1].busy_factor() > 15.0, "{e:?}");
    // A cold 4.8k prompt harms e4's stuck sessions more than e2's, and goes to e2: with
    // 1 / (1 − ρ) on both, e2's higher arrival rate and the fleet's mean queue made e4
    // the cheaper, and its queue grew to 27 s while e2 stayed near 1 s.
    let (h2, h4) = (e[0].harm_ms(), e[1].harm_ms());
    assert!(e[0].ms + h2 < e[1].ms + h4, "{h2} vs {h4}: {e:?}");
    let old = |x: &Estimate| x.harm_ms() / x.busy_factor() / (1.0 - x.rho.min(RHO_CAP));
    assert!(e[0].ms + old(&e[0]) > e[1].ms + old(&e[1]), "{e:?}");
}

#[test]
fn requests_the_engine_queued_for_others_count() {
    let m = model(1000.0, 0.0);
    m.observe(
        InstanceKey(9),
        &Observation {
            queued_tokens: 0,
            uncached_tokens: 500,
            ttft_ms: 500.0,
            tpot_ms: None,
        },
    );
    let mut busy = cand(0, 0);
    busy.engine = Some(crate::candidate::EngineLoad {
        running: 8,
        waiting: 4,
        kv_usage: 0.9,
    });
    let e = est(&m, &req(100), &[busy, cand(1, 0)]);
    // 4 requests of ~500 uncached tokens queued by another gateway: +2 s.
    assert!((e[0].queue_ms - 2000.0).abs() < 1.0, "{e:?}");
    assert_eq!(e[1].queue_ms, 0.0);
}
