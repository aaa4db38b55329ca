//! What clients see of the gateway's inside, through the real binary: upstream failures
//! say what failed without addresses or OS errors (the detail is in the log with the
//! request id), the routing headers can be turned off (`response_headers.routing`), the
//! engines' own `x-*` headers pass only when named (`response_headers.engine`), and a body
//! that does not say it is JSON is refused with 415 before anything is sent upstream.
//!
//! And the code's own hygiene, from the file system only: no source file of the workspace is
//! over [`MAX_SOURCE_LINES`] lines except tests and the files on [`LONG_FILES`].

mod common;

use common::*;

async fn post(gw: &GatewayProc, content_type: Option<&str>) -> reqwest::Response {
    let mut r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .body(chat_body("m", 200, false));
    if let Some(ct) = content_type {
        r = r.header("content-type", ct);
    }
    r.send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_say_what_failed_without_addresses_or_os_errors() {
    let dead = dead_addr();
    for routing in [true, false] {
        let gw = GatewayProc::start(&format!(
            "health_check: {{enabled: false}}\nresponse_headers: {{routing: {routing}}}\nservices:\n{}",
            service("m", &[("gone-1", dead)])
        ));
        let r = post(&gw, Some("application/json")).await;
        assert_eq!(r.status(), 502);
        let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
        let v: serde_json::Value = r.json().await.unwrap();
        let msg = v["error"]["message"].as_str().unwrap();
        assert_eq!(v["error"]["code"], "upstream_error", "{v}");
        let who = if routing {
            "instance gone-1"
        } else {
            "the upstream"
        };
        assert!(msg.contains(&format!("cannot connect to {who}")), "{msg}");
        assert!(msg.contains(&id), "the request id to quote: {msg}");
        for leak in [
            dead.to_string(),
            dead.port().to_string(),
            "127.0.0.1".into(),
            "refused".into(),
            "os error".into(),
            "Peer".into(),
        ] {
            assert!(
                !msg.contains(&leak),
                "{leak:?} in the client's message: {msg}"
            );
        }
        if !routing {
            assert!(!msg.contains("gone-1"), "{msg}");
        }
        // The detail is in the log, on a line with the request id.
        eventually("the failure's detail in the log", || async {
            gw.log_text()
                .lines()
                .any(|l| l.contains(&id) && l.contains(&dead.to_string()))
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_headers_can_be_turned_off_and_engine_headers_pass_only_when_named() {
    let fleet = sims(1, "m", "e", 50.0).await;
    let svc = format!("services:\n  - name: m\n{}", sim_instances(&fleet));
    // Default: the routing headers, and none of the engine's own.
    let gw = GatewayProc::start(&svc);
    let r = post(&gw, None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-tokengate-instance"], "e1");
    assert!(r.headers().contains_key("x-tokengate-reason"));
    assert!(r.headers().contains_key("x-request-id"));
    assert!(
        !r.headers().contains_key("x-engine-id"),
        "{:?}",
        r.headers()
    );
    drop(gw);
    // Routing headers off, the engine's id named: the reverse.
    let gw = GatewayProc::start(&format!(
        "response_headers: {{routing: false, engine: [X-Engine-Id]}}\n{svc}"
    ));
    let r = post(&gw, None).await;
    assert_eq!(r.status(), 200);
    assert!(!r.headers().contains_key("x-tokengate-instance"));
    assert!(!r.headers().contains_key("x-tokengate-reason"));
    assert!(r.headers().contains_key("x-request-id"));
    assert_eq!(r.headers()["x-engine-id"], "e1");
    // The access log still says where it went.
    eventually("the access line with the instance", || async {
        gw.log_text().contains("instance=e1")
    })
    .await;
}

#[test]
fn response_headers_are_checked_and_printed() {
    let (ok, err) = check_yaml(
        "response_headers: {routing: true, engine: [server, \"*\"]}\nservices:\n  - name: m\n    instances: [{id: a, addr: \"127.0.0.1:1\"}]\n",
    );
    assert!(!ok);
    assert!(
        err.contains("response_headers.engine[0]: \"server\""),
        "{err}"
    );
    assert!(err.contains("response_headers.engine[1]: \"*\""), "{err}");
    let (ok, err) = check_yaml("response_headers: {routing: maybe}\n");
    assert!(!ok);
    assert!(err.contains("response_headers.routing"), "{err}");
    // check --print writes the keys back, and its output is a valid config again.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("c.yaml");
    std::fs::write(
        &f,
        "response_headers: {routing: false, engine: [x-engine-id, \"x-ratelimit-*\"]}\nservices:\n  - name: m\n    instances: [{id: a, addr: \"127.0.0.1:1\"}]\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["check", "--print", "-c"])
        .arg(&f)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    let v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&printed).unwrap();
    assert_eq!(
        v["response_headers"]["routing"].as_bool(),
        Some(false),
        "{printed}"
    );
    assert_eq!(
        v["response_headers"]["engine"][1].as_str(),
        Some("x-ratelimit-*"),
        "{printed}"
    );
    let (ok, err) = check_yaml(&printed);
    assert!(ok, "{err}\n{printed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_declared_json_is_refused_with_415() {
    let m = Mock::start().await;
    let gw = GatewayProc::start(&format!("services:\n{}", service("m", &[("up-1", m.addr)])));
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let r = post(&gw, Some(ct)).await;
        assert_eq!(r.status(), 415, "{ct}");
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "unsupported_media_type", "{v}");
    }
    assert_eq!(m.requests.load(std::sync::atomic::Ordering::SeqCst), 0);
    for ct in [
        None,
        Some("application/json"),
        Some("Application/JSON; charset=utf-8"),
        Some("application/vnd.api+json"),
    ] {
        let r = post(&gw, ct).await;
        assert_eq!(r.status(), 200, "{ct:?}");
    }
    assert_eq!(m.requests.load(std::sync::atomic::Ordering::SeqCst), 4);
}

/// The longest a source file of the workspace may be, in lines. Tests are exempt: a file named
/// `tests.rs` or under a `tests/` directory.
const MAX_SOURCE_LINES: usize = 800;

/// Source files still over [`MAX_SOURCE_LINES`], being split into modules. This list must
/// shrink, never grow: a file that outgrows the bound is split, not added here. An entry whose
/// file is back within the bound (or gone) fails the test until it is taken off.
const LONG_FILES: &[&str] = &[];

/// The workspace's `.rs` files under `dir` that are not tests, with their line counts; paths
/// relative to `root`, with `/`.
fn source_lengths(root: &std::path::Path, dir: &std::path::Path, out: &mut Vec<(String, usize)>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for e in entries {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "tests") {
                source_lengths(root, &p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs")
            && p.file_name().is_some_and(|n| n != "tests.rs")
        {
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            let rel: Vec<String> = p
                .strip_prefix(root)
                .unwrap()
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            out.push((rel.join("/"), text.lines().count()));
        }
    }
}

#[test]
fn no_source_file_is_over_800_lines() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "plugins/src", "sim/src", "bench/src"] {
        source_lengths(root, &root.join(dir), &mut files);
    }
    files.sort();
    assert!(
        files.len() > 50,
        "the workspace's sources were not found: {files:?}"
    );
    let mut msg = String::new();
    for (path, lines) in &files {
        if *lines > MAX_SOURCE_LINES && !LONG_FILES.contains(&path.as_str()) {
            msg += &format!("\n  {path}: {lines} lines");
        }
    }
    if !msg.is_empty() {
        msg = format!(
            "source files over {MAX_SOURCE_LINES} lines (split each into modules of cohesive parts; tests may go to a `tests.rs` child module):{msg}\n"
        );
    }
    for allowed in LONG_FILES {
        match files.iter().find(|(p, _)| p == allowed) {
            Some((_, n)) if *n > MAX_SOURCE_LINES => {}
            Some((_, n)) => {
                msg += &format!("\n{allowed} is {n} lines now: take it off LONG_FILES\n")
            }
            None => msg += &format!("\n{allowed} does not exist: take it off LONG_FILES\n"),
        }
    }
    assert!(msg.is_empty(), "{msg}");
}
