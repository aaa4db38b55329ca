//! `tokengate bench replay`: a load generator for LLM gateways and engines.
//!
//! It replays a Mooncake-format trace ([`trace`]) — every hash id becomes a fixed block of
//! words ([`text`]) so equal ids share a real text prefix — or runs a synthetic multi-turn
//! chat workload ([`synth`]) or a multi-tenant agentic one ([`agentic`]; both with their
//! prefix-hit ceiling, [`ideal`]), sends OpenAI streaming chat completions open-loop under a
//! concurrency cap ([`replay`], [`client`]), and reports TTFT / inter-token / end-to-end
//! latency, throughput, the engines' cached-token ratio, errors and the load spread across
//! instances ([`report`]) as JSON, markdown and SVG plots ([`plot`]).
//!
//! Library use: build a [`ReplayConfig`] and call [`replay`]; the CLI is [`ReplayArgs`] +
//! [`run_replay`].

pub mod agentic;
pub mod client;
pub mod ideal;
pub mod plot;
pub mod replay;
pub mod report;
pub mod synth;
pub mod text;
pub mod trace;

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};

pub use agentic::{AgenticConfig, SizeRange};
pub use replay::{replay, ReplayConfig, TraceWorkload, UrlPolicy, Workload};
pub use report::{Report, RequestRecord};
pub use synth::SynthConfig;
pub use trace::{Scaling, TraceRecord};

/// Replay a Mooncake trace (or a synthetic multi-turn workload) against an OpenAI-compatible
/// endpoint and report latency, throughput, prefix-cache hits and load spread.
#[derive(clap::Args, Clone, Debug)]
pub struct ReplayArgs {
    /// Target base URL (repeat or comma-separate for several: requests are spread by
    /// --url-policy; the gateway is one URL)
    #[arg(long, value_delimiter = ',', default_value = "http://127.0.0.1:8080")]
    pub url: Vec<String>,
    /// How requests pick among several --url targets
    #[arg(long, value_enum, default_value_t = UrlPolicy::RoundRobin)]
    pub url_policy: UrlPolicy,
    /// Model name sent in every request
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Bearer API key sent as `Authorization: Bearer KEY`
    #[arg(long, env = "TOKENGATE_BENCH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids)
    #[arg(long, value_name = "FILE", required_unless_present_any = ["synthetic", "agentic"])]
    pub trace: Option<PathBuf>,
    /// Replay the trace this many times faster (timestamps are divided by it)
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Tokens per hash-id block when replayed; all token counts scale by
    /// block-tokens / trace-block-tokens (e.g. 64 makes the trace 8× lighter)
    #[arg(long, default_value_t = 512)]
    pub block_tokens: usize,
    /// Tokens per hash-id block in the trace file (512 for Mooncake)
    #[arg(long, default_value_t = 512)]
    pub trace_block_tokens: usize,
    /// Skip this many trace records first (the next one is sent at time 0)
    #[arg(long, default_value_t = 0)]
    pub skip: usize,

    /// Send a session header (--session-header). Trace: the conversation root = the first
    /// hash id after the prefix shared by every record (hash_ids[1] in the Mooncake trace).
    /// Default: on for --synthetic and --agentic, off for traces
    #[arg(long, overrides_with = "no_sessions")]
    pub sessions: bool,
    /// Send no session header
    #[arg(long)]
    pub no_sessions: bool,
    /// Name of the session header
    #[arg(long, default_value = "x-session-id")]
    pub session_header: String,

    /// Run the synthetic multi-turn chat workload instead of a trace
    #[arg(long, conflicts_with = "agentic")]
    pub synthetic: bool,
    /// Run the multi-tenant agentic workload instead of a trace: Zipf-popular tenants with
    /// long system prompts of their own, Poisson session arrivals until --duration, one-shots
    /// and growing multi-turn sessions (bench/README.md)
    #[arg(long)]
    pub agentic: bool,
    /// Synthetic: number of sessions (conversations)
    #[arg(long, default_value_t = 100)]
    pub syn_sessions: usize,
    /// Turns (requests) per session; each turn resends the whole history. Synthetic: N
    /// [default: 5]; agentic: turns of a multi-turn session, N or MIN-MAX (uniform)
    /// [default: 2-10]
    #[arg(long, value_name = "N|MIN-MAX")]
    pub turns: Option<SizeRange>,
    /// Synthetic: number of distinct system prompts (session s uses prompt s mod K)
    #[arg(long, default_value_t = 4)]
    pub system_prompts: usize,
    /// Tokens per system prompt. Synthetic: N [default: 1024]; agentic: per tenant, N or
    /// MIN-MAX (drawn once per tenant) [default: 2048-4096]
    #[arg(long, value_name = "N|MIN-MAX")]
    pub system_tokens: Option<SizeRange>,
    /// Tokens per user message. Synthetic: N [default: 128]; agentic: per turn (a tool
    /// result), N or MIN-MAX [default: 64-512]
    #[arg(long, value_name = "N|MIN-MAX")]
    pub user_tokens: Option<SizeRange>,
    /// Output tokens per answer (max_tokens). Synthetic: N [default: 64]; agentic: per turn,
    /// N or MIN-MAX [default: 32-128]
    #[arg(long, value_name = "N|MIN-MAX")]
    pub output_tokens: Option<SizeRange>,
    /// Session arrivals per second, Poisson. Synthetic: 0 = all at once [default: 10];
    /// agentic: > 0 [default: 2]
    #[arg(long)]
    pub rate: Option<f64>,
    /// Pause between an answer and the session's next turn (e.g. 500ms) [default: synthetic
    /// 0s, agentic 200ms]
    #[arg(long, value_parser = humantime::parse_duration)]
    pub think_time: Option<Duration>,
    /// Agentic: draw every pause uniformly between --think-time and this (e.g. --think-time 1s
    /// --think-time-max 5s: people reading the answer)
    #[arg(long, value_parser = humantime::parse_duration)]
    pub think_time_max: Option<Duration>,
    /// Agentic: fraction of the sessions that send the session header (the others send none)
    #[arg(long, default_value_t = 1.0)]
    pub header_share: f64,
    /// Agentic: number of tenants, each with its own system prompt
    #[arg(long, default_value_t = 32)]
    pub tenants: usize,
    /// Agentic: Zipf exponent of tenant popularity (tenant k drawn ∝ 1/(k+1)^zipf)
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    /// Agentic: fraction of sessions that are a single request
    #[arg(long, default_value_t = 0.2)]
    pub one_shot: f64,
    /// Synthetic and agentic: tokens per KV block of the engines, for the prefix-hit ceiling
    /// (one infinite shared cache, engine-sim's chat template and block hashes)
    #[arg(long, default_value_t = 16)]
    pub engine_block_size: usize,

    /// Maximum requests in flight; a request due while all are busy waits (and is counted)
    #[arg(long, default_value_t = 256)]
    pub concurrency: usize,
    /// Send at most this many requests
    #[arg(long)]
    pub limit: Option<usize>,
    /// Stop sending after this long (e.g. 60s); running requests then get --drain-timeout
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// Per-request timeout, send to end of stream
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    pub timeout: Duration,
    /// After sending stops, cancel requests still running after this long
    #[arg(long, value_parser = humantime::parse_duration, default_value = "60s")]
    pub drain_timeout: Duration,
    /// Time bucket of the per-instance in-flight series, ms
    #[arg(long, default_value_t = 100)]
    pub bucket_ms: u64,
    /// Seed of the prompt text and of the synthetic arrivals
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Write the JSON report here
    #[arg(long, value_name = "FILE")]
    pub out_json: Option<PathBuf>,
    /// Write the markdown summary here (it is printed to stdout as well)
    #[arg(long, value_name = "FILE")]
    pub out_md: Option<PathBuf>,
    /// Write one JSON line per request here
    #[arg(long, value_name = "FILE")]
    pub out_requests: Option<PathBuf>,
    /// Write SVG plots (ttft_cdf.svg, inflight.svg) into this directory
    #[arg(long, value_name = "DIR")]
    pub plots: Option<PathBuf>,
    /// Print a progress line to stderr every 5 s
    #[arg(long)]
    pub progress: bool,

    /// Start N in-process engine-sims on 127.0.0.1 (ids sim-0..) and target them instead of
    /// --url: a direct, gateway-less baseline
    #[arg(long, value_name = "N")]
    pub spawn_sims: Option<usize>,
    /// Time scale of the spawned engine-sims (their durations are divided by it)
    #[arg(long, default_value_t = 1.0)]
    pub sim_time_scale: f64,
}

fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if a.is_empty()
                || a.contains(|c: char| c.is_whitespace() || "'\"$`\\|&;<>()*?".contains(c))
            {
                format!("'{}'", a.replace('\'', r"'\''"))
            } else {
                a
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

impl ReplayArgs {
    /// The library config these flags describe (loads the trace file).
    pub fn to_config(&self) -> anyhow::Result<ReplayConfig> {
        let workload = if self.synthetic {
            let fixed = |name: &str, v: Option<SizeRange>, default: usize| match v {
                None => Ok(default),
                Some(r) if r.is_fixed() => Ok(r.min),
                Some(r) => Err(anyhow::anyhow!(
                    "--synthetic takes a single number for --{name}, not {r}"
                )),
            };
            Workload::Synthetic(SynthConfig {
                sessions: self.syn_sessions,
                turns: fixed("turns", self.turns, 5)?,
                system_prompts: self.system_prompts,
                system_tokens: fixed("system-tokens", self.system_tokens, 1024)?,
                user_tokens: fixed("user-tokens", self.user_tokens, 128)?,
                output_tokens: fixed("output-tokens", self.output_tokens, 64)?,
                rate: self.rate.unwrap_or(10.0),
                think_time: self.think_time.unwrap_or(Duration::ZERO),
            })
        } else if self.agentic {
            let d = AgenticConfig::default();
            let ac = AgenticConfig {
                tenants: self.tenants,
                zipf: self.zipf,
                system_tokens: self.system_tokens.unwrap_or(d.system_tokens),
                user_tokens: self.user_tokens.unwrap_or(d.user_tokens),
                output_tokens: self.output_tokens.unwrap_or(d.output_tokens),
                one_shot: self.one_shot,
                turns: self.turns.unwrap_or(d.turns),
                rate: self.rate.unwrap_or(d.rate),
                think_time: self.think_time.unwrap_or(d.think_time),
                think_time_max: self.think_time_max,
                header_share: self.header_share,
            };
            ac.validate()
                .map_err(|e| anyhow::anyhow!("--agentic: {e}"))?;
            if self.duration.is_none() {
                bail!("--agentic needs --duration (sessions arrive until then)");
            }
            Workload::Agentic(ac)
        } else {
            let Some(path) = &self.trace else {
                bail!("--trace FILE, --synthetic or --agentic is required");
            };
            if self.time_scale.is_nan() || self.time_scale <= 0.0 {
                bail!("--time-scale must be > 0");
            }
            if self.block_tokens == 0 || self.trace_block_tokens == 0 {
                bail!("--block-tokens and --trace-block-tokens must be > 0");
            }
            Workload::Trace(TraceWorkload {
                records: Arc::new(trace::load_trace(path)?),
                source: path.display().to_string(),
                scaling: Scaling {
                    trace_block_tokens: self.trace_block_tokens,
                    block_tokens: self.block_tokens,
                    time_scale: self.time_scale,
                },
                skip: self.skip,
            })
        };
        let sessions = if self.sessions {
            true
        } else if self.no_sessions {
            false
        } else {
            self.synthetic || self.agentic
        };
        Ok(ReplayConfig {
            url_policy: self.url_policy,
            api_key: self.api_key.clone(),
            session_header: sessions.then(|| self.session_header.clone()),
            concurrency: self.concurrency,
            limit: self.limit,
            duration: self.duration,
            request_timeout: self.timeout,
            drain_timeout: self.drain_timeout,
            bucket: Duration::from_millis(self.bucket_ms.max(1)),
            seed: self.seed,
            engine_block_size: self.engine_block_size.max(1),
            command_line: command_line(),
            progress: self.progress,
            ..ReplayConfig::new(self.url.clone(), self.model.clone(), workload)
        })
    }
}

/// Writes the report's JSON, markdown, per-request lines and plots where asked.
pub fn write_outputs(report: &Report, args: &ReplayArgs) -> anyhow::Result<()> {
    let write = |p: &PathBuf, s: String| {
        if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::write(p, s).with_context(|| format!("writing {}", p.display()))
    };
    if let Some(p) = &args.out_json {
        write(p, serde_json::to_string_pretty(report)? + "\n")?;
    }
    if let Some(p) = &args.out_md {
        write(p, report.to_markdown())?;
    }
    if let Some(p) = &args.out_requests {
        write(p, report.requests_jsonl())?;
    }
    if let Some(dir) = &args.plots {
        plot::write_plots(report, dir)?;
    }
    Ok(())
}

/// The `tokengate bench replay` command: run, print the markdown summary, write the outputs.
pub async fn run_replay(args: ReplayArgs) -> anyhow::Result<()> {
    let mut cfg = args.to_config()?;
    let mut sims = Vec::new();
    if let Some(n) = args.spawn_sims {
        if n == 0 {
            bail!("--spawn-sims must be at least 1");
        }
        for i in 0..n {
            let sim = engine_sim::spawn_local(engine_sim::SimConfig {
                id: format!("sim-{i}"),
                model: args.model.clone(),
                time_scale: args.sim_time_scale,
                ..Default::default()
            })
            .await
            .context("starting engine-sim")?;
            sims.push(sim);
        }
        cfg.urls = sims.iter().map(|s| s.url()).collect();
    }
    let result = replay(cfg).await;
    for s in sims {
        s.stop().await;
    }
    let report = result?;
    println!("{}", report.to_markdown());
    write_outputs(&report, &args)
}
