//! Real upstreams through the binary: engines addressed by name and by URL, HTTPS with a
//! private CA made in the test (and the loud insecure switch), the engines' own API key
//! (sent to them, never shown anywhere), and a name that moves to another address.

mod common;

use common::tls::{tls_front, TestPki};
use common::*;

const KEY: &str = "sk-engine-secret-4f9a1c";

/// Held by the tests that resolve names while one of them rewrites /etc/hosts: a gateway
/// that resolved `localhost` during a rewrite found no address and answered 503 (a CI run
/// of the certificate test; `std::fs::write` truncates before it writes).
static HOSTS_FILE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn body(stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "m", "stream": stream, "max_tokens": 3,
        "messages": [{"role": "user", "content": "hello there"}]})
}

async fn post(c: &reqwest::Client, gw: &GatewayProc, model: &str, mock: &str) -> reqwest::Response {
    let mut b = body(mock == "sse");
    b["model"] = serde_json::json!(model);
    c.post(gw.url("/v1/chat/completions"))
        .header("authorization", "Bearer sk-client")
        .header("x-mock", mock)
        .json(&b)
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_engine_by_name_gets_its_key_which_is_never_shown() {
    let _hosts = HOSTS_FILE.lock().await;
    let pki = TestPki::new();
    let dir = tempfile::tempdir().unwrap();
    let ca = pki.write_ca(dir.path(), "ca.pem");
    let mock = Mock::start().await;
    let front = tls_front(&pki, mock.addr).await;
    let sim = sims(1, "plain", "s", 100.0).await;
    let dead = dead_addr();
    // No active checks: one would take d1 out before the request that shows its error.
    let gw = GatewayProc::start(&format!(
        "api_keys: [sk-client]\nhealth_check: {{enabled: false}}\nservices:\n  - name: m\n    api_key: {KEY}\n    tls: {{ca_file: \"{}\"}}\n    instances:\n      - {{id: tls1, addr: \"https://localhost:{}\"}}\n  - name: plain\n    instances:\n      - {{id: s1, addr: \"http://localhost:{}\", api_key: {KEY}}}\n  - name: down\n    api_key: {KEY}\n    instances:\n      - {{id: d1, addr: \"{dead}\"}}\n",
        ca.display(),
        front.port(),
        sim[0].addr.port()
    ));
    let c = reqwest::Client::new();
    // Over TLS (SNI localhost, verified against the private CA): the engine sees its own key,
    // not the client's, and the Host it was configured with.
    let r = post(&c, &gw, "m", "echo").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-tokengate-instance"], "tls1");
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["auth"], format!("Bearer {KEY}"), "{v}");
    // A stream over TLS.
    let r = post(&c, &gw, "m", "sse").await;
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("[DONE]"));
    // An engine-sim addressed by http://localhost:port.
    let r = post(&c, &gw, "plain", "echo").await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(sim[0].stats().requests_finished, 1);
    // An engine that is down: the error names it, never its key.
    let r = post(&c, &gw, "down", "echo").await;
    assert_eq!(r.status(), 502);
    let err = r.text().await.unwrap();
    assert!(err.contains("d1"), "{err}");
    assert!(!err.contains(KEY), "{err}");
    // The key is nowhere: /admin, /metrics, the status JSON, the log.
    gw.wait_idle().await;
    let c2 = reqwest::Client::new();
    for path in ["/admin/instances", "/metrics", "/admin/status"] {
        let text = c2
            .get(gw.admin_url(path))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(!text.contains(KEY), "{path} shows the key");
        assert!(!text.contains(&KEY[3..]), "{path} shows the key");
    }
    let inst = gw.instances().await;
    assert!(inst.to_string().contains("https://localhost"), "{inst}");
    let log = gw.log_text();
    assert!(!log.contains(&KEY[3..]), "the log shows the key:\n{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused_unless_verification_is_off() {
    let _hosts = HOSTS_FILE.lock().await;
    let pki = TestPki::new();
    let other = TestPki::new();
    let dir = tempfile::tempdir().unwrap();
    let wrong_ca = other.write_ca(dir.path(), "other-ca.pem");
    let mock = Mock::start().await;
    let front = tls_front(&pki, mock.addr).await;
    let svc = |tls: &str| {
        format!(
            "health_check: {{enabled: false}}\nservices:\n  - name: m\n    tls: {tls}\n    instances:\n      - {{id: t1, addr: \"https://localhost:{}\"}}\n",
            front.port()
        )
    };
    let c = reqwest::Client::new();
    // (Active health checks off: a check refused by TLS marks the instance down at once, and
    // the request would get 503 instead of the certificate's 502, depending on which comes
    // first.) The system's roots do not know the test CA, nor does another private CA.
    for tls in [
        "{}".to_string(),
        format!("{{ca_file: \"{}\"}}", wrong_ca.display()),
    ] {
        let gw = GatewayProc::start(&svc(&tls));
        let r = post(&c, &gw, "m", "echo").await;
        assert_eq!(r.status(), 502, "tls: {tls}");
        assert_eq!(mock.requests.load(std::sync::atomic::Ordering::Relaxed), 0);
        gw.wait_idle().await;
    }
    // insecure_skip_verify: accepted, and said loudly.
    let gw = GatewayProc::start(&svc("{insecure_skip_verify: true}"));
    let r = post(&c, &gw, "m", "echo").await;
    // (Once, in a CI run, this was a 503 after ~20 s: see `HOSTS_FILE`.)
    assert_eq!(r.status(), 200, "{}", gw.log_text());
    assert!(gw.log_text().contains("insecure_skip_verify is on"));
}

#[test]
fn bad_upstream_settings_name_the_yaml_path() {
    let dir = tempfile::tempdir().unwrap();
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "hello").unwrap();
    let cases = [
        (
            "services:\n  - name: m\n    instances:\n      - {id: a, addr: \"https://h:1/v1\"}\n".to_string(),
            "services[0].instances[0].addr: invalid address",
        ),
        (
            format!(
                "services:\n  - name: m\n    tls: {{ca_file: \"{}\"}}\n    instances:\n      - {{id: a, addr: \"https://localhost:1\"}}\n",
                not_pem.display()
            ),
            "services[0].tls.ca_file:",
        ),
        (
            "services:\n  - name: m\n    api_key: \"a b\"\n    instances:\n      - {id: a, addr: \"127.0.0.1:1\"}\n".to_string(),
            "services[0].api_key: must be non-empty",
        ),
    ];
    for (yaml, want) in cases {
        let p = dir.path().join("bad.yaml");
        std::fs::write(&p, &yaml).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .args(["check", "-c"])
            .arg(&p)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let text = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(text.contains(want), "want {want:?} in {text}");
        assert!(!text.contains("a b\""), "{text}");
    }
}

/// A hosts-file entry for the duration of a test (removed on drop).
struct HostsEntry {
    name: String,
}

impl HostsEntry {
    /// Points `name` at `ip` in /etc/hosts; `None` when the file is not writable (not root).
    fn set(name: &str, ip: &str) -> Option<HostsEntry> {
        let text = std::fs::read_to_string("/etc/hosts").ok()?;
        let mut kept: Vec<&str> = text
            .lines()
            .filter(|l| !l.split_whitespace().skip(1).any(|n| n == name))
            .collect();
        let line = format!("{ip} {name}");
        kept.push(&line);
        std::fs::write("/etc/hosts", kept.join("\n") + "\n").ok()?;
        Some(HostsEntry { name: name.into() })
    }
}

impl Drop for HostsEntry {
    fn drop(&mut self) {
        if let Ok(text) = std::fs::read_to_string("/etc/hosts") {
            let kept: Vec<&str> = text
                .lines()
                .filter(|l| !l.split_whitespace().skip(1).any(|n| n == self.name))
                .collect();
            let _ = std::fs::write("/etc/hosts", kept.join("\n") + "\n");
        }
    }
}

/// A name whose address changes (a restarted pod behind a headless Service) is followed,
/// and a name that stops resolving makes its instance unavailable, not the gateway fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_moves_is_followed() {
    let _hosts = HOSTS_FILE.lock().await;
    let name = format!("tg-test-{}.internal", std::process::id());
    let a = Mock::start_on("127.0.0.2:0").await;
    let port = a.addr.port();
    let b = Mock::start_on(&format!("127.0.0.3:{port}")).await;
    let Some(entry) = HostsEntry::set(&name, "127.0.0.2") else {
        eprintln!("skipped: /etc/hosts is not writable here (CI runs as root)");
        return;
    };
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    instances:\n      - {{id: e1, addr: \"http://{name}:{port}\"}}\n"
    ));
    let c = reqwest::Client::new();
    let r = post(&c, &gw, "m", "echo").await;
    assert_eq!(r.status(), 200);
    let count = |m: &Mock| m.requests.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!((count(&a), count(&b)), (1, 0));
    // The pod moves: within the re-resolution period requests reach the new address.
    let moved = HostsEntry::set(&name, "127.0.0.3").unwrap();
    eventually("requests reach the new address", || async {
        let r = post(&c, &gw, "m", "echo").await;
        r.status() == 200 && count(&b) > 0
    })
    .await;
    // The name disappears: the instance is unavailable (503, not a crash or a hang), and
    // comes back when the name does.
    drop(entry);
    drop(moved);
    eventually("the instance becomes unavailable", || async {
        post(&c, &gw, "m", "echo").await.status() == 503
    })
    .await;
    let _entry = HostsEntry::set(&name, "127.0.0.3").unwrap();
    eventually("the instance is back", || async {
        post(&c, &gw, "m", "echo").await.status() == 200
    })
    .await;
}
