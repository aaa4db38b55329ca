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
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let sim = engine_sim::spawn_local(engine_sim::SimConfig::default()).await?;
//! println!("serving on {}", sim.url());
//! sim.stop().await;
//! # Ok(()) }
//! ```

mod api;
pub mod decision;
mod engine;
mod faults;
pub mod kvcache;
mod server;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::oneshot;

pub use engine::Stats;
pub use faults::Faults;

/// Engine parameters. All durations are divided by `time_scale`.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Returned in the `x-engine-id` header of every response.
    pub id: String,
    /// Served model name; requests naming another model get 404.
    pub model: String,
    /// Tokens per KV block (vLLM's `--block-size`).
    pub block_size: usize,
    /// KV cache capacity in blocks.
    pub kv_blocks: usize,
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
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            id: "engine-sim".into(),
            model: "sim-model".into(),
            block_size: 16,
            kv_blocks: 65536,
            max_running: 64,
            max_model_len: 131072,
            prefill_tps: 8000.0,
            decode_step_ms: 6.0,
            decode_per_req_ms: 0.35,
            time_scale: 1.0,
            default_output_tokens: 64,
            chunk_tokens: 1,
            faults: Faults::default(),
            decision_mode: false,
        }
    }
}

impl SimConfig {
    fn validate(&self) -> io::Result<()> {
        let bad = |m: &str| Err(io::Error::new(io::ErrorKind::InvalidInput, m.to_string()));
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
        Ok(())
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
    /// KV-cache capacity in blocks
    #[arg(long, default_value_t = 65536)]
    pub kv_blocks: usize,
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
    #[command(flatten)]
    pub faults: Faults,
}

impl SimArgs {
    pub fn into_config(self) -> SimConfig {
        SimConfig {
            id: self.id.unwrap_or_else(|| self.listen.to_string()),
            model: self.model,
            block_size: self.block_size,
            kv_blocks: self.kv_blocks,
            max_running: self.max_running,
            max_model_len: self.max_model_len,
            prefill_tps: self.prefill_tps,
            decode_step_ms: self.decode_step_ms,
            decode_per_req_ms: self.decode_per_req_ms,
            time_scale: self.time_scale,
            default_output_tokens: self.default_output_tokens,
            chunk_tokens: self.chunk_tokens,
            faults: self.faults,
            decision_mode: self.decision_mode,
        }
    }
}

/// A running simulator. Dropping it aborts the server; [`SimHandle::stop`]
/// shuts it down and waits until the port is closed.
pub struct SimHandle {
    pub addr: SocketAddr,
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
    let cfg = Arc::new(cfg);
    let engine = engine::Engine::new(cfg.clone());
    let scheduler = server::AbortOnDrop(tokio::spawn(engine.clone().run()));
    let shared = server::Shared::new(cfg, engine);
    let (tx, rx) = oneshot::channel();
    let task = tokio::spawn(server::accept_loop(listener, shared.clone(), rx, scheduler));
    Ok(SimHandle {
        addr,
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
    tokio::signal::ctrl_c().await?;
    handle.stop().await;
    Ok(())
}
