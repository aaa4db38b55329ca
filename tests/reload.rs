//! Hot reload: SIGHUP and file changes swap the config atomically; a bad file is rejected
//! with its YAML path and the running config kept; streams in flight are not dropped and
//! the load counters of instances that stay survive.

mod common;

use common::*;
use futures_util::StreamExt;

fn instances_of(v: &serde_json::Value) -> Vec<String> {
    v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_swaps_config_without_dropping_streams() {
    let fleet = sims(2, "m", "e", 1.0).await;
    let one = format!(
        "services:\n  - name: m\n    instances:\n      - {{id: e1, addr: \"{}\"}}\n",
        fleet[0].addr
    );
    let gw = GatewayProc::start(&one);
    let cfg_path = gw.config_path();
    let header = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .split("services:")
        .next()
        .unwrap()
        .to_string();
    // A stream in flight on e1 across the reloads.
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(
            &serde_json::json!({"model": "m", "stream": true, "max_tokens": 600,
            "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-tokengate-instance"], "e1");
    let mut stream = r.bytes_stream();
    stream.next().await.unwrap().unwrap();

    // A bad file is rejected; the old config keeps serving.
    std::fs::write(
        &cfg_path,
        format!(
            "{header}services:\n  - name: m\n    instances:\n      - {{id: e1, addr: nowhere}}\n"
        ),
    )
    .unwrap();
    let pid = gw.child.id().to_string();
    std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    eventually("the rejection to be counted", || async {
        gw.metrics()
            .await
            .contains("tokengate_config_reloads_total{result=\"error\"} 1")
    })
    .await;
    // The counter is bumped just before the error is logged.
    eventually("the rejection to be logged", || async {
        gw.log_text()
            .contains("services[0].instances[0].addr: invalid socket address")
    })
    .await;
    assert!(gw
        .metrics()
        .await
        .contains("tokengate_config_last_reload_success 0"));
    assert_eq!(instances_of(&gw.instances().await), vec!["e1"]);

    // A good file adds e2 (picked up from the file change alone, no signal).
    std::fs::write(
        &cfg_path,
        format!(
            "{header}services:\n  - name: m\n    load_balancing: least-request\n    instances:\n      - {{id: e1, addr: \"{}\"}}\n      - {{id: e2, addr: \"{}\"}}\n",
            fleet[0].addr, fleet[1].addr
        ),
    )
    .unwrap();
    eventually("e2 to appear", || async {
        instances_of(&gw.instances().await) == vec!["e1", "e2"]
    })
    .await;
    // e1 kept its counter: the stream in flight is still counted there.
    let v = gw.instances().await;
    assert_eq!(v["instances"][0]["inflight_requests"], 1, "{v:#}");
    // least-request now sends new work to the idle e2.
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(&serde_json::json!({"model": "m", "max_tokens": 1,
            "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-tokengate-instance"], "e2");
    r.bytes().await.unwrap();
    // The stream that started before both reloads completes.
    let mut text = String::new();
    while let Some(c) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&c.unwrap()));
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    gw.wait_idle().await;

    // One instance computes a prompt of several prefix blocks; when it leaves the service,
    // the prefix index forgets what it held (the other's prompts were shorter than a block).
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(&serde_json::json!({"model": "m", "max_tokens": 1,
            "messages": [{"role": "user", "content": "word ".repeat(400)}]}))
        .send()
        .await
        .unwrap();
    let who = r.headers()["x-tokengate-instance"]
        .to_str()
        .unwrap()
        .to_string();
    r.bytes().await.unwrap();
    gw.wait_idle().await;
    let (pos, stays) = if who == "e1" { (0, 1) } else { (1, 0) };
    let index_blocks = |v: &serde_json::Value| v["prefix_indexes"][0]["blocks"].as_u64().unwrap();
    let v = gw.instances().await;
    assert!(index_blocks(&v) > 10, "{v:#}");
    assert_eq!(
        v["instances"][pos]["cached_blocks"],
        index_blocks(&v),
        "{v:#}"
    );
    std::fs::write(
        &cfg_path,
        format!(
            "{header}services:\n  - name: m\n    load_balancing: least-request\n    instances:\n      - {{id: e{}, addr: \"{}\"}}\n",
            stays + 1,
            fleet[stays].addr
        ),
    )
    .unwrap();
    eventually("one instance to leave", || async {
        instances_of(&gw.instances().await) == vec![format!("e{}", stays + 1)]
    })
    .await;
    // (The index is cleared right after the swap.)
    eventually("the index to forget it", || async {
        index_blocks(&gw.instances().await) == 0
    })
    .await;
    eventually("the log line", || async {
        gw.log_text().contains(&format!("instance {who} left"))
    })
    .await;
}

fn sessions_of(v: &serde_json::Value, scheduler: &str) -> u64 {
    v["schedulers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == scheduler)
        .unwrap()["sessions"]
        .as_u64()
        .unwrap()
}

/// A reload applies new session table sizes and TTLs, and a new maintenance interval, to
/// the tables it keeps (policy mode has `session_max_entries` too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_applies_session_sizes_ttls_and_the_maintenance_interval() {
    let m = Mock::start().await;
    let policy = |max: usize, ttl: &str, maint: &str| {
        format!(
            "prefix_index: {{maintenance_interval: {maint}}}\nservices:\n  - name: m\n    scheduler:\n      mode: policy\n      plugins: [{{kind: session-affinity}}, {{kind: least-inflight}}]\n      session_max_entries: {max}\n      session_ttl: {ttl}\n    instances:\n      - {{id: a, addr: \"{0}\"}}\n      - {{id: b, addr: \"{0}\"}}\n",
            m.addr
        )
    };
    let gw = GatewayProc::start(&policy(100, "1h", "1h"));
    let cfg_path = gw.config_path();
    let header = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .split("prefix_index:")
        .next()
        .unwrap()
        .to_string();
    let c = reqwest::Client::new();
    let send = |s: &'static str| {
        let c = c.clone();
        let url = gw.url("/v1/chat/completions");
        async move {
            let r = c
                .post(url)
                .header("session-id", s)
                .body(chat_body("m", 100, false))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
        }
    };
    for s in ["s1", "s2", "s3"] {
        send(s).await;
    }
    assert_eq!(sessions_of(&gw.instances().await, "m"), 3);
    // A smaller table keeps the most recently used bindings.
    std::fs::write(&cfg_path, format!("{header}{}", policy(1, "1h", "1h"))).unwrap();
    eventually("the table to shrink to 1", || async {
        sessions_of(&gw.instances().await, "m") == 1
    })
    .await;
    assert!(gw
        .log_text()
        .contains("service m: session table resized from 100 to 1 entries"));
    // A short TTL and a fast maintenance pass: the binding expires and is swept.
    std::fs::write(&cfg_path, format!("{header}{}", policy(1, "300ms", "50ms"))).unwrap();
    eventually("the binding to expire and be swept", || async {
        sessions_of(&gw.instances().await, "m") == 0
    })
    .await;
    let log = gw.log_text();
    assert!(log.contains("service m: session ttl changed"), "{log}");
    assert!(
        log.contains("prefix_index.maintenance_interval changed to 50ms"),
        "{log}"
    );
}

/// Status of a one-token chat request, with or without a key.
async fn status_with(gw: &GatewayProc, key: Option<&str>) -> u16 {
    let mut r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .body(chat_body("m", 1, false));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.unwrap();
    let s = r.status().as_u16();
    r.bytes().await.unwrap();
    s
}

/// A file rewritten in place is applied only once it has settled: a writer that truncates
/// the file, writes the part before `api_keys` (which parses and validates on its own) and
/// pauses never has that half served; the completed file applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_written_file_is_never_applied() {
    use std::io::Write;
    let fleet = sims(1, "m", "e", 1.0).await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    instances:\n      - {{id: e1, addr: \"{}\"}}\napi_keys: [\"sk-one\"]\n",
        fleet[0].addr
    ));
    let cfg_path = gw.config_path();
    let full = std::fs::read_to_string(&cfg_path).unwrap();
    let half = full.split("api_keys:").next().unwrap().to_string();
    assert_eq!(status_with(&gw, None).await, 401);
    assert_eq!(status_with(&gw, Some("sk-one")).await, 200);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&cfg_path)
        .unwrap();
    f.write_all(half.as_bytes()).unwrap();
    f.flush().unwrap();
    // The writer pauses 1.2 s; a client without a key keeps asking meanwhile.
    let until = std::time::Instant::now() + std::time::Duration::from_millis(1200);
    while std::time::Instant::now() < until {
        assert_eq!(
            status_with(&gw, None).await,
            401,
            "served without a key while the config file was half written"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await; // ok-sleep: the writer's pause, not a wait for a server
    }
    // The rest of the file, with a second key so that the reload shows.
    f.write_all(b"api_keys: [\"sk-one\", \"sk-two\"]\n")
        .unwrap();
    drop(f);
    eventually("the completed file to apply", || async {
        status_with(&gw, Some("sk-two")).await == 200
    })
    .await;
    assert_eq!(status_with(&gw, None).await, 401);
    let log = gw.log_text();
    assert_eq!(log.matches("config reloaded from").count(), 1, "{log}");
    assert!(!log.contains("`api_keys` removed"), "{log}");
}

/// A file replaced whole (written elsewhere, then renamed over the config: editors' atomic
/// saves, Kubernetes' symlink swaps) is complete when it appears and applies without the
/// debounce; a reload that removes authentication says so in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renamed_file_applies_at_once_and_removing_keys_warns() {
    let fleet = sims(1, "m", "e", 1.0).await;
    let services = format!(
        "services:\n  - name: m\n    instances:\n      - {{id: e1, addr: \"{}\"}}\n",
        fleet[0].addr
    );
    // A debounce this long would hold an in-place change past the test's deadline.
    let gw = GatewayProc::start(&format!(
        "reload: {{debounce: 10m}}\napi_keys: [\"sk-one\"]\n{services}"
    ));
    let cfg_path = gw.config_path();
    assert_eq!(status_with(&gw, None).await, 401);
    let header = std::fs::read_to_string(&cfg_path)
        .unwrap()
        .split("reload:")
        .next()
        .unwrap()
        .to_string();
    let tmp = cfg_path.with_extension("yaml.new");
    std::fs::write(
        &tmp,
        format!("{header}reload: {{debounce: 10m}}\n{services}"),
    )
    .unwrap();
    std::fs::rename(&tmp, &cfg_path).unwrap();
    eventually("the renamed file to apply", || async {
        status_with(&gw, None).await == 200
    })
    .await;
    eventually("the warning", || async {
        gw.log_text().contains(
            "config reload: `api_keys` removed: the proxy now accepts requests without a key",
        )
    })
    .await;
}

/// `reload: {watch: false}`: a changed file waits for SIGHUP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_watcher_only_sighup_reloads() {
    let fleet = sims(1, "m", "e", 1.0).await;
    let services = format!(
        "services:\n  - name: m\n    instances:\n      - {{id: e1, addr: \"{}\"}}\n",
        fleet[0].addr
    );
    let gw = GatewayProc::start(&format!(
        "reload: {{watch: false, debounce: 0s}}\n{services}"
    ));
    let cfg_path = gw.config_path();
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    assert_eq!(status_with(&gw, None).await, 200);
    std::fs::write(&cfg_path, format!("{text}api_keys: [\"sk-one\"]\n")).unwrap();
    // The watcher would have applied it within two checks (0.5 s); give it four times that.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await; // ok-sleep: a negative check, nothing is awaited
    assert_eq!(status_with(&gw, None).await, 200, "applied without SIGHUP");
    std::process::Command::new("kill")
        .args(["-HUP", &gw.child.id().to_string()])
        .status()
        .unwrap();
    eventually("SIGHUP to apply the file", || async {
        status_with(&gw, None).await == 401
    })
    .await;
}
