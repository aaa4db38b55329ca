//! `tokengate demo` starts a fleet and answers the curl commands it prints.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `tokengate demo -c cfg` (time scale 50), running until dropped, and what it printed up to
/// its `Ctrl-C …` line (at most 30 s).
fn start_demo(cfg: &std::path::Path) -> (Kill, Vec<String>) {
    let mut child = Kill(
        Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .args(["demo", "--time-scale", "50", "-c"])
            .arg(cfg)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let out = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let l = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("demo output");
        let done = l.starts_with("Ctrl-C");
        lines.push(l);
        if done {
            break;
        }
    }
    (child, lines)
}

/// Pulls `(url, body)` out of the printed `curl ... URL ... -d 'BODY'` commands.
fn curls(lines: &[String]) -> Vec<(String, Option<String>)> {
    let text = lines.join("\n").replace("\\\n", " ");
    text.lines()
        .filter(|l| l.trim_start().starts_with("curl "))
        .map(|l| {
            let url = l
                .split_whitespace()
                .find(|w| w.starts_with("http://"))
                .unwrap()
                .to_string();
            let body = l
                .split("-d '")
                .nth(1)
                .map(|b| b.trim_end_matches('\'').to_string());
            (url, body)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_answers_the_printed_curl_commands() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("demo.yaml");
    // The shipped demo config with every port replaced by 0 (no fixed ports in tests).
    let demo =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/conf/demo.yaml")).unwrap();
    let re_port = |s: &str| {
        s.lines()
            .map(|l| {
                if let Some(i) = l.find("127.0.0.1:") {
                    let end = l[i + 10..]
                        .find(|c: char| !c.is_ascii_digit())
                        .map_or(l.len(), |e| i + 10 + e);
                    format!("{}127.0.0.1:0{}", &l[..i], &l[end..])
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    std::fs::write(&cfg, re_port(&demo)).unwrap();
    let (_child, lines) = start_demo(&cfg);
    assert_eq!(
        lines.iter().filter(|l| l.contains("engine-sim ")).count(),
        4
    );
    let cmds = curls(&lines);
    assert_eq!(cmds.len(), 5, "{lines:#?}");
    let c = reqwest::Client::new();
    for (url, body) in cmds {
        let r = match &body {
            Some(b) => c
                .post(&url)
                .header("content-type", "application/json")
                .body(b.clone()),
            None => c.get(&url),
        }
        .send()
        .await
        .unwrap();
        assert_eq!(r.status(), 200, "{url}");
        let text = r.text().await.unwrap();
        match body {
            Some(b) if b.contains("\"stream\":true") => {
                assert!(text.contains("data: "), "{text}");
                assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
            }
            Some(_) => {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v["usage"]["completion_tokens"], 16, "{v}");
            }
            None if url.ends_with("/metrics") => assert!(text.contains("tokengate_requests_total")),
            None => {
                let _: serde_json::Value = serde_json::from_str(&text).unwrap();
            }
        }
    }
}

/// `tokengate demo -c FILE` with `api_keys`: the printed commands carry the key (from
/// `$TOKENGATE_KEY`) and answer 200; editing the file reloads it (a rotated key, a new
/// instance with an engine of its own), as `serve` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_with_keys_prints_working_commands_and_reloads() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("mine.yaml");
    let yaml = |key: &str, extra: &str| {
        format!(
            "listen: [\"127.0.0.1:0\"]\nadmin_listen: 127.0.0.1:0\nthreads: 2\napi_keys: [{key}]\nservices:\n  - name: m\n    instances:\n      - {{id: a, addr: \"127.0.0.1:0\"}}\n{extra}"
        )
    };
    std::fs::write(&cfg, yaml("sk-demo-1", "")).unwrap();
    let (_child, lines) = start_demo(&cfg);
    let text = lines.join("\n");
    assert!(text.contains("export TOKENGATE_KEY="), "{text}");
    assert!(
        !text.contains("sk-demo-1"),
        "the key itself is not printed:\n{text}"
    );
    let cmds: Vec<(String, Option<String>, bool)> = {
        let joined = text.replace("\\\n", " ");
        let mut v = Vec::new();
        for l in joined
            .lines()
            .filter(|l| l.trim_start().starts_with("curl "))
        {
            let keyed = l.contains("-H \"Authorization: Bearer $TOKENGATE_KEY\"");
            let (url, body) = curls(&[l.to_string()]).remove(0);
            v.push((url, body, keyed));
        }
        v
    };
    assert_eq!(cmds.len(), 5, "{text}");
    let c = reqwest::Client::new();
    let send = |url: &str, body: &Option<String>, key: Option<&str>| {
        let mut r = match body {
            Some(b) => c
                .post(url)
                .header("content-type", "application/json")
                .body(b.clone()),
            None => c.get(url),
        };
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    for (url, body, keyed) in &cmds {
        let proxy = url.contains("/v1/");
        assert_eq!(*keyed, proxy, "{url}: the proxy's commands carry the key");
        let key = keyed.then_some("sk-demo-1");
        assert_eq!(send(url, body, key).await.unwrap().status(), 200, "{url}");
        if proxy {
            assert_eq!(send(url, body, None).await.unwrap().status(), 401, "{url}");
        }
    }
    // A rotated key and a new instance: the file is reloaded.
    let (chat_url, chat_body, _) = cmds[0].clone();
    let admin = cmds
        .iter()
        .find(|(u, ..)| u.ends_with("/admin/instances"))
        .unwrap()
        .0
        .clone();
    std::fs::write(
        &cfg,
        yaml("sk-demo-2", "      - {id: b, addr: \"127.0.0.1:0\"}\n"),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = send(&chat_url, &chat_body, Some("sk-demo-2"))
            .await
            .unwrap()
            .status();
        if s == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the new key never worked: {s}");
        tokio::time::sleep(Duration::from_millis(50)).await; // ok-sleep: poll interval under a deadline
    }
    let s = send(&chat_url, &chat_body, Some("sk-demo-1"))
        .await
        .unwrap();
    assert_eq!(s.status(), 401);
    let v: serde_json::Value = c.get(&admin).send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = v["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a", "b"], "{v:#}");
    // The new instance has an engine of its own, where the gateway routes to it.
    let b = &v["instances"][1]["addr"];
    assert_ne!(b, "127.0.0.1:0", "{v:#}");
    let direct = format!("http://{}/v1/chat/completions", b.as_str().unwrap());
    let r = send(&direct, &chat_body, None).await.unwrap();
    assert_eq!(r.status(), 200, "{direct}");
}
