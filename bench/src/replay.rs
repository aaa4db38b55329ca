//! The load generator: schedules the workload's requests, sends them, collects the records.
//!
//! Open loop for traces: request *i* is sent at `t0 + timestamp_i / time_scale` whether or
//! not earlier requests finished. The only brake is the concurrency cap: when all
//! `concurrency` slots are busy the dispatcher waits for one (the request is counted in
//! `waited_for_concurrency`, and its lateness shows in `dispatch_lag_ms`); later requests
//! then go out late too (bounded memory, no unbounded backlog). The synthetic workload is
//! open loop across sessions (Poisson arrivals) and closed loop within one (a turn needs the
//! previous answer). `limit` bounds the number of requests, `duration` the time during which
//! requests are sent; after that, running requests get `drain_timeout` to finish and are
//! then cancelled. The agentic workload is planned up front for the `duration` horizon
//! ([`AgenticConfig::plan`]) and runs like the synthetic one. For session workloads the
//! prefix-hit ceiling is counted as the requests are sent ([`crate::ideal`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

use super::agentic::{AgenticConfig, PlanSummary};
use super::client::{self, Outgoing, Sent};
use super::ideal::{render_chat, IdealCache};
use super::report::{Counts, MachineInfo, Report, RequestRecord, RunMeta};
use super::synth::{History, SynthConfig};
use super::text::BlockText;
use super::trace::{self, Scaling, TraceRecord};

/// How a request picks one of several target URLs (only matters with more than one).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum UrlPolicy {
    /// Request i goes to URL i mod n.
    #[default]
    RoundRobin,
    /// Hash of the session id mod n (a sticky client-side baseline); round-robin without one.
    Session,
}

/// A trace to replay.
#[derive(Clone, Debug)]
pub struct TraceWorkload {
    /// All records of the trace (the session heuristic looks at all of them).
    pub records: Arc<Vec<TraceRecord>>,
    /// Where they came from (for the report).
    pub source: String,
    pub scaling: Scaling,
    /// Records to skip at the start; the first replayed record is sent at time 0.
    pub skip: usize,
}

#[derive(Clone, Debug)]
pub enum Workload {
    Trace(TraceWorkload),
    Synthetic(SynthConfig),
    /// Multi-tenant agentic sessions; needs [`ReplayConfig::duration`] (the arrival horizon).
    Agentic(AgenticConfig),
}

/// Everything [`replay`] needs.
#[derive(Clone, Debug)]
pub struct ReplayConfig {
    /// Base URLs (`http://127.0.0.1:8080`); `/v1/chat/completions` is appended.
    pub urls: Vec<String>,
    pub url_policy: UrlPolicy,
    pub model: String,
    pub api_key: Option<String>,
    pub workload: Workload,
    /// Session header name; `None` sends none.
    pub session_header: Option<String>,
    /// Maximum requests in flight.
    pub concurrency: usize,
    /// Maximum requests sent.
    pub limit: Option<usize>,
    /// Stop sending after this long.
    pub duration: Option<Duration>,
    /// Per request, send to end of stream.
    pub request_timeout: Duration,
    /// After sending stops: how long running requests may still take.
    pub drain_timeout: Duration,
    /// Time bucket of the in-flight series.
    pub bucket: Duration,
    pub seed: u64,
    /// Tokens per KV block of the engines, for the session workloads' prefix-hit ceiling.
    pub engine_block_size: usize,
    /// Recorded in the report.
    pub command_line: String,
    /// Print a progress line to stderr every few seconds.
    pub progress: bool,
}

impl ReplayConfig {
    /// Defaults for everything but the targets and the workload.
    pub fn new(urls: Vec<String>, model: impl Into<String>, workload: Workload) -> Self {
        ReplayConfig {
            urls,
            url_policy: UrlPolicy::RoundRobin,
            model: model.into(),
            api_key: None,
            workload,
            session_header: None,
            concurrency: 256,
            limit: None,
            duration: None,
            request_timeout: Duration::from_secs(300),
            drain_timeout: Duration::from_secs(60),
            bucket: Duration::from_millis(100),
            seed: 0,
            engine_block_size: 16,
            command_line: String::new(),
            progress: false,
        }
    }
}

/// Shared by the dispatcher and the request tasks.
struct Ctx {
    client: reqwest::Client,
    endpoints: Vec<String>,
    url_policy: UrlPolicy,
    model: String,
    api_key: Option<String>,
    session_header: Option<String>,
    timeout: Duration,
    slots: Arc<Semaphore>,
    t0: Instant,
    deadline: Option<Instant>,
    waited: AtomicUsize,
    sent: AtomicUsize,
    done: AtomicUsize,
    tx: mpsc::UnboundedSender<Sent>,
    /// Session workloads: the one-infinite-cache ceiling of the requests sent so far.
    ideal: Mutex<IdealCache>,
}

/// One request to send, as the workload describes it.
struct Req {
    index: usize,
    turn: Option<usize>,
    tenant: Option<usize>,
    session: Option<String>,
    /// Send the session key as the session header (when the run sends one).
    header: bool,
    scheduled: Duration,
    waited: bool,
    body: String,
    input_tokens: usize,
    max_tokens: usize,
    /// Keep the streamed text (sessions append it to the history).
    keep_text: bool,
}

impl Ctx {
    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// A concurrency slot; the flag says whether the request had to wait for it.
    async fn slot(&self) -> (OwnedSemaphorePermit, bool) {
        match self.slots.clone().try_acquire_owned() {
            Ok(p) => (p, false),
            Err(_) => {
                self.waited.fetch_add(1, Ordering::Relaxed);
                let p = self
                    .slots
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("never closed");
                (p, true)
            }
        }
    }

    fn endpoint(&self, index: usize, session: Option<&str>) -> &str {
        let n = self.endpoints.len();
        let i = match (self.url_policy, session) {
            (UrlPolicy::Session, Some(s)) => {
                (xxhash_rust::xxh3::xxh3_64(s.as_bytes()) % n as u64) as usize
            }
            _ => index % n,
        };
        &self.endpoints[i]
    }

    fn body(&self, messages: serde_json::Value, max_tokens: usize) -> String {
        serde_json::json!({
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string()
    }

    async fn send(&self, r: Req) -> Sent {
        let endpoint = self.endpoint(r.index, r.session.as_deref()).to_string();
        let record = RequestRecord {
            index: r.index,
            turn: r.turn,
            tenant: r.tenant,
            session: r.session.clone(),
            url: endpoint.clone(),
            scheduled_ms: r.scheduled.as_secs_f64() * 1000.0,
            waited_for_slot: r.waited,
            intended_input_tokens: r.input_tokens,
            intended_output_tokens: r.max_tokens,
            ..Default::default()
        };
        let out = Outgoing {
            endpoint,
            body: r.body,
            max_tokens: r.max_tokens,
            session: if r.header {
                self.session_header.clone().zip(r.session)
            } else {
                None
            },
            api_key: self.api_key.clone(),
            timeout: self.timeout,
            keep_text: r.keep_text,
        };
        self.sent.fetch_add(1, Ordering::Relaxed);
        let sent = client::send(&self.client, out, record, self.t0).await;
        self.done.fetch_add(1, Ordering::Relaxed);
        sent
    }
}

/// Replays the workload against the targets and returns the report (`report.requests` holds
/// every request's record).
pub async fn replay(cfg: ReplayConfig) -> anyhow::Result<Report> {
    if cfg.urls.is_empty() {
        bail!("no target URL");
    }
    if cfg.concurrency == 0 {
        bail!("concurrency must be at least 1");
    }
    if let Workload::Agentic(ac) = &cfg.workload {
        ac.validate()
            .map_err(|e| anyhow::anyhow!("agentic workload: {e}"))?;
        if cfg.duration.is_none() {
            bail!("the agentic workload needs a duration (its sessions arrive until then)");
        }
    }
    let endpoints: Vec<String> = cfg
        .urls
        .iter()
        .map(|u| format!("{}/v1/chat/completions", u.trim_end_matches('/')))
        .collect();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(cfg.concurrency.min(4096))
        .tcp_nodelay(true)
        .build()
        .context("building the HTTP client")?;
    let started_at = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let t0 = Instant::now();
    let ctx = Arc::new(Ctx {
        client,
        endpoints,
        url_policy: cfg.url_policy,
        model: cfg.model.clone(),
        api_key: cfg.api_key.clone(),
        session_header: cfg.session_header.clone(),
        timeout: cfg.request_timeout,
        slots: Arc::new(Semaphore::new(cfg.concurrency)),
        t0,
        deadline: cfg.duration.map(|d| t0 + d),
        waited: AtomicUsize::new(0),
        sent: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        tx,
        ideal: Mutex::new(IdealCache::new(cfg.engine_block_size)),
    });

    let stop_progress = Arc::new(AtomicBool::new(false));
    if cfg.progress {
        spawn_progress(ctx.clone(), stop_progress.clone());
    }

    let mut tasks = JoinSet::new();
    let (workload_name, params, scheduled, trace_ideal) = match &cfg.workload {
        Workload::Trace(tw) => {
            let (scheduled, ideal) = dispatch_trace(&ctx, &cfg, tw, &mut tasks).await;
            let params = serde_json::json!({
                "trace": tw.source, "skip": tw.skip, "scaling": tw.scaling,
                "session_heuristic": "first hash id after the prefix shared by all records",
            });
            ("trace", params, Scheduled::Known(scheduled), Some(ideal))
        }
        Workload::Synthetic(sc) => {
            let claimed = dispatch_synthetic(&ctx, &cfg, sc, &mut tasks);
            let params = serde_json::to_value(sc).unwrap_or_default();
            ("synthetic", params, Scheduled::Counter(claimed), None)
        }
        Workload::Agentic(ac) => {
            let (claimed, plan) = dispatch_agentic(&ctx, &cfg, ac, &mut tasks);
            let mut params = serde_json::to_value(ac).unwrap_or_default();
            params["plan"] = serde_json::to_value(plan).unwrap_or_default();
            params["engine_block_size"] = cfg.engine_block_size.into();
            ("agentic", params, Scheduled::Counter(claimed), None)
        }
    };

    // Drain: once sending stops, running requests get drain_timeout to finish. A trace stops
    // sending when the dispatcher returns; sessions (synthetic, agentic) go on sending until
    // the deadline, or, without one, until they end (every request has its own timeout).
    let drain_until = match (&cfg.workload, ctx.deadline) {
        (Workload::Trace(_), _) => Some(Instant::now() + cfg.drain_timeout),
        (_, Some(d)) => Some(d.max(Instant::now()) + cfg.drain_timeout),
        (_, None) => None,
    };
    drain(&mut tasks, drain_until).await;
    stop_progress.store(true, Ordering::Relaxed);
    let (sent, waited) = (
        ctx.sent.load(Ordering::Relaxed),
        ctx.waited.load(Ordering::Relaxed),
    );
    let ideal = trace_ideal.or_else(|| {
        let c = ctx.ideal.lock().expect("ideal cache lock");
        (!c.is_empty()).then(|| c.ratios())
    });
    drop(ctx);
    let mut records = Vec::new();
    let mut itl = Vec::new();
    while let Ok(s) = rx.try_recv() {
        if s.record.ok() {
            itl.extend_from_slice(&s.itl_ms);
        }
        records.push(s.record);
    }
    let scheduled = match scheduled {
        Scheduled::Known(n) => n,
        Scheduled::Counter(c) => c
            .load(Ordering::Relaxed)
            .min(cfg.limit.unwrap_or(usize::MAX)),
    };
    let counts = Counts {
        scheduled,
        cancelled: sent.saturating_sub(records.len()),
        waited_for_concurrency: waited,
        ..Default::default()
    };
    let meta = run_meta(&cfg, started_at, workload_name, params);
    let bucket_ms = cfg.bucket.as_secs_f64() * 1000.0;
    let mut report = Report::build(meta, counts, records, itl, bucket_ms);
    if let Some((b, t)) = ideal {
        report.tokens.ideal_block_hit_ratio = Some(b);
        report.tokens.ideal_token_hit_ratio = Some(t);
    }
    Ok(report)
}

/// A progress line on stderr every 5 s until `stop`.
fn spawn_progress(ctx: Arc<Ctx>, stop: Arc<AtomicBool>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        tick.tick().await;
        loop {
            tick.tick().await;
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let (s, d) = (
                ctx.sent.load(Ordering::Relaxed),
                ctx.done.load(Ordering::Relaxed),
            );
            eprintln!(
                "bench replay: {:>6.1}s sent {s} done {d} in-flight {} waited-for-cap {}",
                ctx.t0.elapsed().as_secs_f64(),
                s.saturating_sub(d),
                ctx.waited.load(Ordering::Relaxed)
            );
        }
    });
}

/// Waits for the requests still running until `until` (for ever without one), then aborts
/// what is left.
async fn drain(tasks: &mut JoinSet<()>, until: Option<Instant>) {
    let all = async { while tasks.join_next().await.is_some() {} };
    let drained = match until {
        Some(t) => tokio::time::timeout_at(t.into(), all).await.is_ok(),
        None => {
            all.await;
            true
        }
    };
    if !drained {
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
    }
}

/// What the report says about the run itself.
fn run_meta(
    cfg: &ReplayConfig,
    started_at: String,
    workload_name: &str,
    params: serde_json::Value,
) -> RunMeta {
    RunMeta {
        tool: "tokengate bench replay".into(),
        tokengate_version: env!("CARGO_PKG_VERSION").into(),
        command_line: cfg.command_line.clone(),
        started_at,
        seed: cfg.seed,
        machine: MachineInfo::detect(),
        urls: cfg.urls.clone(),
        url_policy: serde_json::to_value(cfg.url_policy)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default(),
        model: cfg.model.clone(),
        workload: workload_name.into(),
        workload_params: params,
        concurrency: cfg.concurrency,
        limit: cfg.limit,
        duration_s: cfg.duration.map(|d| d.as_secs_f64()),
        session_header: cfg.session_header.clone(),
    }
}

/// How many requests the workload produced: known up front (trace) or counted by the
/// synthetic sessions as they go (claims of a request index; claims beyond --limit excluded).
enum Scheduled {
    Known(usize),
    Counter(Arc<AtomicUsize>),
}

/// Sends the trace's requests at their times. Returns (requests scheduled, ideal hit ratios
/// of the scheduled requests).
async fn dispatch_trace(
    ctx: &Arc<Ctx>,
    cfg: &ReplayConfig,
    tw: &TraceWorkload,
    tasks: &mut JoinSet<()>,
) -> (usize, (f64, f64)) {
    let recs = &tw.records[tw.skip.min(tw.records.len())..];
    let t0_ms = recs.first().map_or(0, |r| r.timestamp);
    let root_skip = trace::common_prefix_len(&tw.records);
    let mut reqs: Vec<_> = recs
        .iter()
        .take(cfg.limit.unwrap_or(usize::MAX))
        .map(|r| tw.scaling.scale(r, t0_ms))
        .collect();
    if let Some(d) = cfg.duration {
        reqs.retain(|r| r.at < d);
    }
    let ideal = trace::ideal_hit_ratio(&reqs, tw.scaling.block_tokens);
    let text = BlockText {
        seed: cfg.seed,
        block_tokens: tw.scaling.block_tokens,
    };
    let scheduled = reqs.len();
    for (index, r) in reqs.into_iter().enumerate() {
        tokio::time::sleep_until((ctx.t0 + r.at).into()).await;
        let (permit, waited) = ctx.slot().await;
        if ctx.past_deadline() {
            break;
        }
        while tasks.try_join_next().is_some() {}
        let ctx = ctx.clone();
        // The session key is always computed (for --url-policy session); it is sent as a
        // header only when session headers are on.
        let session =
            trace::session_root(&r.hash_ids, root_skip).map(|root| format!("trace-{root}"));
        tasks.spawn(async move {
            let prompt = text.prompt(&r.hash_ids, r.input_tokens);
            let messages = serde_json::json!([{"role": "user", "content": prompt}]);
            let body = ctx.body(messages, r.output_tokens);
            let sent = ctx
                .send(Req {
                    index,
                    turn: None,
                    tenant: None,
                    session,
                    header: true,
                    scheduled: r.at,
                    waited,
                    body,
                    input_tokens: r.input_tokens,
                    max_tokens: r.output_tokens,
                    keep_text: false,
                })
                .await;
            drop(permit);
            let _ = ctx.tx.send(sent);
        });
    }
    (scheduled, ideal)
}

/// One conversation: its key, its system prompt and, per turn, the user message, max_tokens
/// and the pause after the answer.
struct SessionSpec {
    key: String,
    /// Whether its requests carry the session header.
    header: bool,
    tenant: Option<usize>,
    system: String,
    turns: Vec<(String, usize, Duration)>,
}

/// Runs one session from its arrival `at`: every turn sends the whole history plus the next
/// user message, appends the streamed answer and waits the think time. Stops at the deadline,
/// when the request budget is spent, or after a failed turn (its history would be incomplete).
async fn run_session(
    ctx: &Ctx,
    spec: SessionSpec,
    at: Duration,
    next_index: &AtomicUsize,
    budget: usize,
) {
    let mut history = History::new(spec.system);
    let mut scheduled = at;
    for (turn, (user, max_tokens, think)) in spec.turns.into_iter().enumerate() {
        if ctx.past_deadline() {
            break;
        }
        let index = next_index.fetch_add(1, Ordering::Relaxed);
        if index >= budget {
            break;
        }
        let (permit, waited) = ctx.slot().await;
        if ctx.past_deadline() {
            break;
        }
        history.messages.push(("user", user));
        let input_tokens: usize = history.messages.iter().map(|(_, c)| c.len()).sum::<usize>() / 4;
        ctx.ideal
            .lock()
            .expect("ideal cache lock")
            .observe(&render_chat(&history.messages));
        let body = ctx.body(history.to_json(), max_tokens);
        let mut sent = ctx
            .send(Req {
                index,
                turn: Some(turn),
                tenant: spec.tenant,
                session: Some(spec.key.clone()),
                header: spec.header,
                scheduled,
                waited,
                body,
                input_tokens,
                max_tokens,
                keep_text: true,
            })
            .await;
        drop(permit);
        let ok = sent.record.ok();
        let answer = std::mem::take(&mut sent.text);
        let _ = ctx.tx.send(sent);
        if !ok {
            break;
        }
        history.messages.push(("assistant", answer));
        if !think.is_zero() {
            tokio::time::sleep(think).await;
        }
        scheduled = ctx.t0.elapsed();
    }
}

/// Starts session `s` of `arrivals` at its time (those before the end of --duration; arrivals
/// are sorted), built by `make(s)` when it arrives. Returns the counter of request indices the
/// sessions claim.
fn dispatch_sessions<F>(
    ctx: &Arc<Ctx>,
    cfg: &ReplayConfig,
    arrivals: Vec<Duration>,
    make: F,
    tasks: &mut JoinSet<()>,
) -> Arc<AtomicUsize>
where
    F: Fn(usize) -> SessionSpec + Send + Sync + 'static,
{
    let budget = cfg.limit.unwrap_or(usize::MAX);
    let next_index = Arc::new(AtomicUsize::new(0));
    let make = Arc::new(make);
    let mut sessions = JoinSet::new();
    for (s, at) in arrivals.into_iter().enumerate() {
        if cfg.duration.is_some_and(|d| at >= d) {
            break;
        }
        let (ctx, next_index, make) = (ctx.clone(), next_index.clone(), make.clone());
        sessions.spawn(async move {
            tokio::time::sleep_until((ctx.t0 + at).into()).await;
            run_session(&ctx, make(s), at, &next_index, budget).await;
        });
    }
    // The sessions run in their own set; hand them to the caller's drain as one task.
    tasks.spawn(async move { while sessions.join_next().await.is_some() {} });
    next_index
}

/// The synthetic sessions: `sc.sessions` conversations at Poisson arrivals.
fn dispatch_synthetic(
    ctx: &Arc<Ctx>,
    cfg: &ReplayConfig,
    sc: &SynthConfig,
    tasks: &mut JoinSet<()>,
) -> Arc<AtomicUsize> {
    let seed = cfg.seed;
    let arrivals = sc.arrivals(seed);
    let sc = sc.clone();
    let make = move |s: usize| SessionSpec {
        key: SynthConfig::session_id(seed, s),
        header: true,
        tenant: None,
        system: sc.system_prompt(seed, s),
        turns: (0..sc.turns)
            .map(|t| (sc.user_message(seed, s, t), sc.output_tokens, sc.think_time))
            .collect(),
    };
    dispatch_sessions(ctx, cfg, arrivals, make, tasks)
}

/// The agentic sessions: planned for the --duration horizon; returns the request counter and
/// the plan's summary.
fn dispatch_agentic(
    ctx: &Arc<Ctx>,
    cfg: &ReplayConfig,
    ac: &AgenticConfig,
    tasks: &mut JoinSet<()>,
) -> (Arc<AtomicUsize>, PlanSummary) {
    let seed = cfg.seed;
    let plan = ac.plan(seed, cfg.duration.unwrap_or_default());
    let summary = ac.summary(&plan);
    // Each used tenant's system prompt, made once.
    let mut systems = vec![String::new(); ac.tenants];
    for p in &plan {
        if systems[p.tenant].is_empty() {
            systems[p.tenant] = ac.system_prompt(seed, p.tenant);
        }
    }
    let arrivals = plan.iter().map(|p| p.at).collect();
    let make = move |s: usize| {
        let p = &plan[s];
        SessionSpec {
            key: AgenticConfig::session_id(seed, s),
            header: p.header,
            tenant: Some(p.tenant),
            system: systems[p.tenant].clone(),
            turns: p
                .turns
                .iter()
                .zip(&p.think)
                .enumerate()
                .map(|(t, (&(user, output), &think))| {
                    (AgenticConfig::user_message(seed, s, t, user), output, think)
                })
                .collect(),
        }
    };
    (dispatch_sessions(ctx, cfg, arrivals, make, tasks), summary)
}
