//! Tenants (`tenants:`) through the real binary and real engine-sims: a key's tenant may
//! call only its models (403 in the API's shape, `/v1/models` filtered); per-minute token
//! limits are charged with what a request really used (a long stream counts its output)
//! and refuse with `Retry-After` and `x-ratelimit-*` headers; concurrency slots come back
//! after client hang-ups and upstream failures; a reload keeps the counters of the tenants
//! it leaves in place. Time passes through the gateway's test clock, never by sleeping.

mod common;

use common::*;
use futures_util::StreamExt;

async fn sim(model: &str, id: &str, time_scale: f64) -> engine_sim::SimHandle {
    engine_sim::spawn_local(engine_sim::SimConfig {
        id: id.into(),
        model: model.into(),
        time_scale,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// A chat body saying "hello there" to `model` (not `common::chat`: any model, an optional
/// `max_tokens`).
fn hello(model: &str, max_tokens: Option<u64>, stream: bool) -> serde_json::Value {
    let mut v = serde_json::json!({"model": model, "stream": stream,
        "messages": [{"role": "user", "content": "hello there"}]});
    if let Some(m) = max_tokens {
        v["max_tokens"] = m.into();
    }
    v
}

async fn post(
    gw: &GatewayProc,
    key: &str,
    body: &serde_json::Value,
    extra: &[(&str, &str)],
) -> reqwest::Response {
    let mut r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(body);
    for (k, v) in extra {
        r = r.header(*k, *v);
    }
    r.send().await.unwrap()
}

fn header(r: &reqwest::Response, name: &str) -> Option<String> {
    r.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

fn num(r: &reqwest::Response, name: &str) -> u64 {
    header(r, name)
        .unwrap_or_else(|| panic!("no {name} in {:?}", r.headers()))
        .parse()
        .unwrap()
}

async fn models(gw: &GatewayProc, key: &str) -> Vec<String> {
    let v: serde_json::Value = reqwest::Client::new()
        .get(gw.url("/v1/models"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_calls_only_its_tenants_models() {
    let small = sim("m-small", "s1", 50.0).await;
    let big = sim("big", "b1", 50.0).await;
    let yaml = format!(
        "api_keys: [sk-global-1]\ntenants:\n  - name: search\n    keys: [sk-search-1]\n    models: [\"m-*\"]\n  - name: other\n    keys_env: TG_TEST_OTHER_KEYS\n    models: [big]\nservices:\n{}{}",
        service("m-small", &[("s1", small.addr)]),
        service("big", &[("b1", big.addr)]),
    );
    let gw =
        GatewayProc::start_with_env(&yaml, &[("TG_TEST_OTHER_KEYS", "sk-other-1, sk-other-2")]);
    // /v1/models lists what the key's tenant may call.
    assert_eq!(models(&gw, "sk-search-1").await, vec!["m-small"]);
    assert_eq!(models(&gw, "sk-other-2").await, vec!["big"]);
    assert_eq!(models(&gw, "sk-global-1").await, vec!["m-small", "big"]);

    let r = post(&gw, "sk-search-1", &hello("m-small", Some(4), false), &[]).await;
    assert_eq!(r.status(), 200);
    // A model outside `models`: 403, OpenAI-shaped on the OpenAI API…
    let r = post(&gw, "sk-search-1", &hello("big", Some(4), false), &[]).await;
    assert_eq!(r.status(), 403);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_allowed", "{v}");
    assert_eq!(v["error"]["type"], "permission_error", "{v}");
    // …Anthropic-shaped on /v1/messages.
    let r = reqwest::Client::new()
        .post(gw.url("/v1/messages"))
        .header("x-api-key", "sk-search-1")
        .json(&serde_json::json!({"model": "big", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "permission_error", "{v}");
    // The other tenant's keys (from the environment) and the global key.
    let r = post(&gw, "sk-other-1", &hello("big", Some(4), false), &[]).await;
    assert_eq!(r.status(), 200);
    let r = post(&gw, "sk-other-1", &hello("m-small", Some(4), false), &[]).await;
    assert_eq!(r.status(), 403);
    let r = post(&gw, "sk-global-1", &hello("big", Some(4), false), &[]).await;
    assert_eq!(r.status(), 200);
    let r = post(&gw, "sk-nobody", &hello("big", Some(4), false), &[]).await;
    assert_eq!(r.status(), 401);

    gw.wait_idle().await;
    let m = gw.metrics().await;
    for (line, want) in [
        (
            "tokengate_tenant_requests_total{model=\"m-small\",tenant=\"search\"}",
            1.0,
        ),
        (
            "tokengate_tenant_requests_total{model=\"big\",tenant=\"other\"}",
            1.0,
        ),
        (
            "tokengate_tenant_requests_total{model=\"big\",tenant=\"default\"}",
            1.0,
        ),
        (
            "tokengate_tenant_rejections_total{reason=\"model_not_allowed\",tenant=\"search\"}",
            2.0,
        ),
        (
            "tokengate_tenant_rejections_total{reason=\"model_not_allowed\",tenant=\"other\"}",
            1.0,
        ),
    ] {
        assert_eq!(metric(&m, line), Some(want), "{line}:\n{m}");
    }
    let out = metric(
        &m,
        "tokengate_tenant_tokens_total{kind=\"output\",model=\"m-small\",tenant=\"search\"}",
    );
    assert_eq!(out, Some(4.0), "{m}");
    eventually("the access lines", || async {
        gw.log_text().matches("tenant=search").count() >= 3
    })
    .await;
    // Keys appear nowhere: not in the log, the metrics or /admin.
    let admin = reqwest::get(gw.admin_url("/admin/instances"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for text in [gw.log_text(), m, admin] {
        for key in ["sk-search-1", "sk-other-1", "sk-other-2", "sk-global-1"] {
            assert!(!text.contains(key), "{key} in:\n{text}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_limits_charge_what_a_stream_used() {
    let e = sim("m", "e1", 20.0).await;
    let yaml = format!(
        "tenants:\n  - name: t\n    keys: [sk-t]\n    limits: {{requests_per_minute: 100, output_tokens_per_minute: 1000}}\nservices:\n{}",
        service("m", &[("e1", e.addr)]),
    );
    let gw = GatewayProc::start(&yaml);
    // A stream without max_tokens reserves 256 output tokens and runs to 900.
    let r = post(
        &gw,
        "sk-t",
        &hello("m", None, true),
        &[("x-sim-output-tokens", "900")],
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(num(&r, "x-ratelimit-limit-output-tokens"), 1000);
    assert_eq!(num(&r, "x-ratelimit-limit-requests"), 100);
    let left = num(&r, "x-ratelimit-remaining-output-tokens");
    assert!(
        (744..=760).contains(&left),
        "{left}: 1000 - the 256 reserved"
    );
    assert!(header(&r, "x-ratelimit-reset-output-tokens").is_some());
    let body = r.text().await.unwrap();
    assert!(body.contains("[DONE]"), "{body}");
    // (The gateway completes the request just after the client read its end.)
    gw.wait_idle().await;
    // Charged 900, not 256: 200 more output tokens do not fit this minute.
    let r = post(&gw, "sk-t", &hello("m", Some(200), false), &[]).await;
    assert_eq!(r.status(), 429, "{:?}", r.headers());
    let retry: u64 = num(&r, "retry-after");
    assert!((5..=7).contains(&retry), "retry-after {retry}");
    let left = num(&r, "x-ratelimit-remaining-output-tokens");
    assert!(left < 200, "{left}");
    assert_eq!(num(&r, "x-ratelimit-limit-output-tokens"), 1000);
    assert!(header(&r, "x-ratelimit-reset-output-tokens").is_some());
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    // The Anthropic API says it in its shape.
    let r = reqwest::Client::new()
        .post(gw.url("/v1/messages"))
        .header("x-api-key", "sk-t")
        .json(&serde_json::json!({"model": "m", "max_tokens": 200,
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert!(header(&r, "retry-after").is_some());
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    // A minute later the bucket is full again.
    gw.advance_clock(60_000).await;
    let r = post(&gw, "sk-t", &hello("m", Some(200), false), &[]).await;
    assert_eq!(r.status(), 200);
    let left = num(&r, "x-ratelimit-remaining-output-tokens");
    assert!((800..=810).contains(&left), "{left}");
    r.text().await.unwrap();
    gw.wait_idle().await;
    let m = gw.metrics().await;
    let out = metric(
        &m,
        "tokengate_tenant_tokens_total{kind=\"output\",model=\"m\",tenant=\"t\"}",
    );
    assert_eq!(out, Some(1100.0), "{m}");
    assert_eq!(
        metric(
            &m,
            "tokengate_tenant_rejections_total{reason=\"output_tokens_per_minute\",tenant=\"t\"}"
        ),
        Some(2.0),
        "{m}"
    );
    // Requests per minute: 100 this minute, 3 used.
    gw.advance_clock(60_000).await;
    let r = post(&gw, "sk-t", &hello("m", Some(1), false), &[]).await;
    assert_eq!(num(&r, "x-ratelimit-remaining-requests"), 99);
}

/// Requests in flight are the tenant's concurrency until they end, however they end: the
/// client hanging up mid-stream, the upstream failing, the model refused downstream of the
/// limit check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_comes_back_after_hang_ups_and_failures() {
    let e = sim("m", "e1", 1.0).await;
    let dead = dead_addr();
    let yaml = format!(
        "tenants:\n  - name: t\n    keys: [sk-t]\n    limits: {{concurrency: 2, input_tokens_per_minute: 100000, output_tokens_per_minute: 100000}}\nhealth_check: {{enabled: false}}\npassive_health: {{eject_for: 0s}}\nservices:\n{}{}",
        service("m", &[("e1", e.addr)]),
        service("down", &[("d1", dead)]),
    );
    let gw = GatewayProc::start(&yaml);
    let long = &[("x-sim-output-tokens", "100000")];
    // A request's slot is released when the gateway completes it, which may be just after
    // its client read the answer: a refusal right after one is retried (bounded by the
    // deadline); a slot that never comes back fails the test at the deadline.
    let deadline = std::time::Instant::now() + DEADLINE;
    let mut refused_late = 0;
    for round in 0..3 {
        // Two long streams hold both slots; a third request is refused.
        let mut streams = Vec::new();
        while streams.len() < 2 {
            let r = post(&gw, "sk-t", &hello("m", None, true), long).await;
            if r.status() == 429 && std::time::Instant::now() < deadline {
                refused_late += 1;
                continue;
            }
            assert_eq!(r.status(), 200, "round {round}: a slot never came back");
            let mut s = r.bytes_stream();
            s.next().await.unwrap().unwrap();
            streams.push(s);
        }
        let r = post(&gw, "sk-t", &hello("m", Some(1), false), &[]).await;
        assert_eq!(r.status(), 429, "round {round}");
        assert_eq!(num(&r, "retry-after"), 1);
        // The clients hang up: the slots come back.
        drop(streams);
        // Upstream failures end their requests too.
        let mut failed = 0;
        while failed < 3 {
            let r = post(&gw, "sk-t", &hello("down", Some(1), false), &[]).await;
            if r.status() == 429 && std::time::Instant::now() < deadline {
                refused_late += 1;
                continue;
            }
            assert!(
                [502, 503].contains(&r.status().as_u16()),
                "round {round}: {}",
                r.status()
            );
            failed += 1;
        }
    }
    eprintln!("refused while a slot was being released: {refused_late}");
    // The token buckets are full again a minute later.
    gw.advance_clock(60_000).await;
    let r = post(&gw, "sk-t", &hello("m", Some(1), false), &[]).await;
    assert_eq!(r.status(), 200);
    let left = num(&r, "x-ratelimit-remaining-output-tokens");
    assert!(left >= 99_000, "{left}");
    // A body above 64 KiB (proxied by a subrequest) is the tenant's too.
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth("sk-t")
        .header("content-type", "application/json")
        .body(chat_body("m", 100_000, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let left = num(&r, "x-ratelimit-remaining-input-tokens");
    // (The bucket refills while the engine prefills those 25k tokens for ~3 s.)
    assert!(
        left < 100_000 - 10_000,
        "{left}: the 25k-token prompt reserved"
    );
    r.bytes().await.unwrap();
    gw.wait_idle().await;
    let input = metric(
        &gw.metrics().await,
        "tokengate_tenant_tokens_total{kind=\"input\",model=\"m\",tenant=\"t\"}",
    )
    .unwrap();
    assert!(input > 20_000.0, "{input}");
    let m = gw.metrics().await;
    let refused = metric(
        &m,
        "tokengate_tenant_rejections_total{reason=\"concurrency\",tenant=\"t\"}",
    );
    assert!(refused >= Some(3.0), "{m}");
}

/// A client at exactly its concurrency limit that sends its next request as soon as it has
/// read the last byte of an answer is not refused: the slot is freed when the answer ends,
/// before that byte leaves the gateway (it used to be freed in `logging`, a moment later —
/// a window of microseconds here, which 120 tries did not hit with the old code). Each
/// request goes on a new connection (a kept-alive one waits for `logging` anyway). A long
/// stream holds the other slot throughout, so a slot freed twice (at the end and again at
/// settlement) lets a third request in, and one never freed refuses the second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_request_right_after_an_answer_gets_the_slot() {
    let e = sim("m", "e1", 50.0).await;
    let yaml = format!(
        "tenants:\n  - name: t\n    keys: [sk-t]\n    limits: {{concurrency: 2}}\nservices:\n{}",
        service("m", &[("e1", e.addr)]),
    );
    let gw = GatewayProc::start(&yaml);
    let long = &[("x-sim-output-tokens", "100000")];
    let held = post(&gw, "sk-t", &hello("m", None, true), long).await;
    assert_eq!(held.status(), 200);
    let mut held = held.bytes_stream();
    held.next().await.unwrap().unwrap();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut refused = Vec::new();
    for i in 0..120 {
        let stream = i % 2 == 0;
        let r = client
            .post(gw.url("/v1/chat/completions"))
            .bearer_auth("sk-t")
            .json(&hello("m", Some(2), stream))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let body = r.bytes().await.unwrap();
        if status != 200 {
            refused.push((i, status, String::from_utf8_lossy(&body).into_owned()));
        } else if stream {
            assert!(body.ends_with(b"data: [DONE]\n\n"), "{body:?}");
        }
    }
    assert!(refused.is_empty(), "refused at the limit: {refused:?}");
    // Exactly one slot is free now: a second long stream takes it, a third request is refused.
    let second = post(&gw, "sk-t", &hello("m", None, true), long).await;
    assert_eq!(second.status(), 200);
    let mut second = second.bytes_stream();
    second.next().await.unwrap().unwrap();
    let r = post(&gw, "sk-t", &hello("m", Some(1), false), &[]).await;
    assert_eq!(r.status(), 429, "a slot was freed twice");
    drop((held, second));
    gw.wait_idle().await;
    let m = gw.metrics().await;
    assert_eq!(
        metric(
            &m,
            "tokengate_tenant_requests_total{model=\"m\",tenant=\"t\"}"
        ),
        Some(122.0),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_keeps_the_counters_of_unchanged_tenants() {
    let e = sim("m", "e1", 50.0).await;
    let tenants = |b_rpm: u32, extra: &str| {
        format!(
            "tenants:\n  - name: a\n    keys: [sk-a]\n    limits: {{requests_per_minute: 2}}\n  - name: b\n    keys: [sk-b]\n    limits: {{requests_per_minute: {b_rpm}}}\n{extra}services:\n{}",
            service("m", &[("e1", e.addr)]),
        )
    };
    let gw = GatewayProc::start(&tenants(2, ""));
    for key in ["sk-a", "sk-a", "sk-b"] {
        let r = post(&gw, key, &hello("m", Some(1), false), &[]).await;
        assert_eq!(r.status(), 200);
    }
    let r = post(&gw, "sk-a", &hello("m", Some(1), false), &[]).await;
    assert_eq!(r.status(), 429);
    // b gets a higher limit and c is added; a is unchanged.
    let path = gw.config_path();
    let header = std::fs::read_to_string(&path)
        .unwrap()
        .split("tenants:")
        .next()
        .unwrap()
        .to_string();
    std::fs::write(
        &path,
        format!(
            "{header}{}",
            tenants(
                5,
                "  - name: c\n    keys: [sk-c]\n    limits: {requests_per_minute: 1}\n"
            )
        ),
    )
    .unwrap();
    let pid = gw.child.id().to_string();
    std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    eventually("the reload", || async {
        gw.metrics()
            .await
            .contains("tokengate_config_reloads_total{result=\"ok\"} 1")
    })
    .await;
    // a's minute is still used up; b has its new limit with the request it made counted.
    let r = post(&gw, "sk-a", &hello("m", Some(1), false), &[]).await;
    assert_eq!(r.status(), 429, "a's counter was dropped by the reload");
    let r = post(&gw, "sk-b", &hello("m", Some(1), false), &[]).await;
    assert_eq!(r.status(), 200);
    assert_eq!(num(&r, "x-ratelimit-limit-requests"), 5);
    assert_eq!(num(&r, "x-ratelimit-remaining-requests"), 0);
    let r = post(&gw, "sk-c", &hello("m", Some(1), false), &[]).await;
    assert_eq!(r.status(), 200);
}

#[test]
fn config_errors_name_the_path_and_never_the_key() {
    let (ok, err) = check_yaml(
        "api_keys: [sk-dup-1]\ntenants:\n  - name: a\n    keys: [sk-dup-1]\n    models: [\"q*x\"]\n    limits: {concurrency: 0}\n  - name: a\n    keys: []\n",
    );
    assert!(!ok);
    for want in [
        "tenants[0].keys[0]: the same key as api_keys[0]",
        "tenants[0].models[0]: \"q*x\" must be a model name or a prefix ending in `*`",
        "tenants[0].limits.concurrency: must be at least 1",
        "tenants[1].name: \"a\" is already the name of tenants[0]",
        "tenants[1].keys: at least one key is required",
    ] {
        assert!(err.contains(want), "{want:?} not in:\n{err}");
    }
    assert!(!err.contains("sk-dup-1"), "{err}");
    // A missing keys_env variable.
    let (ok, err) = check_yaml(
        "tenants:\n  - name: a\n    keys_env: TG_TEST_SURELY_UNSET_VAR\nservices:\n  - name: m\n    instances: [{id: a, addr: \"127.0.0.1:1\"}]\n",
    );
    assert!(!ok);
    assert!(
        err.contains(
            "tenants[0].keys_env: environment variable `TG_TEST_SURELY_UNSET_VAR` is not set"
        ),
        "{err}"
    );
    // A model that names nothing served: valid, with a warning.
    let (ok, err) = check_yaml(
        "tenants:\n  - name: a\n    keys: [k1]\n    models: [m, \"qwen*\", gtp-4o]\nservices:\n  - name: m\n    instances: [{id: a, addr: \"127.0.0.1:1\"}]\n",
    );
    assert!(ok, "{err}");
    assert!(
        err.contains("tenants[0].models[1]: \"qwen*\" matches no service, route or alias"),
        "{err}"
    );
    assert!(err.contains("tenants[0].models[2]: \"gtp-4o\""), "{err}");
    assert!(!err.contains("models[0]"), "{err}");
}

#[test]
fn check_print_masks_tenant_keys_and_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# team keys\nsk-file-1\n\nsk-file-2\n").unwrap();
    let cfg = dir.path().join("c.yaml");
    std::fs::write(
        &cfg,
        format!(
            "tenants:\n  - name: a\n    keys: [sk-lit-1]\n    keys_file: {}\n    models: [\"m*\"]\n    priority: batch\n    limits: {{requests_per_minute: 5, output_tokens_per_minute: 100}}\n  - name: b\n    keys: [sk-lit-2]\nservices:\n  - name: m\n    instances: [{{id: a, addr: \"127.0.0.1:1\"}}]\n",
            keys.display()
        ),
    )
    .unwrap();
    let print = |p: &std::path::Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .args(["check", "--print", "-c"])
            .arg(p)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let yaml = print(&cfg);
    for k in ["sk-lit-1", "sk-lit-2", "sk-file-1", "sk-file-2"] {
        assert!(!yaml.contains(k), "{k} printed:\n{yaml}");
    }
    // Four keys masked, the file's two among them.
    assert_eq!(yaml.matches("'***'").count(), 4, "{yaml}");
    for want in ["priority: batch", "requests_per_minute: 5", "- '*'"] {
        assert!(yaml.contains(want), "{want:?} not in:\n{yaml}");
    }
    let again = dir.path().join("again.yaml");
    std::fs::write(&again, &yaml).unwrap();
    assert_eq!(print(&again), yaml);
}

/// A service with one slot and a queue, and the tenants of the queueing tests.
async fn queued_service(tenants: &str) -> (engine_sim::SimHandle, GatewayProc) {
    let e = sim("m", "e1", 4.0).await;
    let yaml = format!(
        "tenants:\n{tenants}services:\n  - name: m\n    throttling: {{overflow: queue, total: 1, max_queue: 1000, queue_timeout: 60s}}\n    instances:\n      - {{id: e1, addr: \"{}\"}}\n",
        e.addr
    );
    (e, GatewayProc::start(&yaml))
}

/// Sends `n` requests of `key` at once; each records its place in the order of completion
/// (`done`, shared by every batch) under `label`.
fn send_many(
    gw: &GatewayProc,
    key: &'static str,
    label: &'static str,
    n: usize,
    extra: Option<(&'static str, &'static str)>,
    done: &std::sync::Arc<parking_lot::Mutex<Vec<&'static str>>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|_| {
            let url = gw.url("/v1/chat/completions");
            let done = done.clone();
            tokio::spawn(async move {
                let mut r = reqwest::Client::new()
                    .post(url)
                    .bearer_auth(key)
                    .json(&hello("m", Some(16), false));
                if let Some((k, v)) = extra {
                    r = r.header(k, v);
                }
                let r = r.send().await.unwrap();
                assert_eq!(r.status(), 200);
                r.bytes().await.unwrap();
                done.lock().push(label);
            })
        })
        .collect()
}

async fn queue_at_least(gw: &GatewayProc, n: f64) {
    eventually("the queue to fill", || async {
        metric(
            &gw.metrics().await,
            "tokengate_throttle_queue_length{service=\"m\"}",
        )
        .is_some_and(|q| q >= n)
    })
    .await;
}

/// Two backlogged tenants, one sending 10× the other, share the engine's tokens evenly
/// (every request the same size: shares of requests are shares of tokens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_backlog_does_not_starve_a_light_tenant() {
    let (_e, gw) =
        queued_service("  - name: heavy\n    keys: [sk-h]\n  - name: light\n    keys: [sk-l]\n")
            .await;
    let done = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = send_many(&gw, "sk-h", "h", 100, None, &done);
    queue_at_least(&gw, 60.0).await;
    let before = done.lock().len();
    tasks.extend(send_many(&gw, "sk-l", "l", 10, None, &done));
    for t in tasks {
        t.await.unwrap();
    }
    let order = done.lock().clone();
    // From the light tenant's arrival to its last answer, both were backlogged.
    let share = share_while_backlogged(&order, before, "l");
    assert!(share >= 0.4, "light tenant got {share:.2}: {order:?}");
}

/// An interactive request overtakes queued ones; a request may lower its class with
/// `x-tokengate-priority` but never raise it above its tenant's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interactive_overtakes_and_the_header_only_lowers() {
    let (_e, gw) = queued_service(
        "  - name: def\n    keys: [sk-d]\n  - name: int\n    keys: [sk-i]\n    priority: interactive\n  - name: bat\n    keys: [sk-b]\n    priority: batch\n",
    )
    .await;
    let done = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = send_many(&gw, "sk-d", "d", 10, None, &done);
    queue_at_least(&gw, 8.0).await;
    let h = ("x-tokengate-priority", "batch");
    tasks.extend(send_many(&gw, "sk-i", "i-lowered", 1, Some(h), &done));
    let h = ("x-tokengate-priority", "interactive");
    tasks.extend(send_many(&gw, "sk-b", "b-raised", 1, Some(h), &done));
    let before = done.lock().len();
    tasks.extend(send_many(&gw, "sk-i", "i", 1, None, &done));
    for t in tasks {
        t.await.unwrap();
    }
    let order = done.lock().clone();
    let pos = |l: &str| order.iter().position(|x| *x == l).unwrap();
    // At most the request being served and the head that was taking its slot finish
    // between the interactive request's arrival and its answer.
    assert!(pos("i") <= before + 3, "{order:?} (arrived after {before})");
    // Lowered or not raised: behind every queued default request.
    let last_d = order.iter().rposition(|x| *x == "d").unwrap();
    assert!(pos("i-lowered") > last_d, "{order:?}");
    assert!(pos("b-raised") > last_d, "{order:?}");
    // The queue's wait by class: the interactive one, the two that ended up batch.
    let m = gw.metrics().await;
    for (class, n) in [("interactive", 1.0), ("batch", 2.0)] {
        let line = format!("tokengate_queue_wait_by_class_seconds_count{{class=\"{class}\"}}");
        assert_eq!(metric(&m, &line), Some(n), "{line}:\n{m}");
    }
}
