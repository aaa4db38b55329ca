//! The live status page on the admin listener: `/admin/status` and the admin token's cookie
//! flow through the real binary, and the page itself rendered by a real headless Chromium
//! (Debian's `chromium`) against `tokengate demo` after a burst of traffic (every other
//! request mirrored) and an overload of its throttled service (queue, refusals, a member
//! gateway taking the overflow).
//!
//! The browser test skips (with a message) when no Chromium is installed, unless
//! `TOKENGATE_REQUIRE_BROWSER=1` (set by `.ci/run`), where a missing browser fails. The
//! screenshot goes to `$TOKENGATE_SCREENSHOT` (`.ci/run`: `bench/results/status-page.png`),
//! else to `target/status-page.png`.

mod common;

use common::fleet::{Fleet, FLEET_YAML};
use common::{eventually, GatewayProc, DEADLINE};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn yaml_with_token(addr: &str) -> String {
    format!(
        "admin_token: \"s3cret; tok\"\nhealth_check: {{ enabled: false }}\nservices:\n  - name: m\n    instances:\n      - {{ id: a, addr: \"{addr}\" }}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_and_the_page_behind_the_admin_token() {
    let sims = common::sims(1, "m", "a", 50.0).await;
    let addr = sims[0].addr.to_string();
    let gw = GatewayProc::start(&yaml_with_token(&addr));
    let c = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let get = |path: &str| c.get(gw.admin_url(path));

    // Without the token: the page explains how to open it, the JSON is refused, the
    // page's static assets and /health are open.
    let r = get("/").send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.text().await.unwrap().contains("/?token="));
    assert_eq!(get("/admin/status").send().await.unwrap().status(), 401);
    assert_eq!(get("/?token=wrong").send().await.unwrap().status(), 401);
    for p in ["/assets/status.js", "/assets/status.css", "/health"] {
        assert_eq!(get(p).send().await.unwrap().status(), 200, "{p}");
    }

    // `/?token=` (percent-encoded) sets the cookie and redirects to the page without it.
    let r = get("/?token=s3cret%3B%20tok").send().await.unwrap();
    assert_eq!(r.status(), 303);
    assert_eq!(r.headers()["location"], "./");
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    // The cookie is a session (an expiry and an HMAC keyed by the token), never the token.
    assert!(!cookie.contains("s3cret"), "{cookie}");
    assert!(cookie.contains("Max-Age=43200"), "{cookie}");
    let pair = cookie.split(';').next().unwrap().to_string();
    let page = get("/").header("cookie", &pair).send().await.unwrap();
    assert_eq!(page.status(), 200);
    // Neither the raw token as a cookie nor a session whose expiry was moved is accepted.
    let (exp, mac) = pair.split_once('=').unwrap().1.split_once('.').unwrap();
    let later = exp.parse::<u64>().unwrap() + 1;
    for forged in [
        "tokengate_admin=s3cret%3B%20tok".to_string(),
        format!("tokengate_admin={later}.{mac}"),
    ] {
        let r = get("/admin/status")
            .header("cookie", &forged)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{forged}");
    }
    // Admin answers are not stored by browsers or proxies.
    let r = get("/admin/status")
        .header("cookie", &pair)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["cache-control"], "no-store");
    assert!(page.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    let html = page.text().await.unwrap();
    assert!(html.contains("assets/status.js") && html.contains("id=\"instances\""));
    let bearer = get("/admin/status")
        .header("authorization", "Bearer s3cret; tok")
        .send()
        .await
        .unwrap();
    assert_eq!(bearer.status(), 200);
    // The token never reaches the log.
    assert!(!gw.log_text().contains("s3cret"));

    // Traffic: a stream, a unary request, an unknown model.
    let url = gw.url("/v1/chat/completions");
    for (model, stream) in [("m", true), ("m", false), ("nope", false)] {
        let r = c
            .post(&url)
            .json(
                &serde_json::json!({"model": model, "stream": stream, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello there"}]}),
            )
            .send()
            .await
            .unwrap();
        let _ = r.bytes().await;
    }
    let status = |c: reqwest::Client, u: String, pair: String| async move {
        c.get(u)
            .header("cookie", pair)
            .send()
            .await
            .unwrap()
            .json::<serde_json::Value>()
            .await
            .unwrap()
    };
    let su = gw.admin_url("/admin/status");
    let mut v = serde_json::Value::Null;
    let deadline = Instant::now() + DEADLINE;
    while Instant::now() < deadline {
        v = status(c.clone(), su.clone(), pair.clone()).await;
        if v["recent"].as_array().unwrap().len() == 3 && v["instances"][0]["completed"] == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await; // ok-sleep: poll interval under a deadline
    }
    let recent = v["recent"].as_array().unwrap();
    assert_eq!(recent.len(), 3, "{v:#}");
    assert_eq!(recent[0]["model"], "-", "not routed: no model was resolved");
    assert_eq!(recent[0]["status"], 404);
    assert!(
        recent[0]["reason"].as_str().unwrap().contains("nope"),
        "{v:#}"
    );
    assert_eq!(recent[2]["stream"], true);
    assert_eq!(recent[2]["instance"], "a");
    assert!(recent[2]["ttft_ms"].as_f64().unwrap() > 0.0);
    assert_eq!(recent[1]["reason"], "least-token");
    assert_eq!(v["totals"]["requests"], 3.0);
    assert_eq!(v["totals"]["client_errors"], 1.0);
    assert_eq!(v["services"][0]["name"], "m");
    assert_eq!(v["services"][0]["available"], 1);
    assert_eq!(v["reasons"][0]["reason"], "least-token");
    assert_eq!(v["reasons"][0]["count"], 2.0);
    assert!(
        !v["history"].as_array().unwrap().is_empty(),
        "a first point at start"
    );
    assert_eq!(v["reload"]["last"], serde_json::Value::Null);

    // A rejected reload, then an applied one, show in the reload state.
    std::fs::write(gw.config_path(), "services: [").unwrap();
    eventually("the rejected reload", || {
        let (c, su, pair) = (c.clone(), su.clone(), pair.clone());
        async move { status(c, su, pair).await["reload"]["errors"] == 1 }
    })
    .await;
    let v = status(c.clone(), su.clone(), pair.clone()).await;
    assert_eq!(v["reload"]["last"]["ok"], false);
    assert_eq!(v["reload"]["last_ok"], false);
    assert!(!v["reload"]["last"]["message"].as_str().unwrap().is_empty());
    let good = format!(
        "listen: [\"127.0.0.1:0\"]\nadmin_listen: 127.0.0.1:0\nthreads: 2\n{}",
        yaml_with_token(&addr)
    );
    std::fs::write(gw.config_path(), good).unwrap();
    eventually("the applied reload", || {
        let (c, su, pair) = (c.clone(), su.clone(), pair.clone());
        async move { status(c, su, pair).await["reload"]["ok"] == 1 }
    })
    .await;
    let v = status(c.clone(), su, pair).await;
    assert_eq!(v["reload"]["last"]["ok"], true);
    assert_eq!(v["reload"]["last_ok"], true);
    assert_eq!(v["reload"]["generation"], 1);
}

/// Debian's `chromium`, or `$CHROMIUM`.
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|b| {
            std::env::var_os("PATH").and_then(|path| {
                std::env::split_paths(&path)
                    .map(|d| d.join(b))
                    .find(|p| p.is_file())
            })
        })
}

/// Runs headless Chromium with the flags a closed network needs, bounded in time; returns
/// its stdout.
fn run_chromium(bin: &Path, args: &[String]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(bin);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .args(args)
    .stdin(Stdio::null())
    .stderr(Stdio::null());
    let out = tempfile::NamedTempFile::new().unwrap();
    cmd.stdout(out.reopen().unwrap());
    let mut child = cmd.spawn().expect("start chromium");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(st.success(), "chromium {args:?} failed: {st}");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("chromium {args:?} did not finish within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50)); // ok-sleep: poll interval under a deadline
    }
    std::fs::read_to_string(out.path()).unwrap()
}

/// The text of the first element after `from` in `html` that carries `attr` (e.g.
/// `data-field="completed"`).
fn cell<'a>(html: &'a str, from: &str, attr: &str) -> Option<&'a str> {
    let i = html.find(from)?;
    let rest = &html[i..];
    let end = rest.find("</tr>").unwrap_or(rest.len());
    let row = &rest[..end];
    let j = row.find(attr)?;
    let gt = row[j..].find('>')? + j + 1;
    let lt = row[gt..].find('<')? + gt;
    Some(&row[gt..lt])
}

fn fmt_int(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_page_renders_live_numbers_in_headless_chromium() {
    let required = std::env::var("TOKENGATE_REQUIRE_BROWSER").is_ok_and(|v| v == "1");
    let Some(bin) = chromium() else {
        assert!(
            !required,
            "TOKENGATE_REQUIRE_BROWSER=1 but no chromium found (apt-get install chromium)"
        );
        eprintln!("SKIPPED status page browser test: no chromium on PATH (apt-get install chromium; CI sets TOKENGATE_REQUIRE_BROWSER=1)");
        return;
    };
    let fleet = Fleet::start(FLEET_YAML);
    let sent = fleet.drive(8).await;
    assert!(sent >= 64);
    // The throttled service queues, refuses and overflows to the member gateway.
    fleet.overload().await;
    let status = fleet.settled_status().await;
    let url = fleet.admin_url("/");

    // The DOM after the page's script has fetched /admin/status and rendered it.
    let b = bin.clone();
    let u = url.clone();
    let dom = tokio::task::spawn_blocking(move || {
        run_chromium(
            &b,
            &[
                "--window-size=1280,800".into(),
                "--virtual-time-budget=5000".into(),
                "--dump-dom".into(),
                u,
            ],
        )
    })
    .await
    .unwrap();
    assert!(
        dom.contains("data-state=\"live\""),
        "the page never went live:\n{dom}"
    );
    let updates: u32 = dom
        .find("data-updates=\"")
        .and_then(|i| dom[i + 14..].split('"').next()?.parse().ok())
        .unwrap_or(0);
    assert!(updates >= 1, "no update rendered");

    // Every instance has its row, with the numbers the load table has.
    let instances = status["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 8);
    let mut completed_total = 0;
    for i in instances {
        let id = i["id"].as_str().unwrap();
        let row = format!("data-instance=\"{id}\"");
        assert!(dom.contains(&row), "no row for {id}:\n{dom}");
        let completed = i["completed"].as_u64().unwrap();
        completed_total += completed;
        assert_eq!(
            cell(&dom, &row, "data-field=\"completed\""),
            Some(fmt_int(completed).as_str()),
            "completed of {id}"
        );
        assert_eq!(
            cell(&dom, &row, "data-field=\"inflight_requests\""),
            Some("0"),
            "in flight of {id}"
        );
        assert!(
            cell(&dom, &row, "data-field=\"health\"").is_some(),
            "health of {id}"
        );
        assert!(
            dom[dom.find(&row).unwrap()..].contains("healthy"),
            "{id} healthy"
        );
    }
    assert!(completed_total >= 56, "completed {completed_total}");
    // Each instance's role, and its throttling slots (in use / limit) when throttled.
    for (id, role, slots) in [
        ("small-1", "integrated", "–"),
        ("mid-1", "integrated", "0/1 prefill"),
        ("pf-1", "prefill", "0/4 prefill"),
        ("dc-1", "decode", "0/8 decode"),
        ("dc-2", "decode", "0/8 decode"),
    ] {
        let row = format!("data-instance=\"{id}\"");
        assert_eq!(
            cell(&dom, &row, "data-field=\"role\""),
            Some(role),
            "role of {id}"
        );
        assert_eq!(
            cell(&dom, &row, "data-field=\"slots\""),
            Some(slots),
            "slots of {id}"
        );
    }

    // KPIs, charts, services, recent requests, routing reasons, config.
    let kpi = |name: &str| {
        let i = dom
            .find(&format!("data-kpi=\"{name}\""))
            .unwrap_or_else(|| panic!("kpi {name}"));
        let v = dom[i..].find("class=\"value\">").unwrap() + i + 14;
        dom[v..].split('<').next().unwrap().to_string()
    };
    assert_eq!(kpi("instances"), "8/8");
    assert_eq!(kpi("inflight"), "0");
    assert_ne!(kpi("ttft"), "–", "a TTFT from the streamed requests");
    // The TTFT headline says what it counts, and counts it: the median (nearest rank) TTFT of
    // the streamed requests among the recent ones, not of every request.
    let tile = &dom[dom.find("data-kpi=\"ttft\"").unwrap()..];
    let label = &tile[tile.find("class=\"label\"").unwrap()..];
    let label = label[label.find('>').unwrap() + 1..]
        .split('<')
        .next()
        .unwrap();
    assert_eq!(label, "TTFT p50 (streams)");
    let recent = status["recent"].as_array().unwrap();
    let mut streamed: Vec<f64> = recent
        .iter()
        .filter(|r| r["stream"] == true)
        .filter_map(|r| r["ttft_ms"].as_f64())
        .collect();
    let unstreamed = recent.iter().filter(|r| r["stream"] == false).count();
    assert!(
        !streamed.is_empty() && unstreamed > 0,
        "both kinds among the recent requests"
    );
    streamed.sort_by(f64::total_cmp);
    let p50 = streamed[(streamed.len() as f64 * 0.5).ceil() as usize - 1];
    let shown: f64 = tile[tile.find("data-ms=\"").unwrap() + 9..]
        .split('"')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (shown - p50).abs() < 1e-6,
        "headline {shown} ms, the recent streams' median {p50} ms"
    );
    assert!(
        tile.contains(&format!(" · {} streams<", streamed.len())),
        "{}",
        &tile[..400.min(tile.len())]
    );
    assert_ne!(kpi("rps"), "–");
    let points = |id: &str| -> u32 {
        let i = dom.find(&format!("id=\"{id}\"")).unwrap();
        let j = dom[i..].find("data-points=\"").unwrap() + i + 13;
        dom[j..].split('"').next().unwrap().parse().unwrap()
    };
    assert!(points("chart-requests") >= 1, "requests chart is empty");
    assert!(points("chart-ttft") >= 1, "TTFT chart is empty");
    for svc in ["qwen3-0.6b", "qwen3-32b"] {
        let i = dom
            .find(&format!("data-service=\"{svc}\""))
            .unwrap_or_else(|| panic!("no card for {svc}"));
        let card = &dom[i..];
        let j = card.find("data-ratio=\"ceiling\"").unwrap();
        assert!(card[j..j + 400].contains('%'), "ceiling ratio of {svc}");
    }
    assert!(dom.contains("data-route=\"qwen3\""), "the route card");
    // The throttled service's card: its queue (empty again), slots, refusals and waits as
    // /admin/status has them.
    let card = |svc: &str| {
        let i = dom
            .find(&format!("data-service=\"{svc}\""))
            .unwrap_or_else(|| panic!("no card for {svc}"));
        let end = dom[i..].find("</svg>").map_or(dom.len(), |e| i + e);
        dom[i..end].to_string()
    };
    let svc = |name: &str| {
        status["services"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name)
            .unwrap()
            .clone()
    };
    let throttled = card("qwen3-8b");
    let t = &svc("qwen3-8b")["throttle"];
    assert!(throttled.contains("throttle · queue"), "{throttled}");
    assert!(throttled.contains("queue <b>0/2</b>"), "{throttled}");
    assert!(
        throttled.contains("prefill slots <b>0/1</b>"),
        "{throttled}"
    );
    let refused = format!(
        "refused <b>{} queue full · {} timed out · 0 at limit</b>",
        t["rejections"]["queue_full"], t["rejections"]["queue_timeout"]
    );
    assert!(throttled.contains(&refused), "{refused} in {throttled}");
    assert!(
        throttled.contains(&format!("waited <b>{}× · mean ", t["queue_wait"]["count"])),
        "{throttled}"
    );
    // The disaggregated service: its protocol and the prefill legs by outcome.
    let pd = card("qwen3-235b");
    let legs = &svc("qwen3-235b")["pd"]["prefill"];
    assert!(legs["ok"].as_u64().unwrap() >= 16, "{legs}");
    assert!(pd.contains("prefill/decode · vllm-nixl"), "{pd}");
    assert!(pd.contains("1 prefill + 2 decode"), "{pd}");
    assert!(
        pd.contains(&format!(
            "prefill legs <b>{} ok · 0 error · 0 aborted</b>",
            fmt_int(legs["ok"].as_u64().unwrap())
        )),
        "{pd}"
    );
    // The member gateway with what it answered; the request it served among the recent ones.
    assert!(
        dom.contains("id=\"global-card\">"),
        "the global card is shown"
    );
    let ok = status["global"]["members"][0]["outcomes"]["ok"]
        .as_u64()
        .unwrap();
    assert!(ok >= 1);
    assert_eq!(
        cell(&dom, "data-member=\"eu-west\"", "data-field=\"ok\""),
        Some(fmt_int(ok).as_str())
    );
    assert!(dom.contains("us-east → what it cannot take"));
    assert!(dom.contains("global(eu-west)"), "the overflowed request");
    // The traffic mirror (every other request, to the member gateway): where the copies go
    // and what became of them, as /admin/status has them once every copy has ended.
    let mi = &status["mirror"];
    let o = &mi["outcomes"];
    let n = |k: &str| o[k].as_u64().unwrap();
    assert!(n("ok") >= 20, "{mi}");
    assert_eq!(n("sent"), n("ok"), "every copy answered: {mi}");
    assert!(
        dom.contains("id=\"mirror-card\">"),
        "the mirror card is shown"
    );
    let member = fleet.member.as_ref().unwrap().proxy;
    assert!(
        dom.contains(&format!("50% → http://{member} as qwen3-8b")),
        "the mirror's target"
    );
    let mirror = |field: &str| {
        cell(
            &dom,
            "id=\"mirror-card\"",
            &format!("data-field=\"{field}\""),
        )
    };
    let sent = fmt_int(n("sent"));
    assert_eq!(mirror("sent"), Some(sent.as_str()));
    let answered = format!("{} ok · 0 http error", fmt_int(n("ok")));
    assert_eq!(mirror("answered"), Some(answered.as_str()));
    assert_eq!(mirror("failed"), Some("0 error · 0 timeout"));
    assert_eq!(mirror("unsent"), Some("0 dropped · 0 expired"));
    assert_eq!(mirror("queue"), Some("0 waiting · 0 in flight"));
    let latency = mirror("latency").unwrap();
    assert!(
        latency.starts_with("first token ")
            && latency.contains(" · last byte ")
            && !latency.contains('–'),
        "{latency}"
    );
    // The prefix index figures and the decision service's calls with their latency.
    assert!(
        dom.matches("\">prefix index: ").count() == 4
            && dom.contains(" nodes · ")
            && dom.contains(" · evicted ")
            && dom.contains(" · trimmed "),
        "the prefix index line"
    );
    assert!(dom.contains("qwen3 → "), "decision calls");
    assert!(dom.contains(" mean"), "decision latency");
    let recent_rows = dom.matches("data-request=\"").count();
    assert!(recent_rows >= 10, "{recent_rows} recent rows");
    for reason in ["least-token", "decision(", "no-such-model"] {
        assert!(dom.contains(reason), "{reason} not shown");
    }
    assert!(dom.contains("as started"), "the reload state");
    for junk in ["NaN", "undefined", "[object Object]"] {
        assert!(!dom.contains(junk), "{junk} rendered:\n{dom}");
    }

    // The screenshot an operator would see at 1280×800.
    let shot = std::env::var_os("TOKENGATE_SCREENSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/status-page.png"));
    if let Some(d) = shot.parent() {
        std::fs::create_dir_all(d).unwrap();
    }
    let _ = std::fs::remove_file(&shot);
    let arg = format!("--screenshot={}", shot.display());
    tokio::task::spawn_blocking(move || {
        run_chromium(
            &bin,
            &[
                "--window-size=1280,800".into(),
                "--virtual-time-budget=5000".into(),
                arg,
                url,
            ],
        )
    })
    .await
    .unwrap();
    let png = std::fs::read(&shot).expect("screenshot written");
    assert_eq!(&png[1..4], b"PNG");
    let w = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(png[20..24].try_into().unwrap());
    assert_eq!((w, h), (1280, 800));
    assert!(
        png.len() > 30_000,
        "a nearly blank screenshot ({} bytes)",
        png.len()
    );
    eprintln!("status page screenshot: {}", shot.display());
}

/// The status page's top tenants: `/admin/status` lists the tenants by the tokens they
/// were charged (the `tokengate_tenant_tokens_total` counters), with requests, refusals and
/// requests in flight; the page renders them in that order (in Chromium when installed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_tenants_by_tokens_in_the_status_json_and_on_the_page() {
    let sims = common::sims(1, "m", "e", 50.0).await;
    let gw = GatewayProc::start(&format!(
        "health_check: {{ enabled: false }}\ntenants:\n  - name: idle\n    keys: [sk-idle]\n  - name: light\n    keys: [sk-light]\n    priority: interactive\n  - name: heavy\n    keys: [sk-heavy]\n    priority: batch\n    models: [m]\n    limits: {{concurrency: 8}}\nservices:\n  - name: m\n    instances:\n      - {{ id: e1, addr: \"{}\" }}\n",
        sims[0].addr
    ));
    let post = |key: &'static str, model: &'static str, max_tokens: u64| {
        let url = gw.url("/v1/chat/completions");
        async move {
            let r = reqwest::Client::new()
                .post(url)
                .bearer_auth(key)
                .json(
                    &serde_json::json!({"model": model, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": "hello there, tell me more"}]}),
                )
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            r.bytes().await.unwrap();
            status
        }
    };
    for _ in 0..3 {
        assert_eq!(post("sk-heavy", "m", 40).await, 200);
    }
    assert_eq!(post("sk-light", "m", 3).await, 200);
    assert_eq!(
        post("sk-heavy", "other", 3).await,
        403,
        "outside its models"
    );
    gw.wait_idle().await;
    let status: serde_json::Value = reqwest::get(gw.admin_url("/admin/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let top = status["top_tenants"].as_array().unwrap().clone();
    let names: Vec<&str> = top.iter().map(|t| t["tenant"].as_str().unwrap()).collect();
    assert_eq!(names, ["heavy", "light", "idle"], "{top:#?}");
    let metrics = gw.metrics().await;
    for t in &top {
        let name = t["tenant"].as_str().unwrap();
        let counted = |kind: &str| {
            common::metric(
                &metrics,
                &format!("tokengate_tenant_tokens_total{{kind=\"{kind}\",model=\"m\",tenant=\"{name}\"}}"),
            )
            .unwrap_or(0.0) as u64
        };
        assert_eq!(t["input_tokens"].as_u64(), Some(counted("input")), "{t}");
        assert_eq!(t["output_tokens"].as_u64(), Some(counted("output")), "{t}");
        assert_eq!(
            t["tokens"].as_u64(),
            Some(counted("input") + counted("output"))
        );
        assert_eq!(t["inflight"], 0, "{t}");
    }
    assert_eq!(top[0]["output_tokens"], 120, "3 answers of 40 tokens");
    assert_eq!(top[0]["requests"], 3);
    assert_eq!(top[0]["rejections"], 1);
    assert_eq!(top[0]["priority"], "batch");
    assert_eq!(top[1]["output_tokens"], 3);
    assert_eq!(top[2]["tokens"], 0);

    let Some(bin) = chromium() else {
        eprintln!("SKIPPED the page half of the top-tenants test: no chromium on PATH");
        return;
    };
    let url = gw.admin_url("/");
    let dom = tokio::task::spawn_blocking(move || {
        run_chromium(
            &bin,
            &[
                "--window-size=1280,800".into(),
                "--virtual-time-budget=5000".into(),
                "--dump-dom".into(),
                url,
            ],
        )
    })
    .await
    .unwrap();
    assert!(
        dom.contains("id=\"tenants-card\">"),
        "the tenants card is shown:\n{dom}"
    );
    let rows: Vec<usize> = ["heavy", "light", "idle"]
        .iter()
        .map(|n| dom.find(&format!("data-tenant=\"{n}\"")).expect(n))
        .collect();
    assert!(rows[0] < rows[1] && rows[1] < rows[2], "in order of tokens");
    for t in &top {
        let row = format!("data-tenant=\"{}\"", t["tenant"].as_str().unwrap());
        for (field, key) in [
            ("tokens", "tokens"),
            ("output", "output_tokens"),
            ("requests", "requests"),
            ("refused", "rejections"),
        ] {
            assert_eq!(
                cell(&dom, &row, &format!("data-field=\"{field}\"")),
                Some(fmt_int(t[key].as_u64().unwrap()).as_str()),
                "{row} {field}"
            );
        }
    }
}
