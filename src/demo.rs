//! `tokengate demo`: a whole fleet in one process. Starts one engine-sim per instance of the
//! demo config (model = service name, id = instance id, on the instance's address; the
//! instances of a prefill/decode-disaggregated service as prefill or decode engines speaking
//! its `pd.mode`, an SGLang prefill with its bootstrap server on its `bootstrap_port`), then
//! the gateway, and prints ready-to-paste requests. Ctrl-C stops everything. An instance
//! address with port 0 gets a free port (used by the tests).

use crate::config::{Config, InstanceRole, PdMode};
use crate::server;
use anyhow::Context;
use std::io::Write;
use std::path::Path;

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
    for s in &mut cfg.services {
        // A disaggregated service's instances play their part in its protocol.
        let pd_mode = s.pd.as_ref().map(|p| match p.mode {
            PdMode::SglangMooncake => engine_sim::PdMode::Sglang,
            PdMode::VllmNixl => engine_sim::PdMode::Vllm,
        });
        for i in &mut s.instances {
            let role = match i.role {
                None => engine_sim::Role::Integrated,
                Some(InstanceRole::Prefill) => engine_sim::Role::Prefill,
                Some(InstanceRole::Decode) => engine_sim::Role::Decode,
            };
            let sim = engine_sim::SimConfig {
                id: i.id.clone(),
                model: s.name.clone(),
                time_scale: opts.time_scale,
                role,
                pd_mode: pd_mode.unwrap_or_default(),
                // An SGLang prefill serves its bootstrap endpoints on the configured port.
                bootstrap_port: i.bootstrap_port,
                ..engine_sim::SimConfig::default()
            };
            let addr = i.addr.as_str().to_string();
            let h = rt
                .block_on(async move {
                    let l = tokio::net::TcpListener::bind(&addr).await?;
                    engine_sim::start(sim, l).await
                })
                .with_context(|| format!("starting engine-sim {} on {}", i.id, i.addr))?;
            // An address with port 0 got a free port: route to where the engine really is.
            i.addr = h.addr.to_string().into();
            handles.push(h);
        }
    }
    // Decision models on loopback (routes' decision services) are played by engine-sims in
    // decision mode.
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
            time_scale: opts.time_scale,
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
        handles.push(h);
    }
    let listeners = server::Listeners::bind(&cfg)?;
    let proxy = listeners
        .proxy_addrs()
        .first()
        .copied()
        .context("no proxy listener")?;
    let admin = listeners.admin_addr().context("no admin listener")?;
    let model = cfg
        .services
        .first()
        .map(|s| s.name.clone())
        .unwrap_or_default();
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "tokengate demo: {} engine-sims", handles.len())?;
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
                    i.id, s.name, i.addr
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
        writeln!(out, "Try:")?;
        writeln!(
            out,
            "  curl -s http://{proxy}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{model}\",\"max_tokens\":16,\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'"
        )?;
        writeln!(
            out,
            "  curl -sN http://{proxy}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{model}\",\"stream\":true,\"max_tokens\":16,\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'"
        )?;
        if let Some(r) = cfg.routes.first() {
            writeln!(
                out,
                "  curl -s http://{proxy}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{}\",\"max_tokens\":16,\"messages\":[{{\"role\":\"user\",\"content\":\"Write a one-line greeting card.\"}}]}}'",
                r.name
            )?;
        }
        writeln!(out, "  curl -s http://{proxy}/v1/models")?;
        writeln!(out, "  curl -s http://{admin}/admin/instances")?;
        writeln!(out, "  curl -s http://{admin}/metrics")?;
        writeln!(out, "Ctrl-C stops the demo.")?;
        out.flush()?;
    }
    // Keep the engines' runtime alive for the life of the process.
    let _keep = (rt, handles);
    server::run(cfg, listeners, None)
}
