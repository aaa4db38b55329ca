//! Layered scheduling (session affinity → prefix cache → load balancing) through the real
//! gateway binary in front of engine-sim fleets.

mod common;

use common::*;

async fn post(
    c: &reqwest::Client,
    gw: &GatewayProc,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut r = c.post(gw.url("/v1/chat/completions")).json(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().await.unwrap();
    assert_eq!(r.status(), 200);
    r
}

fn inst(r: &reqwest::Response) -> String {
    r.headers()["x-tokengate-instance"]
        .to_str()
        .unwrap()
        .to_string()
}
fn reason(r: &reqwest::Response) -> String {
    r.headers()["x-tokengate-reason"]
        .to_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_stick_and_claude_code_sessions_are_recognised() {
    let fleet = sims(4, "m", "e", 200.0).await;
    let yaml = format!(
        "services:\n  - name: m\n    load_balancing: least-request\n    scheduler:\n      mode: layered\n      affinity: {{mode: soft}}\n{}",
        sim_instances(&fleet)
    );
    let gw = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    let mut bound = std::collections::HashMap::new();
    for round in 0..4 {
        for s in ["s1", "s2", "s3", "s4", "s5", "s6"] {
            let header = if s == "s6" {
                "x-claude-code-session-id"
            } else {
                "x-session-id"
            };
            let r = post(&c, &gw, &chat("sys", s, 2, false), &[(header, s)]).await;
            let i = inst(&r);
            let why = reason(&r);
            r.bytes().await.unwrap();
            if round == 0 {
                // Unbound, no cached prefix: the least-cached layer (on by default).
                assert_eq!(why, "least-cached", "new session {s}");
                bound.insert(s, i);
            } else {
                assert_eq!(why, "affinity", "{s} round {round}");
                assert_eq!(bound[s], i, "{s} moved in round {round}");
            }
        }
    }
    // Sessions were spread over the emptiest caches when they bound: all four instances got some.
    let used: std::collections::HashSet<_> = bound.values().collect();
    assert_eq!(used.len(), 4, "{bound:?}");
    // No session header: the layers below affinity.
    let r = post(&c, &gw, &chat("sys", "anon", 2, false), &[]).await;
    assert_eq!(reason(&r), "least-cached");
    gw.wait_idle().await;
    let m = gw.metrics().await;
    assert_eq!(
        metric(&m, "tokengate_routing_decisions_total{reason=\"affinity\"}"),
        Some(18.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "tokengate_sessions{scheduler=\"m\"}"),
        Some(6.0),
        "{m}"
    );
}

/// Opens a stream that stays open (the engine generates far more than we read) and returns it
/// once its headers arrived.
async fn hold(
    c: &reqwest::Client,
    gw: &GatewayProc,
    system: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut hs: Vec<(&str, &str)> = headers.to_vec();
    hs.push(("x-sim-output-tokens", "100000"));
    post(c, gw, &chat(system, "hold", 100_000, true), &hs).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_affinity_escapes_an_overloaded_instance_and_strict_stays() {
    for mode in ["soft", "strict"] {
        let fleet = sims(2, "m", "e", 1.0).await;
        let yaml = format!(
            "services:\n  - name: m\n    load_balancing: least-request\n    scheduler:\n      mode: layered\n      affinity: {{mode: {mode}, soft_max_load_ratio: 1.5}}\n{}",
            sim_instances(&fleet)
        );
        let gw = GatewayProc::start(&yaml);
        let c = reqwest::Client::new();
        let s = [("x-session-id", "sess")];
        let first = hold(&c, &gw, "sys", &s).await;
        let home = inst(&first);
        // The bound instance now carries 1 request, the other 0: 1 > avg 0.5 × 1.5.
        let second = hold(&c, &gw, "sys", &s).await;
        if mode == "soft" {
            assert_eq!(reason(&second), "affinity-escape");
            assert_ne!(
                inst(&second),
                home,
                "soft mode must leave the overloaded instance"
            );
            // …and the session is now bound to the new instance.
            let third = post(&c, &gw, &chat("sys", "x", 1, false), &s).await;
            assert_eq!(inst(&third), inst(&second));
        } else {
            assert_eq!(reason(&second), "affinity");
            assert_eq!(inst(&second), home, "strict mode stays");
        }
        drop((first, second));
        gw.wait_idle().await;
    }
}

fn family_prompt(f: usize) -> String {
    // ~4 KB of text unique to the family.
    (0..400).map(|i| format!("f{f}w{i} ")).collect()
}

/// Sends 6 requests for each of 7 prompt families (interleaved; 7 is coprime with the 4
/// instances, so round-robin rotates each family over all of them) and returns the
/// engine-reported cached tokens and the reasons seen.
async fn run_families(gw: &GatewayProc) -> (f64, Vec<String>) {
    let c = reqwest::Client::new();
    let mut reasons = Vec::new();
    for turn in 0..6 {
        for f in 0..7 {
            let r = post(
                &c,
                gw,
                &chat(&family_prompt(f), &format!("question {turn}"), 2, false),
                &[],
            )
            .await;
            reasons.push(reason(&r));
            r.bytes().await.unwrap();
        }
    }
    gw.wait_idle().await;
    let m = gw.metrics().await;
    (
        metric(&m, "tokengate_tokens_total{kind=\"cached\",model=\"m\"}").unwrap(),
        reasons,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefixes_go_where_they_are_cached_and_raise_engine_hits() {
    let fleet_rr = sims(4, "m", "rr", 200.0).await;
    let fleet_px = sims(4, "m", "px", 200.0).await;
    let rr = GatewayProc::start(&format!(
        "services:\n  - name: m\n    load_balancing: round-robin\n{}",
        sim_instances(&fleet_rr)
    ));
    let px = GatewayProc::start(&format!(
        "services:\n  - name: m\n    load_balancing: least-request\n    scheduler:\n      mode: layered\n      prefix: {{}}\n{}",
        sim_instances(&fleet_px)
    ));
    let (cached_rr, _) = run_families(&rr).await;
    let (cached_px, reasons) = run_families(&px).await;
    // After its first request, every family is routed by the prefix layer.
    let prefix_routed = reasons.iter().filter(|r| r.starts_with("prefix(")).count();
    assert_eq!(prefix_routed, 35, "{reasons:?}");
    // Round-robin spreads each family over all 4 caches (4 cold starts per family instead of 1).
    assert!(
        cached_px > cached_rr * 1.3,
        "prefix-aware cached {cached_px} vs round-robin {cached_rr}"
    );
    let m = px.metrics().await;
    let ceiling = metric(
        &m,
        "tokengate_prefix_hit_ratio{kind=\"ceiling\",service=\"m\"}",
    )
    .unwrap();
    let predicted = metric(
        &m,
        "tokengate_prefix_hit_ratio{kind=\"predicted\",service=\"m\"}",
    )
    .unwrap();
    let engine = metric(
        &m,
        "tokengate_prefix_hit_ratio{kind=\"engine\",service=\"m\"}",
    )
    .unwrap();
    // 35 of 42 requests can reuse ~all of their prompt.
    assert!(ceiling > 0.7 && ceiling <= 1.0, "ceiling {ceiling}");
    assert!(
        (predicted - ceiling).abs() < 1e-9,
        "predicted {predicted} vs ceiling {ceiling}"
    );
    assert!(
        (engine - predicted).abs() < 0.1,
        "engine {engine} vs predicted {predicted}"
    );
    assert!(metric(&m, "tokengate_prefix_index_nodes{service=\"m\"}").unwrap() > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_prefix_holder_is_not_preferred() {
    let fleet = sims(2, "m", "e", 1.0).await;
    // The seed's fixed limits, least_cached off: that layer compares predicted TTFTs, and the
    // holder's (a cached prompt) is far below the other's, so it would take the request back.
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    load_balancing: least-request\n    scheduler:\n      mode: layered\n      prefix: {{load_tolerance: 0.3}}\n      least_cached: {{enabled: false}}\n{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    let sys = family_prompt(1);
    let warm = post(&c, &gw, &chat(&sys, "warm", 1, false), &[]).await;
    let holder = inst(&warm);
    warm.bytes().await.unwrap();
    // Eligible: both idle, so the prefix holder wins.
    let a = hold(&c, &gw, &sys, &[]).await;
    assert!(reason(&a).starts_with("prefix("), "{}", reason(&a));
    assert_eq!(inst(&a), holder);
    // Now the holder has 1 in flight > avg 0.5 × 1.3: the prefix layer passes.
    let b = hold(&c, &gw, &sys, &[]).await;
    assert_eq!(reason(&b), "least-request");
    assert_ne!(inst(&b), holder);
    drop((a, b));
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_low_hit_ratio_is_a_miss() {
    let fleet = sims(2, "m", "e", 200.0).await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    load_balancing: round-robin\n    scheduler:\n      mode: layered\n      prefix: {{min_hit_ratio: 0.9}}\n{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    let sys = family_prompt(2);
    post(&c, &gw, &chat(&sys, "x", 1, false), &[])
        .await
        .bytes()
        .await
        .unwrap();
    // Same system prompt but a user message as long again: ~50 % match < 0.9.
    let long_user = family_prompt(3);
    let r = post(&c, &gw, &chat(&sys, &long_user, 1, false), &[]).await;
    assert_eq!(reason(&r), "least-cached");
    // An exact repeat is a 100 % match.
    let r = post(&c, &gw, &chat(&sys, "x", 1, false), &[]).await;
    assert!(reason(&r).starts_with("prefix(1.00"), "{}", reason(&r));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_bound_evicts_the_index() {
    let fleet = sims(2, "m", "e", 200.0).await;
    // A 1 MB "container": the process is always over budget, so every maintenance pass
    // empties the index.
    let gw = GatewayProc::start(&format!(
        "prefix_index: {{maintenance_interval: 50ms, memory_limit_bytes: 1000000}}\nservices:\n  - name: m\n    scheduler:\n      mode: layered\n      prefix: {{}}\n{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    for f in 0..5 {
        post(&c, &gw, &chat(&family_prompt(f), "x", 1, false), &[])
            .await
            .bytes()
            .await
            .unwrap();
    }
    eventually("the index to be evicted", || async {
        let m = gw.metrics().await;
        metric(&m, "tokengate_prefix_index_evicted_bytes{service=\"m\"}").unwrap_or(0.0) > 0.0
            && metric(&m, "tokengate_prefix_index_nodes{service=\"m\"}") == Some(0.0)
    })
    .await;
    // The line is written just after the eviction the metrics already show: poll for it too.
    eventually("the eviction to be logged", || async {
        gw.log_text().contains("prefix index of m: evicted")
    })
    .await;
}

/// No scheduling key at all (the default is the layered scheduler): a hot tenant whose
/// requests pile up on the engine holding its system prompt gets a second engine once that
/// one's queue costs more than recomputing the prompt elsewhere plus the copy, and no third
/// one; a cold tenant stays on the one engine that holds its prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_hot_tenant_spreads_over_two_engines_and_a_cold_one_stays_on_one() {
    hot_and_cold_tenants("", true).await;
}

/// The same burst through policy mode as `conf/policy.yaml`'s `agents` service documents it
/// (the predicted-TTFT filter with `stay_or_move`): the same spread, by the same comparison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_mode_with_stay_or_move_spreads_a_hot_tenant_and_keeps_a_cold_one_home() {
    let conf =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/conf/policy.yaml")).unwrap();
    // The agents service's scheduler block, as the file has it.
    let start = conf
        .find("  - name: agents\n")
        .expect("conf/policy.yaml: agents");
    let block: String = conf[start..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("    instances:"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(block.contains("stay_or_move: true"), "{block}");
    hot_and_cold_tenants(&block, false).await;
}

/// A hot and a cold tenant's burst on four slow engines (see the test above); `scheduler`:
/// the service's scheduling keys ("" = none); `reasons`: check the layered reason headers.
async fn hot_and_cold_tenants(scheduler: &str, reasons_layered: bool) {
    // Slow prefill (1,000 tokens/s): a 300-token question waits 0.3 s per request queued
    // ahead of it, so a burst sent at once queues on the engines.
    let fleet = sim_fleet(
        4,
        engine_sim::SimConfig {
            prefill_tps: 1000.0,
            ..Default::default()
        },
    )
    .await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n{scheduler}{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    // System prompts of ~1,200 tokens (4 bytes a token), questions of ~300, unique at their
    // start so that only the system prompt is shared.
    let system = |t: &str| -> String { (0..600).map(|i| format!("{t}{i:06} ")).collect() };
    let (hot, cold) = (system("h"), system("c"));
    let question = |k: usize| -> String { format!("q{k:04} {}", "x".repeat(1190)) };
    // Each tenant's first request: placed by least-cached on an empty cache.
    let r = post(&c, &gw, &chat(&hot, &question(0), 1, false), &[]).await;
    let hot_home = inst(&r);
    r.bytes().await.unwrap();
    let r = post(&c, &gw, &chat(&cold, &question(1), 1, false), &[]).await;
    let cold_home = inst(&r);
    r.bytes().await.unwrap();
    assert_ne!(hot_home, cold_home);
    // The burst: 11 hot requests and 4 cold ones at once. Staying costs the holder's queue +
    // ~300 tokens, moving ~1,500 tokens (the whole prompt) + 1,200 (the copy it evicts), +
    // a decode step either way: the holder keeps 8 hot requests (the old fixed limit of 2
    // waiting kept 3), the second home 4 more before a third would open.
    let mut tasks = Vec::new();
    for k in 0..15 {
        let cold_one = k % 4 == 1;
        let body = if cold_one {
            chat(&cold, &question(100 + k), 1, false)
        } else {
            chat(&hot, &question(100 + k), 1, false)
        };
        let (c, url) = (c.clone(), gw.url("/v1/chat/completions"));
        tasks.push(tokio::spawn(async move {
            let r = c.post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 200);
            let out = (inst(&r), reason(&r));
            r.bytes().await.unwrap();
            (cold_one, out)
        }));
    }
    let mut hot_on = std::collections::BTreeMap::<String, usize>::new();
    let mut cold_on = std::collections::BTreeSet::new();
    let mut reasons = Vec::new();
    for t in tasks {
        let (is_cold, (i, why)) = t.await.unwrap();
        if is_cold {
            assert!(
                !reasons_layered || why.starts_with("prefix("),
                "cold: {why}"
            );
            cold_on.insert(i);
        } else {
            *hot_on.entry(i).or_default() += 1;
            reasons.push(why);
        }
    }
    assert_eq!(
        cold_on.into_iter().collect::<Vec<_>>(),
        vec![cold_home.clone()],
        "the cold tenant stays home"
    );
    // Spread beyond its home, but not over every engine: the cold tenant's home takes none of
    // it. (Whether a third home opens late in the burst depends on the prefill rates the
    // cost model has learned by then, i.e. on the machine's timing: it did once in a CI run
    // on a loaded 2-core machine, {"e1": 8, "e3": 2, "e4": 1}. The unit tests in
    // plugins/src/layered.rs pin the rule itself: a second home opens when the first is
    // saturated, and no third while the second has room.)
    assert!(
        (2..=3).contains(&hot_on.len()),
        "the hot tenant on two engines (at most three): {hot_on:?} {reasons:?}"
    );
    assert!(hot_on.contains_key(&hot_home), "{hot_on:?}");
    assert!(!hot_on.contains_key(&cold_home), "{hot_on:?}");
    assert!(hot_on[&hot_home] >= 6, "{hot_on:?} {reasons:?}");
    if !reasons_layered {
        gw.wait_idle().await;
        return;
    }
    // Each new home was opened by a request whose prompt was cached but whose holder's queue
    // cost more (`prefix-spill`); every other request went by the prefix.
    let spills = reasons.iter().filter(|r| *r == "prefix-spill").count();
    assert!(spills >= hot_on.len() - 1, "{reasons:?}");
    assert_eq!(
        reasons.iter().filter(|r| r.starts_with("prefix(")).count(),
        11 - spills,
        "{reasons:?}"
    );
    gw.wait_idle().await;
}

/// New capacity is used: an engine added (by a config reload) to a busy fleet whose hot
/// prompt is cached on the other engines takes a share of that prompt's requests once the
/// holders' queues cost more than recomputing the prompt there plus the copy's placement
/// (the stay-or-move comparison); from then on it holds the prompt too and equal matches
/// share by load. Below that point waiting for the cache is the cheaper choice: with 10
/// clients instead of 20 (holders' waits ~750 ms against a 1,350-ms move) it takes none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_added_to_a_busy_fleet_takes_a_share_of_its_cached_prompts() {
    // Prefill at 2,000 tokens/s: a ~300-token question costs 150 ms where the ~1,200-token
    // system prompt is cached, the whole ~1,500 tokens 750 ms where it is not.
    let fleet = sim_fleet(
        3,
        engine_sim::SimConfig {
            prefill_tps: 2000.0,
            ..Default::default()
        },
    )
    .await;
    let yaml = |n: usize| format!("services:\n  - name: m\n{}", sim_instances(&fleet[..n]));
    let gw = GatewayProc::start(&yaml(2));
    let c = reqwest::Client::new();
    let system: String = (0..600).map(|i| format!("s{i:06} ")).collect();
    let question = |k: usize| -> String { format!("q{k:05} {}", "x".repeat(1190)) };
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // 20 clients in a closed loop, each sending `per_client` requests one after the other:
    // ~10 wait on each holder, 1.5 s of queued prefill.
    let run = |per_client: usize| {
        let mut tasks = Vec::new();
        for _ in 0..20 {
            let (c, url, next, system) = (
                c.clone(),
                gw.url("/v1/chat/completions"),
                next.clone(),
                system.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let mut on = Vec::new();
                for _ in 0..per_client {
                    let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let r = c
                        .post(&url)
                        .json(&chat(&system, &question(k), 1, false))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                    on.push((k, inst(&r), reason(&r)));
                    r.bytes().await.unwrap();
                }
                on
            }));
        }
        tasks
    };
    let mut before = Vec::new();
    for t in run(2) {
        before.extend(t.await.unwrap());
    }
    assert!(before.iter().all(|(_, i, _)| i != "e3"), "{before:?}");
    // The third engine joins by a reload while the load goes on.
    let tasks = run(5);
    std::fs::write(gw.config_path(), yaml(3)).unwrap();
    eventually("the reload", || async {
        gw.metrics()
            .await
            .contains("tokengate_config_reloads_total{result=\"ok\"} 1")
    })
    .await;
    // Requests sent from here on can see the third engine.
    let from = next.load(std::sync::atomic::Ordering::Relaxed);
    let mut after = Vec::new();
    for t in tasks {
        after.extend(t.await.unwrap());
    }
    after.retain(|(k, _, _)| *k >= from);
    after.sort();
    assert!(
        after.len() >= 40,
        "{} requests after the reload",
        after.len()
    );
    let on_new = after.iter().filter(|(_, i, _)| i == "e3").count();
    eprintln!("the new engine: {on_new} of {} requests", after.len());
    assert!(
        on_new * 6 >= after.len(),
        "the new engine took {on_new} of the {} requests after it joined: {after:?}",
        after.len()
    );
    gw.wait_idle().await;
}

/// The cost model's fleet figures on `/admin/instances` (`cost_model`): a system prompt sent
/// twenty times in a row is one cold placement followed by nineteen requests routed to the
/// cache that holds it, so the least-cached layer prices a cold placement for 19 followers
/// (the share 0.95, its cap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_shows_how_many_requests_follow_a_cold_placement() {
    let fleet = sim_fleet(2, engine_sim::SimConfig::default()).await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    let f = gw.instances().await["cost_model"].clone();
    assert_eq!(f["decisions"], 0, "{f}");
    assert_eq!(f["followers"], 0.0, "{f}");
    let system = words("tools", 400);
    for i in 0..20 {
        let r = post(
            &c,
            &gw,
            &chat(&system, &format!("question {i}"), 2, true),
            &[],
        )
        .await;
        r.bytes().await.unwrap();
    }
    let f = gw.wait_idle().await["cost_model"].clone();
    assert_eq!(f["decisions"], 20, "{f}");
    assert_eq!(f["warm_share"], 0.95, "{f}");
    assert_eq!(f["followers"], 19.0, "{f}");
    assert!(f["warm_uncached_tokens"].as_f64().unwrap() > 0.0, "{f}");
}
