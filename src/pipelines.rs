//! Config → pipelines: the one place where the YAML scheduler settings become the pure
//! pipelines of `tokengate-plugins` (filters, then a picker composed of stages or scorers).
//!
//! Every pipeline starts with the filters `Available → NotTried → HasFreeSlot` (healthy, not
//! tried by this request, a free throttling slot):
//!
//! | config | pipeline |
//! |---|---|
//! | no `scheduler`, no `load_balancing`, more than one instance | as `mode: layered` with its defaults |
//! | no `scheduler` otherwise | filters → [`FirstHit`] with no stage (load balancing) |
//! | `mode: layered` | filters → [`FirstHit`]: [`AffinityStage`] → [`PrefixStage`] → [`LeastCachedStage`] → balancing (`least-token`), the prefix layer comparing the cost of waiting for the prefix's holder with recomputing elsewhere ([`Adaptive`]); with `cluster.placement: rendezvous`, [`RendezvousStage`] before least-cached |
//! | `mode: policy` (service) | filters → [`WeightedSum`] of the plugins' scorers |
//! | `route_by: policy` | the same over every target's instances, with `DecisionTarget` after the filters when a `decision-service` plugin is listed |
//!
//! Adding a scorer: one file in `plugins/src/scorer/` (its parameters, their checks and its
//! [`Scorer`]) and one line in that module's registry; this file builds every plugin through
//! [`PluginSettings::build`](tokengate_plugins::PluginSettings::build).

use crate::api::{Api, RequestInfo};
use crate::config::{
    KeySource, PolicySettings, SchedulerConfig, ServiceConfig, DEFAULT_AFFINITY_TTFT_SLACK,
    DEFAULT_AFFINITY_TTFT_TOLERANCE, DEFAULT_COST_MIN_HIT, DEFAULT_PREFIX_LOAD_TOLERANCE,
    DEFAULT_PREFIX_MIN_HIT, DEFAULT_PREFIX_PLACEMENT, DEFAULT_PREFIX_WAITING_CAP,
    DEFAULT_PREFIX_WAITING_THRESHOLD, DEFAULT_TTFT_SLACK, DEFAULT_TTFT_TOLERANCE,
};
use log::info;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokengate_plugins::{
    Adaptive, AffinityStage, Available, BuildCtx, CostModel, CostTolerance, DecisionTarget,
    Eligibility, Escape, FirstHit, HasFreeSlot, LbPolicy, LeastCachedStage, Needs, NotTried,
    Pipeline, Plugin, PrefixLayerConfig, PrefixStage, RendezvousStage, Role, RoleIs, Scorer,
    SessionConfig, SessionKey, SessionTable, WeightedSum,
};

/// The tolerance of a predicted-TTFT rule, from optional settings.
fn tolerance(t: Option<f64>, slack: Option<Duration>) -> CostTolerance {
    tolerance_or(t, slack, DEFAULT_TTFT_TOLERANCE, DEFAULT_TTFT_SLACK)
}

/// The same with other defaults.
fn tolerance_or(
    t: Option<f64>,
    slack: Option<Duration>,
    default_t: f64,
    default_slack: Duration,
) -> CostTolerance {
    CostTolerance {
        tolerance: t.unwrap_or(default_t),
        slack_ms: slack.unwrap_or(default_slack).as_secs_f64() * 1000.0,
    }
}

/// A pipeline plus what it needs from a request: the session key sources and the session
/// table it binds (when it has a session stage or scorer), and its request counter.
pub struct Scheduler {
    pub pipeline: Pipeline,
    /// What the pipeline reads (computed once).
    pub needs: Needs,
    /// Where the session key comes from, first present wins.
    pub session_sources: Vec<KeySource>,
    /// The session table of the affinity stage or scorer.
    pub sessions: Option<Arc<SessionTable>>,
    /// `layered(affinity→prefix→least-token)`, `policy(affinity*1+inflight*1)`, …
    pub describe: String,
    turn: AtomicU64,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("describe", &self.describe)
            .finish()
    }
}

impl Scheduler {
    fn new(
        pipeline: Pipeline,
        session_sources: Vec<KeySource>,
        sessions: Option<Arc<SessionTable>>,
        describe: String,
    ) -> Self {
        let needs = pipeline.needs();
        Scheduler {
            pipeline,
            needs,
            session_sources,
            sessions,
            describe,
            turn: AtomicU64::new(0),
        }
    }

    /// `layered`, `policy` or `balance`.
    pub fn mode(&self) -> &'static str {
        self.pipeline.mode()
    }

    /// The next value of the request counter (round-robin and tie rotation).
    pub fn next_turn(&self) -> u64 {
        self.turn.fetch_add(1, Relaxed)
    }

    /// The request's session key, when the pipeline reads one.
    pub fn session_key(
        &self,
        headers: &http::HeaderMap,
        info: &RequestInfo,
        api: Api,
    ) -> Option<SessionKey> {
        if !self.needs.contains(Needs::SESSION) {
            return None;
        }
        let body_ok = matches!(api, Api::Responses | Api::Messages);
        session_key(&self.session_sources, headers, info, body_ok)
    }

    /// Frees expired session bindings.
    pub fn sweep(&self, now_ms: u64) {
        if let Some(s) = &self.sessions {
            s.sweep_expired(now_ms);
        }
    }
}

/// The first session key found by `sources`. Body keys count only when `body_keys_allowed`
/// (the Responses and Messages APIs: a chat/completions `user` is not a session).
pub fn session_key(
    sources: &[KeySource],
    headers: &http::HeaderMap,
    info: &RequestInfo,
    body_keys_allowed: bool,
) -> Option<SessionKey> {
    for s in sources {
        let v: Option<&str> = match s {
            KeySource::Header(h) => headers.get(h.as_str()).and_then(|v| v.to_str().ok()),
            KeySource::PromptCacheKey if body_keys_allowed => info.prompt_cache_key.as_deref(),
            KeySource::User if body_keys_allowed => info.user.as_deref(),
            KeySource::MetadataUserId if body_keys_allowed => info.metadata_user_id.as_deref(),
            _ => None,
        };
        if let Some(v) = v.filter(|v| !v.is_empty()) {
            return Some(SessionKey::of(v));
        }
    }
    None
}

/// The session table for `cfg`: the previous scheduler's, when there was one (its bindings
/// survive a reload; a new TTL applies in place, a new size rebuilds it keeping the most
/// recently used bindings), else a fresh one.
fn sessions_for(
    who: &str,
    cfg: SessionConfig,
    prev: Option<&Scheduler>,
    now_ms: u64,
) -> Arc<SessionTable> {
    let Some(old) = prev.and_then(|p| p.sessions.as_ref()) else {
        return Arc::new(SessionTable::new(cfg));
    };
    let was = old.config();
    if was.max_entries != cfg.max_entries {
        info!(
            "{who}: session table resized from {} to {} entries (keeping the most recently used)",
            was.max_entries, cfg.max_entries
        );
        return Arc::new(SessionTable::migrated(cfg, old, now_ms));
    }
    if was.ttl_ms != cfg.ttl_ms {
        info!(
            "{who}: session ttl changed from {} ms to {} ms",
            was.ttl_ms, cfg.ttl_ms
        );
        old.set_ttl_ms(cfg.ttl_ms);
    }
    old.clone()
}

/// The filters every scheduler starts with: available instances, not already tried, with a
/// free throttling slot.
fn base(picker: impl tokengate_plugins::Picker + 'static) -> Pipeline {
    Pipeline::new(picker)
        .filter(Available)
        .filter(NotTried)
        .filter(HasFreeSlot)
}

/// [`base`] restricted to the instances of one role (prefill/decode disaggregation), when
/// given.
fn base_for(picker: impl tokengate_plugins::Picker + 'static, role: Option<Role>) -> Pipeline {
    match role {
        Some(r) => base(picker).filter(RoleIs(r)),
        None => base(picker),
    }
}

/// The decode pipeline of a prefill/decode-disaggregated service: the decode instances,
/// balanced by `pd.decode_policy` (the service's scheduler picks the prefill instance).
pub fn decode(policy: LbPolicy) -> Pipeline {
    base_for(FirstHit::balance(policy), Some(Role::Decode))
}

/// The scheduler of `services[si]`. `prev` is the same service's scheduler before a reload,
/// if it had the same mode (its session table is kept). `rendezvous`: `cluster.placement:
/// rendezvous` (a layered scheduler places new sessions and prefixes by [`RendezvousStage`]).
pub fn service(
    si: usize,
    s: &ServiceConfig,
    prev: Option<&Scheduler>,
    cost: &Arc<CostModel>,
    now_ms: u64,
    rendezvous: bool,
) -> Result<Scheduler, String> {
    let who = format!("service {}", s.name);
    // A disaggregated service's scheduler picks among the prefill instances.
    let role = s.pd.as_ref().map(|_| Role::Prefill);
    // A service that says nothing about scheduling gets the layered scheduler with its
    // defaults (one instance has nothing to choose between; one name with `expand` may be
    // many); `load_balancing` alone is an explicit choice of plain balancing.
    let scheduler = s.effective_scheduler();
    Ok(match scheduler.as_deref() {
        None => {
            let lb = s.load_balancing.unwrap_or(LbPolicy::LeastToken);
            Scheduler::new(
                base_for(FirstHit::balance(lb).with_cost(cost.clone()), role),
                Vec::new(),
                None,
                format!("balance({lb})"),
            )
        }
        Some(SchedulerConfig::Layered {
            affinity,
            prefix,
            least_cached,
        }) => {
            // The layered default balances the requests no layer claimed (new sessions whose
            // prompt is cached nowhere) by in-flight tokens: measured on bench/tail.sh, this
            // spreads new sessions better than placing each where its own first token comes
            // soonest (bench/results/tail.md).
            let lb = s.load_balancing.unwrap_or(LbPolicy::LeastToken);
            let mut fh = FirstHit::balance(lb).with_cost(cost.clone());
            let mut sources = Vec::new();
            let mut sessions = None;
            if let Some(a) = affinity.as_ref().filter(|a| a.enabled) {
                let table = sessions_for(
                    &who,
                    SessionConfig {
                        ttl_ms: a.ttl.as_millis() as u64,
                        max_entries: a.max_entries,
                        ..SessionConfig::default()
                    },
                    prev,
                    now_ms,
                );
                let escape = match a.soft_max_load_ratio {
                    Some(r) => Escape::Load(r),
                    None if a.ttft_tolerance.is_some() || a.ttft_slack.is_some() => {
                        Escape::Cost(tolerance_or(
                            a.ttft_tolerance,
                            a.ttft_slack,
                            DEFAULT_AFFINITY_TTFT_TOLERANCE,
                            DEFAULT_AFFINITY_TTFT_SLACK,
                        ))
                    }
                    // The default: the prefix layer's stay-or-move comparison, for the
                    // session's instance against every other.
                    None => Escape::Adaptive(
                        Adaptive {
                            placement: DEFAULT_PREFIX_PLACEMENT,
                            load_tolerance: DEFAULT_PREFIX_LOAD_TOLERANCE,
                            waiting_cap: DEFAULT_PREFIX_WAITING_CAP,
                        },
                        tolerance_or(
                            None,
                            None,
                            DEFAULT_AFFINITY_TTFT_TOLERANCE,
                            DEFAULT_AFFINITY_TTFT_SLACK,
                        ),
                    ),
                };
                fh = fh.then(AffinityStage::new(a.mode, escape, table.clone()));
                sources = a
                    .headers
                    .iter()
                    .map(|h| KeySource::Header(h.to_ascii_lowercase()))
                    .collect();
                sessions = Some(table);
            }
            if prefix.enabled {
                let p = prefix;
                let (eligibility, min_hit) = if p.ttft_tolerance.is_some() || p.ttft_slack.is_some()
                {
                    // Opt-in: preferred while its predicted TTFT is near the best.
                    let e = Eligibility::Cost(tolerance(p.ttft_tolerance, p.ttft_slack));
                    (e, DEFAULT_COST_MIN_HIT)
                } else if p.fixed_limits() {
                    // The seed's fixed ratios, with its defaults for what is not given.
                    let e = Eligibility::Load {
                        load_tolerance: p.load_tolerance.unwrap_or(0.3),
                        waiting_threshold: p
                            .waiting_threshold
                            .unwrap_or(DEFAULT_PREFIX_WAITING_THRESHOLD),
                    };
                    (e, 0.5)
                } else {
                    // The default: the holder of the prefix while waiting there costs less
                    // than recomputing elsewhere plus the copy's placement (DEFAULT_PREFIX_*).
                    let e = Eligibility::Adaptive(Adaptive {
                        placement: DEFAULT_PREFIX_PLACEMENT,
                        load_tolerance: DEFAULT_PREFIX_LOAD_TOLERANCE,
                        waiting_cap: DEFAULT_PREFIX_WAITING_CAP,
                    });
                    (e, DEFAULT_PREFIX_MIN_HIT)
                };
                fh = fh.then(PrefixStage(PrefixLayerConfig {
                    min_hit_ratio: p.min_hit_ratio.unwrap_or(min_hit),
                    eligibility,
                }));
            }
            if rendezvous {
                // Replicas that share nothing agree where a new session or prefix goes.
                fh = fh.then(RendezvousStage::default());
            }
            if least_cached.enabled {
                fh = fh.then(LeastCachedStage(tolerance(
                    least_cached.ttft_tolerance,
                    least_cached.ttft_slack,
                )));
            }
            let describe = format!("layered({})", fh.describe());
            Scheduler::new(base_for(fh, role), sources, sessions, describe)
        }
        Some(SchedulerConfig::Policy(ps)) => policy(
            &who,
            &format!("services[{si}].scheduler.plugins"),
            ps,
            prev,
            cost,
            now_ms,
            role,
        )?,
    })
}

/// The policy scheduler of a service or a route (`route_by: policy`). A `decision-service`
/// plugin becomes the [`DecisionTarget`] filter; the others are scorers. `path` is the
/// settings' YAML path, for errors.
pub fn policy(
    who: &str,
    path: &str,
    ps: &PolicySettings,
    prev: Option<&Scheduler>,
    cost: &Arc<CostModel>,
    now_ms: u64,
    role: Option<Role>,
) -> Result<Scheduler, String> {
    let mut sessions = None;
    let mut decision = false;
    let mut scorers: Vec<(Arc<dyn Scorer>, f64)> = Vec::new();
    {
        let mut table = || {
            sessions
                .get_or_insert_with(|| {
                    sessions_for(
                        who,
                        SessionConfig {
                            ttl_ms: ps.session_ttl.as_millis() as u64,
                            max_entries: ps.session_max_entries,
                            ..SessionConfig::default()
                        },
                        prev,
                        now_ms,
                    )
                })
                .clone()
        };
        let mut ctx = BuildCtx::new(cost, &mut table);
        for p in &ps.plugins {
            match p.build(&mut ctx) {
                Plugin::Scorer(sc) => scorers.push((sc, p.weight().unwrap_or(1.0))),
                Plugin::DecisionTarget => decision = true,
            }
        }
    }
    let describe = format!(
        "policy({}{})",
        if decision { "decision|" } else { "" },
        scorers
            .iter()
            .map(|(s, w)| format!("{}*{w}", s.name()))
            .collect::<Vec<_>>()
            .join("+")
    );
    let picker = WeightedSum::new(scorers).map_err(|e| format!("{path}: {e}"))?;
    let mut pipeline = base_for(picker, role);
    if decision {
        pipeline = pipeline.filter(DecisionTarget);
    }
    Ok(Scheduler::new(
        pipeline,
        ps.session_keys.clone(),
        sessions,
        describe,
    ))
}
