//! The Grafana dashboard (`docker/grafana/dashboards/tokengate.json`) against what a live
//! gateway exports, and a real Prometheus scraping one.
//!
//! - Every PromQL query of the dashboard names only series and labels that `/metrics`
//!   exports (after a burst of traffic through a fleet that exercises every family).
//! - Every `tokengate_*` family — exported by the live gateway, or registered anywhere in
//!   `src/` — is shown by the dashboard (a query names it) and by the status page (its
//!   field of `/admin/status`, listed in [`PAGE`], exists in the live JSON; the page renders
//!   it, `tests/status_page.rs`). A new family fails this test until it has both: adding a
//!   family = one panel in the dashboard JSON + one [`PAGE`] entry (+ traffic in
//!   [`FLEET_YAML`] that makes the family export a series, when it needs some).
//! - Prometheus (Debian's `prometheus`; skipped when absent unless
//!   `TOKENGATE_REQUIRE_PROMETHEUS=1`, which `.ci/run` sets): `promtool check config` on the
//!   shipped `docker/prometheus/prometheus.yml`, a Prometheus scraping the live gateway
//!   with the shipped `tokengate` job, every dashboard query accepted by its HTTP API, and
//!   the main panels' queries returning data.

mod common;

use common::fleet::{Fleet, FLEET_YAML};
use common::DEADLINE;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// (panel title, expr) of every query of the dashboard, template variables included
/// (`label_values(metric, label)` as a query of its own).
fn dashboard_queries() -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(root().join("docker/grafana/dashboards/tokengate.json")).unwrap();
    let d: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON parses");
    fn walk(p: &serde_json::Value, out: &mut Vec<(String, String)>) {
        let title = p["title"].as_str().unwrap_or("").to_string();
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                out.push((title.clone(), e.to_string()));
            }
        }
        for c in p["panels"].as_array().into_iter().flatten() {
            walk(c, out);
        }
    }
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        walk(p, &mut out);
    }
    for v in d["templating"]["list"].as_array().into_iter().flatten() {
        let q = v["query"]["query"]
            .as_str()
            .or_else(|| v["query"].as_str())
            .unwrap_or_default();
        out.push((format!("variable {}", v["name"]), q.to_string()));
    }
    assert!(out.len() > 30, "the dashboard has its panels");
    out
}

/// The expr with Grafana's variables replaced (what Prometheus receives).
fn substitute(e: &str) -> String {
    e.replace("$__rate_interval", "1m")
        .replace("$__range", "5m")
        .replace("$model", ".*")
        .replace("$instance", ".*")
        .replace("$service", ".*")
}

/// Series name → label names, and family names, of Prometheus text.
struct Exposition {
    series: BTreeMap<String, BTreeSet<String>>,
    families: BTreeSet<String>,
}

fn parse_metrics(text: &str) -> Exposition {
    let mut series: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut families = BTreeSet::new();
    for l in text.lines() {
        if let Some(rest) = l.strip_prefix("# TYPE ") {
            families.insert(rest.split_whitespace().next().unwrap().to_string());
            continue;
        }
        if l.starts_with('#') || l.trim().is_empty() {
            continue;
        }
        let name_end = l.find(['{', ' ']).unwrap();
        let labels = series.entry(l[..name_end].to_string()).or_default();
        if l.as_bytes()[name_end] == b'{' {
            let body = &l[name_end + 1..l.rfind('}').unwrap()];
            for kv in body.split("\",") {
                if let Some((k, _)) = kv.split_once('=') {
                    labels.insert(k.trim().to_string());
                }
            }
        }
    }
    Exposition { series, families }
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// What a PromQL expression refers to: (metric, label names in its matcher), label names
/// in `by (…)` / `without (…)`, and labels created by `label_replace` / `label_join`.
struct Refs {
    metrics: Vec<(String, Vec<String>)>,
    grouping: Vec<String>,
    created: Vec<String>,
}

fn refs(expr: &str) -> Refs {
    let b: Vec<char> = expr.chars().collect();
    let mut r = Refs {
        metrics: Vec::new(),
        grouping: Vec::new(),
        created: Vec::new(),
    };
    let mut i = 0;
    while i < b.len() {
        if b[i] == '"' {
            // skip string literals
            i += 1;
            while i < b.len() && b[i] != '"' {
                i += if b[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            continue;
        }
        if !is_ident(b[i]) || (i > 0 && is_ident(b[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && is_ident(b[i]) {
            i += 1;
        }
        let word: String = b[start..i].iter().collect();
        let mut j = i;
        while j < b.len() && b[j] == ' ' {
            j += 1;
        }
        if word.starts_with("tokengate_") {
            let mut labels = Vec::new();
            if j < b.len() && b[j] == '{' {
                let end = j + b[j..].iter().position(|&c| c == '}').unwrap();
                let body: String = b[j + 1..end].iter().collect();
                for m in body.split(',') {
                    let name: String = m.trim().chars().take_while(|&c| is_ident(c)).collect();
                    if !name.is_empty() {
                        labels.push(name);
                    }
                }
                i = end + 1;
            }
            r.metrics.push((word, labels));
        } else if (word == "by" || word == "without") && j < b.len() && b[j] == '(' {
            let end = j + b[j..].iter().position(|&c| c == ')').unwrap();
            let body: String = b[j + 1..end].iter().collect();
            r.grouping.extend(
                body.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty()),
            );
            i = end + 1;
        } else if word == "label_replace" || word == "label_join" || word == "label_values" {
            // label_replace(v, "dst", …) / label_values(metric, label)
            let rest: String = b[j..].iter().collect();
            if word == "label_values" {
                let inner = rest.trim_start_matches('(');
                if let Some((_, lbl)) = inner.split_once(',') {
                    r.grouping
                        .push(lbl.trim().trim_end_matches(')').trim().to_string());
                }
            } else if let Some(q) = second_arg(&rest) {
                let dst: String = rest[q..]
                    .trim_start()
                    .trim_start_matches('"')
                    .chars()
                    .take_while(|&c| c != '"')
                    .collect();
                r.created.push(dst);
            }
        }
    }
    r
}

/// Byte offset of the second argument of the call that `s` starts with (`(a, b, …)`).
fn second_arg(s: &str) -> Option<usize> {
    let mut depth = 0;
    let mut in_str = false;
    let mut prev = ' ';
    for (i, c) in s.char_indices() {
        if in_str {
            in_str = !(c == '"' && prev != '\\');
        } else {
            match c {
                '"' => in_str = true,
                '(' | '{' | '[' => depth += 1,
                ')' | '}' | ']' => depth -= 1,
                ',' if depth == 1 => return Some(i + 1),
                _ => {}
            }
        }
        prev = c;
    }
    None
}

/// `tokengate_*` families registered in `src/` (the first argument of a metric
/// constructor: `Opts::new("tokengate_…"`, `IntGauge::new("tokengate_…"`, …).
fn registered_families() -> BTreeSet<String> {
    fn files(d: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut fs = Vec::new();
    files(&root().join("src"), &mut fs);
    let mut out = BTreeSet::new();
    for f in fs {
        let text = std::fs::read_to_string(&f).unwrap();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("\"tokengate_") {
            let before = rest[..i].trim_end();
            let name: String = rest[i + 1..].chars().take_while(|&c| is_ident(c)).collect();
            if before.ends_with("::new(") {
                out.insert(name);
            }
            rest = &rest[i + 1..];
        }
    }
    out
}

/// Where the status page shows each metric family: a JSON pointer into `/admin/status`
/// (`0` = the first instance / service / call).
const PAGE: &[(&str, &str)] = &[
    ("tokengate_trace_spans_total", "/tracing/spans/exported"),
    (
        "tokengate_cluster_redis_calls_total",
        "/cluster/redis_calls/ok",
    ),
    ("tokengate_cluster_degraded", "/cluster/degraded"),
    (
        "tokengate_cluster_redis_rtt_seconds",
        "/cluster/rtt/mean_ms",
    ),
    (
        "tokengate_cluster_events_applied_total",
        "/cluster/events_applied/placed",
    ),
    (
        "tokengate_cluster_local_fallbacks_total",
        "/cluster/local_fallbacks/session",
    ),
    (
        "tokengate_cluster_writes_dropped_total",
        "/cluster/writes_dropped",
    ),
    ("tokengate_requests_total", "/totals/requests"),
    (
        "tokengate_request_duration_seconds",
        "/recent/0/duration_ms",
    ),
    ("tokengate_ttft_seconds", "/recent/0/ttft_ms"),
    ("tokengate_tokens_total", "/services/0/tokens/prompt"),
    (
        "tokengate_inflight_requests",
        "/instances/0/inflight_requests",
    ),
    ("tokengate_inflight_tokens", "/instances/0/inflight_tokens"),
    ("tokengate_waiting_requests", "/instances/0/waiting"),
    (
        "tokengate_queued_prefill_tokens",
        "/instances/0/queued_prefill_tokens",
    ),
    ("tokengate_held_requests", "/instances/0/held"),
    (
        "tokengate_learned_prefill_tokens_per_second",
        "/instances/0/learned/prefill_tokens_per_second",
    ),
    (
        "tokengate_learned_decode_step_seconds",
        "/instances/0/learned/decode_step_ms",
    ),
    ("tokengate_routing_decisions_total", "/reasons/0/count"),
    (
        "tokengate_prefix_tokens_total",
        "/services/0/hit_ratio/ceiling",
    ),
    (
        "tokengate_prefix_engine_tokens_total",
        "/services/0/hit_ratio/engine",
    ),
    (
        "tokengate_prefix_hit_ratio",
        "/services/0/hit_ratio/predicted",
    ),
    ("tokengate_prefix_index_nodes", "/services/0/index/nodes"),
    ("tokengate_prefix_index_bytes", "/services/0/index/bytes"),
    (
        "tokengate_prefix_index_evicted_bytes",
        "/services/0/index/evicted_bytes",
    ),
    (
        "tokengate_prefix_index_trimmed_blocks",
        "/services/0/index/trimmed_blocks",
    ),
    (
        "tokengate_prefix_index_capacity_evicted_blocks",
        "/services/0/index/capacity_evicted_blocks",
    ),
    ("tokengate_sessions", "/services/0/sessions"),
    ("tokengate_decision_total", "/decision_calls/0/count"),
    (
        "tokengate_decision_latency_seconds",
        "/decision_calls/0/mean_latency_ms",
    ),
    ("tokengate_config_reloads_total", "/reload/ok"),
    ("tokengate_config_last_reload_success", "/reload/last_ok"),
    (
        "tokengate_protocol_errors_total",
        "/protocol_errors/head_timeout",
    ),
    (
        "tokengate_instance_available",
        "/instances/0/health/healthy",
    ),
    (
        "tokengate_instance_ejections",
        "/instances/0/health/ejections",
    ),
    // The fleet's third service (qwen3-8b) is throttled, its fifth instance (mid-1) is that
    // service's, its sixth (pf-1) a prefill node; one member gateway.
    (
        "tokengate_throttle_queue_length",
        "/services/2/throttle/queued",
    ),
    (
        "tokengate_throttle_queue_wait_seconds",
        "/services/2/throttle/queue_wait/mean_ms",
    ),
    (
        "tokengate_queue_wait_by_class_seconds",
        "/services/2/throttle/queue_wait/by_class/default/count",
    ),
    (
        "tokengate_throttle_rejections_total",
        "/services/2/throttle/rejections/queue_full",
    ),
    ("tokengate_slots_in_use", "/instances/4/slots/prefill"),
    ("tokengate_slot_limit", "/instances/4/slots/limits/prefill"),
    ("tokengate_pd_prefill_total", "/instances/5/pd_prefill/ok"),
    (
        "tokengate_global_requests_total",
        "/global/members/0/outcomes/ok",
    ),
    (
        "tokengate_split_requests_total",
        "/split/proxies/1/outcomes/ok",
    ),
    // The fleet mirrors every other request to the member gateway.
    ("tokengate_mirror_requests_total", "/mirror/outcomes/ok"),
    (
        "tokengate_mirror_latency_seconds",
        "/mirror/latency/total/mean_ms",
    ),
    ("tokengate_mirror_queue_depth", "/mirror/queued"),
    ("tokengate_mirror_inflight", "/mirror/inflight"),
];

/// A fleet after traffic (rounds through every service, and the throttled service
/// overloaded into its queue, refusals and the member gateway), with every family of the
/// metrics module exported; its `/admin/status`.
async fn busy_fleet() -> (Fleet, Exposition, serde_json::Value) {
    let fleet = Fleet::start(FLEET_YAML);
    fleet.drive(6).await;
    fleet.overload().await;
    let status = fleet.settled_status().await;
    let text = fleet.metrics().await;
    (fleet, parse_metrics(&text), status)
}

#[test]
fn the_query_reader_finds_metrics_labels_and_groupings() {
    let r = refs(
        r#"sum by (reason, le) (label_replace(rate(tokengate_x_total{a="1",b=~"x|y"}[1m]), "kind", "$1", "reason", "(.*)")) / on() tokengate_y"#,
    );
    assert_eq!(
        r.metrics,
        vec![
            (
                "tokengate_x_total".to_string(),
                vec!["a".to_string(), "b".to_string()]
            ),
            ("tokengate_y".to_string(), vec![]),
        ]
    );
    assert_eq!(r.grouping, vec!["reason", "le"]);
    assert_eq!(r.created, vec!["kind"]);
    let r = refs("label_values(tokengate_requests_total, model)");
    assert_eq!(r.grouping, vec!["model"]);
    assert!(registered_families().contains("tokengate_requests_total"));
    assert!(!registered_families().contains("tokengate_admin"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_queries_name_only_exported_metrics_and_labels() {
    let (_fleet, exp, _) = busy_fleet().await;
    let mut problems = Vec::new();
    for (title, expr) in dashboard_queries() {
        let r = refs(&expr);
        assert!(
            !r.metrics.is_empty(),
            "panel {title:?} queries no tokengate metric: {expr}"
        );
        let mut all_labels: BTreeSet<String> = r.created.iter().cloned().collect();
        for (m, labels) in &r.metrics {
            let Some(have) = exp.series.get(m) else {
                problems.push(format!(
                    "panel {title:?}: {m} is not exported by /metrics (exercise it in FLEET_YAML / Fleet::drive if it needs traffic)"
                ));
                continue;
            };
            for l in labels {
                if !have.contains(l) {
                    problems.push(format!(
                        "panel {title:?}: {m} has no label {l:?} (it has {have:?})"
                    ));
                }
            }
            all_labels.extend(have.iter().cloned());
        }
        for g in &r.grouping {
            if !all_labels.contains(g) {
                problems.push(format!(
                    "panel {title:?}: groups by {g:?}, which none of its metrics has ({all_labels:?})"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_exported_family_is_on_the_dashboard_and_the_status_page() {
    let (_fleet, exp, status) = busy_fleet().await;
    let mut families: BTreeSet<String> = exp
        .families
        .iter()
        .filter(|f| f.starts_with("tokengate_"))
        .cloned()
        .collect();
    let registered = registered_families();
    assert!(registered.len() >= 25, "{registered:?}");
    // What the metrics module registers and the fleet's traffic exports agree.
    let unexported: Vec<&String> = registered.difference(&families).collect();
    assert!(
        unexported.is_empty(),
        "registered in src/ but not exported by the test fleet (add traffic / config to FLEET_YAML): {unexported:?}"
    );
    families.extend(registered);
    let shown: BTreeSet<String> = dashboard_queries()
        .iter()
        .flat_map(|(_, e)| refs(e).metrics.into_iter().map(|(m, _)| m))
        .collect();
    let missing: Vec<&String> = families
        .iter()
        .filter(|f| {
            !["", "_bucket", "_sum", "_count"]
                .iter()
                .any(|s| shown.contains(&format!("{f}{s}")))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "metric families the dashboard does not show: {missing:?} — add a panel to docker/grafana/dashboards/tokengate.json"
    );
    let on_page: BTreeSet<&str> = PAGE.iter().map(|(f, _)| *f).collect();
    let missing: Vec<&String> = families
        .iter()
        .filter(|f| !on_page.contains(f.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "metric families the status page does not show: {missing:?} — show them on the page (src/status/) and list their /admin/status field in PAGE"
    );
    for (f, ptr) in PAGE {
        assert!(
            status.pointer(ptr).is_some_and(|v| !v.is_null()),
            "{f}: /admin/status has no {ptr}:\n{status:#}"
        );
    }
}

/// The admin API's documents are their typed views (`tokengate::status::StatusView`,
/// `tokengate::admin::InstancesDoc`): read into them and written back, no field is lost or
/// changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_documents_are_their_typed_views() {
    let (fleet, _, status) = busy_fleet().await;
    let typed: tokengate::status::StatusView =
        serde_json::from_value(status.clone()).expect("/admin/status reads as StatusView");
    assert_eq!(serde_json::to_value(&typed).unwrap(), status);
    assert!(typed.split.is_some() && typed.mirror.settings.is_some());
    let instances = fleet.admin_json("/admin/instances").await;
    let typed: tokengate::admin::InstancesDoc =
        serde_json::from_value(instances.clone()).expect("/admin/instances reads as InstancesDoc");
    assert_eq!(serde_json::to_value(&typed).unwrap(), instances);
    assert_eq!(typed.table.instances.len(), 8);
}

fn find_bin(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// A Prometheus server; killed on drop.
struct Prom {
    child: std::process::Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prom {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prom {
    /// Starts `prometheus` on 127.0.0.1:0 with `config` and reads its address from its log.
    fn start(bin: &Path, config: &str) -> Prom {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("prometheus.yml");
        std::fs::write(&cfg, config).unwrap();
        let mut child = Command::new(bin)
            .arg(format!("--config.file={}", cfg.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .args(["--web.listen-address=127.0.0.1:0", "--log.level=info"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start prometheus");
        let err = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let deadline = Instant::now() + DEADLINE;
        let mut seen = Vec::new();
        let addr = loop {
            let Ok(l) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) else {
                let _ = child.kill();
                panic!(
                    "prometheus did not report its address:\n{}",
                    seen.join("\n")
                );
            };
            // msg="Listening on" address=127.0.0.1:PORT
            if l.contains("msg=\"Listening on\"") {
                if let Some(a) = l.split("address=").nth(1) {
                    break a.split_whitespace().next().unwrap().to_string();
                }
            }
            seen.push(l);
        };
        Prom {
            child,
            addr,
            _dir: dir,
        }
    }

    async fn query(&self, c: &reqwest::Client, q: &str) -> serde_json::Value {
        c.get(format!("http://{}/api/v1/query", self.addr))
            .query(&[("query", q)])
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

/// Panels whose queries must return data once the gateway is scraped under traffic.
const MAIN_PANELS: &[&str] = &[
    "Request rate",
    "Requests by status code",
    "Time to first token",
    "Request duration",
    "Tokens per second by kind",
    "In-flight requests",
    "Hit ratio since start",
    "Routing decisions by reason",
    "Instances available",
    "Config reloads",
    "Throttle queue length",
    "Throttle rejections by reason",
    "Slots in use vs limit",
    "Prefill legs by instance and outcome",
    "Requests to member gateways",
    "Mirror copies by outcome",
    "Mirror queue and in flight",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_gateway_and_answers_the_dashboard() {
    let required = std::env::var("TOKENGATE_REQUIRE_PROMETHEUS").is_ok_and(|v| v == "1");
    let (Some(prom), Some(promtool)) = (find_bin("prometheus"), find_bin("promtool")) else {
        assert!(
            !required,
            "TOKENGATE_REQUIRE_PROMETHEUS=1 but prometheus/promtool are missing (apt-get install prometheus)"
        );
        eprintln!("SKIPPED Prometheus test: no prometheus/promtool on PATH (apt-get install prometheus; CI sets TOKENGATE_REQUIRE_PROMETHEUS=1)");
        return;
    };
    let shipped = root().join("docker/prometheus/prometheus.yml");
    let out = Command::new(&promtool)
        .args(["check", "config"])
        .arg(&shipped)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check config {}:\n{}{}",
        shipped.display(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let fleet = Fleet::start(FLEET_YAML);
    // The shipped `tokengate` job, pointed at the live gateway, scraping every second.
    let mut cfg: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&shipped).unwrap()).unwrap();
    cfg["global"]["scrape_interval"] = "1s".into();
    cfg["global"]["evaluation_interval"] = "1s".into();
    let jobs = cfg["scrape_configs"].as_sequence_mut().unwrap();
    jobs.retain(|j| j["job_name"] == "tokengate");
    assert_eq!(jobs.len(), 1, "the shipped config has a tokengate job");
    jobs[0]["static_configs"][0]["targets"] =
        serde_yaml_ng::Value::Sequence(vec![fleet.admin.to_string().into()]);
    let cfg = serde_yaml_ng::to_string(&cfg).unwrap();
    let p = Prom::start(&prom, &cfg);
    let c = reqwest::Client::new();
    // Throttling refusals and the member gateway's share happen once, while scraped.
    fleet.overload().await;

    let queries: Vec<(String, String)> = dashboard_queries()
        .into_iter()
        .filter(|(t, _)| !t.starts_with("variable"))
        .map(|(t, e)| (t, substitute(&e)))
        .collect();
    // Traffic until Prometheus has scraped enough of it for every main panel (rates need two
    // scrapes that saw the counters move).
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut empty: Vec<String>;
    loop {
        fleet.drive(2).await;
        empty = Vec::new();
        for (title, q) in queries
            .iter()
            .filter(|(t, _)| MAIN_PANELS.contains(&t.as_str()))
        {
            let v = p.query(&c, q).await;
            assert_eq!(v["status"], "success", "{title}: {q}: {v}");
            if v["data"]["result"].as_array().is_none_or(|r| r.is_empty()) {
                empty.push(format!("{title}: {q}"));
            }
        }
        if empty.is_empty() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await; // ok-sleep: poll interval under a deadline
    }
    assert!(
        empty.is_empty(),
        "main dashboard series without data after 90 s of scraping:\n{}",
        empty.join("\n")
    );
    assert!(
        MAIN_PANELS
            .iter()
            .all(|m| queries.iter().any(|(t, _)| t == m)),
        "every main panel exists"
    );
    // Every query of the dashboard is valid PromQL for a real Prometheus.
    for (title, q) in &queries {
        let v = p.query(&c, q).await;
        assert_eq!(v["status"], "success", "{title}: {q}: {v}");
    }
    let up = p.query(&c, "up{job=\"tokengate\"}").await;
    assert_eq!(up["data"]["result"][0]["value"][1], "1", "{up}");
}
