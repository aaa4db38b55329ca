//! Hot reload: on SIGHUP, or when the config file changes (checked every second), the file is
//! read and validated; a bad file keeps the running config (the error, with its YAML path, is
//! logged and counted); a good one is swapped in atomically. Requests in flight keep the
//! state they started with; instances that still exist (same id and address) keep their load
//! counters and health, services that still exist keep their prefix index (a new `ttl`
//! applies), and schedulers that still bind sessions keep their bindings (a new TTL applies in
//! place, a new `max_entries` rebuilds the table keeping the most recently used bindings); a
//! new `maintenance_interval` applies after the wait in progress. Listen addresses, threads and `shutdown_grace` change only on
//! restart. Instance addresses given by name are re-resolved every
//! [`crate::resolve::RERESOLVE_EVERY`]; a name that points elsewhere reloads the file (the
//! moved instance starts with fresh counters).

use crate::config::Config;
use crate::runtime::Runtime;
use crate::shared::Shared;
use log::{error, info, warn};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// Where reloads come from, set up before the gateway announces its listeners: the config
/// file as it was loaded (a change after that is a reload), and SIGHUP caught from then on
/// (without it, a SIGHUP arriving before the reload loop runs would end the process).
pub struct ReloadSource {
    pub path: PathBuf,
    loaded: Option<(SystemTime, u64)>,
    hup: Arc<AtomicBool>,
}

impl ReloadSource {
    /// Takes the file's stamp and starts catching SIGHUP.
    pub fn new(path: PathBuf) -> ReloadSource {
        let hup = Arc::new(AtomicBool::new(false));
        if let Err(e) = signal_hook::flag::register(signal_hook::consts::SIGHUP, hup.clone()) {
            warn!("cannot catch SIGHUP ({e}); reloading on file changes only");
        }
        ReloadSource {
            loaded: stamp(&path),
            path,
            hup,
        }
    }
}

pub struct Reloader {
    pub source: ReloadSource,
    pub shared: Arc<Shared>,
    /// The settings that need a restart, as started.
    pub listen: Vec<String>,
    pub admin_listen: String,
}

fn stamp(p: &std::path::Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(p).ok()?;
    Some((m.modified().ok()?, m.len()))
}

impl Reloader {
    /// Reads, validates and swaps in the config file. Returns whether it was applied.
    pub fn reload(&self) -> bool {
        let m = &self.shared.metrics;
        let old = self.shared.runtime.load_full();
        let built = Config::load(&self.source.path).and_then(|cfg| {
            let rt = Runtime::build(&cfg, Some(&old), m)?;
            Ok((cfg, rt))
        });
        match built {
            Ok((cfg, rt)) => {
                if cfg.listen != self.listen || cfg.admin_listen != self.admin_listen {
                    warn!(
                        "config reload: listen / admin_listen changes take effect only after a restart"
                    );
                }
                for w in cfg.warnings() {
                    warn!("config: {w}");
                }
                self.shared.install(rt);
                m.reloads.with_label_values(&["ok"]).inc();
                m.reload_ok.set(1);
                self.shared.status.reloaded(true, "");
                info!(
                    "config reloaded from {}: {} services, {} routes",
                    self.source.path.display(),
                    cfg.services.len(),
                    cfg.routes.len()
                );
                true
            }
            Err(e) => {
                m.reloads.with_label_values(&["error"]).inc();
                m.reload_ok.set(0);
                self.shared.status.reloaded(false, &e.0.join("\n"));
                error!(
                    "config reload from {} rejected, keeping the running config:\n  {}",
                    self.source.path.display(),
                    e.0.join("\n  ")
                );
                false
            }
        }
    }

    /// Re-resolves the instances addressed by name. A name that stops resolving makes its
    /// instance unavailable (and available again once it resolves); returns, described for
    /// the log, the first instance whose name now points elsewhere than its running address
    /// (the config is then reloaded, which resolves it anew).
    async fn name_moved(&self) -> Option<String> {
        let cfg = Config::load(&self.source.path).ok()?;
        let rt = self.shared.runtime.load_full();
        for s in &cfg.services {
            for i in s
                .instances
                .iter()
                .filter(|i| crate::resolve::is_name(&i.addr))
            {
                let Some(running) = rt
                    .ordered
                    .iter()
                    .flat_map(|s| s.instances.iter())
                    .find(|x| x.id == i.id)
                else {
                    continue;
                };
                let now = match crate::resolve::resolve_all(&i.addr).await {
                    Ok(all) if !all.is_empty() => all,
                    r => {
                        if running.health.set_resolved(false) {
                            warn!(
                                "instance {}: {} does not resolve ({}); it gets no requests until it does",
                                i.id,
                                i.addr,
                                r.err().unwrap_or_else(|| "no address".into())
                            );
                        }
                        continue;
                    }
                };
                if !now.contains(&running.addr) {
                    return Some(format!(
                        "instance {}: {} now resolves to {now:?} (was {})",
                        i.id, i.addr, running.addr
                    ));
                }
                if running.health.set_resolved(true) {
                    info!("instance {}: {} resolves again", i.id, i.addr);
                }
            }
        }
        None
    }

    /// Reloads on SIGHUP and on file changes until `stop` fires.
    pub async fn run(self, mut stop: pingora::server::ShutdownWatch) {
        let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                warn!("cannot listen for SIGHUP ({e}); reloading on file changes only");
                None
            }
        };
        let path = self.source.path.clone();
        let mut last = self.source.loaded;
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let mut names = tokio::time::interval(crate::resolve::RERESOLVE_EVERY);
        names.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    // Both handlers saw it: one reload.
                    self.source.hup.store(false, Ordering::Relaxed);
                    info!("SIGHUP: reloading {}", path.display());
                    last = stamp(&path);
                    self.reload();
                }
                _ = tick.tick() => {
                    if self.source.hup.swap(false, Ordering::Relaxed) {
                        info!("SIGHUP: reloading {}", path.display());
                        last = stamp(&path);
                        self.reload();
                        continue;
                    }
                    let now = stamp(&path);
                    if now.is_some() && now != last {
                        last = now;
                        info!("{} changed: reloading", path.display());
                        self.reload();
                    }
                }
                _ = names.tick() => {
                    if let Some(what) = self.name_moved().await {
                        info!("{what}: reloading {}", path.display());
                        self.reload();
                    }
                }
                r = stop.changed() => {
                    if r.is_err() || *stop.borrow() {
                        return;
                    }
                }
            }
        }
    }
}
