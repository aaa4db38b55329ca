//! Traffic mirroring through the real binary: the sampled share is exact, the mirror gets the
//! model rewrite and its own bearer token (never logged), the primary's upstream sees
//! nothing of it, and a stalled or dead mirror target changes nothing for clients (copies
//! are dropped, expire or time out, and are counted). Tests here run one at a time: the
//! latency bound of the stall test should not measure the 10,000-request test next to it.

mod common;

use common::*;
use futures_util::StreamExt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const SECRET: &str = "sk-mirror-SECRET-42";

fn config(primary: SocketAddr, mirror: &str) -> String {
    format!(
        "services:\n{}mirror:\n{mirror}",
        service("m", &[("p1", primary)])
    )
}

/// `n` small chat requests, `conc` at a time; every status and latency.
async fn blast(gw: &GatewayProc, n: usize, conc: usize) -> Vec<(u16, Duration)> {
    let client = reqwest::Client::new();
    let url = gw.url("/v1/chat/completions");
    let body = chat_body("m", 120, false);
    futures_util::stream::iter(0..n)
        .map(|_| {
            let (client, url, body) = (client.clone(), url.clone(), body.clone());
            async move {
                let t = Instant::now();
                let r = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                r.bytes().await.unwrap();
                (status, t.elapsed())
            }
        })
        .buffer_unordered(conc)
        .collect()
        .await
}

fn mirror_count(metrics: &str, outcome: &str) -> u64 {
    metric(
        metrics,
        &format!("tokengate_mirror_requests_total{{outcome=\"{outcome}\"}}"),
    )
    .unwrap_or(0.0) as u64
}

/// Every sampled copy's end: ok, http_error, error, timeout (sent) or dropped, expired.
fn mirror_ended(metrics: &str) -> u64 {
    ["ok", "http_error", "error", "timeout", "dropped", "expired"]
        .iter()
        .map(|o| mirror_count(metrics, o))
        .sum()
}

/// Waits until `n` sampled copies have ended and none is queued or in flight.
async fn wait_mirror_settled(gw: &GatewayProc, n: u64) -> String {
    eventually("every mirror copy to end", || async {
        let m = gw.metrics().await;
        mirror_ended(&m) == n
            && metric(&m, "tokengate_mirror_inflight") == Some(0.0)
            && metric(&m, "tokengate_mirror_queue_depth") == Some(0.0)
    })
    .await;
    gw.metrics().await
}

/// Accepts connections and never reads or answers; counts them.
async fn stalled_target() -> (SocketAddr, Arc<AtomicU64>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicU64::new(0));
    let a = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
            held.push(s);
        }
    });
    (addr, accepted)
}

/// Accepts connections and holds them unread and unanswered (counting them) until
/// `release` is notified; then closes them and every later connection at once.
async fn held_target() -> (SocketAddr, Arc<AtomicU64>, Arc<tokio::sync::Notify>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicU64::new(0));
    let release = Arc::new(tokio::sync::Notify::new());
    let (a, r) = (accepted.clone(), release.clone());
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            tokio::select! {
                c = l.accept() => match c {
                    Ok((s, _)) => {
                        a.fetch_add(1, Ordering::SeqCst);
                        held.push(s);
                    }
                    Err(_) => return,
                },
                _ = r.notified() => break,
            }
        }
        drop(held);
        while let Ok((s, _)) = l.accept().await {
            drop(s);
        }
    });
    (addr, accepted, release)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ratio_is_exact_over_ten_thousand_requests() {
    let _serial = SERIAL.lock().await;
    let primary = Mock::start().await;
    let shadow = Mock::start().await;
    let gw = GatewayProc::start(&config(
        primary.addr,
        &format!("  target: \"http://{}\"\n  ratio: 25\n", shadow.addr),
    ));
    let n = 10_000;
    let results = blast(&gw, n, 32).await;
    assert!(results.iter().all(|(s, _)| *s == 200));
    let m = wait_mirror_settled(&gw, 2_500).await;
    let got = shadow.requests.load(Ordering::SeqCst);
    // Within ±3 % of 25 % (the sampler is exact: every copy reached the target).
    assert!((2_425..=2_575).contains(&got), "mirror received {got}");
    assert_eq!(got, 2_500, "{m}");
    assert_eq!(mirror_count(&m, "sent"), 2_500);
    assert_eq!(mirror_count(&m, "ok"), 2_500);
    assert_eq!(mirror_count(&m, "dropped"), 0);
    assert_eq!(primary.requests.load(Ordering::SeqCst), n as u64);
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirror_gets_the_model_rewrite_and_its_token_and_the_primary_nothing() {
    let _serial = SERIAL.lock().await;
    let primary = Mock::recording().await;
    let shadow = Mock::recording().await;
    let gw = GatewayProc::start(&format!(
        "api_keys: [\"sk-client-key\"]\n{}",
        config(
            primary.addr,
            &format!(
                "  target: \"http://{}/shadow\"\n  target_model: shadow-7b\n  ratio: 100\n  auth_token: {SECRET}\n  timeout_ms: 5000\n  log: true\n",
                shadow.addr
            ),
        )
    ));
    let client = reqwest::Client::new();
    // Unary, stream (usage injected by the gateway) and a body above 64 KiB (the
    // subrequest path).
    let cases = [
        ("mirror-unary-1", chat_body("m", 200, false), "echo"),
        ("mirror-stream-1", chat_body("m", 200, true), "sse"),
        ("mirror-big-1", chat_body("m", 200_000, false), "echo"),
    ];
    for (id, body, mode) in &cases {
        let r = client
            .post(gw.url("/v1/chat/completions?trace=1"))
            .header("authorization", "Bearer sk-client-key")
            .header("content-type", "application/json")
            .header("x-request-id", *id)
            .header("x-session-id", "s-1")
            .header("x-mock", *mode)
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{id}");
        assert_eq!(r.headers()["x-request-id"], *id);
        r.bytes().await.unwrap();
    }
    wait_mirror_settled(&gw, 3).await;
    let seen = shadow.seen();
    let sent = primary.seen();
    assert_eq!(seen.len(), 3);
    assert_eq!(sent.len(), 3);
    for (id, _, _) in &cases {
        let s = seen
            .iter()
            .find(|s| s.header("x-request-id") == Some(*id))
            .unwrap_or_else(|| panic!("{id} not mirrored"));
        let p = sent
            .iter()
            .find(|s| s.header("x-request-id") == Some(*id))
            .unwrap();
        assert_eq!(s.path, "/shadow/v1/chat/completions?trace=1");
        assert_eq!(
            s.header("authorization"),
            Some(&*format!("Bearer {SECRET}"))
        );
        assert_eq!(s.header("x-tokengate-mirror"), Some("1"));
        assert_eq!(s.header("x-session-id"), Some("s-1"));
        assert_eq!(
            s.header("x-mock"),
            None,
            "only allowlisted headers are copied"
        );
        // The body as the gateway forwards it, with the model replaced.
        let mut want = p.json();
        assert_eq!(want["model"], "m");
        want["model"] = "shadow-7b".into();
        assert_eq!(s.json(), want, "{id}");
        // The primary's upstream: the client's model, neither key, no mirror mark.
        assert_eq!(p.header("authorization"), None);
        assert_eq!(p.header("x-tokengate-mirror"), None);
    }
    assert!(sent[..]
        .iter()
        .find(|p| p.header("x-request-id") == Some("mirror-stream-1"))
        .unwrap()
        .json()["stream_options"]["include_usage"]
        .as_bool()
        .unwrap());
    // One mirror line per request, next to the primary's figures, with the access line's id.
    eventually("the mirror log lines", || async {
        gw.log_text().matches(" mirror] id=").count() == 3
    })
    .await;
    let log = gw.log_text();
    for (id, _, _) in &cases {
        let line = log
            .lines()
            .find(|l| l.contains(" mirror] ") && l.contains(&format!("id={id} ")))
            .unwrap_or_else(|| panic!("no mirror line for {id}:\n{log}"));
        for want in [
            "path=/v1/chat/completions",
            "model=m mirror_model=shadow-7b",
            "outcome=ok status=200",
            "primary_instance=p1 primary_status=200",
        ] {
            assert!(line.contains(want), "{want} not in {line}");
        }
        assert!(log
            .lines()
            .any(|l| l.contains(" access] ") && l.contains(&format!("id={id}"))));
    }
    let unary = log
        .lines()
        .find(|l| l.contains(" mirror] id=mirror-unary-1 "))
        .unwrap();
    assert!(
        unary.contains("prompt_tokens=11 completion_tokens=3 cached_tokens=5")
            && unary.contains("primary_prompt_tokens=11"),
        "{unary}"
    );
    // The token is nowhere: logs, metrics, the admin API.
    let admin = reqwest::get(gw.admin_url("/admin/instances"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&admin).unwrap();
    assert_eq!(
        v["mirror"]["target"],
        format!("http://{}/shadow", shadow.addr)
    );
    assert_eq!(v["mirror"]["authorization"], true);
    for text in [&log, &admin, &gw.metrics().await] {
        assert!(!text.contains(SECRET));
        assert!(!text.contains("sk-client-key"));
    }
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_mirror_changes_nothing_for_clients() {
    let _serial = SERIAL.lock().await;
    let primary = Mock::start().await;
    let (stall, accepted, release) = held_target().await;
    // A copy sent to the stalled target ends only when the target lets go (its timeout is
    // far beyond the test).
    let gw = GatewayProc::start(&config(
        primary.addr,
        &format!("  target: \"http://{stall}\"\n  ratio: 100\n  timeout_ms: 600000\n  log: true\n"),
    ));
    let n = 1500;
    // A client that waited on its copy would never be answered.
    let results = tokio::time::timeout(DEADLINE, blast(&gw, n, 16))
        .await
        .expect("clients waited on the stalled mirror");
    assert!(results.iter().all(|(s, _)| *s == 200));
    assert_eq!(primary.requests.load(Ordering::SeqCst), n as u64);
    // Every client was answered while no copy sent to the mirror had ended: the target held
    // them all, the others waited in the queue or were dropped when it was full.
    let m = gw.metrics().await;
    let sent = mirror_count(&m, "sent");
    assert!(sent > 0, "{m}");
    for outcome in ["ok", "http_error", "error", "timeout", "expired"] {
        assert_eq!(mirror_count(&m, outcome), 0, "{outcome}: {m}");
    }
    assert!(mirror_count(&m, "dropped") > 0, "{m}");
    eventually("the stalled target holds every sent copy", || async {
        accepted.load(Ordering::SeqCst) == mirror_count(&gw.metrics().await, "sent")
    })
    .await;
    // The target lets go (closes what it holds, then every new connection): each copy ends.
    release.notify_one();
    let m = wait_mirror_settled(&gw, n as u64).await;
    assert_eq!(mirror_count(&m, "ok"), 0);
    assert_eq!(mirror_count(&m, "sent"), mirror_count(&m, "error"), "{m}");
    gw.wait_idle().await;
    let log = gw.log_text();
    assert!(log.contains("outcome=error status=- "), "no error line");
    assert!(log.contains("outcome=dropped "), "no drop line");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_mirror_changes_nothing_for_clients() {
    let _serial = SERIAL.lock().await;
    let primary = Mock::start().await;
    let dead = dead_addr();
    let gw = GatewayProc::start(&config(
        primary.addr,
        &format!("  target: \"http://{dead}\"\n  ratio: 100\n  timeout_ms: 2000\n  auth_token: {SECRET}\n  log: true\n"),
    ));
    let n = 1000;
    let results = blast(&gw, n, 16).await;
    assert!(results.iter().all(|(s, _)| *s == 200));
    let m = wait_mirror_settled(&gw, n as u64).await;
    assert!(mirror_count(&m, "error") > 0, "{m}");
    assert_eq!(mirror_count(&m, "ok"), 0);
    assert_eq!(mirror_count(&m, "sent"), mirror_count(&m, "error"), "{m}");
    assert_eq!(primary.requests.load(Ordering::SeqCst), n as u64);
    gw.wait_idle().await;
    let log = gw.log_text();
    assert!(log.contains("outcome=error status=- "), "no error line");
    assert!(log.contains("error=\"connect: "), "no connect error");
    assert!(!log.contains(SECRET));
}

/// Rewrites the config file and waits for the `nth` successful reload.
async fn reload(gw: &GatewayProc, nth: u32, yaml: &str) {
    std::fs::write(gw.config_path(), yaml).unwrap();
    let want = format!("tokengate_config_reloads_total{{result=\"ok\"}} {nth}");
    eventually("the reload", || async {
        gw.metrics().await.contains(&want)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_applies_a_new_ratio_and_target() {
    let _serial = SERIAL.lock().await;
    let primary = Mock::start().await;
    let a = Mock::start().await;
    let b = Mock::start().await;
    let gw = GatewayProc::start(&config(
        primary.addr,
        &format!("  target: \"http://{}\"\n  ratio: 0\n", a.addr),
    ));
    let text = std::fs::read_to_string(gw.config_path()).unwrap();
    let head = text.split("mirror:").next().unwrap().to_string();
    assert!(blast(&gw, 20, 4).await.iter().all(|(s, _)| *s == 200));
    assert_eq!(a.requests.load(Ordering::SeqCst), 0);

    reload(
        &gw,
        1,
        &format!(
            "{head}mirror:\n  target: \"http://{}\"\n  ratio: 100\n",
            a.addr
        ),
    )
    .await;
    blast(&gw, 20, 4).await;
    wait_mirror_settled(&gw, 20).await;
    assert_eq!(a.requests.load(Ordering::SeqCst), 20);

    reload(
        &gw,
        2,
        &format!(
            "{head}mirror:\n  target: \"http://{}\"\n  ratio: 50\n",
            b.addr
        ),
    )
    .await;
    blast(&gw, 20, 4).await;
    wait_mirror_settled(&gw, 30).await;
    assert_eq!(a.requests.load(Ordering::SeqCst), 20);
    assert_eq!(b.requests.load(Ordering::SeqCst), 10);

    // Mirroring removed: nothing more is copied.
    reload(&gw, 3, &head).await;
    blast(&gw, 20, 4).await;
    assert_eq!(mirror_ended(&gw.metrics().await), 30);
    assert_eq!(b.requests.load(Ordering::SeqCst), 10);
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_in_flight_across_a_reload_keep_their_settings() {
    let _serial = SERIAL.lock().await;
    let primary = Mock::start().await;
    let (stall, accepted) = stalled_target().await;
    let fresh = Mock::start().await;
    let gw = GatewayProc::start(&config(
        primary.addr,
        &format!("  target: \"http://{stall}\"\n  ratio: 100\n  timeout_ms: 1500\n"),
    ));
    let head = std::fs::read_to_string(gw.config_path())
        .unwrap()
        .split("mirror:")
        .next()
        .unwrap()
        .to_string();
    assert!(blast(&gw, 5, 5).await.iter().all(|(s, _)| *s == 200));
    eventually("5 copies held by the stalled target", || async {
        accepted.load(Ordering::SeqCst) == 5
    })
    .await;
    // The new target takes the next copies at once; the 5 in flight still end by the old
    // settings (their timeout at the stalled target), not by the reload.
    reload(
        &gw,
        1,
        &format!(
            "{head}mirror:\n  target: \"http://{}\"\n  ratio: 100\n  timeout_ms: 60000\n",
            fresh.addr
        ),
    )
    .await;
    blast(&gw, 5, 5).await;
    let m = wait_mirror_settled(&gw, 10).await;
    assert_eq!(mirror_count(&m, "timeout"), 5, "{m}");
    assert_eq!(mirror_count(&m, "ok"), 5, "{m}");
    assert_eq!(fresh.requests.load(Ordering::SeqCst), 5);
    assert_eq!(accepted.load(Ordering::SeqCst), 5);
    gw.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_line_compares_an_engine_stream_with_the_primary() {
    let _serial = SERIAL.lock().await;
    let primary = sims(1, "m", "e", 1000.0).await;
    let shadow = sims(1, "shadow", "s", 1000.0).await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n{}mirror:\n  target: \"http://{}\"\n  target_model: shadow\n  log: true\n",
        sim_instances(&primary),
        shadow[0].addr
    ));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "cmp-1")
        .json(
            &serde_json::json!({"model": "m", "stream": true, "max_tokens": 6,
            "messages": [{"role": "user", "content": "compare me"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
    eventually("the mirror line", || async {
        gw.log_text().contains(" mirror] id=cmp-1 ")
    })
    .await;
    let log = gw.log_text();
    let line = log
        .lines()
        .find(|l| l.contains(" mirror] id=cmp-1 "))
        .unwrap();
    for want in [
        "model=m mirror_model=shadow outcome=ok status=200",
        "completion_tokens=6",
        "primary_instance=e1 primary_status=200",
        "primary_completion_tokens=6",
    ] {
        assert!(line.contains(want), "{want} not in {line}");
    }
    let ttft = |key: &str| -> f64 {
        line.split(' ')
            .find_map(|kv| kv.strip_prefix(key))
            .unwrap()
            .parse()
            .unwrap_or_else(|_| panic!("{key} in {line}"))
    };
    assert!(ttft("ttft_ms=") <= ttft("dur_ms="), "{line}");
    assert!(
        ttft("primary_ttft_ms=") <= ttft("primary_dur_ms="),
        "{line}"
    );
    gw.wait_idle().await;
}
