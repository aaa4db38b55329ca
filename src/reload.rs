//! Hot reload: on SIGHUP, or when the config file changes, the file is read and validated;
//! a bad file keeps the running config (the error, with its YAML path, is logged and
//! counted); a good one is swapped in atomically.
//!
//! **Only complete files are applied.** The watcher checks the file's identity (device and
//! inode), size and modification time four times a second. A file changed in place (an
//! editor or `cp` truncating and rewriting it) is applied once it has not moved for
//! `reload.debounce` (2 s by default): a writer that pauses half-way — say after the part
//! before `api_keys` — never has its half file served, even though that half parses. A file
//! replaced whole (a rename: editors' atomic saves; a symlink swap: Kubernetes ConfigMaps)
//! is complete when it appears and applies at the next check. The files the config's
//! `*_file` secrets name are watched the same way (a Kubernetes Secret mounted as files is
//! updated by a symlink swap: a rotated key applies within a check, without a restart).
//! `reload.watch: false` turns the watcher off; SIGHUP always reloads at once. A reload
//! that removes authentication (`api_keys`, `admin_token`) or more than half of a service's
//! instances is applied and logged as a warning naming it. Reading and building run on a
//! blocking thread, off the proxy's async workers.
//!
//! Requests in flight keep the state they started with; instances that still exist (same
//! id and address) keep their load counters and health, services that still exist keep
//! their prefix index (a new `ttl` applies), and schedulers that still bind sessions keep
//! their bindings (a new TTL applies in place, a new `max_entries` rebuilds the table
//! keeping the most recently used bindings); a new `maintenance_interval` applies after the
//! wait in progress. Listen addresses, threads, `shutdown_grace`, `tracing` and `cluster` change
//! only on restart.
//! Instance addresses given by name are re-resolved every
//! [`crate::resolve::RERESOLVE_EVERY`]; a name that points elsewhere reloads the file (the
//! moved instance starts with fresh counters).

use crate::config::Config;
use crate::runtime::Runtime;
use crate::shared::Shared;
use log::{error, info, warn};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Where reloads come from, set up before the gateway announces its listeners: the config
/// file as it was loaded (a change after that is a reload), and SIGHUP caught from then on
/// (without it, a SIGHUP arriving before the reload loop runs would end the process).
pub struct ReloadSource {
    pub path: PathBuf,
    loaded: Option<Stamp>,
    /// The secret files the loaded config names, as they were loaded.
    secrets: Vec<(PathBuf, Option<Stamp>)>,
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
            secrets: secret_stamps(&path),
            path,
            hup,
        }
    }
}

/// The secret files (`*_file`) the config file at `config` names, each with its stamp now.
fn secret_stamps(config: &std::path::Path) -> Vec<(PathBuf, Option<Stamp>)> {
    let text = std::fs::read_to_string(config).unwrap_or_default();
    crate::config_source::secret_file_paths(&text)
        .into_iter()
        .map(|p| {
            let s = stamp(&p);
            (p, s)
        })
        .collect()
}

/// A settle state for each secret file.
fn settles(stamps: Vec<(PathBuf, Option<Stamp>)>) -> Vec<(PathBuf, Settle)> {
    stamps
        .into_iter()
        .map(|(p, s)| (p, Settle::new(s)))
        .collect()
}

pub struct Reloader {
    pub source: ReloadSource,
    pub shared: Arc<Shared>,
    /// The settings that need a restart, as started.
    pub listen: Vec<String>,
    pub admin_listen: String,
}

/// One version of the config file as the file system shows it (through symlinks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    modified: SystemTime,
    len: u64,
}

fn stamp(p: &std::path::Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).ok()?;
    Some(Stamp {
        dev: m.dev(),
        ino: m.ino(),
        modified: m.modified().ok()?,
        len: m.len(),
    })
}

/// When a changed file is complete enough to apply (see the module docs).
#[derive(Debug)]
struct Settle {
    /// The version last applied (or rejected: it is not read again until it changes).
    applied: Option<Stamp>,
    /// A version seen since, and when it was first seen.
    seen: Option<(Stamp, Instant)>,
}

impl Settle {
    fn new(applied: Option<Stamp>) -> Settle {
        Settle {
            applied,
            seen: None,
        }
    }

    /// Looks at the file as it is `now`; true when this version is to be applied.
    fn observe(&mut self, now: Option<Stamp>, at: Instant, debounce: Duration) -> bool {
        // A missing file is the middle of a swap (or a mistake): wait for it to come back.
        let Some(cur) = now else {
            self.seen = None;
            return false;
        };
        if Some(cur) == self.applied {
            self.seen = None;
            return false;
        }
        match self.seen {
            Some((s, since)) if s == cur => {
                let replaced = self
                    .applied
                    .is_none_or(|a| (a.dev, a.ino) != (cur.dev, cur.ino));
                let wait = if replaced { Duration::ZERO } else { debounce };
                if at.saturating_duration_since(since) >= wait {
                    self.applied = Some(cur);
                    self.seen = None;
                    return true;
                }
                false
            }
            _ => {
                self.seen = Some((cur, at));
                false
            }
        }
    }

    /// A reload happened outside the watcher (SIGHUP) on the file as it is now.
    fn reset(&mut self, now: Option<Stamp>) {
        self.applied = now;
        self.seen = None;
    }
}

/// What a new runtime takes away that the running one had and that a half-written or
/// mistaken file would take away: authentication, or most of a service's instances.
fn removals(old: &Runtime, new: &Runtime) -> Vec<String> {
    let mut w = Vec::new();
    if !old.tenants.is_empty() && new.tenants.is_empty() {
        // (`api_keys` and every tenant's keys.)
        w.push("`api_keys` removed: the proxy now accepts requests without a key".to_string());
    }
    if old.admin_token.is_some() && new.admin_token.is_none() {
        w.push("`admin_token` removed: `/metrics` and `/admin/*` are now open".to_string());
    }
    for s in &old.ordered {
        let before = s.instances.len();
        match new.services.get(&s.name) {
            None => w.push(format!(
                "service {}: removed with its {before} instance(s)",
                s.name
            )),
            Some(n) if n.instances.len() * 2 < before => w.push(format!(
                "service {}: {} of its {before} instances removed",
                s.name,
                before - n.instances.len()
            )),
            Some(_) => {}
        }
    }
    w
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
                match self.shared.set_tracing(cfg.tracing.as_ref()) {
                    Ok(true) => match self.shared.otel.load().as_ref() {
                        Some(o) => info!(
                            "config reload: tracing: spans exported to {} (OTLP/{})",
                            o.url, o.protocol
                        ),
                        None => info!("config reload: tracing off"),
                    },
                    Ok(false) => {}
                    Err(e) => warn!("config reload: tracing unchanged: {e}"),
                }
                let cluster = cfg
                    .cluster
                    .as_ref()
                    .filter(|c| c.redis.is_some())
                    .map(crate::cluster::settings_key);
                if cluster != self.shared.cluster.as_ref().map(|c| c.settings_key.clone()) {
                    warn!("config reload: cluster changes take effect only after a restart");
                }
                for w in cfg.warnings() {
                    warn!("config: {w}");
                }
                for w in removals(&old, &rt) {
                    warn!("config reload: {w}");
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
        let p = self.source.path.clone();
        let cfg = tokio::task::spawn_blocking(move || Config::load(&p))
            .await
            .ok()?
            .ok()?;
        let rt = self.shared.runtime.load_full();
        for s in &cfg.services {
            for i in s
                .instances
                .iter()
                .filter(|i| crate::resolve::is_name(&i.addr))
            {
                if i.expand {
                    // One instance per address: the set of addresses is what counts.
                    let stem = format!("{}/", i.id);
                    let running: Vec<std::net::SocketAddr> = rt
                        .services
                        .get(&s.name)
                        .into_iter()
                        .flat_map(|s| s.instances.iter())
                        .filter(|x| x.id.starts_with(&stem))
                        .map(|x| x.addr)
                        .collect();
                    let mut running = running;
                    running.sort();
                    if let Ok(now) = crate::resolve::resolve_all(&i.addr).await {
                        if !now.is_empty() && now != running {
                            return Some(format!(
                                "instance {}: {} now resolves to {now:?} (was {running:?}): one instance per address",
                                i.id, i.addr
                            ));
                        }
                    }
                    continue;
                }
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

    /// Reloads on a blocking thread (reading the file and resolving names must not stall
    /// an async worker).
    async fn reload_off_thread(self: &Arc<Self>) {
        let me = self.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || me.reload()).await {
            error!("config reload failed: {e}");
        }
    }

    fn watch_settings(&self) -> (bool, Duration) {
        let rt = self.shared.runtime.load();
        (rt.reload.watch, rt.reload.debounce)
    }

    /// Reloads on SIGHUP and on file changes until `stop` fires.
    pub async fn run(self, mut stop: pingora::server::ShutdownWatch) {
        let me = Arc::new(self);
        let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                warn!("cannot listen for SIGHUP ({e}); reloading on file changes only");
                None
            }
        };
        let path = me.source.path.clone();
        let mut settle = Settle::new(me.source.loaded);
        let mut secrets = settles(me.source.secrets.clone());
        let mut tick = tokio::time::interval(CHECK_EVERY);
        let every = me.shared.runtime.load().reload.resolve_every;
        let mut names = tokio::time::interval(every);
        names.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => {
                    // Both handlers saw it: one reload.
                    me.source.hup.store(false, Ordering::Relaxed);
                    info!("SIGHUP: reloading {}", path.display());
                    settle.reset(stamp(&path));
                    secrets = settles(secret_stamps(&path));
                    me.reload_off_thread().await;
                }
                _ = tick.tick() => {
                    if me.source.hup.swap(false, Ordering::Relaxed) {
                        info!("SIGHUP: reloading {}", path.display());
                        settle.reset(stamp(&path));
                        secrets = settles(secret_stamps(&path));
                        me.reload_off_thread().await;
                        continue;
                    }
                    let (watch, debounce) = me.watch_settings();
                    if !watch {
                        continue;
                    }
                    let now = Instant::now();
                    // Every secret file is looked at (each settles on its own).
                    let changed: Vec<PathBuf> = secrets
                        .iter_mut()
                        .filter_map(|(p, s)| s.observe(stamp(p), now, debounce).then(|| p.clone()))
                        .collect();
                    if settle.observe(stamp(&path), now, debounce) {
                        info!("{} changed: reloading", path.display());
                    } else if let Some(p) = changed.first() {
                        info!("{} changed: reloading {}", p.display(), path.display());
                    } else {
                        continue;
                    }
                    // The secret files of the file as it is now (taken before it is read: a
                    // change while it is read is seen at the next check).
                    secrets = settles(secret_stamps(&path));
                    me.reload_off_thread().await;
                }
                _ = names.tick() => {
                    if let Some(what) = me.name_moved().await {
                        info!("{what}: reloading {}", path.display());
                        secrets = settles(secret_stamps(&path));
                        me.reload_off_thread().await;
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

/// How often the watcher looks at the file.
const CHECK_EVERY: Duration = Duration::from_millis(250);

#[cfg(test)]
mod tests {
    use super::*;

    fn st(ino: u64, len: u64, secs: u64) -> Option<Stamp> {
        Some(Stamp {
            dev: 1,
            ino,
            modified: SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
            len,
        })
    }

    #[test]
    fn in_place_change_waits_until_settled() {
        let d = Duration::from_secs(2);
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut s = Settle::new(st(7, 100, 1));
        assert!(!s.observe(st(7, 100, 1), at(0), d), "unchanged");
        // Truncated and half written, then a 1.2 s pause: never applied.
        assert!(!s.observe(st(7, 40, 2), at(250), d));
        assert!(!s.observe(st(7, 40, 2), at(1450), d));
        // The rest is written: the clock starts again.
        assert!(!s.observe(st(7, 100, 3), at(1700), d));
        assert!(!s.observe(st(7, 100, 3), at(3600), d));
        assert!(s.observe(st(7, 100, 3), at(3700), d), "settled for 2 s");
        assert!(!s.observe(st(7, 100, 3), at(3950), d), "applied once");
    }

    #[test]
    fn replaced_file_applies_at_the_next_check() {
        let d = Duration::from_secs(2);
        let t0 = Instant::now();
        let mut s = Settle::new(st(7, 100, 1));
        // Mid-swap the path may be missing.
        assert!(!s.observe(None, t0, d));
        assert!(!s.observe(st(8, 90, 2), t0 + CHECK_EVERY, d));
        assert!(s.observe(st(8, 90, 2), t0 + 2 * CHECK_EVERY, d));
        // A SIGHUP reload resets what counts as applied.
        s.reset(st(8, 95, 3));
        assert!(!s.observe(st(8, 95, 3), t0 + 3 * CHECK_EVERY, d));
    }
}
