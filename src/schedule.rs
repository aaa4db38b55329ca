//! Choosing an instance for a request: the glue between the proxy's load table and the pure
//! pickers in `plugins/`. A request's destination is a service (its scheduler: load
//! balancing, layered or policy) or a route over several services (round-robin over all
//! their instances, target weights then the target's scheduler, or a policy across all).

use crate::api::{Api, RequestInfo};
use crate::error::GatewayError;
use crate::state::{
    now_ms, session_key, Dest, Instance, Picker, Route, RouteMode, Scheduler, Service,
};
use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::Arc;
use tokengate_plugins::rand::rngs::SmallRng;
use tokengate_plugins::rand::SeedableRng;
use tokengate_plugins::{block_hashes, Candidate, Decision, InstanceKey, RequestView, SessionKey};

thread_local! {
    static RNG: RefCell<SmallRng> = RefCell::new(SmallRng::from_rng(tokengate_plugins::rand::thread_rng()).expect("rng"));
}

/// What the pickers read from a request.
pub struct Inputs<'a> {
    pub headers: &'a http::HeaderMap,
    pub info: &'a RequestInfo,
    pub api: Api,
    /// The prompt's block hashes, computed on first use.
    pub blocks: &'a mut Option<Vec<u64>>,
    pub block_bytes: usize,
    /// The decision service's target, if it answered.
    pub decision: Option<u32>,
}

/// Prefix-cache figures of one decision, in blocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefixFigures {
    pub prompt_blocks: u32,
    pub matched: u32,
    pub best: u32,
}

/// Which scheduler decided (to tell it when the request completes).
#[derive(Clone)]
pub enum By {
    Service(Arc<Service>),
    Route(Arc<Route>),
}

/// The outcome of scheduling one attempt.
pub struct Chosen {
    pub service: Arc<Service>,
    pub instance: Arc<Instance>,
    pub reason: Cow<'static, str>,
    pub by: By,
    pub cand: Candidate,
    pub session: Option<SessionKey>,
    pub prefix: Option<PrefixFigures>,
    /// One line with every candidate's numbers (built only when debug logging is on).
    pub explain: Option<String>,
}

impl Chosen {
    /// Bounded label for the decisions counter: the reason up to its first parenthesis.
    pub fn metric_reason(&self) -> &str {
        let r: &str = &self.reason;
        r.split('(').next().unwrap_or(r)
    }
}

fn blocks_of<'b>(inp: &'b mut Inputs<'_>) -> &'b [u64] {
    if inp.blocks.is_none() {
        *inp.blocks = Some(block_hashes(inp.info.prompt.as_bytes(), inp.block_bytes));
    }
    inp.blocks.as_deref().unwrap_or(&[])
}

/// A picker's answer: position in the candidates, reason, session, prefix figures, and the
/// full decision (absent for plain load balancing).
type Picked = (
    usize,
    Cow<'static, str>,
    Option<SessionKey>,
    Option<PrefixFigures>,
    Option<Decision>,
);

/// Runs a scheduler over candidates; returns the decision (or a plain load-balancing pick).
fn run_picker(
    sched: &Scheduler,
    lb: tokengate_plugins::LbPolicy,
    inp: &mut Inputs<'_>,
    cands: &[Candidate],
    turn: u64,
) -> Option<Picked> {
    if let Picker::Balance = sched.picker {
        let p = tokengate_plugins::pick(lb, cands, turn)?;
        return Some((p.pos, Cow::Borrowed(lb.as_str()), None, None, None));
    }
    let session = if sched.session_sources.is_empty() {
        None
    } else {
        let body_ok = matches!(inp.api, Api::Responses | Api::Messages);
        session_key(&sched.session_sources, inp.headers, inp.info, body_ok)
    };
    let decision = inp.decision;
    let blocks: &[u64] = if sched.uses_prefix {
        blocks_of(inp)
    } else {
        &[]
    };
    let view = RequestView {
        session,
        blocks,
        now_ms: now_ms(),
        turn,
        decision,
        prefix: None,
    };
    let d = match &sched.picker {
        Picker::Layered(p) => p.decide(&view, cands)?,
        Picker::Policy(p) => RNG.with(|r| p.decide(&view, cands, &mut *r.borrow_mut()))?,
        Picker::Balance => unreachable!("handled above"),
    };
    let chosen = cands[d.pos];
    match &sched.picker {
        Picker::Layered(p) => p.on_dispatch(&view, &chosen),
        Picker::Policy(p) => p.on_dispatch(&view, &chosen),
        Picker::Balance => {}
    }
    let prefix = sched.uses_prefix.then_some(PrefixFigures {
        prompt_blocks: d.prompt_blocks,
        matched: d.matched_blocks,
        best: d.best_matched_blocks,
    });
    Some((d.pos, d.reason.clone(), session, prefix, Some(d)))
}

fn in_service(svc: &Arc<Service>, inp: &mut Inputs<'_>, tried: &[InstanceKey]) -> Option<Chosen> {
    let cands = svc.candidates(tried);
    let turn = svc.next_turn();
    let (pos, reason, session, prefix, d) = run_picker(&svc.sched, svc.policy, inp, &cands, turn)?;
    let cand = cands[pos];
    let instance = svc.instances[cand.idx].clone();
    let explain = (log::log_enabled!(log::Level::Debug)).then(|| match &d {
        Some(d) => d.explain_with(|i| svc.instances[i].id.clone()),
        None => explain_balance(
            &cands,
            |i| svc.instances[i].id.clone(),
            &instance.id,
            &reason,
        ),
    });
    Some(Chosen {
        service: svc.clone(),
        instance,
        reason,
        by: By::Service(svc.clone()),
        cand,
        session,
        prefix,
        explain,
    })
}

fn explain_balance(
    cands: &[Candidate],
    name: impl Fn(usize) -> String,
    chosen: &str,
    reason: &str,
) -> String {
    let rows: Vec<String> = cands
        .iter()
        .map(|c| {
            format!(
                "{}:req={},tok={},wait={}",
                name(c.idx),
                c.inflight_requests,
                c.inflight_tokens,
                c.waiting
            )
        })
        .collect();
    format!("chose {chosen} by {reason} | {}", rows.join(" "))
}

/// Chooses an instance of `dest` not in `tried`.
pub fn choose(
    dest: &Dest,
    inp: &mut Inputs<'_>,
    tried: &[InstanceKey],
) -> Result<Chosen, GatewayError> {
    let none = || {
        GatewayError::Unavailable(format!(
            "no instance of {:?} is available ({} tried)",
            dest.name(),
            tried.len()
        ))
    };
    match dest {
        Dest::Service(s) => in_service(s, inp, tried).ok_or_else(none),
        Dest::Route(r) => match &r.mode {
            RouteMode::RoundRobin => {
                let cands = r.candidates(tried);
                if cands.is_empty() {
                    return Err(none());
                }
                let pos = (r.next_turn() % cands.len() as u64) as usize;
                let cand = cands[pos];
                let (t, inst) = r.flat(cand.idx).ok_or_else(none)?;
                Ok(Chosen {
                    service: r.targets[t].clone(),
                    instance: inst.clone(),
                    reason: Cow::Borrowed("round-robin"),
                    by: By::Route(r.clone()),
                    cand,
                    session: None,
                    prefix: None,
                    explain: None,
                })
            }
            RouteMode::Weight(w) => {
                let t = w
                    .pick(|t| r.targets[t].has_untried(tried))
                    .ok_or_else(none)?;
                let mut c = in_service(&r.targets[t], inp, tried).ok_or_else(none)?;
                c.reason = Cow::Owned(format!("weight({})+{}", r.targets[t].name, c.reason));
                Ok(c)
            }
            RouteMode::Policy(sched) => {
                let cands = r.candidates(tried);
                let turn = r.next_turn();
                let lb = tokengate_plugins::LbPolicy::LeastRequest;
                let (pos, reason, session, prefix, d) =
                    run_picker(sched, lb, inp, &cands, turn).ok_or_else(none)?;
                let cand = cands[pos];
                let (t, inst) = r.flat(cand.idx).ok_or_else(none)?;
                let explain = log::log_enabled!(log::Level::Debug).then(|| {
                    d.map(|d| {
                        d.explain_with(|i| r.flat(i).map_or(String::new(), |(_, x)| x.id.clone()))
                    })
                    .unwrap_or_default()
                });
                Ok(Chosen {
                    service: r.targets[t].clone(),
                    instance: inst.clone(),
                    reason,
                    by: By::Route(r.clone()),
                    cand,
                    session,
                    prefix,
                    explain,
                })
            }
        },
    }
}

/// Tells the deciding scheduler that the request completed (refreshes session and index).
pub fn on_complete(c: &Chosen, blocks: Option<&[u64]>) {
    let sched = match &c.by {
        By::Service(s) => &s.sched,
        By::Route(r) => match &r.mode {
            RouteMode::Policy(s) => s,
            _ => return,
        },
    };
    let view = RequestView {
        session: c.session,
        blocks: blocks.unwrap_or(&[]),
        now_ms: now_ms(),
        turn: 0,
        decision: None,
        prefix: None,
    };
    match &sched.picker {
        Picker::Layered(p) => p.on_complete(&view, &c.cand),
        Picker::Policy(p) => p.on_complete(&view, &c.cand),
        Picker::Balance => {}
    }
}
