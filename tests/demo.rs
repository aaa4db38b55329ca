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
    let mut child = Kill(
        Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .args(["demo", "--time-scale", "50", "-c"])
            .arg(&cfg)
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
