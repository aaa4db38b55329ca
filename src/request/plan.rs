//! Phase 2, **plan**: where the request goes. The `model` resolves to a service or a route
//! (or the default model); the upstream body is prepared (usage injection); a route whose
//! pipeline has the decision filter asks its decision model; the prompt is cut into blocks;
//! then the destination's pipeline picks the instance and the [`Leg`] takes its load guard.
//! A retry picks again ([`pick`]) without the instances already tried.
//!
//! Routes: `round-robin` and `weight` choose a target by smooth weighted round-robin (equal
//! weights for round-robin), then the target's own scheduler picks the instance; `policy`
//! runs one pipeline across every target's instances.

use super::admit::Admitted;
use super::{ChosenBy, Guard, Leg, LegRole, LocalLeg, Plan, PrefixFigures, To};
use crate::api::{self, RequestInfo};
use crate::clock::now_ms;
use crate::error::GatewayError;
use crate::load::Limits;
use crate::load::LoadGuard;
use crate::pipelines::Scheduler;
use crate::runtime::{Dest, Instance, Route, RouteMode, Service};
use crate::shared::Shared;
use crate::throttle::{Scope, Throttle};
use bytes::Bytes;
use log::debug;
use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::Arc;
use std::time::Instant;
use tokengate_plugins::rand::rngs::SmallRng;
use tokengate_plugins::rand::SeedableRng;
use tokengate_plugins::{
    block_hashes, Candidate, Decision, InstanceKey, PrefixMatch, RequestView, Role,
};

thread_local! {
    static RNG: RefCell<SmallRng> = RefCell::new(SmallRng::from_entropy());
}

/// Why no leg could be picked.
pub enum PickError {
    /// No available instance (or none left untried).
    Unavailable(GatewayError),
    /// Instances are available but their throttling slots are taken: the caller rejects or
    /// queues (see [`super::slot`]).
    Throttled(Arc<Throttle>),
}

/// Plans an admitted request: resolves it, prepares its body, asks the decision service
/// when the route uses one, and cuts the prompt into blocks. Returns the plan and the
/// upstream body, or the error to answer with; the main leg is picked next
/// ([`pick`], through [`super::slot`] which applies throttling).
pub async fn plan(
    shared: &Shared,
    a: Admitted,
    start: Instant,
    request_id: &str,
    hop: bool,
) -> Result<(Plan, Bytes), GatewayError> {
    let Admitted {
        api,
        runtime: rt,
        body,
        info,
        ticket,
        fleet_session,
    } = a;
    // The split proxy first: an external entry takes the request as it is.
    let external = rt
        .split
        .as_ref()
        .map(|sp| sp.choose(&info.model))
        .filter(|e| !e.local)
        .map(|e| Dest::Split(e.clone()));
    let Some(dest) = external.or_else(|| rt.resolve(&info.model)) else {
        return Err(GatewayError::ModelNotFound(format!(
            "model {:?} is not served here; GET /v1/models lists the models",
            info.model
        )));
    };
    // The upstream body: the client's bytes unless a feature must rewrite them (the model is
    // rewritten per leg, at dispatch, when a route or the default model sends the request to
    // a service of another name).
    let mut upstream_body = body;
    let mut strip_usage = false;
    if info.stream && api.has_stream_options() && !info.client_wants_usage {
        let injected = if info.has_stream_options {
            set_include_usage(&upstream_body)
        } else {
            api::inject_include_usage(&upstream_body)
        };
        if let Some(b) = injected {
            upstream_body = Bytes::from(b);
            strip_usage = true;
        }
    }
    let (decision, decision_call) = match &dest {
        Dest::Route(r) if r.asks_decision() => ask_decision_service(shared, r, &info).await,
        _ => (None, None),
    };
    let blocks = block_hashes(info.prompt.as_bytes(), rt.block_bytes);
    // The rendered prompt has served (blocks, the decision service): nothing reads it
    // later, and a stream would hold it (about the body's size) for as long as it runs.
    let mut info = info;
    info.prompt = String::new();
    let plan = Plan {
        api,
        forward_auth: rt.tenants.is_empty(),
        info: Arc::new(info),
        dest,
        decision,
        decision_call,
        runtime: rt,
        start,
        request_id: request_id.to_string(),
        blocks,
        strip_usage,
        hop,
        ticket,
        fleet_session,
    };
    Ok((plan, upstream_body))
}

/// Picks the legs of an attempt: an instance of the plan's destination not in `tried`
/// (for a disaggregated service, a prefill and a decode instance: the decode is the main
/// leg, first), each with its load guard — and its throttling slot — taken.
pub fn pick(
    plan: &Plan,
    headers: &http::HeaderMap,
    tried: &[InstanceKey],
) -> Result<Vec<Leg>, PickError> {
    let none = || {
        PickError::Unavailable(GatewayError::Unavailable(format!(
            "no instance of {:?} is available ({} tried)",
            plan.dest.name(),
            tried.len()
        )))
    };
    let ask = Ask {
        plan,
        headers,
        tried,
        now: now_ms(),
    };
    match &plan.dest {
        Dest::Split(e) => super::split::first(plan, e).map_err(PickError::Unavailable),
        Dest::Service(s) => ask.in_service(s)?.ok_or_else(none),
        Dest::Route(r) => match &r.mode {
            RouteMode::Targets { by, wrr } => {
                let t = wrr
                    .pick(|t| r.targets[t].has_untried(tried))
                    .ok_or_else(none)?;
                let mut legs = ask.in_service(&r.targets[t])?.ok_or_else(none)?;
                let leg = &mut legs[0];
                leg.reason = Cow::Owned(format!(
                    "{}({})+{}",
                    by.as_str(),
                    r.targets[t].name,
                    leg.reason
                ));
                Ok(legs)
            }
            RouteMode::Policy(sched) => ask
                .across_route(r, sched)?
                .map(|l| vec![l])
                .ok_or_else(none),
        },
    }
}

/// A pipeline's decision for one request, and the session key it read.
struct Picked {
    d: Decision,
    session: Option<tokengate_plugins::SessionKey>,
    explain: Option<String>,
}

/// What one pick reads: the plan, the client's headers (session keys), the instances already
/// tried and the clock.
struct Ask<'a> {
    plan: &'a Plan,
    headers: &'a http::HeaderMap,
    tried: &'a [InstanceKey],
    now: u64,
}

impl Ask<'_> {
    /// Runs `sched`'s pipeline over `cands` with the prompt's match `m`.
    fn run(
        &self,
        sched: &Scheduler,
        cands: &[Candidate],
        m: &PrefixMatch,
        name: impl Fn(usize) -> String,
    ) -> Option<Picked> {
        let plan = self.plan;
        let session = sched.session_key(self.headers, &plan.info, plan.api);
        let explain = log::log_enabled!(log::Level::Debug);
        let view = RequestView {
            session,
            blocks: &plan.blocks,
            prefix: Some(m),
            now_ms: self.now,
            turn: sched.next_turn(),
            decision: plan.decision,
            exclude: self.tried,
            explain,
            prompt_tokens: plan.info.prompt_tokens_est,
            block_tokens: plan.runtime.block_tokens as u64,
        };
        let d = RNG.with(|r| sched.pipeline.pick(&view, cands, &mut *r.borrow_mut()))?;
        let explain = explain.then(|| format!("{} {}", sched.describe, d.explain_with(name)));
        Some(Picked {
            d,
            session,
            explain,
        })
    }

    /// The load guard of a request on `inst`, within its throttling limits (`None` when a
    /// slot is missing: taken meanwhile by a concurrent request).
    fn guard(
        &self,
        service: &Service,
        inst: &Arc<Instance>,
        uncached: u64,
    ) -> Option<LoadGuard<Instance>> {
        let tokens = self.plan.info.expected_tokens(&service.output);
        let Some(t) = &service.throttle else {
            return Some(LoadGuard::acquire(inst.clone(), tokens, uncached));
        };
        let st = t.settings();
        match st.scope {
            Scope::Instance => {
                LoadGuard::try_acquire(inst.clone(), tokens, uncached, inst.limits, None)
            }
            Scope::Service => {
                // The service's pool: the per-instance limits × its available instances (of
                // the same role).
                let n = service
                    .instances
                    .iter()
                    .filter(|i| i.role == inst.role && i.health.available(self.now))
                    .count()
                    .max(1) as u64;
                let (pool, limits) = match inst.role {
                    Role::Decode => (
                        &t.decode_pool,
                        Limits {
                            prefill: 0,
                            total: st.decode * n,
                        },
                    ),
                    Role::Prefill => (
                        &t.pool,
                        Limits {
                            prefill: st.limits.prefill * n,
                            total: 0,
                        },
                    ),
                    Role::Integrated => (
                        &t.pool,
                        Limits {
                            prefill: st.limits.prefill * n,
                            total: st.limits.total * n,
                        },
                    ),
                };
                LoadGuard::try_acquire(
                    inst.clone(),
                    tokens,
                    uncached,
                    Limits::default(),
                    Some((pool, limits)),
                )
            }
        }
    }

    /// The leg for the picked candidate, holding its load guard and throttling slot (`None`
    /// when the slot was taken meanwhile by a concurrent request).
    fn leg(
        &self,
        service: &Arc<Service>,
        inst: &Arc<Instance>,
        by: ChosenBy,
        cand: Candidate,
        p: Picked,
        role: LegRole,
    ) -> Option<Leg> {
        // The prefill work this request brings to the instance: its prompt minus the prefix
        // the index says the instance holds (none on a decode instance).
        let bt = self.plan.runtime.block_tokens as u64;
        let uncached = match inst.role {
            Role::Decode => 0,
            _ => self
                .plan
                .info
                .prompt_tokens_est
                .saturating_sub(u64::from(p.d.matched_blocks) * bt),
        };
        let guard = self.guard(service, inst, uncached)?;
        Some(Leg {
            role,
            reason: p.d.reason,
            explain: p.explain,
            dispatched: None,
            dispatched_ms: 0,
            to: To::Local(LocalLeg {
                service: service.clone(),
                instance: inst.clone(),
                by,
                cand,
                session: p.session,
                prefix: PrefixFigures {
                    prompt_blocks: p.d.prompt_blocks,
                    matched: p.d.matched_blocks,
                    best: p.d.best_matched_blocks,
                },
                guard: Guard::Held(guard),
                label: None,
                queued_ahead: cand.prefill_tokens,
                uncached_tokens: uncached,
                leases: Vec::new(),
                sent: None,
            }),
        })
    }

    /// No decision, or a slot lost to a concurrent request: throttled when some available,
    /// untried candidate is only missing a slot (or the service pool is full).
    fn throttled(&self, services: &[Arc<Service>], cands: &[Candidate]) -> Option<PickError> {
        let t = services.iter().find_map(|s| s.throttle.clone())?;
        let waiting_for_slot = cands
            .iter()
            .any(|c| c.available && !self.tried.contains(&c.key));
        waiting_for_slot.then_some(PickError::Throttled(t))
    }

    /// `Ok(None)`: nothing available.
    fn in_service(&self, svc: &Arc<Service>) -> Result<Option<Vec<Leg>>, PickError> {
        let cands = svc.candidates(self.now);
        let m = svc.index.match_prefix(&self.plan.blocks, self.now);
        let services = std::slice::from_ref(svc);
        let throttled = || self.throttled(services, &cands).map_or(Ok(None), Err);
        let Some(p) = self.run(&svc.sched, &cands, &m, |i| svc.instances[i].id.clone()) else {
            return throttled();
        };
        let cand = cands[p.d.pos];
        let inst = &svc.instances[cand.idx];
        let by = ChosenBy::Service(svc.clone());
        let Some(pd) = &svc.pd else {
            return match self.leg(svc, inst, by, cand, p, LegRole::Main) {
                Some(l) => Ok(Some(vec![l])),
                None => throttled(),
            };
        };
        // A disaggregated service: the scheduler chose the prefill instance; the decode
        // picker balances the decode instances.
        let view = RequestView {
            now_ms: self.now,
            turn: pd.turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            exclude: self.tried,
            explain: p.explain.is_some(),
            prompt_tokens: self.plan.info.prompt_tokens_est,
            block_tokens: self.plan.runtime.block_tokens as u64,
            ..RequestView::default()
        };
        let Some(d) = RNG.with(|r| pd.decode.pick(&view, &cands, &mut *r.borrow_mut())) else {
            return throttled();
        };
        let dcand = cands[d.pos];
        let dinst = &svc.instances[dcand.idx];
        let dexplain = p
            .explain
            .is_some()
            .then(|| d.explain_with(|i| svc.instances[i].id.clone()));
        let Some(mut prefill) = self.leg(svc, inst, by, cand, p, LegRole::Prefill) else {
            return throttled();
        };
        let decode = Picked {
            d,
            session: None,
            explain: None,
        };
        // The prefill's slot is given back if the decode's is missing.
        let Some(mut main) = self.leg(svc, dinst, ChosenBy::Decode, dcand, decode, LegRole::Main)
        else {
            return throttled();
        };
        main.reason = Cow::Owned(format!("{}+decode({})", prefill.reason, main.reason));
        main.explain = prefill
            .explain
            .take()
            .map(|x| format!("{x} decode: {}", dexplain.unwrap_or_default()));
        if let Some(l) = main.local_mut() {
            let name = format!("{}+{}", inst.id, dinst.id);
            l.label = http::HeaderValue::from_str(&name).ok().map(|h| (name, h));
        }
        Ok(Some(vec![main, prefill]))
    }

    fn across_route(&self, r: &Arc<Route>, sched: &Scheduler) -> Result<Option<Leg>, PickError> {
        let cands = r.candidates(self.now);
        let m = r.match_prefix(&self.plan.blocks, self.now);
        let Some(p) = self.run(sched, &cands, &m, |i| {
            r.flat(i).map_or(String::new(), |(_, x)| x.id.clone())
        }) else {
            return self.throttled(&r.targets, &cands).map_or(Ok(None), Err);
        };
        let cand = cands[p.d.pos];
        let Some((t, inst)) = r.flat(cand.idx) else {
            return Ok(None);
        };
        let svc = r.targets[t].clone();
        let Some(mut l) = self.leg(
            &svc,
            inst,
            ChosenBy::Route(r.clone()),
            cand,
            p,
            LegRole::Main,
        ) else {
            return self.throttled(&r.targets, &cands).map_or(Ok(None), Err);
        };
        if r.asks_decision() {
            // Say what the decision service answered, and whether its target was kept.
            let named = self
                .plan
                .decision
                .and_then(|n| r.targets.get(n as usize))
                .map(|s| s.name.as_str());
            l.reason = Cow::Owned(match named {
                Some(n) if n == svc.name => format!("decision({n})+{}", l.reason),
                Some(n) => format!("decision-unavailable({n})+{}", l.reason),
                None => format!("decision(abstain)+{}", l.reason),
            });
        }
        Ok(Some(l))
    }
}

/// Asks the route's decision service which target fits. Never fails the request: a timeout,
/// an error or an answer naming no target abstains.
async fn ask_decision_service(
    shared: &Shared,
    r: &Route,
    info: &RequestInfo,
) -> (Option<u32>, Option<super::DecisionCall>) {
    let Some((provider, spec)) = r.decision.as_ref() else {
        return (None, None);
    };
    let text = crate::decision::request_text(&info.prompt);
    let started = Instant::now();
    let (outcome, latency) = shared.decision.decide(provider, spec, text).await;
    let m = &shared.metrics;
    m.decision_total
        .with_label_values(&[r.name.as_str(), outcome.label()])
        .inc();
    m.decision_latency
        .with_label_values(&[r.name.as_str()])
        .observe(latency.as_secs_f64());
    debug!(
        "decision service {} ({}) for route {}: {outcome} in {:.1} ms",
        provider.name,
        provider.model,
        r.name,
        latency.as_secs_f64() * 1e3
    );
    let call = super::DecisionCall {
        started,
        latency,
        outcome: outcome.label(),
        model: provider.model.clone(),
    };
    (outcome.target().map(|t| t as u32), Some(call))
}

/// Sets `stream_options.include_usage: true` in a body that already has `stream_options`.
fn set_include_usage(body: &[u8]) -> Option<Vec<u8>> {
    let mut v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let so = v
        .as_object_mut()?
        .get_mut("stream_options")?
        .as_object_mut()?;
    so.insert("include_usage".into(), serde_json::Value::Bool(true));
    serde_json::to_vec(&v).ok()
}
