//! Traffic mirroring (`mirror:` in the config): a sampled copy of planned requests goes to
//! another OpenAI-compatible endpoint (a new model, another engine build, a staging gateway),
//! and its answers are measured — status, time to first token, duration, tokens — then thrown
//! away. The client never waits for, or hears of, the mirror:
//!
//! * [`Mirror::offer`] runs on the request path once the request is planned (both the plain
//!   and the big-body path, [`crate::proxy`]): a loop guard (a mirrored request carrying
//!   [`MIRROR_HEADER`] is never mirrored again), the sampler (one atomic add), and for a
//!   sampled request a non-blocking `try_send` of the job — the body is a shared `Bytes`,
//!   only a few allowlisted headers are copied. A full queue drops the copy (counted).
//! * [`Mirror::run`] (a background task) takes jobs from the bounded queue
//!   ([`QUEUE_CAPACITY`]) when one of [`MAX_CONCURRENT`] send slots is free, and sends each in
//!   its own task with `reqwest` (rustls), bounded by `timeout_ms` from its send to its last
//!   response byte. A job that waited in the queue longer than `timeout_ms` expires unsent.
//!   The model rewrite (`target_model`) is done there, off the request path.
//! * Mirrored requests never touch the load table, the prefix index, the session tables or
//!   passive health: they do not go through the scheduling pipelines at all.
//!
//! **Sampling** is deterministic: the n-th planned request is mirrored when
//! `⌊(n+1)·r⌋ > ⌊n·r⌋` with `r` the ratio in basis points over 10,000, so every 10,000
//! consecutive requests carry exactly `ratio` percent of copies (and any 100 consecutive
//! ones within one of it), without a random draw.
//!
//! **Logging** (`log: true`): one line per sampled request on the `mirror` log target, written
//! when both the mirror's exchange and the primary request have ended (whichever is last), so
//! the two sets of figures sit side by side; the primary's access line has the same `id=`.
//! The mirror's `Authorization` is never logged.

use crate::api;
use crate::config::MirrorSettings;
use crate::metrics::Metrics;
use crate::usage::{JsonCollector, SseScanner, Usage};
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, HeaderName, HeaderValue};
use log::info;
use parking_lot::Mutex;
use prometheus::{Histogram, IntCounter, IntGauge};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Semaphore};

/// Copies waiting for a send slot; beyond this they are dropped.
pub const QUEUE_CAPACITY: usize = 1024;
/// Mirror requests sent at the same time.
pub const MAX_CONCURRENT: usize = 64;
/// Marks a mirrored request (value: `1`). A request that carries it is never mirrored again,
/// so a gateway that mirrors to itself, or two that mirror to each other, do not loop.
pub const MIRROR_HEADER: &str = "x-tokengate-mirror";
/// The client headers copied to the mirror (everything else stays: the client's credentials,
/// cookies and any header a third party should not see).
const COPIED_HEADERS: &[&str] = &[
    "content-type",
    "accept",
    "anthropic-version",
    "anthropic-beta",
    "openai-beta",
    "x-session-id",
    "x-claude-code-session-id",
];
/// Sampling resolution: the ratio is kept in basis points.
const SCALE: u64 = 10_000;

/// The mirror settings of one config (rebuilt on reload; a queued job keeps the settings it
/// was sampled with).
pub struct Settings {
    /// The base URL without a trailing `/` (the client's path is appended).
    pub target: String,
    /// Replaces the body's `model`, when set.
    pub target_model: Option<String>,
    /// Percent, as configured.
    pub ratio: f64,
    /// Copies per [`SCALE`] requests.
    per_scale: u64,
    /// `Bearer <auth_token>` (marked sensitive).
    auth: Option<HeaderValue>,
    pub timeout: Duration,
    pub log: bool,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("target", &self.target)
            .field("target_model", &self.target_model)
            .field("ratio", &self.ratio)
            .field("auth", &self.auth.as_ref().map(|_| "<redacted>"))
            .field("timeout", &self.timeout)
            .field("log", &self.log)
            .finish()
    }
}

/// The mirror's settings as `/admin/instances` and `/admin/status` show them (never the
/// token); `/admin/instances` adds the copies queued.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct MirrorSettingsView {
    pub target: String,
    pub target_model: Option<String>,
    /// Percent of planned requests copied.
    pub ratio: f64,
    /// Whether an `auth_token` is configured.
    pub authorization: bool,
    pub timeout_ms: u64,
    pub log: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued: Option<usize>,
}

impl Settings {
    /// The settings of a validated `mirror:` block (an error names its key).
    pub fn new(c: &MirrorSettings) -> Result<Settings, String> {
        c.target.parts().map_err(|e| format!("target: {e}"))?;
        let auth = match &c.auth_token {
            Some(t) => {
                let mut v = HeaderValue::from_str(&format!("Bearer {t}"))
                    .map_err(|_| "auth_token: not a valid header value".to_string())?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        let ratio = c.ratio.clamp(0.0, 100.0);
        Ok(Settings {
            target: c.target.as_str().trim_end_matches('/').to_string(),
            target_model: (!c.target_model.trim().is_empty()).then(|| c.target_model.clone()),
            ratio,
            per_scale: (ratio * SCALE as f64 / 100.0).round() as u64,
            auth,
            timeout: Duration::from_millis(c.timeout_ms.max(1)),
            log: c.log,
        })
    }

    /// What `/admin/instances` shows (never the token).
    pub fn view(&self) -> MirrorSettingsView {
        MirrorSettingsView {
            target: self.target.clone(),
            target_model: self.target_model.clone(),
            ratio: self.ratio,
            authorization: self.auth.is_some(),
            timeout_ms: self.timeout.as_millis() as u64,
            log: self.log,
            queued: None,
        }
    }

    /// One line for the reload log (never the token).
    pub fn describe(&self) -> String {
        format!(
            "{}% to {}{} (timeout {:?}{})",
            self.ratio,
            self.target,
            self.target_model
                .as_deref()
                .map_or(String::new(), |m| format!(" as model {m:?}")),
            self.timeout,
            if self.log { ", logged" } else { "" }
        )
    }
}

/// Whether the `n`-th request is sampled at `per_scale` copies per [`SCALE`].
fn sampled(n: u64, per_scale: u64) -> bool {
    (n % SCALE) * per_scale % SCALE + per_scale >= SCALE
}

/// How a sampled copy ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    HttpError,
    Error,
    Timeout,
    Dropped,
    Expired,
    /// The process stopped before the copy ended (only seen in the log line).
    Aborted,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::HttpError => "http_error",
            Outcome::Error => "error",
            Outcome::Timeout => "timeout",
            Outcome::Dropped => "dropped",
            Outcome::Expired => "expired",
            Outcome::Aborted => "aborted",
        }
    }
}

/// The counters, resolved once.
struct Counters {
    sent: IntCounter,
    ok: IntCounter,
    http_error: IntCounter,
    error: IntCounter,
    timeout: IntCounter,
    dropped: IntCounter,
    expired: IntCounter,
    ttft: Histogram,
    total: Histogram,
    queue: IntGauge,
    inflight: IntGauge,
}

impl Counters {
    fn new(m: &Metrics) -> Counters {
        let c = |o: &str| m.mirror_requests.with_label_values(&[o]);
        let h = |p: &str| m.mirror_latency.with_label_values(&[p]);
        Counters {
            sent: c("sent"),
            ok: c("ok"),
            http_error: c("http_error"),
            error: c("error"),
            timeout: c("timeout"),
            dropped: c("dropped"),
            expired: c("expired"),
            ttft: h("ttft"),
            total: h("total"),
            queue: m.mirror_queue.clone(),
            inflight: m.mirror_inflight.clone(),
        }
    }

    fn count(&self, o: Outcome) {
        match o {
            Outcome::Ok => self.ok.inc(),
            Outcome::HttpError => self.http_error.inc(),
            Outcome::Error => self.error.inc(),
            Outcome::Timeout => self.timeout.inc(),
            Outcome::Dropped => self.dropped.inc(),
            Outcome::Expired => self.expired.inc(),
            Outcome::Aborted => {}
        }
    }
}

/// One sampled copy, waiting for or being sent.
struct Job {
    settings: Arc<Settings>,
    /// The client's path and query.
    path: String,
    headers: HeaderMap,
    /// The body as the gateway forwards it (before the `target_model` rewrite).
    body: Bytes,
    queued: Instant,
    /// The log line's mirror half (`log: true`).
    half: Option<Half>,
}

/// The traffic mirror: the sampler, the queue and the HTTP client (one per process, kept
/// across reloads).
pub struct Mirror {
    tx: mpsc::Sender<Job>,
    rx: Mutex<Option<mpsc::Receiver<Job>>>,
    seq: AtomicU64,
    http: reqwest::Client,
    c: Counters,
}

impl Mirror {
    pub fn new(metrics: &Metrics) -> Mirror {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let http = reqwest::Client::builder()
            .tcp_nodelay(true)
            .redirect(reqwest::redirect::Policy::none())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(MAX_CONCURRENT)
            .build()
            .unwrap_or_default();
        Mirror {
            tx,
            rx: Mutex::new(Some(rx)),
            seq: AtomicU64::new(0),
            http,
            c: Counters::new(metrics),
        }
    }

    /// Copies waiting in the queue.
    pub fn queued(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    /// A planned request: when it is sampled, queues its copy (never waits; a full queue drops
    /// it). Returns the primary's half of the log line when `settings.log` is on.
    pub fn offer(
        &self,
        settings: &Arc<Settings>,
        req: &http::request::Parts,
        body: &Bytes,
        request_id: &str,
        model: &str,
    ) -> Option<Ticket> {
        if settings.per_scale == 0 || req.headers.contains_key(MIRROR_HEADER) {
            return None;
        }
        if !sampled(self.seq.fetch_add(1, Ordering::Relaxed), settings.per_scale) {
            return None;
        }
        let mut headers = HeaderMap::with_capacity(COPIED_HEADERS.len() + 2);
        for name in COPIED_HEADERS {
            if let Some(v) = req.headers.get(*name) {
                headers.insert(HeaderName::from_static(name), v.clone());
            }
        }
        if !headers.contains_key(http::header::CONTENT_TYPE) {
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        if let Ok(id) = HeaderValue::from_str(request_id) {
            headers.insert(HeaderName::from_static("x-request-id"), id);
        }
        headers.insert(
            HeaderName::from_static(MIRROR_HEADER),
            HeaderValue::from_static("1"),
        );
        let path = req
            .uri
            .path_and_query()
            .map_or_else(|| req.uri.path().to_string(), |p| p.as_str().to_string());
        let (ticket, half) = if settings.log {
            let pair = Arc::new(Pair {
                id: request_id.to_string(),
                path: req.uri.path().to_string(),
                model: model.to_string(),
                mirror_model: settings
                    .target_model
                    .clone()
                    .unwrap_or_else(|| model.to_string()),
                state: Mutex::new((None, None)),
            });
            (Some(Ticket(Some(pair.clone()))), Some(Half(Some(pair))))
        } else {
            (None, None)
        };
        let job = Job {
            settings: settings.clone(),
            path,
            headers,
            body: body.clone(),
            queued: Instant::now(),
            half,
        };
        // Counted in the queue before the sender can take it out (the gauge never dips).
        self.c.queue.inc();
        match self.tx.try_send(job) {
            Ok(()) => {}
            Err(e) => {
                let job = match e {
                    mpsc::error::TrySendError::Full(j) | mpsc::error::TrySendError::Closed(j) => j,
                };
                self.c.count(Outcome::Dropped);
                self.c.queue.dec();
                if let Some(h) = job.half {
                    h.finish(Report::unsent(Outcome::Dropped, job.queued));
                }
            }
        }
        ticket
    }

    /// Sends the queued copies, at most [`MAX_CONCURRENT`] at a time, until the process
    /// stops. Runs once (later calls return at once).
    pub async fn run(self: Arc<Self>) {
        let Some(mut rx) = self.rx.lock().take() else {
            return;
        };
        let slots = Arc::new(Semaphore::new(MAX_CONCURRENT));
        loop {
            // A slot first: jobs wait in the (bounded) queue, not here.
            let Ok(slot) = slots.clone().acquire_owned().await else {
                return;
            };
            let Some(job) = rx.recv().await else { return };
            // Each copy is counted in the queue, in flight or by its outcome at every moment
            // (the next place first, then the one it leaves), so queue 0 and in flight 0
            // mean every copy has ended.
            if job.queued.elapsed() > job.settings.timeout {
                self.c.count(Outcome::Expired);
                self.c.queue.dec();
                if let Some(h) = job.half {
                    h.finish(Report::unsent(Outcome::Expired, job.queued));
                }
                continue;
            }
            self.c.inflight.inc();
            self.c.queue.dec();
            let me = self.clone();
            tokio::spawn(async move {
                let _slot = slot;
                me.send(job).await;
            });
        }
    }

    /// Sends one copy (counted in flight by [`Mirror::run`]) and records how it went.
    async fn send(&self, mut job: Job) {
        self.c.sent.inc();
        let s = job.settings.clone();
        let body = match &s.target_model {
            Some(m) => api::rewrite_model(&job.body, m).map_or(job.body.clone(), Bytes::from),
            None => job.body.clone(),
        };
        let mut url = String::with_capacity(s.target.len() + job.path.len());
        url.push_str(&s.target);
        url.push_str(&job.path);
        let mut req = self
            .http
            .post(url)
            .headers(std::mem::take(&mut job.headers))
            .body(body);
        if let Some(a) = &s.auth {
            req = req.header(http::header::AUTHORIZATION, a.clone());
        }
        let started = Instant::now();
        let mut p = Progress::default();
        let result = tokio::time::timeout(s.timeout, exchange(req, started, &mut p)).await;
        let outcome = match result {
            Err(_) => Outcome::Timeout,
            Ok(Err(e)) => {
                p.error = Some(e);
                Outcome::Error
            }
            Ok(Ok(())) if p.status.is_some_and(|c| (200..300).contains(&c)) => Outcome::Ok,
            Ok(Ok(())) => Outcome::HttpError,
        };
        let duration = started.elapsed();
        self.c.count(outcome);
        if matches!(outcome, Outcome::Ok | Outcome::HttpError) {
            self.c.total.observe(duration.as_secs_f64());
            if let Some(t) = p.ttft {
                self.c.ttft.observe(t.as_secs_f64());
            }
        }
        self.c.inflight.dec();
        if let Some(h) = job.half.take() {
            h.finish(Report {
                outcome,
                status: p.status,
                ttft: p.ttft,
                duration: Some(duration),
                queued: started.saturating_duration_since(job.queued),
                usage: p.usage,
                error: p.error,
            });
        }
    }
}

/// What a mirror exchange showed so far (kept when the timeout cuts it short).
#[derive(Default)]
struct Progress {
    status: Option<u16>,
    ttft: Option<Duration>,
    usage: Usage,
    error: Option<String>,
}

/// Sends the request and reads the answer to its end: the status, the first token (the
/// first SSE event carrying output, or the whole of a non-stream body) and the usage.
async fn exchange(
    req: reqwest::RequestBuilder,
    started: Instant,
    p: &mut Progress,
) -> Result<(), String> {
    let resp = req.send().await.map_err(short_error)?;
    p.status = Some(resp.status().as_u16());
    let sse = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut scanner = sse.then(|| SseScanner::new(false));
    let mut json = JsonCollector::default();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(short_error)?;
        match scanner.as_mut() {
            Some(s) => {
                s.feed(&chunk);
                if s.first_token && p.ttft.is_none() {
                    p.ttft = Some(started.elapsed());
                }
            }
            None => json.feed(&chunk),
        }
    }
    match scanner.as_mut() {
        Some(s) => {
            s.finish();
            p.usage = s.usage;
        }
        None => {
            p.usage = json.finish().unwrap_or_default();
            p.ttft = Some(started.elapsed());
        }
    }
    Ok(())
}

/// A transport error without the URL: its innermost cause ("connection refused").
fn short_error(e: reqwest::Error) -> String {
    let mut src: &dyn std::error::Error = &e;
    while let Some(s) = src.source() {
        src = s;
    }
    if e.is_connect() {
        format!("connect: {src}")
    } else {
        src.to_string()
    }
}

/// The primary request's figures for the log line.
pub type Primary = crate::hook::Ended;

/// The mirror's figures for the log line.
struct Report {
    outcome: Outcome,
    status: Option<u16>,
    /// Send to the first token.
    ttft: Option<Duration>,
    /// Send to the last byte (or the timeout).
    duration: Option<Duration>,
    /// Time in the queue.
    queued: Duration,
    usage: Usage,
    error: Option<String>,
}

impl Report {
    fn unsent(outcome: Outcome, queued: Instant) -> Report {
        Report {
            outcome,
            status: None,
            ttft: None,
            duration: None,
            queued: queued.elapsed(),
            usage: Usage::default(),
            error: None,
        }
    }
}

/// The two halves of one log line; whoever ends last writes it.
struct Pair {
    id: String,
    path: String,
    model: String,
    mirror_model: String,
    state: Mutex<(Option<Primary>, Option<Report>)>,
}

impl Pair {
    fn put(&self, primary: Option<Primary>, report: Option<Report>) {
        let both = {
            let mut st = self.state.lock();
            if primary.is_some() {
                st.0 = primary;
            }
            if report.is_some() {
                st.1 = report;
            }
            match (st.0.is_some(), st.1.is_some()) {
                (true, true) => Some((st.0.take(), st.1.take())),
                _ => None,
            }
        };
        if let Some((Some(p), Some(r))) = both {
            self.log(&p, &r);
        }
    }

    fn log(&self, p: &Primary, r: &Report) {
        let ms = |d: Option<Duration>| {
            d.map_or_else(
                || "-".to_string(),
                |d| format!("{:.1}", d.as_secs_f64() * 1e3),
            )
        };
        let n = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
        let err = r
            .error
            .as_deref()
            .map_or_else(String::new, |e| format!(" error={e:?}"));
        info!(
            target: "mirror",
            "id={} path={} model={} mirror_model={} outcome={} status={} ttft_ms={} dur_ms={} queue_ms={:.1} prompt_tokens={} completion_tokens={} cached_tokens={} primary_instance={} primary_status={} primary_ttft_ms={} primary_dur_ms={} primary_prompt_tokens={} primary_completion_tokens={} primary_cached_tokens={}{}",
            self.id,
            self.path,
            self.model,
            self.mirror_model,
            r.outcome.label(),
            r.status.map_or_else(|| "-".to_string(), |s| s.to_string()),
            ms(r.ttft),
            ms(r.duration),
            r.queued.as_secs_f64() * 1e3,
            n(r.usage.prompt),
            n(r.usage.completion),
            n(r.usage.cached),
            if p.instance.is_empty() { "-" } else { &p.instance },
            p.status,
            ms(p.ttft),
            ms(Some(p.duration)),
            n(p.usage.prompt),
            n(p.usage.completion),
            n(p.usage.cached),
            err,
        );
    }
}

/// The primary request's half of a mirrored request's log line (`log: true`), carried by the
/// request to its end ([`Ticket::complete`]); dropped unused, it reports the primary as
/// unknown (status 0).
pub struct Ticket(Option<Arc<Pair>>);

impl Ticket {
    pub fn complete(mut self, p: Primary) {
        if let Some(pair) = self.0.take() {
            pair.put(Some(p), None);
        }
    }
}

/// The mirror follows the primary request through its [`Ticket`].
impl crate::hook::Follower for Ticket {
    fn on_complete(self: Box<Self>, ended: &Primary) {
        self.complete(ended.clone());
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(pair) = self.0.take() {
            pair.put(Some(Primary::default()), None);
        }
    }
}

/// The mirror's half, carried by the job.
struct Half(Option<Arc<Pair>>);

impl Half {
    fn finish(mut self, r: Report) {
        if let Some(pair) = self.0.take() {
            pair.put(None, Some(r));
        }
    }
}

impl Drop for Half {
    fn drop(&mut self) {
        if let Some(pair) = self.0.take() {
            pair.put(None, Some(Report::unsent(Outcome::Aborted, Instant::now())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(per_scale: u64, from: u64, n: u64) -> u64 {
        (from..from + n).filter(|&i| sampled(i, per_scale)).count() as u64
    }

    #[test]
    fn sampling_is_exact_per_ten_thousand_and_even() {
        for (ratio, want) in [
            (0.0, 0),
            (0.01, 1),
            (10.0, 1000),
            (33.33, 3333),
            (100.0, 10000),
        ] {
            let s = Settings::new(&MirrorSettings {
                target: "http://127.0.0.1:1".into(),
                target_model: String::new(),
                ratio,
                auth_token: None,
                timeout_ms: 1,
                log: false,
            })
            .unwrap();
            assert_eq!(count(s.per_scale, 0, 10_000), want, "ratio {ratio}");
            assert_eq!(count(s.per_scale, 12_345, 10_000), want, "ratio {ratio}");
        }
        // Any 100 consecutive requests carry the ratio within one.
        for start in [0, 7, 99, 5_000] {
            let c = count(2_500, start, 100);
            assert!((24..=26).contains(&c), "{c} from {start}");
        }
    }

    #[test]
    fn settings_never_show_the_token() {
        let s = Settings::new(&MirrorSettings {
            target: "https://shadow.example.com/".into(),
            target_model: " ".into(),
            ratio: 5.0,
            auth_token: Some("sk-very-secret".into()),
            timeout_ms: 250,
            log: true,
        })
        .unwrap();
        assert_eq!(s.target, "https://shadow.example.com");
        assert_eq!(s.target_model, None);
        for text in [
            format!("{s:?}"),
            serde_json::to_string(&s.view()).unwrap(),
            s.describe(),
        ] {
            assert!(!text.contains("sk-very-secret"), "{text}");
        }
        assert!(s.view().authorization);
    }
}
