//! What a user meets in the first hour, through the binary: secrets from the environment and
//! from files (never in the log or `/admin`), every config error of a file at once with its
//! line and fix, `/v1/models` behind the key, and the CLI (`TOKENGATE_CONFIG`, completions,
//! `--version`, JSON log lines).

mod common;

use common::{eventually, sim_instances, sims, GatewayProc};
use std::process::Command;
use tokengate::config::Config;

fn chat(model: &str) -> String {
    format!(r#"{{"model":"{model}","max_tokens":4,"messages":[{{"role":"user","content":"hi"}}]}}"#)
}

async fn status(c: &reqwest::Client, g: &GatewayProc, key: Option<&str>) -> u16 {
    let mut r = c
        .post(g.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(chat("m"));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    r.send().await.unwrap().status().as_u16()
}

/// A key from `${VAR}` and keys from `api_keys_file` work, the admin token from
/// `admin_token_file` guards `/admin`, a rotated key file is read again on reload, and no
/// secret appears in the log or an `/admin` answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_from_the_environment_and_files() {
    let engines = sims(1, "m", "e", 50.0).await;
    let dir = tempfile::tempdir().unwrap();
    let env_key = format!("sk-env-{}", uuid_like());
    let file_key = format!("sk-file-{}", uuid_like());
    let rotated = format!("sk-rotated-{}", uuid_like());
    let admin = format!("adm-{}", uuid_like());
    let keys = dir.path().join("keys");
    std::fs::write(&keys, format!("# one key per line\n{file_key}\n\n")).unwrap();
    let admin_file = dir.path().join("admin");
    std::fs::write(&admin_file, format!("{admin}\n")).unwrap();
    let yaml = format!(
        "api_keys: [\"${{TG_TEST_ENV_KEY}}\"]\napi_keys_file: {}\nadmin_token_file: {}\nservices:\n  - name: m\n{}",
        keys.display(),
        admin_file.display(),
        sim_instances(&engines)
    );
    let g = GatewayProc::start_with_env(&yaml, &[("TG_TEST_ENV_KEY", &env_key)]);
    let c = reqwest::Client::new();
    assert_eq!(status(&c, &g, Some(&env_key)).await, 200);
    assert_eq!(status(&c, &g, Some(&file_key)).await, 200);
    assert_eq!(status(&c, &g, None).await, 401);
    assert_eq!(status(&c, &g, Some("sk-wrong")).await, 401);
    // The admin listener wants the token from the file.
    let r = c.get(g.admin_url("/admin/instances")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let mut answers = String::new();
    for path in ["/admin/instances", "/admin/status", "/metrics"] {
        let r = c
            .get(g.admin_url(path))
            .bearer_auth(&admin)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path}");
        answers.push_str(&r.text().await.unwrap());
    }
    // A rotated key file is read on reload (SIGHUP).
    std::fs::write(&keys, format!("{rotated}\n")).unwrap();
    let hup = Command::new("kill")
        .args(["-HUP", &g.child.id().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    eventually("the rotated key to be accepted", || async {
        status(&c, &g, Some(&rotated)).await == 200
    })
    .await;
    assert_eq!(status(&c, &g, Some(&file_key)).await, 401);
    assert_eq!(status(&c, &g, Some(&env_key)).await, 200);
    eventually("the reload's log line", || async {
        g.log_text().contains("config reloaded")
    })
    .await;
    let log = g.log_text();
    for secret in [&env_key, &file_key, &rotated, &admin] {
        assert!(
            !log.contains(secret.as_str()),
            "{secret} in the log:\n{log}"
        );
        assert!(
            !answers.contains(secret.as_str()),
            "{secret} in an /admin answer"
        );
    }
}

/// Not a real UUID: a unique enough suffix for a test's secrets.
fn uuid_like() -> String {
    format!(
        "{:x}{:x}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// `GET /v1/models` needs the key when keys are set: 401 in the API's error shape without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_list_requires_the_key() {
    let engines = sims(1, "m", "e", 50.0).await;
    let yaml = format!(
        "api_keys: [sk-models]\nservices:\n  - name: m\n{}",
        sim_instances(&engines)
    );
    let g = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    let r = c.get(g.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("missing API key"),
        "{v}"
    );
    let r = c
        .get(g.url("/v1/models"))
        .bearer_auth("sk-wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .get(g.url("/v1/models"))
        .bearer_auth("sk-models")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["data"][0]["id"], "m", "{v}");
}

fn check(path: &std::path::Path) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["check", "-c"])
        .arg(path)
        .env_remove("TG_TEST_UNSET_VAR")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// Six mistakes of six kinds in one file: `tokengate check` reports each once, with its path,
/// its line and the fix, in plain words.
#[test]
fn check_reports_every_error_with_its_line_and_hint() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.yaml");
    std::fs::write(
        &p,
        "listen: [\"127.0.0.1:0\"]\n\
         threads: many\n\
         max_body_bytes: 32MiB\n\
         timeouts:\n\
         \x20 first_byte: 120\n\
         services:\n\
         \x20 - name: m\n\
         \x20   sheduler: {mode: layered}\n\
         \x20   load_balancing: least-tokens\n\
         \x20   instances:\n\
         \x20     - {id: a, addr: nowhere}\n\
         \x20     - {id: b, addr: \"${TG_TEST_UNSET_VAR}\"}\n",
    )
    .unwrap();
    let (ok, err) = check(&p);
    assert!(!ok);
    let want = [
        "threads: expected a whole number (0 or more), found the text \"many\" (line 2)",
        "timeouts.first_byte: `first_byte: 120` needs a unit, e.g. `120s` (or `120ms`) (line 5)",
        "services[0].sheduler: unknown key `sheduler` — did you mean `scheduler`? (line 8)",
        "services[0].load_balancing: `least-tokens` is not one of `least-token`, `least-request`, `round-robin`, `predicted-ttft` — did you mean `least-token`? (line 9)",
        "services[0].instances[0].addr: invalid socket address \"nowhere\"",
        "services[0].instances[1].addr: environment variable `TG_TEST_UNSET_VAR` is not set",
    ];
    for w in want {
        assert_eq!(err.matches(w).count(), 1, "{w:?} once in:\n{err}");
    }
    assert!(err.contains("(line 11)"), "{err}");
    assert!(
        err.contains("is not set (write `${TG_TEST_UNSET_VAR:-default}` for a default) (line 12)"),
        "{err}"
    );
    // Exactly these six, in the file's order, in plain words.
    let errors: Vec<&str> = err.lines().skip(1).collect();
    assert_eq!(errors.len(), 6, "{err}");
    for jargon in [
        "unknown field",
        "unknown variant",
        "invalid type",
        "expected usize",
        "services[0]: ",
    ] {
        assert!(!err.contains(jargon), "{jargon:?} in:\n{err}");
    }
    // A YAML syntax error: its line.
    std::fs::write(&p, "services:\n  - name: m\n    instances: [\n").unwrap();
    let (ok, err) = check(&p);
    assert!(!ok);
    assert!(err.contains("YAML syntax error"), "{err}");
    assert!(err.contains("(line 4)"), "{err}");
}

/// `TOKENGATE_CONFIG` stands in for `-c`.
#[test]
fn the_config_path_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.yaml");
    std::fs::write(
        &p,
        "services:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .arg("check")
        .env("TOKENGATE_CONFIG", &p)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("ok (1 services, 1 instances)"), "{stdout}");
}

#[test]
fn completions_and_version() {
    for (shell, want) in [
        ("bash", "complete -F _tokengate"),
        ("zsh", "#compdef tokengate"),
        ("fish", "complete -c tokengate"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success());
        let s = String::from_utf8_lossy(&out.stdout);
        assert!(s.contains(want), "{shell}: {s}");
        assert!(s.contains("serve") && s.contains("check"), "{shell}: {s}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .arg("--version")
        .output()
        .unwrap();
    let v = String::from_utf8_lossy(&out.stdout).to_string();
    let head = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let commit = head.unwrap_or_else(|| "unknown".into());
    assert!(
        v.starts_with(&format!(
            "tokengate {} (commit {commit}, ",
            env!("CARGO_PKG_VERSION")
        )),
        "{v}"
    );
    assert!(v.trim_end().ends_with(" build)"), "{v}");
}

/// `log_format: json` (and `TOKENGATE_LOG_FORMAT=json`): every log line, the access log's
/// too, is one JSON object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_log_lines() {
    let engines = sims(1, "m", "e", 50.0).await;
    let c = reqwest::Client::new();
    for (yaml_extra, env) in [
        ("log_format: json\n", vec![]),
        ("", vec![("TOKENGATE_LOG_FORMAT", "json")]),
    ] {
        let yaml = format!(
            "{yaml_extra}services:\n  - name: m\n{}",
            sim_instances(&engines)
        );
        let g = GatewayProc::start_with_env(&yaml, &env);
        let r = c
            .post(g.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(chat("m"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.text().await.unwrap();
        eventually("the access line", || async {
            g.log_text().contains("\"target\":\"access\"")
        })
        .await;
        let log = g.log_text();
        let mut access = 0;
        for l in log.lines().filter(|l| !l.trim().is_empty()) {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}"));
            assert!(
                v["ts"].is_string() && v["level"].is_string() && v["msg"].is_string(),
                "{l}"
            );
            if v["target"] == "access" {
                access += 1;
                assert_eq!(v["status"], 200.0, "{l}");
                assert_eq!(v["path"], "/v1/chat/completions", "{l}");
                assert_eq!(v["model"], "m", "{l}");
            }
        }
        assert_eq!(access, 1, "{log}");
    }
}

/// With `TOKENGATE_LOG_FORMAT=json`, a config `serve` refuses is reported in JSON lines too.
#[test]
fn json_log_lines_for_a_refused_config() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.yaml");
    std::fs::write(&p, "services: []\nbogus: 1\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["serve", "-c"])
        .arg(&p)
        .env("TOKENGATE_LOG_FORMAT", "json")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    assert!(
        lines.iter().any(|v| v["level"] == "ERROR"
            && v["msg"]
                .as_str()
                .unwrap()
                .contains("bogus: unknown key `bogus`")),
        "{err}"
    );
}

// The parser through the library (the binary runs the same code).

/// serde's path stops at an internally tagged enum; the report names the entry inside.
#[test]
fn errors_inside_tagged_enums_name_their_entry() {
    let svc = "services:\n  - name: m\n    scheduler: {mode: policy, plugins: [PLUGIN]}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n";
    for (plugin, want) in [
        (
            "{kind: fastest}",
            "services[0].scheduler.plugins[0].kind: `fastest` is not one of",
        ),
        (
            "{kind: least-inflight, token_scale: 5}",
            "services[0].scheduler.plugins[0].token_scale: unknown key `token_scale`",
        ),
    ] {
        let e = Config::from_yaml(&svc.replace("PLUGIN", plugin))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
        assert!(e.ends_with("(line 3)"), "{e}");
    }
}

/// Every secret of the config can come from a file (and `${VAR}` from the environment).
#[test]
fn every_secret_has_a_file_form() {
    let dir = tempfile::tempdir().unwrap();
    let f = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let y = format!(
        "api_keys: [\"${{TG_REPORT_TEST_UNSET:-sk-env}}\"]\napi_keys_file: {}\nadmin_token_file: {}\n\
         services:\n  - name: m\n    api_key_file: {}\n    instances:\n      - {{id: a, addr: 127.0.0.1:8000, api_key_file: {}}}\n\
         mirror: {{target: \"http://127.0.0.1:1\", auth_token_file: {}}}\n\
         global: {{members: [{{name: eu, url: \"http://127.0.0.1:2\", token_file: {}}}]}}\n\
         providers: [{{name: p, base_url: \"http://127.0.0.1:3/v1\", api_key_file: {}}}]\n",
        f("keys", "# clients\nsk-a\n\nsk-b\n"),
        f("admin", "adm\n"),
        f("svc", "sk-svc\n"),
        f("inst", "sk-inst"),
        f("mirror", "mir\n"),
        f("member", "mem\n"),
        f("provider", "prov\n"),
    );
    let c = Config::from_yaml(&y).unwrap();
    assert_eq!(c.api_keys, ["sk-env", "sk-a", "sk-b"]);
    assert_eq!(c.admin_token.as_deref(), Some("adm"));
    assert_eq!(c.services[0].api_key.as_ref().unwrap().0, "sk-svc");
    assert_eq!(
        c.services[0].instances[0].api_key.as_ref().unwrap().0,
        "sk-inst"
    );
    assert_eq!(
        c.mirror.as_ref().unwrap().auth_token.as_deref(),
        Some("mir")
    );
    assert_eq!(c.global.members[0].token.as_deref(), Some("mem"));
    assert_eq!(c.providers[0].api_key.as_deref(), Some("prov"));
    // Both forms of one secret: an error at the `_file` key's line.
    let e = Config::from_yaml(&y.replace("admin_token_file", "admin_token: x\nadmin_token_file"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("admin_token_file: give `admin_token` or `admin_token_file`, not both (line 4)"),
        "{e}"
    );
}

#[test]
fn sizes_take_units() {
    let y = "max_body_bytes: 64KiB\nservices:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n";
    assert_eq!(Config::from_yaml(y).unwrap().max_body_bytes, 64 * 1024);
    let y = y.replace("64KiB", "1MB");
    assert_eq!(Config::from_yaml(&y).unwrap().max_body_bytes, 1_000_000);
    let y = y.replace("1MB", "1000");
    assert_eq!(Config::from_yaml(&y).unwrap().max_body_bytes, 1000);
    let e = Config::from_yaml(&y.replace("1000", "lots"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_body_bytes: \"lots\" is not a size"), "{e}");
}

/// Every `model` value anywhere in a JSON value (the answer's, Anthropic's `message.model`,
/// the Responses API's `response.model`).
fn models_in(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("model", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => models_in(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| models_in(x, out)),
        _ => {}
    }
}

/// A service whose engines serve another name (`model`) than clients send (`name`), with an
/// alias, and a route with an alias: the body's `model` goes up as the served name (the
/// engine-sim answers 404 for any other) and comes back as the name the client sent, in the
/// JSON answer and in every SSE event, on all four APIs; a route's answer names its target
/// service. `/v1/models` lists names and aliases, never the served name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_names_and_aliases_are_rewritten_both_ways() {
    const SERVED: &str = "Qwen/Qwen3-8B";
    let engines = sims(1, SERVED, "e", 100.0).await;
    let yaml = format!(
        "services:\n  - name: qwen3-8b\n    model: {SERVED}\n    aliases: [gpt-4o-mini]\n{}routes:\n  - name: fast\n    aliases: [quick]\n    targets: [{{service: qwen3-8b}}]\n",
        sim_instances(&engines)
    );
    let g = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    let body = |path: &str, model: &str, stream: bool| -> String {
        let v = match path {
            "/v1/completions" => {
                serde_json::json!({"model": model, "prompt": "hi", "max_tokens": 6})
            }
            "/v1/responses" => {
                serde_json::json!({"model": model, "input": "hi", "max_output_tokens": 6})
            }
            _ => serde_json::json!({"model": model, "max_tokens": 6,
                "messages": [{"role": "user", "content": "hi"}]}),
        };
        let mut v = v;
        v["stream"] = stream.into();
        v.to_string()
    };
    let paths = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
    ];
    for (asked, answered) in [
        ("qwen3-8b", "qwen3-8b"),
        ("gpt-4o-mini", "gpt-4o-mini"),
        ("fast", "qwen3-8b"),
        ("quick", "qwen3-8b"),
    ] {
        for path in paths {
            for stream in [false, true] {
                let what = format!("{path} model={asked} stream={stream}");
                let r = c
                    .post(g.url(path))
                    .header("content-type", "application/json")
                    .body(body(path, asked, stream))
                    .send()
                    .await
                    .unwrap();
                let st = r.status();
                let text = r.text().await.unwrap();
                assert_eq!(st, 200, "{what}: {text}");
                assert!(
                    !text.contains(SERVED),
                    "{what}: the served name leaked: {text}"
                );
                let mut models = Vec::new();
                let mut events = 0;
                if stream {
                    for data in text.lines().filter_map(|l| l.strip_prefix("data:")) {
                        let Ok(v) = serde_json::from_str::<serde_json::Value>(data.trim()) else {
                            continue; // [DONE]
                        };
                        events += 1;
                        let before = models.len();
                        models_in(&v, &mut models);
                        if path.ends_with("completions") {
                            // OpenAI's chunks each name the model.
                            assert_eq!(models.len(), before + 1, "{what}: {data}");
                        }
                    }
                    assert!(events >= 3, "{what}: {text}");
                } else {
                    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                    assert_eq!(v["model"], answered, "{what}: {v}");
                    models_in(&v, &mut models);
                }
                assert!(!models.is_empty(), "{what}: no model named: {text}");
                for m in &models {
                    assert_eq!(m, answered, "{what}: {text}");
                }
            }
        }
    }
    // An unknown name is still a 404, and the served name is not a client name.
    for unknown in [SERVED, "gpt-4o"] {
        let r = c
            .post(g.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body("/v1/chat/completions", unknown, false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{unknown}");
    }
    let v: serde_json::Value = c
        .get(g.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["qwen3-8b", "gpt-4o-mini", "fast", "quick"], "{v}");
}

/// An alias that is another service's or route's name, or another alias, is an error naming
/// its YAML path, its line and the name it collides with; `check --print` keeps `model` and
/// `aliases`.
#[test]
fn colliding_aliases_are_config_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("aliases.yaml");
    std::fs::write(
        &p,
        "services:\n\
         \x20 - name: a\n\
         \x20   model: org/a-served\n\
         \x20   aliases: [b, x]\n\
         \x20   instances:\n\
         \x20     - {id: i1, addr: 127.0.0.1:1}\n\
         \x20 - name: b\n\
         \x20   aliases: [x, r, \"\"]\n\
         \x20   instances:\n\
         \x20     - {id: i2, addr: 127.0.0.1:2}\n\
         routes:\n\
         \x20 - name: r\n\
         \x20   aliases: [a]\n\
         \x20   targets: [{service: a}]\n",
    )
    .unwrap();
    let (ok, err) = check(&p);
    assert!(!ok);
    for want in [
        "services[0].aliases[0]: \"b\" is also services[1].name; a model name clients send names one service or route (line 4)",
        "services[1].aliases[0]: \"x\" is also services[0].aliases[1]",
        "services[1].aliases[1]: \"r\" is also routes[0].name",
        "services[1].aliases[2]: must not be empty",
        "routes[0].aliases[0]: \"a\" is also services[0].name",
    ] {
        assert_eq!(err.matches(want).count(), 1, "{want:?} once in:\n{err}");
    }
    assert_eq!(err.lines().skip(1).count(), 5, "{err}");
    // The fixed file passes, and its printed form keeps the names and passes too.
    std::fs::write(
        &p,
        "services:\n  - name: a\n    model: org/a-served\n    aliases: [a2]\n    instances:\n      - {id: i1, addr: 127.0.0.1:1}\nroutes:\n  - name: r\n    aliases: [r2]\n    targets: [{service: a}]\n",
    )
    .unwrap();
    let (ok, err) = check(&p);
    assert!(ok, "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["check", "--print", "-c"])
        .arg(&p)
        .output()
        .unwrap();
    assert!(out.status.success());
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    let c = Config::from_yaml(&printed).unwrap();
    assert_eq!(c.services[0].model.as_deref(), Some("org/a-served"));
    assert_eq!(c.services[0].aliases, ["a2"]);
    assert_eq!(c.routes[0].aliases, ["r2"]);
}

/// A Kubernetes Secret mounted as files is updated by a symlink swap (`keys` →
/// `..data/keys`, `..data` → a new directory): the watcher watches the `*_file` secrets, so
/// the rotated key applies without a restart or SIGHUP, and the old one stops working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_secret_file_applies_without_a_restart() {
    let engines = sims(1, "m", "e", 50.0).await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let old = format!("sk-old-{}", uuid_like());
    let new = format!("sk-new-{}", uuid_like());
    std::fs::create_dir(d.join("..v1")).unwrap();
    std::fs::write(d.join("..v1/keys"), format!("{old}\n")).unwrap();
    std::os::unix::fs::symlink("..v1", d.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/keys", d.join("keys")).unwrap();
    let yaml = format!(
        "api_keys_file: {}\nservices:\n  - name: m\n{}",
        d.join("keys").display(),
        sim_instances(&engines)
    );
    let g = GatewayProc::start(&yaml);
    let c = reqwest::Client::new();
    assert_eq!(status(&c, &g, Some(&old)).await, 200);
    assert_eq!(status(&c, &g, Some(&new)).await, 401);
    // The kubelet's update: the new files in a new directory, then `..data` renamed over.
    std::fs::create_dir(d.join("..v2")).unwrap();
    std::fs::write(d.join("..v2/keys"), format!("{new}\n")).unwrap();
    std::os::unix::fs::symlink("..v2", d.join("..data_tmp")).unwrap();
    std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
    eventually("the rotated key to be accepted", || async {
        status(&c, &g, Some(&new)).await == 200
    })
    .await;
    assert_eq!(status(&c, &g, Some(&old)).await, 401);
    let log = g.log_text();
    assert!(log.contains("keys changed: reloading"), "{log}");
    assert!(!log.contains(&old) && !log.contains(&new), "{log}");
}
