//! The live status page on the admin listener.
//!
//! - `GET /` serves [`assets/index.html`](assets/index.html); `GET /assets/status.css` and
//!   `/assets/status.js` its style and script (static, embedded in the binary: no build
//!   step, no CDN, works air-gapped). The script polls `GET /admin/status` every 2 s.
//! - `GET /admin/status` ([`status_json`]): the fleet (every instance with health, its role
//!   — integrated, prefill or decode — in-flight requests and tokens, prefill / decode phase
//!   counts, throttling slots, completed / errors, a prefill node's prefill legs by outcome),
//!   per service the scheduler, prefix index and hit ratios (ceiling, predicted, engine), its
//!   throttle (queue, slots in use against their limits, refusals by reason, queue waits) and
//!   its prefill/decode protocol, routes, the routing reasons and decision-service calls, the
//!   member gateways of global scheduling with their answers by outcome, traffic mirroring
//!   (settings, queue, copies by outcome, latency), the config reload state, the most
//!   recent finished requests and the sampled history (requests, TTFT, tokens, in-flight
//!   and per-service prefix counters every 5 s for 15 minutes, from [`recent::Board`]).
//!
//! With `admin_token` set, `/` and `/admin/status` need it like every admin path: open
//! `/?token=TOKEN` once; the gateway answers with a redirect to `/` that sets an `HttpOnly`,
//! `SameSite=Strict` cookie holding the token, which the page's requests then carry (the
//! token leaves the address bar at once). `Authorization: Bearer` works too.
//!
//! [`run`] is the sampler: a background loop that closes an interval every
//! [`recent::SAMPLE_EVERY`].

pub mod recent;

use crate::clock::{now_ms, sleep_or_stop};
use crate::shared::Shared;
use prometheus::core::Collector;
use recent::{Point, PrefixCounters, SAMPLE_EVERY};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokengate_plugins::Role;

const INDEX_HTML: &str = include_str!("assets/index.html");
const STATUS_CSS: &str = include_str!("assets/status.css");
const STATUS_JS: &str = include_str!("assets/status.js");

/// The page loads nothing but its own assets and its JSON (no inline script, no other
/// origin, not framed).
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Name of the cookie that carries the admin token for the page.
pub const COOKIE: &str = "tokengate_admin";

/// A static asset of the page by path, with its content type (no auth: code, no data).
pub fn asset(path: &str) -> Option<(&'static str, &'static str)> {
    match path {
        "/assets/status.css" => Some(("text/css; charset=utf-8", STATUS_CSS)),
        "/assets/status.js" => Some(("text/javascript; charset=utf-8", STATUS_JS)),
        _ => None,
    }
}

/// The page itself.
pub fn index_html() -> &'static str {
    INDEX_HTML
}

/// The page shown instead of the status page when the admin token is missing or wrong.
pub fn login_html() -> String {
    let body = "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>tokengate · admin token needed</title>\
<link rel=\"stylesheet\" href=\"assets/status.css\"></head><body class=\"login\"><main>\
<h1>tokengate</h1><p>This admin listener needs its <code>admin_token</code>.</p>\
<p>Open <code>/?token=&lt;admin_token&gt;</code> once: the page then keeps the token in a cookie \
(HttpOnly, SameSite=Strict) and removes it from the address bar.</p></main></body></html>";
    body.to_string()
}

/// Decodes `%XX` escapes and `+` (a query parameter or a cookie value).
fn percent_decode(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(v) => {
                        out.push(v);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

/// The decoded value of `name` in a query string.
pub fn query_param(query: Option<&str>, name: &str) -> Option<Vec<u8>> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| percent_decode(v))
}

/// The admin token carried by the page's cookie, decoded.
pub fn cookie_token(headers: &http::HeaderMap) -> Option<Vec<u8>> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| percent_decode(v))
}

/// How long the page's session cookie lasts.
pub const SESSION_SECS: u64 = 12 * 3600;

/// The session proof for `token` expiring at `expires` (Unix seconds): an HMAC-SHA256
/// keyed by the admin token, so the cookie never holds the token, a forged or altered one
/// is refused, and changing the token ends every session.
fn session_mac(token: &[u8], expires: u64) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, token);
    let tag = ring::hmac::sign(
        &key,
        format!("tokengate-admin-session:{expires}").as_bytes(),
    );
    tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// `Set-Cookie` value of a page session opened at `now` (Unix seconds): `<expiry>.<mac>`,
/// `HttpOnly`, `SameSite=Strict`, `Max-Age` [`SESSION_SECS`].
pub fn set_cookie(token: &[u8], now: u64) -> String {
    let expires = now + SESSION_SECS;
    format!(
        "{COOKIE}={expires}.{}; Path=/; HttpOnly; SameSite=Strict; Max-Age={SESSION_SECS}",
        session_mac(token, expires)
    )
}

/// Whether a cookie value is a live session for `token` at `now` (Unix seconds).
pub fn session_ok(cookie: &[u8], token: &[u8], now: u64) -> bool {
    let Some((exp, mac)) = std::str::from_utf8(cookie)
        .ok()
        .and_then(|c| c.split_once('.'))
    else {
        return false;
    };
    let Ok(expires) = exp.parse::<u64>() else {
        return false;
    };
    expires > now
        && expires <= now + SESSION_SECS
        && crate::request::admit::ct_eq(mac.as_bytes(), session_mac(token, expires).as_bytes())
}

fn ratio(num: u64, den: u64) -> Option<f64> {
    (den > 0).then(|| num as f64 / den as f64)
}

/// Every (labels, value) of a counter (or gauge) family.
fn rows(c: &dyn Collector) -> Vec<(BTreeMap<String, String>, f64)> {
    let mut out = Vec::new();
    for mf in c.collect() {
        for m in mf.get_metric() {
            let labels = m
                .get_label()
                .iter()
                .map(|l| (l.name().to_string(), l.value().to_string()))
                .collect();
            let v = if m.get_counter().is_some() {
                m.get_counter().value()
            } else {
                m.get_gauge().value()
            };
            out.push((labels, v));
        }
    }
    out
}

/// Sum of a counter family's values over the series whose `key` label is `value`, by the
/// label `by` (the series are read, never created: a family stays unexported until used).
fn sum_by(
    rows: &[(BTreeMap<String, String>, f64)],
    key: &str,
    value: &str,
    by: &str,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (l, v) in rows {
        if l.get(key).is_some_and(|x| x == value) {
            *out.entry(l.get(by).cloned().unwrap_or_default())
                .or_insert(0.0) += v;
        }
    }
    out
}

/// Sum of a family's values by the label `by`, over all its series.
fn sum_all_by(rows: &[(BTreeMap<String, String>, f64)], by: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (l, v) in rows {
        *out.entry(l.get(by).cloned().unwrap_or_default())
            .or_insert(0.0) += v;
    }
    out
}

/// `{k: count}` for every `k` of `keys` (0 when absent).
fn counts(found: &BTreeMap<String, f64>, keys: &[&str]) -> Value {
    Value::Object(
        keys.iter()
            .map(|k| {
                (
                    k.to_string(),
                    json!(found.get(*k).copied().unwrap_or(0.0) as u64),
                )
            })
            .collect(),
    )
}

/// A service's throttle: settings, queue, slots in use against their limits (summed over
/// its instances, per phase, as the slot metrics count them), refusals by reason and the
/// queue's waits.
fn throttle_json(
    shared: &Shared,
    s: &crate::runtime::Service,
    t: &crate::throttle::Throttle,
    rejections: &[(BTreeMap<String, String>, f64)],
) -> Value {
    let st = t.settings();
    let mut slots: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    for i in &s.instances {
        for (phase, used, limit) in crate::throttle::slot_phases(i.role, &i.load.snapshot(), &st) {
            let e = slots.entry(phase).or_default();
            e.0 += used;
            e.1 += limit;
        }
    }
    let slots: serde_json::Map<String, Value> = slots
        .into_iter()
        .map(|(p, (used, limit))| (p.to_string(), json!({"in_use": used, "limit": limit})))
        .collect();
    let (mut waited, mut wait_sum) = (0u64, 0.0);
    for mf in shared.metrics.throttle_queue_wait.collect() {
        for x in mf.get_metric() {
            if x.get_label().iter().any(|l| l.value() == s.name) {
                waited += x.get_histogram().sample_count();
                wait_sum += x.get_histogram().sample_sum();
            }
        }
    }
    json!({
        "overflow": format!("{:?}", st.overflow).to_lowercase(),
        "scope": format!("{:?}", st.scope).to_lowercase(),
        "queued": t.queued(),
        "max_queue": st.max_queue,
        "queue_timeout_ms": st.queue_timeout.as_millis() as u64,
        "slots": slots,
        "rejections": counts(
            &sum_by(rejections, "service", &s.name, "reason"),
            &["limit", "queue_full", "queue_timeout"],
        ),
        "queue_wait": {
            "count": waited,
            "mean_ms": (waited > 0).then(|| wait_sum * 1e3 / waited as f64),
            // By tenant priority class, over every throttled service (the metric has no
            // service label).
            "by_class": queue_wait_by_class(shared),
        },
    })
}

/// The tenants that used the most tokens since start (`tokengate_tenant_*` counters, over
/// every model), at most [`TOP_TENANTS`], with the requests in flight now (their
/// concurrency slots) and their refusals. Tenants of the current config only, in order of
/// tokens (input + output), then name.
pub const TOP_TENANTS: usize = 10;

fn top_tenants(shared: &Shared, rt: &crate::runtime::Runtime) -> Value {
    let t = &shared.metrics.tenants;
    let tokens = rows(&t.tokens);
    let requests = sum_all_by(&rows(&t.requests), "tenant");
    let refused = sum_all_by(&rows(&t.rejections), "tenant");
    let mut top: Vec<Value> = rt
        .tenants
        .list()
        .iter()
        .map(|x| {
            let kinds = sum_by(&tokens, "tenant", &x.name, "kind");
            let input = kinds.get("input").copied().unwrap_or(0.0) as u64;
            let output = kinds.get("output").copied().unwrap_or(0.0) as u64;
            json!({
                "tenant": x.name,
                "priority": x.priority,
                "tokens": input + output,
                "input_tokens": input,
                "output_tokens": output,
                "requests": requests.get(&x.name).copied().unwrap_or(0.0) as u64,
                "rejections": refused.get(&x.name).copied().unwrap_or(0.0) as u64,
                "inflight": x.state.inflight(),
            })
        })
        .collect();
    top.sort_by(|a, b| {
        b["tokens"]
            .as_u64()
            .cmp(&a["tokens"].as_u64())
            .then_with(|| a["tenant"].as_str().cmp(&b["tenant"].as_str()))
    });
    top.truncate(TOP_TENANTS);
    Value::Array(top)
}

/// `tokengate_queue_wait_by_class_seconds` per class: `{count, mean_ms}`, every class listed.
fn queue_wait_by_class(shared: &Shared) -> Value {
    let mut by: BTreeMap<String, (u64, f64)> = ["interactive", "default", "batch"]
        .into_iter()
        .map(|c| (c.to_string(), (0, 0.0)))
        .collect();
    for mf in shared.metrics.tenants.queue_wait.collect() {
        for x in mf.get_metric() {
            if let Some(l) = x.get_label().iter().find(|l| l.name() == "class") {
                let e = by.entry(l.value().to_string()).or_default();
                e.0 += x.get_histogram().sample_count();
                e.1 += x.get_histogram().sample_sum();
            }
        }
    }
    by.into_iter()
        .map(|(c, (n, sum))| {
            (
                c,
                json!({"count": n, "mean_ms": (n > 0).then(|| sum * 1e3 / n as f64)}),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Per service, the cumulative [`PrefixCounters`].
fn prefix_counters(shared: &Shared) -> Vec<(String, PrefixCounters)> {
    let m = &shared.metrics;
    let rt = shared.runtime.load();
    rt.ordered
        .iter()
        .map(|s| {
            let svc = s.name.as_str();
            let p = |k| m.prefix_tokens.with_label_values(&[svc, k]).get();
            let e = |k| m.engine_tokens.with_label_values(&[svc, k]).get();
            (
                s.name.clone(),
                [
                    p("prompt"),
                    p("ceiling"),
                    p("predicted"),
                    e("prompt"),
                    e("cached"),
                    e("predicted"),
                ],
            )
        })
        .collect()
}

/// Sum of a token kind over every service.
fn tokens_total(shared: &Shared, kind: &str) -> u64 {
    let rt = shared.runtime.load();
    rt.ordered
        .iter()
        .map(|s| {
            shared
                .metrics
                .tokens
                .with_label_values(&[s.name.as_str(), kind])
                .get()
        })
        .sum()
}

/// The sampler: every [`SAMPLE_EVERY`], closes the interval of [`recent::Board`] into a
/// history point. A first point is taken at once, so the charts have a start.
pub async fn run(shared: Arc<Shared>, mut stop: pingora::server::ShutdownWatch) {
    let mut prev_tokens = (0, 0);
    loop {
        let mut iv = shared.status.take_interval();
        let [t50, t95] = iv.ttft_ms.quantiles([0.5, 0.95]);
        let [d50, d95] = iv.duration_ms.quantiles([0.5, 0.95]);
        let tokens = (
            tokens_total(&shared, "prompt"),
            tokens_total(&shared, "completion"),
        );
        let (mut inflight, mut waiting) = (0, 0);
        for s in &shared.runtime.load().ordered {
            for i in &s.instances {
                let l = i.load.snapshot();
                inflight += l.inflight_requests;
                waiting += l.waiting;
            }
        }
        shared.status.push_point(Point {
            t: now_ms(),
            requests: iv.requests,
            ok: iv.ok,
            client_errors: iv.client_errors,
            server_errors: iv.server_errors,
            ttft_p50_ms: t50,
            ttft_p95_ms: t95,
            duration_p50_ms: d50,
            duration_p95_ms: d95,
            prompt_tokens: tokens.0.saturating_sub(prev_tokens.0),
            completion_tokens: tokens.1.saturating_sub(prev_tokens.1),
            inflight,
            waiting,
            prefix: prefix_counters(&shared),
        });
        prev_tokens = tokens;
        if !sleep_or_stop(SAMPLE_EVERY, &mut stop).await {
            return;
        }
    }
}

/// The JSON behind the page (`GET /admin/status`); see the module docs.
/// The cluster's state and counters (`off` without `cluster:`).
fn cluster_view(shared: &Shared) -> Value {
    let mut v = shared.cluster_metrics.view();
    let s = shared
        .cluster
        .as_ref()
        .map_or(json!({"state": "off", "summary": "cluster: off"}), |c| {
            c.summary()
        });
    for k in ["state", "summary", "replica"] {
        if let Some(x) = s.get(k) {
            v[k] = x.clone();
        }
    }
    v
}

/// Routing reasons by count, the most frequent first.
fn reasons(m: &crate::metrics::Metrics) -> Vec<Value> {
    let mut reasons: Vec<(String, f64)> = rows(&m.decisions)
        .into_iter()
        .map(|(l, v)| (l.get("reason").cloned().unwrap_or_default(), v))
        .collect();
    reasons.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    reasons
        .into_iter()
        .map(|(r, v)| json!({"reason": r, "count": v}))
        .collect()
}

/// Decision-service calls by route and outcome, with the route's mean latency.
fn decision_calls(m: &crate::metrics::Metrics) -> Vec<Value> {
    // Mean latency of the decision service per route (the histogram's sum / count).
    let mut latency: BTreeMap<String, f64> = BTreeMap::new();
    for mf in m.decision_latency.collect() {
        for x in mf.get_metric() {
            let h = x.get_histogram();
            if let (Some(r), true) = (x.get_label().first(), h.sample_count() > 0) {
                latency.insert(
                    r.value().to_string(),
                    h.sample_sum() * 1e3 / h.sample_count() as f64,
                );
            }
        }
    }
    rows(&m.decision_total)
        .into_iter()
        .map(|(l, v)| {
            let route = l.get("route").cloned().unwrap_or_default();
            json!({"route": route, "outcome": l.get("outcome"), "count": v,
                "mean_latency_ms": latency.get(&route)})
        })
        .collect()
}

/// Requests answered to clients (local endpoints' successes left out), client errors and
/// server errors.
fn request_totals(m: &crate::metrics::Metrics) -> (f64, f64, f64) {
    let (mut requests, mut server_errors, mut client_errors) = (0.0, 0.0, 0.0);
    for (l, v) in rows(&m.requests) {
        let code: u16 = l.get("code").and_then(|c| c.parse().ok()).unwrap_or(0);
        if l.get("model").is_some_and(|x| x == "-") && code < 400 {
            continue; // local endpoints
        }
        requests += v;
        match code {
            400..=499 => client_errors += v,
            200..=399 => {}
            _ => server_errors += v,
        }
    }
    (requests, client_errors, server_errors)
}

/// The most recent requests.
fn recent_view(shared: &Shared) -> Vec<Value> {
    shared
        .status
        .recent()
        .into_iter()
        .map(|s| {
            json!({
                "at_ms": s.at_ms,
                "request_id": s.request_id,
                "model": s.model,
                "instance": s.instance,
                "status": s.status,
                "reason": s.reason,
                "stream": s.stream,
                "ttft_ms": s.ttft_ms,
                "duration_ms": s.duration_ms,
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": s.completion_tokens,
                "cached_tokens": s.cached_tokens,
            })
        })
        .collect()
}

/// Member gateways of other regions (global scheduling) with their answers by outcome.
fn global_view(rt: &crate::runtime::Runtime, m: &crate::metrics::Metrics, now: u64) -> Value {
    let global_rows = rows(&m.global_requests);
    let members: Vec<Value> = rt
        .members
        .iter()
        .map(|mb| {
            let e = &mb.endpoint;
            json!({
                "name": e.name,
                "url": format!("{}{}", e.origin(), e.base_path),
                "available": e.available(now),
                "outcomes": counts(
                    &sum_by(&global_rows, "member", &e.name, "outcome"),
                    &["ok", "refused", "error", "cancelled"],
                ),
            })
        })
        .collect();
    json!({
        "name": rt.hop_name.to_str().unwrap_or_default(),
        "members": members,
    })
}

/// Split proxy: every entry (never its key) with its attempts by outcome.
fn split_view(
    rt: &crate::runtime::Runtime,
    m: &crate::metrics::Metrics,
    now: u64,
) -> Option<Value> {
    let split_rows = rows(&m.split_requests);
    rt.split.as_ref().map(|sp| {
        let mut v = sp.view(now);
        if let Some(list) = v.get_mut("proxies").and_then(Value::as_array_mut) {
            for e in list {
                let name = e["name"].as_str().unwrap_or_default().to_string();
                e["outcomes"] = counts(
                    &sum_by(&split_rows, "entry", &name, "outcome"),
                    &["ok", "refused", "error", "cancelled"],
                );
            }
        }
        v
    })
}

/// Traffic mirroring: the settings (never the token), the queue, copies by outcome and the
/// answered copies' latency.
fn mirror_view(rt: &crate::runtime::Runtime, m: &crate::metrics::Metrics) -> Value {
    let mirror_rows = rows(&m.mirror_requests);
    let mut latency = serde_json::Map::new();
    for mf in m.mirror_latency.collect() {
        for x in mf.get_metric() {
            let phase = x
                .get_label()
                .iter()
                .find(|l| l.name() == "phase")
                .map(|l| l.value().to_string())
                .unwrap_or_default();
            let (n, sum) = (
                x.get_histogram().sample_count(),
                x.get_histogram().sample_sum(),
            );
            latency.insert(
                phase,
                json!({"count": n, "mean_ms": (n > 0).then(|| sum * 1e3 / n as f64)}),
            );
        }
    }
    json!({
        // null when no `mirror:` block is configured (the counters stay, after a reload)
        "settings": rt.mirror.as_ref().map(|s| s.view()),
        "queued": m.mirror_queue.get(),
        "inflight": m.mirror_inflight.get(),
        "outcomes": counts(
            &sum_all_by(&mirror_rows, "outcome"),
            &["sent", "ok", "http_error", "error", "timeout", "dropped", "expired"],
        ),
        "latency": latency,
    })
}

/// Config reloads: counts, the last one, the runtime's generation.
fn reload_view(shared: &Shared) -> Value {
    let m = &shared.metrics;
    json!({
        "ok": m.reloads.with_label_values(&["ok"]).get(),
        "errors": m.reloads.with_label_values(&["error"]).get(),
        "last_ok": m.reload_ok.get() == 1,
        "last": shared.status.last_reload(),
        "generation": *shared.generation.borrow(),
    })
}

/// Connections closed at the protocol level, by reason.
fn protocol_errors_view(m: &crate::metrics::Metrics) -> Value {
    let pe = |r: &str| m.protocol_errors.with_label_values(&[r]).get();
    json!({
        "head_timeout": pe("head_timeout"),
        "head_too_large": pe("head_too_large"),
        "too_many_headers": pe("too_many_headers"),
        "bad_request": pe("bad_request"),
    })
}

pub fn status_json(shared: &Shared) -> Value {
    let rt = shared.runtime.load();
    let m = &shared.metrics;
    let now = now_ms();
    let table = rt.instances_json();
    let mut instances = table["instances"].as_array().cloned().unwrap_or_default();
    // Prefill nodes: their prefill legs by outcome.
    let pd_rows = rows(&m.pd_prefill);
    const PD_OUTCOMES: [&str; 3] = ["ok", "error", "aborted"];
    for i in &mut instances {
        if i["role"] == "prefill" {
            let id = i["id"].as_str().unwrap_or_default().to_string();
            i["pd_prefill"] = counts(&sum_by(&pd_rows, "instance", &id, "outcome"), &PD_OUTCOMES);
        }
    }
    let rejections = rows(&m.throttle_rejections);
    let schedulers = table["schedulers"].as_array().cloned().unwrap_or_default();
    let indexes = table["prefix_indexes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let counters = prefix_counters(shared);
    let services: Vec<Value> = rt
        .ordered
        .iter()
        .map(|s| {
            let c = counters
                .iter()
                .find(|(n, _)| *n == s.name)
                .map_or([0; 6], |(_, c)| *c);
            let available = s
                .instances
                .iter()
                .filter(|i| i.health.available(now))
                .count();
            let tok = |k| m.tokens.with_label_values(&[s.name.as_str(), k]).get();
            let sched = schedulers.iter().find(|x| x["name"] == s.name.as_str());
            let index = indexes.iter().find(|x| x["service"] == s.name.as_str());
            let pd = s.pd.as_ref().map(|p| {
                let mut prefill = BTreeMap::new();
                for i in s.instances.iter().filter(|i| i.role == Role::Prefill) {
                    for (o, v) in sum_by(&pd_rows, "instance", &i.id, "outcome") {
                        *prefill.entry(o).or_insert(0.0) += v;
                    }
                }
                let role = |r| s.instances.iter().filter(|i| i.role == r).count();
                json!({
                    "mode": p.mode.as_str(),
                    "decode_policy": p.decode_policy.as_str(),
                    "prefill_instances": role(Role::Prefill),
                    "decode_instances": role(Role::Decode),
                    "prefill": counts(&prefill, &PD_OUTCOMES),
                })
            });
            json!({
                "name": s.name,
                "instances": s.instances.len(),
                "available": available,
                // null when the service is not throttled / not disaggregated
                "throttle": s.throttle.as_ref().map(|t| throttle_json(shared, s, t, &rejections)),
                "pd": pd,
                "mode": sched.map(|x| x["mode"].clone()),
                "pipeline": sched.map(|x| x["pipeline"].clone()),
                // null when the scheduler binds no sessions
                "sessions": s.sched.sessions.as_ref().map(|t| t.gauges().entries),
                "index": index,
                "hit_ratio": {
                    "ceiling": ratio(c[1], c[0]),
                    "predicted": ratio(c[2], c[0]),
                    "engine": ratio(c[4], c[3]),
                    // the index's prediction for the requests `engine` counts, in the
                    // engines' units: compare it with `engine`
                    "engine_predicted": ratio(c[5], c[3]),
                },
                "tokens": {"prompt": tok("prompt"), "completion": tok("completion"), "cached": tok("cached")},
            })
        })
        .collect();
    let routes: Vec<Value> = rt
        .ordered_routes
        .iter()
        .map(|r| {
            let targets: Vec<&str> = r.targets.iter().map(|t| t.name.as_str()).collect();
            let sessions = rt
                .schedulers()
                .into_iter()
                .find(|(n, _)| *n == r.name)
                .and_then(|(_, s)| s.sessions.as_ref().map(|t| t.gauges().entries));
            json!({"name": r.name, "mode": r.mode_name(), "targets": targets, "sessions": sessions})
        })
        .collect();
    let (requests, client_errors, server_errors) = request_totals(m);
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "now_ms": now,
        "uptime_ms": now.saturating_sub(shared.status.started_ms),
        "cluster": cluster_view(shared),
        "interval_ms": SAMPLE_EVERY.as_millis() as u64,
        "totals": {
            "requests": requests,
            "client_errors": client_errors,
            "server_errors": server_errors,
            "prompt_tokens": tokens_total(shared, "prompt"),
            "completion_tokens": tokens_total(shared, "completion"),
            "cached_tokens": tokens_total(shared, "cached"),
        },
        "instances": instances,
        "services": services,
        "routes": routes,
        "reasons": reasons(m),
        "decision_calls": decision_calls(m),
        "global": global_view(&rt, m, now),
        "split": split_view(&rt, m, now),
        "mirror": mirror_view(&rt, m),
        // The tenants that used the most tokens (empty without `tenants:` / `api_keys`).
        "top_tenants": top_tenants(shared, &rt),
        // OpenTelemetry traces: the collector's URL (null: tracing off), the OTLP transport
        // (http, grpc) and spans by outcome.
        "tracing": {
            "endpoint": shared.otel.load().as_ref().map(|o| o.url.clone()),
            "protocol": shared.otel.load().as_ref().map(|o| o.protocol),
            "spans": shared.trace_spans.view(),
        },
        "reload": reload_view(shared),
        "protocol_errors": protocol_errors_view(m),
        "recent": recent_view(shared),
        "history": shared.status.history(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_sessions_expire_and_belong_to_their_token() {
        let now = 1_000_000;
        let c = set_cookie(b"tok", now);
        let v = c.split(';').next().unwrap().split_once('=').unwrap().1;
        assert!(session_ok(v.as_bytes(), b"tok", now));
        assert!(session_ok(v.as_bytes(), b"tok", now + SESSION_SECS - 1));
        assert!(
            !session_ok(v.as_bytes(), b"tok", now + SESSION_SECS),
            "expired"
        );
        assert!(!session_ok(v.as_bytes(), b"other", now), "another token");
        assert!(!session_ok(b"tok", b"tok", now), "the raw token");
        assert!(!session_ok(b"", b"tok", now));
    }

    #[test]
    fn query_and_cookie_tokens_are_decoded() {
        assert_eq!(
            query_param(Some("a=1&token=s%20e+c%3Br"), "token").as_deref(),
            Some(&b"s e c;r"[..])
        );
        assert_eq!(query_param(Some("tokenx=1"), "token"), None);
        assert_eq!(query_param(None, "token"), None);
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::COOKIE,
            http::HeaderValue::from_static("x=1; tokengate_admin=p%40ss%3Bw%20rd"),
        );
        assert_eq!(cookie_token(&h).as_deref(), Some(&b"p@ss;w rd"[..]));
        assert_eq!(percent_decode("%zz%4"), b"%zz%4");
    }
}
