//! The `tokengate` command line.

use clap::{Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use tokengate::config::Config;
use tokengate::server;

/// tokengate: an LLM inference gateway on Cloudflare Pingora.
///
/// It reads each request's JSON body, routes it by model to one of many inference engines
/// (vLLM, SGLang, ...) by load, streams the answer back unbuffered, and counts tokens and
/// time-to-first-token. Log level: the RUST_LOG environment variable (default: info; the
/// access log is the `access` target, e.g. RUST_LOG=info,access=off).
#[derive(Parser)]
#[command(name = "tokengate", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once at start: the size of the engine-sim variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Run the gateway with a YAML config.
    ///
    /// Prints one line per listener once bound ("tokengate: proxy listening on http://ADDR",
    /// "tokengate: admin listening on http://ADDR"); a port of 0 in the config picks a free one.
    /// SIGTERM shuts down gracefully (in-flight requests finish), SIGINT at once. SIGHUP, or
    /// saving the file, reloads the config (a bad file is rejected and the old one kept).
    Serve {
        /// The config file (see conf/ for commented examples).
        #[arg(short, long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Run the demo: 4 engine-sims (qwen3-0.6b ×2, qwen3-32b ×2) and the gateway in one
    /// process, with conf/demo.yaml built in. Prints the URLs and ready-to-paste curl commands.
    Demo {
        /// Use another config: one engine-sim is started on every instance address in it.
        #[arg(short, long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Speed-up of the simulated engines' timing (1 = H100-like real time).
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
    },
    /// Run engine-sim, a fake OpenAI/Anthropic-compatible inference engine with a KV prefix
    /// cache, continuous batching and fault injection (for tests and benchmarks without GPUs).
    EngineSim {
        #[command(flatten)]
        args: Box<engine_sim::SimArgs>,
    },
    /// Benchmarks: replay a request trace (or a synthetic multi-turn workload) against any
    /// OpenAI-compatible URL and report TTFT, latency, throughput, cache hits and load spread.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// One HTTP GET: exit 0 when the answer is 2xx, else print why and exit 1. The
    /// container image's HEALTHCHECK (no curl in it).
    Probe(Box<ProbeArgs>),
    /// Validate a config file: exit 0 when valid (printing warnings about settings that have
    /// no effect); otherwise print every error with its YAML path (e.g.
    /// `services[1].instances[0].addr: invalid socket address`) and exit 1.
    Check {
        /// The config file to check.
        #[arg(short, long, value_name = "FILE")]
        config: PathBuf,
        /// Print the effective config as YAML on stdout (every default filled in, every
        /// credential `***`); the summary line goes to stderr.
        #[arg(long)]
        print: bool,
    },
}

#[derive(clap::Args)]
struct ProbeArgs {
    /// What to GET.
    #[arg(default_value = tokengate::probe::DEFAULT_URL)]
    url: String,
    /// Connect and read timeout.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    timeout: std::time::Duration,
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Open-loop replay of a Mooncake-format trace (or `--synthetic` sessions); see bench/README.md.
    Replay(Box<tokengate_bench::ReplayArgs>),
}

/// mimalloc: the proxy allocates and frees many small buffers per request (headers, bodies,
/// futures); glibc malloc cost ~10 % of the gateway's CPU under load (bench/results/overhead.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn init_logging() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .format_timestamp_micros()
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Check { config, print } => match Config::load(&config).and_then(|c| {
            // Build it too: what a running gateway would build must build.
            tokengate::runtime::Runtime::build(&c, None, &tokengate::metrics::Metrics::new())?;
            Ok(c)
        }) {
            Ok(c) => {
                for w in c.warnings() {
                    eprintln!("  warning: {w}");
                }
                // A name that does not resolve here is not an error (the gateway starts and the
                // instance waits until it resolves), but whoever runs `check` wants to know.
                for (si, s) in c.services.iter().enumerate() {
                    for (ii, i) in s.instances.iter().enumerate() {
                        if tokengate::resolve::is_name(&i.addr) {
                            if let Err(e) = tokengate::resolve::resolve(&i.addr) {
                                eprintln!(
                                    "  warning: services[{si}].instances[{ii}].addr: {e} (from here; \
                                     the instance gets no requests until it resolves)"
                                );
                            }
                        }
                    }
                }
                let n: usize = c.services.iter().map(|s| s.instances.len()).sum();
                let summary = format!(
                    "{}: ok ({} services, {} instances)",
                    config.display(),
                    c.services.len(),
                    n
                );
                if print {
                    print!("{}", c.to_yaml());
                    eprintln!("{summary}");
                } else {
                    println!("{summary}");
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{}: invalid config", config.display());
                for line in e.0 {
                    eprintln!("  {line}");
                }
                ExitCode::from(1)
            }
        },
        Cmd::Probe(p) => match tokengate::probe::get_status(&p.url, p.timeout) {
            Ok(s) if (200..300).contains(&s) => ExitCode::SUCCESS,
            Ok(s) => {
                eprintln!("{}: status {s}", p.url);
                ExitCode::from(1)
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(1)
            }
        },
        Cmd::Demo { config, time_scale } => {
            init_logging();
            match tokengate::demo::run(
                config.as_deref(),
                tokengate::demo::DemoOptions { time_scale },
            ) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("tokengate demo: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Bench(BenchCmd::Replay(args)) => {
            init_logging();
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("bench: {e}");
                    return ExitCode::from(1);
                }
            };
            match rt.block_on(tokengate_bench::run_replay(*args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("bench replay: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::EngineSim { args } => {
            init_logging();
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("engine-sim: {e}");
                    return ExitCode::from(1);
                }
            };
            match rt.block_on(engine_sim::run_cli(*args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("engine-sim: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Serve { config } => {
            init_logging();
            let cfg = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{}: invalid config", config.display());
                    for line in e.0 {
                        eprintln!("  {line}");
                    }
                    return ExitCode::from(1);
                }
            };
            // Catch SIGHUP and take the file's stamp before the listeners are announced.
            let reloads = tokengate::reload::ReloadSource::new(config.clone());
            let listeners = match server::Listeners::bind(&cfg) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("tokengate: {e:#}");
                    return ExitCode::from(1);
                }
            };
            {
                let mut out = std::io::stdout().lock();
                for a in listeners.proxy_addrs() {
                    let _ = writeln!(out, "tokengate: proxy listening on http://{a}");
                }
                if let Some(a) = listeners.admin_addr() {
                    let _ = writeln!(out, "tokengate: admin listening on http://{a}");
                }
                let _ = out.flush();
            }
            if let Err(e) = server::run(cfg, listeners, Some(reloads)) {
                eprintln!("tokengate: {e:#}");
                return ExitCode::from(1);
            }
            ExitCode::SUCCESS
        }
    }
}
