//! `tokengate demo`: a whole fleet in one process. Starts one engine-sim per instance of the
//! demo config (model = the service's served `model`, else its name; id = instance id, on the instance's address; the
//! instances of a prefill/decode-disaggregated service as prefill or decode engines speaking
//! its `pd.mode`, an SGLang prefill with its bootstrap server on its `bootstrap_port`), then
//! the gateway, and prints ready-to-paste requests. Ctrl-C stops everything. An instance
//! address with port 0 gets a free port (used by the tests).

use crate::config::{Config, InstanceConfig, InstanceRole, PdMode, ServiceConfig};
use crate::server;
use anyhow::Context;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The built-in demo config (conf/demo.yaml).
pub const DEMO_YAML: &str = include_str!("../conf/demo.yaml");

/// Options of the demo's engines.
pub struct DemoOptions {
    /// Speed-up of the simulated engines (1 = real-time H100-like timing).
    pub time_scale: f64,
}

pub fn run(config: Option<&Path>, opts: DemoOptions) -> anyhow::Result<()> {
    let mut cfg = match config {
        Some(p) => Config::load(p).map_err(|e| anyhow::anyhow!("{}:\n{e}", p.display()))?,
        None => Config::from_yaml(DEMO_YAML).map_err(|e| anyhow::anyhow!("demo config: {e}"))?,
    };
    // The engines run on their own runtime thread; the gateway's Pingora server owns main.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name("engine-sim")
        .build()
        .context("engine-sim runtime")?;
    let mut handles = Vec::new();
    // Where each instance's engine really is (an address with port 0 got a free one).
    let mut running: HashMap<(String, String), String> = HashMap::new();
    for s in &mut cfg.services {
        let snapshot = s.clone();
        for i in &mut s.instances {
            let h = start_engine(rt.handle(), &snapshot, i, opts.time_scale)?;
            // Route to where the engine really is.
            i.addr = h.addr.to_string().into();
            running.insert((s.name.clone(), i.id.clone()), i.addr.to_string());
            handles.push(h);
        }
    }
    // Decision models on loopback (routes' decision services) are played by engine-sims in
    // decision mode.
    start_decision_engines(&mut cfg, &rt, opts.time_scale, &mut running, &mut handles)?;
    // `-c FILE`: the gateway reloads a copy of the file with the engines' real addresses,
    // rewritten whenever the file changes (new instances get engines of their own).
    let reloads = match config {
        Some(p) => {
            let copy = copy_path(p);
            write_copy(
                p,
                &copy,
                &mut running,
                rt.handle(),
                opts.time_scale,
                &mut handles,
            )
            .context("writing the demo's copy of the config")?;
            let source = crate::reload::ReloadSource::new(copy.clone());
            let watched = p.to_path_buf();
            let handle = rt.handle().clone();
            let time_scale = opts.time_scale;
            std::thread::Builder::new()
                .name("demo-watch".into())
                .spawn(move || watch(watched, copy, running, handle, time_scale))
                .context("starting the config watcher")?;
            Some(source)
        }
        None => None,
    };
    let listeners = server::Listeners::bind(&cfg)?;
    let proxy = listeners
        .proxy_addrs()
        .first()
        .copied()
        .context("no proxy listener")?;
    let admin = listeners.admin_addr().context("no admin listener")?;
    print_banner(&cfg, handles.len(), proxy, admin)?;
    // Keep the engines' runtime alive for the life of the process.
    let _keep = (rt, handles);
    server::run(cfg, listeners, reloads)
}

/// Engine-sims in decision mode for the providers on loopback (the decision models of routes'
/// decision services), each recorded in `running` and kept in `handles`.
fn start_decision_engines(
    cfg: &mut Config,
    rt: &tokio::runtime::Runtime,
    time_scale: f64,
    running: &mut HashMap<(String, String), String>,
    handles: &mut Vec<engine_sim::SimHandle>,
) -> anyhow::Result<()> {
    let route_models: Vec<(String, String)> = cfg
        .routes
        .iter()
        .filter_map(|r| r.decision.as_ref())
        .filter_map(|d| Some((d.provider.clone(), d.model.clone()?)))
        .collect();
    for p in &mut cfg.providers {
        // The model the sim serves: the provider's, else the first route's that asks it.
        let model = p.model.clone().or_else(|| {
            route_models
                .iter()
                .find(|(n, _)| *n == p.name)
                .map(|(_, m)| m.clone())
        });
        let Some(model) = model else { continue };
        let Some(hostport) = p
            .base_url
            .strip_prefix("http://")
            .and_then(|r| r.split('/').next())
            .filter(|h| h.starts_with("127.0.0.1:") || h.starts_with("localhost:"))
            .map(str::to_string)
        else {
            continue;
        };
        let sim = engine_sim::SimConfig {
            id: p.name.clone(),
            model,
            time_scale,
            decision_mode: true,
            ..engine_sim::SimConfig::default()
        };
        let bind = hostport.replace("localhost:", "127.0.0.1:");
        let h = rt
            .block_on(async move {
                let l = tokio::net::TcpListener::bind(&bind).await?;
                engine_sim::start(sim, l).await
            })
            .with_context(|| format!("starting decision engine-sim {} on {hostport}", p.name))?;
        p.base_url = format!("http://{}/v1", h.addr);
        running.insert((PROVIDER.into(), p.name.clone()), p.base_url.clone());
        handles.push(h);
    }
    Ok(())
}

/// What the demo runs and requests to paste, on stdout.
fn print_banner(
    cfg: &Config,
    engines: usize,
    proxy: std::net::SocketAddr,
    admin: std::net::SocketAddr,
) -> std::io::Result<()> {
    let model = cfg
        .services
        .first()
        .map(|s| s.name.clone())
        .unwrap_or_default();
    let mut out = std::io::stdout().lock();
    writeln!(out, "tokengate demo: {engines} engine-sims")?;
    for s in &cfg.services {
        for i in &s.instances {
            let role = match i.role {
                None => String::new(),
                Some(InstanceRole::Prefill) => match i.bootstrap_port {
                    Some(p) => format!(" (prefill, bootstrap port {p})"),
                    None => " (prefill)".into(),
                },
                Some(InstanceRole::Decode) => " (decode)".into(),
            };
            writeln!(
                out,
                "  engine-sim {:<10} model {:<12} http://{}{role}",
                i.id,
                s.served(),
                i.addr
            )?;
        }
    }
    for p in &cfg.providers {
        writeln!(
            out,
            "  decision model {} ({}) at {}",
            p.name,
            p.model.as_deref().unwrap_or("per route"),
            p.base_url
        )?;
    }
    for r in &cfg.routes {
        let t: Vec<&str> = r.targets.iter().map(|t| t.service.as_str()).collect();
        writeln!(out, "  route {} -> {}", r.name, t.join(", "))?;
    }
    writeln!(out, "tokengate: proxy listening on http://{proxy}")?;
    writeln!(out, "tokengate: admin listening on http://{admin}")?;
    writeln!(out)?;
    // The key is not printed (it may come from a secret): the commands read it from
    // $TOKENGATE_KEY.
    let auth = if cfg.api_keys.is_empty() && cfg.tenants.is_empty() {
        String::new()
    } else {
        writeln!(
            out,
            "The config requires an API key: export TOKENGATE_KEY=<one of its api_keys or tenants' keys> first."
        )?;
        " -H \"Authorization: Bearer $TOKENGATE_KEY\"".to_string()
    };
    writeln!(out, "Try:")?;
    writeln!(
        out,
        "  curl -s http://{proxy}/v1/chat/completions{auth} -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{model}\",\"max_tokens\":16,\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'"
    )?;
    writeln!(
        out,
        "  curl -sN http://{proxy}/v1/chat/completions{auth} -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{model}\",\"stream\":true,\"max_tokens\":16,\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'"
    )?;
    if let Some(r) = cfg.routes.first() {
        writeln!(
            out,
            "  curl -s http://{proxy}/v1/chat/completions{auth} -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{}\",\"max_tokens\":16,\"messages\":[{{\"role\":\"user\",\"content\":\"Write a one-line greeting card.\"}}]}}'",
            r.name
        )?;
    }
    writeln!(out, "  curl -s http://{proxy}/v1/models{auth}")?;
    writeln!(out, "  curl -s http://{admin}/admin/instances")?;
    writeln!(out, "  curl -s http://{admin}/metrics")?;
    writeln!(out, "Ctrl-C stops the demo.")?;
    out.flush()?;
    Ok(())
}

/// The key of a provider's decision engine in the running table.
const PROVIDER: &str = "\u{0}provider";

/// Where the demo keeps its copy of `config`: `.NAME.demo.yaml` beside it (gone with its
/// directory, overwritten by the next demo), or in the temp directory when that directory
/// is not writable.
fn copy_path(config: &Path) -> PathBuf {
    let name = config
        .file_name()
        .map_or("config".into(), |n| n.to_string_lossy().to_string());
    let dir = config
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let beside = dir.join(format!(".{name}.demo.yaml"));
    let writable = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&beside)
        .is_ok();
    if writable {
        beside
    } else {
        std::env::temp_dir().join(format!("tokengate-demo-{}.yaml", std::process::id()))
    }
}

/// Starts the engine-sim of one instance of `s` on its address.
fn start_engine(
    rt: &tokio::runtime::Handle,
    s: &ServiceConfig,
    i: &InstanceConfig,
    time_scale: f64,
) -> anyhow::Result<engine_sim::SimHandle> {
    // A disaggregated service's instances play their part in its protocol.
    let pd_mode = s.pd.as_ref().map(|p| match p.mode {
        PdMode::SglangMooncake => engine_sim::PdMode::Sglang,
        PdMode::VllmNixl => engine_sim::PdMode::Vllm,
    });
    let role = match i.role {
        None => engine_sim::Role::Integrated,
        Some(InstanceRole::Prefill) => engine_sim::Role::Prefill,
        Some(InstanceRole::Decode) => engine_sim::Role::Decode,
    };
    let sim = engine_sim::SimConfig {
        id: i.id.clone(),
        model: s.served().to_string(),
        time_scale,
        role,
        pd_mode: pd_mode.unwrap_or_default(),
        // An SGLang prefill serves its bootstrap endpoints on the configured port.
        bootstrap_port: i.bootstrap_port,
        ..engine_sim::SimConfig::default()
    };
    let addr = i.addr.as_str().to_string();
    rt.block_on(async move {
        let l = tokio::net::TcpListener::bind(&addr).await?;
        engine_sim::start(sim, l).await
    })
    .with_context(|| format!("starting engine-sim {} on {}", i.id, i.addr))
}

/// Writes `copy`: the config at `path` with every instance's (and decision provider's)
/// address replaced by where its engine runs; an instance without an engine gets one.
fn write_copy(
    path: &Path,
    copy: &Path,
    running: &mut HashMap<(String, String), String>,
    rt: &tokio::runtime::Handle,
    time_scale: f64,
    handles: &mut Vec<engine_sim::SimHandle>,
) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut doc: serde_yaml_ng::Value = match serde_yaml_ng::from_str(&text) {
        Ok(v) => v,
        // Not YAML: copied as it is, for the reload to report.
        Err(_) => return Ok(std::fs::write(copy, text)?),
    };
    // New instances need engines: start them from the parsed config (a bad file starts none).
    if let Ok(cfg) = Config::load(path) {
        for s in &cfg.services {
            for i in &s.instances {
                let key = (s.name.clone(), i.id.clone());
                if let std::collections::hash_map::Entry::Vacant(slot) = running.entry(key) {
                    match start_engine(rt, s, i, time_scale) {
                        Ok(h) => {
                            log::info!("demo: started engine-sim {} on {}", i.id, h.addr);
                            slot.insert(h.addr.to_string());
                            handles.push(h);
                        }
                        Err(e) => log::warn!("demo: {e:#}"),
                    }
                }
            }
        }
    }
    let field =
        |m: &serde_yaml_ng::Value, k: &str| m.get(k).and_then(|v| v.as_str()).map(str::to_string);
    if let Some(services) = doc.get_mut("services").and_then(|v| v.as_sequence_mut()) {
        for s in services {
            let Some(name) = field(s, "name") else {
                continue;
            };
            let Some(insts) = s.get_mut("instances").and_then(|v| v.as_sequence_mut()) else {
                continue;
            };
            for i in insts {
                let Some(id) = field(i, "id") else { continue };
                if let (Some(addr), Some(m)) =
                    (running.get(&(name.clone(), id)), i.as_mapping_mut())
                {
                    m.insert("addr".into(), addr.clone().into());
                }
            }
        }
    }
    if let Some(providers) = doc.get_mut("providers").and_then(|v| v.as_sequence_mut()) {
        for p in providers {
            let Some(name) = field(p, "name") else {
                continue;
            };
            if let (Some(url), Some(m)) = (
                running.get(&(PROVIDER.to_string(), name)),
                p.as_mapping_mut(),
            ) {
                m.insert("base_url".into(), url.clone().into());
            }
        }
    }
    // Written whole, then moved into place: the reload never reads half a file.
    // Only this user may read it (the file may hold keys).
    let tmp = copy.with_extension("yaml.tmp");
    {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(serde_yaml_ng::to_string(&doc)?.as_bytes())?;
    }
    std::fs::rename(&tmp, copy)?;
    Ok(())
}

/// Rewrites the copy whenever the config file changes (checked twice a second, as the
/// gateway checks the copy), for the rest of the process.
fn watch(
    path: PathBuf,
    copy: PathBuf,
    mut running: HashMap<(String, String), String>,
    rt: tokio::runtime::Handle,
    time_scale: f64,
) {
    let stamp = |p: &Path| {
        std::fs::metadata(p)
            .ok()
            .map(|m| (m.modified().ok(), m.len()))
    };
    let mut handles = Vec::new();
    let mut last = stamp(&path);
    loop {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let now = stamp(&path);
        if now.is_none() || now == last {
            continue;
        }
        last = now;
        if let Err(e) = write_copy(&path, &copy, &mut running, &rt, time_scale, &mut handles) {
            log::warn!(
                "demo: {} changed but cannot be reloaded: {e:#}",
                path.display()
            );
        }
    }
}
