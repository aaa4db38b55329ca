//! The `tokengate` command line.

use clap::{Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use tokengate::config::Config;
use tokengate::logging::LogFormat;
use tokengate::server;

/// The `--help` footer of a build without the tools (cargo features `sim`, `bench`; default on).
const MISSING_TOOLS: Option<&str> = match (cfg!(feature = "sim"), cfg!(feature = "bench")) {
    (true, true) => None,
    (false, true) => Some("Not in this build: demo, engine-sim (cargo feature `sim`)."),
    (true, false) => Some("Not in this build: bench (cargo feature `bench`)."),
    (false, false) => {
        Some("Not in this build: demo, engine-sim, bench (cargo features `sim`, `bench`).")
    }
};

/// The version with the commit it was built from and the build profile.
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("TOKENGATE_GIT_COMMIT"),
    ", ",
    env!("TOKENGATE_BUILD_PROFILE"),
    " build)"
);

/// tokengate: an LLM inference gateway on Cloudflare Pingora.
///
/// It reads each request's JSON body, routes it by model to one of many inference engines
/// (vLLM, SGLang, ...) by load, streams the answer back unbuffered, and counts tokens and
/// time-to-first-token. Log level: the RUST_LOG environment variable (default: info; the
/// access log is the `access` target, e.g. RUST_LOG=info,access=off); one JSON object per
/// line with TOKENGATE_LOG_FORMAT=json (or `log_format: json` in the config).
#[derive(Parser)]
#[command(name = "tokengate", version = VERSION, about, long_about, after_help = MISSING_TOOLS)]
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
        #[arg(short, long, value_name = "FILE", env = "TOKENGATE_CONFIG")]
        config: PathBuf,
    },
    /// Run the demo: 4 engine-sims (qwen3-0.6b ×2, qwen3-32b ×2) and the gateway in one
    /// process, with conf/demo.yaml built in. Prints the URLs and ready-to-paste curl commands.
    #[cfg(feature = "sim")]
    Demo {
        /// Use another config: one engine-sim is started on every instance address in it
        /// (and the gateway reloads it when it changes, as `serve` does, from a copy with the
        /// engines' real addresses kept beside it as `.NAME.demo.yaml`).
        #[arg(short, long, value_name = "FILE", env = "TOKENGATE_CONFIG")]
        config: Option<PathBuf>,
        /// Speed-up of the simulated engines' timing (1 = H100-like real time).
        #[arg(long, default_value_t = 1.0)]
        time_scale: f64,
    },
    /// Run engine-sim, a fake OpenAI/Anthropic-compatible inference engine with a KV prefix
    /// cache, continuous batching and fault injection (for tests and benchmarks without GPUs).
    #[cfg(feature = "sim")]
    EngineSim {
        #[command(flatten)]
        args: Box<engine_sim::SimArgs>,
    },
    /// Benchmarks: replay a request trace (or a synthetic multi-turn workload) against any
    /// OpenAI-compatible URL and report TTFT, latency, throughput, cache hits and load spread.
    #[cfg(feature = "bench")]
    #[command(subcommand)]
    Bench(BenchCmd),
    /// One HTTP GET: exit 0 when the answer is 2xx, else print why and exit 1. The
    /// container image's HEALTHCHECK (no curl in it).
    Probe(Box<ProbeArgs>),
    /// Validate a config file: exit 0 when valid (printing warnings about settings that have
    /// no effect); otherwise print every error (syntax, type, unknown key, semantic) with its
    /// YAML path, its line and the fix where there is one, e.g. "services[0].sheduler: unknown
    /// key `sheduler` — did you mean `scheduler`? (line 4)", and exit 1.
    ///
    /// Any string value may read an environment variable, `${VAR}` or `${VAR:-default}` (`$${`
    /// is a literal `${`); every secret may come from a file instead: `api_keys_file` (one key
    /// per line), `admin_token_file`, `api_key_file`, `token_file`, `auth_token_file` (a
    /// relative path is from the working directory, as `ca_file`), read at start and at
    /// every reload.
    Check {
        /// The config file to check.
        #[arg(short, long, value_name = "FILE", env = "TOKENGATE_CONFIG")]
        config: PathBuf,
        /// Print the effective config as YAML on stdout (every key's default filled in, a
        /// service's `scheduler`, `load_balancing` and `engine_queue` as they run, every
        /// credential `***`; a feature left out, such as `throttling` or `mirror`, prints as
        /// `null`: off); the summary line goes to stderr.
        #[arg(long)]
        print: bool,
    },
    /// Print a shell completion script, e.g. `tokengate completions bash >
    /// /etc/bash_completion.d/tokengate` (zsh: into a directory of `$fpath` as `_tokengate`;
    /// fish: `~/.config/fish/completions/tokengate.fish`).
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
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

#[cfg(feature = "bench")]
#[derive(Subcommand)]
enum BenchCmd {
    /// Open-loop replay of a Mooncake-format trace (or `--synthetic` sessions); see bench/README.md.
    Replay(Box<tokengate_bench::ReplayArgs>),
}

/// mimalloc: the proxy allocates and frees many small buffers per request (headers, bodies,
/// futures); glibc malloc cost ~10 % of the gateway's CPU under load (bench/results/overhead.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The log as the environment (`TOKENGATE_LOG_FORMAT`) or else the config asks.
fn init_logging(configured: LogFormat) {
    tokengate::logging::init(LogFormat::from_env_or(configured));
}

fn main() -> ExitCode {
    tokengate::memory::no_huge_pages();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Check { config, print } => check(&config, print),
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
        Cmd::Completions { shell } => {
            use clap::CommandFactory;
            let mut cmd = Cli::command();
            // Written whole: a closed pipe (`| head`) is not a panic.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, "tokengate", &mut script);
            let _ = std::io::stdout().write_all(&script);
            ExitCode::SUCCESS
        }
        #[cfg(feature = "sim")]
        Cmd::Demo { config, time_scale } => {
            // The log format of the demo's config (its errors are reported by the demo).
            init_logging(
                config
                    .as_deref()
                    .and_then(|p| Config::load(p).ok())
                    .map_or(LogFormat::Text, |c| c.log_format),
            );
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
        #[cfg(feature = "bench")]
        Cmd::Bench(BenchCmd::Replay(args)) => {
            init_logging(LogFormat::Text);
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
        #[cfg(feature = "sim")]
        Cmd::EngineSim { args } => {
            init_logging(LogFormat::Text);
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
        Cmd::Serve { config } => serve(config),
    }
}

/// `tokengate check`: loads and builds the config, prints its warnings (names that do not
/// resolve from here among them) and a summary, or its errors.
fn check(config: &std::path::Path, print: bool) -> ExitCode {
    match Config::load(config).and_then(|c| {
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
                print!("{}", c.with_defaults().to_yaml());
                eprintln!("{summary}");
            } else {
                println!("{summary}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let n = e.0.len();
            let s = if n == 1 { "" } else { "s" };
            eprintln!("{}: invalid config ({n} error{s})", config.display());
            for line in e.0 {
                eprintln!("  {line}");
            }
            ExitCode::from(1)
        }
    }
}

/// `tokengate serve`: the config loaded (its errors as log lines when the environment asks for
/// JSON logs), the listeners bound and announced on stdout, then the gateway.
fn serve(config: std::path::PathBuf) -> ExitCode {
    // JSON by the environment: from the first line on (a bad config's errors too).
    let json_env = LogFormat::from_env_or(LogFormat::Text) == LogFormat::Json;
    if json_env {
        init_logging(LogFormat::Json);
    }
    let cfg = match Config::load(&config) {
        Ok(c) => {
            if !json_env {
                init_logging(c.log_format);
            }
            c
        }
        Err(e) if json_env => {
            for line in e.0 {
                log::error!("{}: invalid config: {line}", config.display());
            }
            return ExitCode::from(1);
        }
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
