//! engine-sim: a realistic fake LLM inference engine.
//!
//! It speaks the OpenAI (chat/completions, Responses) and Anthropic Messages
//! APIs like vLLM does, simulates a paged KV cache with automatic prefix
//! caching ([`kvcache`]), continuous batching with a shared decode-step clock,
//! exposes vLLM-named Prometheus metrics and SGLang-router probe endpoints, and
//! can inject faults ([`Faults`]) from the CLI, over HTTP (`/admin/faults`) or
//! in-process ([`SimHandle::set_faults`]). In [`decision`] mode it plays a
//! rule-based routing model for tokengate's decision service.
//!
//! `/metrics` speaks vLLM's or SGLang's metric names ([`MetricsFlavor`]). An
//! engine can also play one side of a prefill/decode-disaggregated fleet
//! ([`Role`], [`PdMode`]): SGLang's bootstrap-room protocol or vLLM's
//! `kv_transfer_params` protocol, with the KV handed over between engine-sims
//! over loopback HTTP (see the `pd` module and `sim/README.md`). As SGLang's
//! server, it aborts in-flight requests by the `rid` of their body on
//! `POST /abort_request` (see the `abort` module).
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let sim = engine_sim::spawn_local(engine_sim::SimConfig::default()).await?;
//! println!("serving on {}", sim.url());
//! sim.stop().await;
//! # Ok(()) }
//! ```

mod abort;
mod api;
pub mod decision;
mod engine;
mod faults;
pub mod kvcache;
mod metrics;
mod pd;
mod server;
mod task;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub use engine::Stats;
pub use faults::Faults;

/// Metric names exported on `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricsFlavor {
    /// vLLM's names (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, …).
    #[default]
    Vllm,
    /// SGLang's names (`sglang:num_running_reqs`, `sglang:token_usage`, …).
    Sglang,
}

/// The engine's part in a prefill/decode (PD) disaggregated fleet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// A normal engine: prefill and decode in one place (PD fields are ignored).
    #[default]
    Integrated,
    /// Prefills, then hands the KV to a decode engine.
    Prefill,
    /// Gets the KV from a prefill engine, then decodes.
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Integrated => "integrated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// SGLang's `engine_type` metric label.
    pub(crate) fn sglang_engine_type(self) -> &'static str {
        match self {
            Role::Integrated => "unified",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// Which real PD protocol a prefill or decode engine speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PdMode {
    /// SGLang (Mooncake): the router sends the same request, with
    /// `bootstrap_host` / `bootstrap_port` / `bootstrap_room`, to both engines at
    /// once; the decode pulls the room's KV from the prefill's bootstrap server.
    #[default]
    Sglang,
    /// vLLM (NIXL): the proxy sends the prefill a `max_tokens: 1` request with
    /// `kv_transfer_params.do_remote_decode`, then the decode the original request
    /// with the `kv_transfer_params` the prefill returned.
    Vllm,
}

impl PdMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PdMode::Sglang => "sglang",
            PdMode::Vllm => "vllm",
        }
    }
}

/// Engine parameters. All durations are divided by `time_scale`.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Returned in the `x-engine-id` header of every response.
    pub id: String,
    /// Served model name; requests naming another model get 404.
    pub model: String,
    /// Tokens per KV block (vLLM's `--block-size`).
    pub block_size: usize,
    /// Prompt bytes per token of the engine's tokenizer (the gateway estimates 4).
    pub bytes_per_token: f64,
    /// KV cache capacity in blocks.
    pub kv_blocks: usize,
    /// Prefix cache size in tokens: at most this many tokens of blocks no running
    /// request uses are kept (least recently used evicted first). 0: only `kv_blocks`
    /// bounds them (the whole pool caches, as in vLLM).
    pub cache_tokens: usize,
    /// Maximum requests in the running batch; others wait FIFO.
    pub max_running: usize,
    /// Maximum prompt + output tokens of one request (400 beyond).
    pub max_model_len: usize,
    /// Prefill throughput, uncached prompt tokens per second (shared, serialized).
    pub prefill_tps: f64,
    /// Fixed cost of one decode step, ms.
    pub decode_step_ms: f64,
    /// Extra cost of one decode step per running request, ms.
    pub decode_per_req_ms: f64,
    /// 0: prefill runs beside the decode steps without slowing them. N > 0: prefill
    /// and decode share the engine (chunked prefill): while prefill work is pending,
    /// each decode step also carries up to N tokens of it and lasts their prefill
    /// time longer, and the prefill waits for the step's decode part.
    pub prefill_chunk_tokens: usize,
    /// Admit a waiting request (look its prefix up, take its KV blocks) only once the
    /// prefill work before it has finished, as vLLM's and SGLang's schedulers do: their
    /// waiting requests hold no blocks, so a queued request's cached prefix can be evicted
    /// before its turn. `false`: admitted at once while a running slot and blocks are free,
    /// its prefix kept for it while its prefill waits.
    pub admit_at_prefill: bool,
    /// Speed-up factor: every simulated duration is divided by it.
    pub time_scale: f64,
    /// Output tokens when the request sets no max_tokens and no `x-sim-output-tokens`.
    pub default_output_tokens: usize,
    /// Tokens per streamed SSE chunk.
    pub chunk_tokens: usize,
    /// Initial faults.
    pub faults: Faults,
    /// Decision mode ([`decision`]): chat requests whose system text holds a
    /// target list are answered with one target's name instead of filler.
    pub decision_mode: bool,
    /// Metric names on `/metrics`.
    pub metrics_flavor: MetricsFlavor,
    /// Part in a prefill/decode-disaggregated fleet.
    pub role: Role,
    /// PD protocol spoken when `role` is prefill or decode.
    pub pd_mode: PdMode,
    /// SGLang prefill only: also serve the bootstrap endpoints on this port
    /// (Mooncake's `--disaggregation-bootstrap-port`; 0 picks a free port, see
    /// [`SimHandle::bootstrap_addr`]). They are always served on the main port too.
    pub bootstrap_port: Option<u16>,
    /// Simulated KV transfer time from prefill to decode, ms per 1000 prompt
    /// tokens (divided by `time_scale`).
    pub kv_transfer_ms_per_1k_tokens: f64,
    /// PD: how long (wall-clock ms, not scaled) a decode waits for its KV and a
    /// prefill keeps finished KV pinned for a decode to fetch.
    pub pd_timeout_ms: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            id: "engine-sim".into(),
            model: "sim-model".into(),
            block_size: 16,
            bytes_per_token: 4.0,
            kv_blocks: 65536,
            cache_tokens: 0,
            max_running: 64,
            max_model_len: 131072,
            prefill_tps: 8000.0,
            decode_step_ms: 6.0,
            decode_per_req_ms: 0.35,
            prefill_chunk_tokens: 0,
            admit_at_prefill: false,
            time_scale: 1.0,
            default_output_tokens: 64,
            chunk_tokens: 1,
            faults: Faults::default(),
            decision_mode: false,
            metrics_flavor: MetricsFlavor::Vllm,
            role: Role::Integrated,
            pd_mode: PdMode::Sglang,
            bootstrap_port: None,
            kv_transfer_ms_per_1k_tokens: 10.0,
            pd_timeout_ms: 30_000,
        }
    }
}

impl SimConfig {
    fn validate(&self) -> io::Result<()> {
        let bad = |m: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, m.to_string()));
        if !(self.bytes_per_token >= 0.5 && self.bytes_per_token <= 64.0) {
            return bad("bytes_per_token must be between 0.5 and 64");
        }
        if self.block_size == 0 || self.kv_blocks == 0 || self.max_running == 0 {
            return bad("block_size, kv_blocks and max_running must be > 0");
        }
        if self.chunk_tokens == 0 || self.max_model_len == 0 {
            return bad("chunk_tokens and max_model_len must be > 0");
        }
        if !(self.prefill_tps > 0.0 && self.time_scale > 0.0) {
            return bad("prefill_tps and time_scale must be > 0");
        }
        if !(self.decode_step_ms >= 0.0 && self.decode_per_req_ms >= 0.0) {
            return bad("decode times must be >= 0");
        }
        if !(self.kv_transfer_ms_per_1k_tokens >= 0.0
            && self.kv_transfer_ms_per_1k_tokens.is_finite())
        {
            return bad("kv_transfer_ms_per_1k_tokens must be >= 0");
        }
        if self.pd_timeout_ms == 0 {
            return bad("pd_timeout_ms must be > 0");
        }
        Ok(())
    }

    /// `Some(role)` when the engine plays prefill or decode.
    pub(crate) fn pd_active(&self) -> Option<Role> {
        (self.role != Role::Integrated).then_some(self.role)
    }
}

/// Command-line flags of `engine-sim` (flatten into a clap command).
#[derive(clap::Args, Clone, Debug)]
pub struct SimArgs {
    /// Engine id sent in the x-engine-id response header [default: the listen address]
    #[arg(long)]
    pub id: Option<String>,
    /// Served model name (requests for other models get 404)
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Address to listen on
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Tokens per KV-cache block
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Prompt bytes per token of the simulated tokenizer. The gateway estimates 4; another
    /// value (e.g. 3.4 or 4.6, ±15 %) makes the engine count tokens differently from it,
    /// as a real tokenizer does
    #[arg(long, default_value_t = 4.0)]
    pub bytes_per_token: f64,
    /// KV-cache capacity in blocks
    #[arg(long, default_value_t = 65536)]
    pub kv_blocks: usize,
    /// Prefix cache size in tokens: keep at most this many tokens of blocks that no
    /// running request uses (least recently used evicted first), a cache smaller than
    /// the KV pool. 0: the whole pool caches
    #[arg(long, default_value_t = 0)]
    pub cache_tokens: usize,
    /// Maximum number of requests in the running batch (the rest wait FIFO)
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Maximum prompt + output tokens per request
    #[arg(long, default_value_t = 131072)]
    pub max_model_len: usize,
    /// Prefill throughput in uncached prompt tokens per second
    #[arg(long, default_value_t = 8000.0)]
    pub prefill_tps: f64,
    /// Fixed duration of one decode step in ms
    #[arg(long, default_value_t = 6.0)]
    pub decode_step_ms: f64,
    /// Additional decode-step duration per running request in ms
    #[arg(long, default_value_t = 0.35)]
    pub decode_per_req_ms: f64,
    /// Prefill and decode share the engine (chunked prefill): while prompts are
    /// being prefilled, every decode step also carries up to this many prefill
    /// tokens and takes their prefill time longer. 0: prefill runs beside the
    /// decode steps without slowing them
    #[arg(long, default_value_t = 0)]
    pub prefill_chunk_tokens: usize,
    /// Admit a waiting request (look its prefix up, take its KV blocks) only when the
    /// prefill before it has finished, as vLLM and SGLang do (their waiting requests hold
    /// no blocks: a queued request's cached prefix can be evicted before its turn).
    /// Without it a request is admitted at once while a running slot and blocks are free,
    /// and its prefix is kept for it while its prefill waits
    #[arg(long)]
    pub admit_at_prefill: bool,
    /// Divide every simulated duration by this factor (faults excepted)
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Output tokens when neither max_tokens nor the x-sim-output-tokens header is given
    #[arg(long, default_value_t = 64)]
    pub default_output_tokens: usize,
    /// Tokens per streamed SSE chunk
    #[arg(long, default_value_t = 1)]
    pub chunk_tokens: usize,
    /// Act as a rule-based decision model: chat requests whose system text
    /// holds a target list ("N. name: criteria" lines) are answered with the
    /// name of the target whose criteria best match the last user message
    #[arg(long)]
    pub decision_mode: bool,
    /// Metric names on /metrics: vLLM's (vllm:num_requests_running, …) or
    /// SGLang's (sglang:num_running_reqs, …)
    #[arg(long, value_enum, default_value_t = MetricsFlavor::Vllm)]
    pub metrics_flavor: MetricsFlavor,
    /// Part in a prefill/decode-disaggregated fleet
    #[arg(long, value_enum, default_value_t = Role::Integrated)]
    pub role: Role,
    /// PD protocol of a prefill or decode engine: SGLang's bootstrap rooms or
    /// vLLM's kv_transfer_params
    #[arg(long, value_enum, default_value_t = PdMode::Sglang)]
    pub pd_mode: PdMode,
    /// SGLang prefill: also serve the bootstrap endpoints on this port (like
    /// --disaggregation-bootstrap-port; they are always on the main port too)
    #[arg(long)]
    pub bootstrap_port: Option<u16>,
    /// Simulated prefill-to-decode KV transfer time in ms per 1000 prompt tokens
    #[arg(long, default_value_t = 10.0)]
    pub kv_transfer_ms_per_1k_tokens: f64,
    /// PD: wall-clock ms a decode waits for its KV, and a prefill keeps finished
    /// KV for a decode to fetch, before giving up
    #[arg(long, default_value_t = 30_000)]
    pub pd_timeout_ms: u64,
    #[command(flatten)]
    pub faults: Faults,
}

impl SimArgs {
    pub fn into_config(self) -> SimConfig {
        SimConfig {
            id: self.id.unwrap_or_else(|| self.listen.to_string()),
            model: self.model,
            block_size: self.block_size,
            bytes_per_token: self.bytes_per_token,
            kv_blocks: self.kv_blocks,
            cache_tokens: self.cache_tokens,
            max_running: self.max_running,
            max_model_len: self.max_model_len,
            prefill_tps: self.prefill_tps,
            decode_step_ms: self.decode_step_ms,
            decode_per_req_ms: self.decode_per_req_ms,
            prefill_chunk_tokens: self.prefill_chunk_tokens,
            admit_at_prefill: self.admit_at_prefill,
            time_scale: self.time_scale,
            default_output_tokens: self.default_output_tokens,
            chunk_tokens: self.chunk_tokens,
            faults: self.faults,
            decision_mode: self.decision_mode,
            metrics_flavor: self.metrics_flavor,
            role: self.role,
            pd_mode: self.pd_mode,
            bootstrap_port: self.bootstrap_port,
            kv_transfer_ms_per_1k_tokens: self.kv_transfer_ms_per_1k_tokens,
            pd_timeout_ms: self.pd_timeout_ms,
        }
    }
}

/// A running simulator. Dropping it aborts the server; [`SimHandle::stop`]
/// shuts it down and waits until the port is closed.
pub struct SimHandle {
    pub addr: SocketAddr,
    bootstrap_addr: Option<SocketAddr>,
    shared: Arc<server::Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl SimHandle {
    /// `http://<addr>`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn id(&self) -> &str {
        &self.shared.cfg.id
    }

    /// SGLang prefill with `bootstrap_port` set: where the separate bootstrap
    /// listener is (the same endpoints are also on [`addr`](Self::addr)).
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        self.bootstrap_addr
    }

    pub fn config(&self) -> &SimConfig {
        &self.shared.cfg
    }

    /// Current faults.
    pub fn faults(&self) -> Faults {
        self.shared.faults.read().clone()
    }

    /// Replace the faults (`Faults::default()` clears them).
    pub fn set_faults(&self, faults: Faults) {
        *self.shared.faults.write() = faults;
    }

    /// Modify the faults in place.
    pub fn update_faults(&self, f: impl FnOnce(&mut Faults)) {
        f(&mut self.shared.faults.write());
    }

    /// Engine state snapshot.
    pub fn stats(&self) -> Stats {
        self.shared.engine.stats()
    }

    /// Stop accepting, close all connections, stop the scheduler.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

/// Serve `cfg` on `listener` (must be called inside a tokio runtime).
pub async fn start(cfg: SimConfig, listener: TcpListener) -> io::Result<SimHandle> {
    cfg.validate()?;
    let addr = listener.local_addr()?;
    let bootstrap = match cfg.bootstrap_port {
        Some(port) if cfg.role == Role::Prefill && cfg.pd_mode == PdMode::Sglang => {
            Some(TcpListener::bind(SocketAddr::new(addr.ip(), port)).await?)
        }
        _ => None,
    };
    let bootstrap_addr = match &bootstrap {
        Some(l) => Some(l.local_addr()?),
        None => None,
    };
    let cfg = Arc::new(cfg);
    let engine = engine::Engine::new(cfg.clone());
    let scheduler = task::AbortOnDrop(tokio::spawn(engine.clone().run()));
    let shared = server::Shared::new(cfg, engine);
    let (tx, rx) = oneshot::channel();
    let task = tokio::spawn(server::accept_loop(
        listener,
        bootstrap,
        shared.clone(),
        rx,
        scheduler,
    ));
    Ok(SimHandle {
        addr,
        bootstrap_addr,
        shared,
        shutdown: Some(tx),
        task: Some(task),
    })
}

/// Bind `127.0.0.1:0` and serve `cfg` there.
pub async fn spawn_local(cfg: SimConfig) -> io::Result<SimHandle> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    start(cfg, listener).await
}

/// Serve until Ctrl-C.
pub async fn run_cli(args: SimArgs) -> io::Result<()> {
    let listen = args.listen;
    let cfg = args.into_config();
    let listener = TcpListener::bind(listen).await?;
    let handle = start(cfg, listener).await?;
    log::info!(
        "engine-sim {} serving model {} on {}",
        handle.id(),
        handle.config().model,
        handle.url()
    );
    eprintln!("engine-sim {} listening on {}", handle.id(), handle.url());
    if let Some(b) = handle.bootstrap_addr() {
        eprintln!("engine-sim {} bootstrap server on {b}", handle.id());
    }
    tokio::signal::ctrl_c().await?;
    handle.stop().await;
    Ok(())
}
