//! Phase 4, **complete**: how each leg ended goes back where it is learned from. The load
//! guard returns the leg's counters (completed / errors / cancelled); the instance's passive
//! health counts a failure or a success; the scheduler hears the outcome (a completed
//! request refreshes its session binding); the service's prefix index refreshes the prompt
//! on success; the metrics (per model and service: tokens, prefix ceiling / predicted /
//! engine hits, TTFT, duration, status) and one access-log line record the request; a
//! mirrored request's figures go to its mirror log line ([`crate::mirror`]).
//!
//! [`finish`] runs once per request, from Pingora's `logging` hook, whatever path the request
//! took; [`attempt_failed`] ends an attempt that is retried on another instance.

use super::{global, linger, pd, Ctx, Guard, LegRole, LocalLeg, Plan, TenantState, To};
use crate::clock::now_ms;
use crate::load::Outcome;
use crate::runtime::{Instance, Runtime, Service};
use crate::shared::Shared;
use crate::usage::Usage;
use log::info;
use pingora::prelude::*;
use pingora::proxy::Session;
use std::sync::Arc;
use tokengate_plugins::{Completion, RequestView};

/// A traced request's prefill leg: its span ends as the prefill did.
fn trace_prefill(trace: Option<&mut crate::otel::Trace>, state: Option<pd::State>) {
    use crate::otel::PrefillEnd;
    let (Some(t), Some(s)) = (trace, state) else {
        return;
    };
    let message;
    t.prefill_end(match s {
        pd::State::Done { usage, ms } => PrefillEnd::Done {
            ms,
            input_tokens: usage.prompt,
        },
        pd::State::Failed(f) => {
            message = f.message;
            PrefillEnd::Failed(&message)
        }
        pd::State::Aborted => PrefillEnd::Aborted,
        pd::State::Running => PrefillEnd::Running,
    });
}

/// Feeds a request's outcome to the instance's passive health.
fn passive(inst: &Arc<Instance>, failed: bool, rt: &Runtime, now: u64) {
    inst.passive(failed, &rt.passive, now);
}

/// Tells the leg's scheduler how it ended.
fn feedback(leg: &LocalLeg, plan: &Plan, done: &Completion, now: u64) {
    let Some(s) = leg.by.scheduler() else { return };
    let view = RequestView {
        session: leg.session,
        blocks: &plan.blocks,
        now_ms: now,
        ..RequestView::default()
    };
    s.pipeline.on_complete(&view, &leg.cand, done);
}

/// A member gateway's answer, for `tokengate_global_requests_total{member,outcome}`.
/// (An external entry of the split proxy: `tokengate_split_requests_total{entry,outcome}`.)
fn count_remote(shared: &Shared, r: &super::RemoteLeg, outcome: &str) {
    let m = if r.entry.is_some() {
        &shared.metrics.split_requests
    } else {
        &shared.metrics.global_requests
    };
    m.with_label_values(&[r.endpoint.name.as_str(), outcome])
        .inc();
}

/// The current attempt failed and the request is retried elsewhere (or answered with an
/// error). 5xx and connect failures count against the instance's passive health; a 429
/// (busy, not broken) does not: ejecting busy engines under overload would turn a slowdown
/// into an outage. A disaggregated pair blames one instance (see [`super::pd`]): the
/// prefill when it failed (its own task already counted its health), else the decode; the
/// other one is not counted and may serve the retry; a prefill still running is aborted.
pub fn attempt_failed(shared: &Shared, ctx: &mut Ctx, plan: &Plan, retried_status: Option<u16>) {
    let now = now_ms();
    let mut pd = ctx.pd.take();
    if ctx.trace.is_some() {
        let state = pd.as_ref().map(|a| a.side.state());
        trace_prefill(ctx.trace.as_mut(), state);
    }
    let prefill_failed = pd.as_ref().is_some_and(|a| a.side.failure().is_some());
    if let Some(a) = pd.as_mut() {
        ctx.attempt.tried.push(a.blamed());
        if !prefill_failed {
            a.abort_prefill();
        }
    }
    for leg in std::mem::take(&mut ctx.legs) {
        match (leg.role, leg.to) {
            (LegRole::Main, To::Local(l)) => {
                let blamed = !prefill_failed;
                if blamed && retried_status.is_none_or(|s| s >= 500) {
                    passive(&l.instance, true, &plan.runtime, now);
                }
                feedback(&l, plan, &Completion::of(Outcome::Failed), now);
                l.guard.finish(if blamed {
                    Outcome::Failed
                } else {
                    Outcome::Cancelled
                });
            }
            (LegRole::Prefill, To::Local(l)) => {
                let o = if prefill_failed {
                    Outcome::Failed
                } else {
                    Outcome::Cancelled
                };
                feedback(&l, plan, &Completion::of(o), now);
                l.guard.finish(o);
            }
            (_, To::Remote(r)) => {
                let outcome = if retried_status.is_some() {
                    "refused"
                } else {
                    "error"
                };
                count_remote(shared, &r, outcome);
            }
        }
    }
}

/// What a completed leg teaches the gateway's models: the cost model gets the leg's prefill
/// work and time to first token (and its time per output token); the prefix index is
/// corrected when the engine reported fewer cached tokens than the index predicted (the
/// engine evicted the tail), then given the prompt again (the engine just computed it).
fn learn(
    shared: &Shared,
    leg: &LocalLeg,
    dispatched: Option<std::time::Instant>,
    plan: &Plan,
    ctx: &Ctx,
    u: Usage,
    now: u64,
) {
    // How the engine's tokenizer counts against the gateway's estimate.
    if let Some(p) = u.prompt {
        leg.instance
            .engine
            .observe_prompt(p, plan.info.prompt_tokens_est);
    }
    // What the engine really had to prefill, when it said, in the gateway's estimated tokens
    // (the unit the cost model predicts in).
    let uncached = match (u.prompt, u.cached) {
        (Some(p), Some(c)) => {
            let ratio = leg.instance.engine.tokens_per_estimate().unwrap_or(1.0);
            (p.saturating_sub(c) as f64 / ratio) as u64
        }
        _ => leg.uncached_tokens,
    };
    if let (Some(at), Some(ttft)) = (dispatched, ctx.response.ttft) {
        let since_start = at.saturating_duration_since(ctx.start);
        let ttft_leg = ttft.saturating_sub(since_start);
        let tpot = match (plan.info.stream, u.completion) {
            (true, Some(n)) if n > 1 => {
                let decode = ctx.start.elapsed().saturating_sub(ttft);
                Some(decode.as_secs_f64() * 1000.0 / (n - 1) as f64)
            }
            _ => None,
        };
        // Non-stream answers arrive whole: their "first token" is the last one, no prefill
        // time can be read from them.
        if plan.info.stream {
            plan.runtime.cost.observe(
                leg.instance.key,
                &tokengate_plugins::Observation {
                    queued_tokens: leg.queued_ahead,
                    uncached_tokens: uncached,
                    ttft_ms: ttft_leg.as_secs_f64() * 1000.0,
                    tpot_ms: tpot,
                },
            );
        }
    }
    // Self-correction, in the engine's units (its block size, its token count): the index
    // forgets what the engine reported it no longer holds, beyond the rounding of its blocks
    // (`tokengate_plugins::calibrate`).
    if let (Some(prompt), Some(cached)) = (u.prompt, u.cached) {
        leg.instance.engine.observe_cached(cached);
        if let Some(keep) = calibration(leg, plan, prompt, cached).trim_to {
            let idx = &leg.service.index;
            idx.trim(&plan.blocks, leg.instance.key, keep);
            idx.insert(&plan.blocks, leg.instance.key, now);
            super::cluster::trimmed(shared, plan, leg, keep);
        }
    }
}

/// The index's match for this leg against what its engine reported
/// ([`tokengate_plugins::calibrate::check`]).
fn calibration(
    leg: &LocalLeg,
    plan: &Plan,
    prompt: u64,
    cached: u64,
) -> tokengate_plugins::calibrate::Check {
    tokengate_plugins::calibrate::check(
        plan.blocks.len(),
        leg.prefix.matched,
        prompt,
        cached,
        leg.instance.engine_block_tokens(),
    )
}

/// Whether the instance is to blame: an upstream-side error, or a 5xx it answered.
fn upstream_failed(e: Option<&Error>, upstream_status: Option<u16>) -> bool {
    e.is_some_and(|e| e.esource() == &pingora::ErrorSource::Upstream)
        || upstream_status.is_some_and(|s| s >= 500)
}

/// The request's tenant: its ticket settled with what the request used (the engine's
/// counts; without them, the estimate for what evidently ran: the prompt of a dispatched
/// request, the reserved output of an answer that started), its requests and tokens
/// counted, or the limit that refused it.
fn tenant_accounting(
    shared: &Shared,
    ctx: &Ctx,
    ticket: Option<crate::tenants::Ticket>,
    outcome: Outcome,
    u: Usage,
    served: bool,
) {
    let Some(TenantState { tenant: t, refused }) = ctx.tenant.as_ref() else {
        return;
    };
    let m = &shared.metrics.tenants;
    if let Some(reason) = *refused {
        m.rejections.with_label_values(&[&t.name, reason]).inc();
        return;
    }
    let (Some(plan), Some(ticket)) = (ctx.plan.as_ref(), ticket) else {
        return;
    };
    let (_, reserved_out) = ticket.reserved();
    let started = ctx.response.first_token || (served && outcome == Outcome::Completed);
    let input = u.prompt.unwrap_or(if served {
        plan.info.prompt_tokens_est
    } else {
        0
    });
    let output = u
        .completion
        .unwrap_or(if started { reserved_out } else { 0 });
    ticket.settle(input, output);
    t.count(m, plan.dest.name(), input, output);
}

/// How the answer ended, the `outcome` of `tokengate_requests_total` and the access line:
/// `complete` (whatever its status), `truncated` (the status was sent, then the answer broke
/// off: an engine that died mid-stream, `timeouts.total`), `client_left` (the client hung up
/// before the end), `left_queue` (it hung up while queued for a throttling slot),
/// `no_response` (the connection ended with nothing sent, not by the client).
fn ended_as(ctx: &Ctx, e: Option<&Error>, status: u16, client_left: bool) -> &'static str {
    if ctx.refused.as_ref().is_some_and(|r| r.left_queue) {
        "left_queue"
    } else if client_left {
        "client_left"
    } else if status == 0 {
        "no_response"
    } else if e.is_none() || ctx.local_status.is_some() {
        "complete"
    } else {
        "truncated"
    }
}

/// What served a request: its main, dispatched leg.
#[derive(Default)]
struct Served {
    /// The leg's name (an instance, an external upstream, another region's gateway).
    by: Option<String>,
    /// The metric's instance label: a pair's decode instance (its prefill instance is in
    /// tokengate_pd_prefill_total; pairs would multiply the label values).
    id: Option<String>,
    /// The local service that served it.
    service: Option<Arc<Service>>,
}

/// A disaggregated pair's prefill, as its legs' completion sees it.
struct PrefillEnd {
    /// The prefill's own usage (its cached tokens are the prefix cache's truth).
    usage: Option<Usage>,
    /// The decode failed because its prefill did.
    failed: bool,
}

/// Each leg's outcome: remote legs counted; local ones into passive health, the scheduler's
/// feedback, the engine's learned figures, the prefix index and the hit-rate counters, and
/// their load guards released (the main leg's held while `lingering`: an answer that did not
/// reach its end, the engine may still be running it, [`super::linger`]).
#[allow(clippy::too_many_arguments)]
fn settle_legs(
    shared: &Shared,
    ctx: &Ctx,
    plan: &Plan,
    legs: Vec<super::Leg>,
    outcome: Outcome,
    u: Usage,
    prefill: PrefillEnd,
    mut lingering: Option<linger::Held>,
) -> Served {
    let mut served = Served::default();
    let now = now_ms();
    for leg in legs {
        let dispatched = leg.dispatched;
        let dispatched_ms = leg.dispatched_ms;
        let role = leg.role;
        if dispatched.is_some() && role == LegRole::Main {
            served.by = Some(leg.name().to_string());
            if let To::Local(l) = &leg.to {
                if l.label.is_some() {
                    served.id = Some(l.instance.id.clone());
                }
            }
        }
        let l = match leg.to {
            To::Local(l) => l,
            To::Remote(r) => {
                if dispatched.is_some() {
                    let refusal = |s: u16| match r.entry {
                        Some(_) => super::split::fails_over_on(s),
                        None => global::REFUSALS.contains(&s),
                    };
                    let o = match (outcome, ctx.response.upstream_status) {
                        (Outcome::Completed, _) => "ok",
                        (_, Some(s)) if refusal(s) => "refused",
                        (Outcome::Cancelled, _) => "cancelled",
                        _ => "error",
                    };
                    count_remote(shared, &r, o);
                }
                continue;
            }
        };
        // A prefill leg's health was counted when its prefill ended; a decode that
        // failed because its prefill did is not to blame.
        if dispatched.is_some() && role == LegRole::Main {
            match outcome {
                Outcome::Failed if !prefill.failed => {
                    passive(&l.instance, true, &plan.runtime, now)
                }
                Outcome::Completed => passive(&l.instance, false, &plan.runtime, now),
                _ => {}
            }
        }
        if l.instance.role == tokengate_plugins::Role::Decode {
            // The decode instance holds no prompt for the index and no scheduler state.
            l.guard.finish(outcome);
            continue;
        }
        let u = match (role, prefill.usage) {
            (LegRole::Prefill, Some(p)) => Usage {
                prompt: p.prompt.or(u.prompt),
                cached: p.cached.or(u.cached),
                completion: u.completion,
            },
            _ => u,
        };
        let done = Completion {
            outcome,
            ttft_ms: match (dispatched, ctx.response.ttft) {
                (Some(d), Some(t)) => {
                    let since_dispatch = d.saturating_duration_since(ctx.start);
                    Some(t.saturating_sub(since_dispatch).as_secs_f64() * 1e3)
                }
                _ => None,
            },
            prompt_tokens: u.prompt,
            cached_tokens: u.cached,
        };
        feedback(&l, plan, &done, now);
        if outcome == Outcome::Completed {
            learn(shared, &l, dispatched, plan, ctx, u, now);
        }
        if dispatched.is_some() {
            // Refresh the prompt's last use (the index keeps whole ticks: a request that
            // ended within the tick of its dispatch, when the index inserted it, has
            // nothing to refresh).
            use tokengate_plugins::prefix::TICK_MS;
            if outcome == Outcome::Completed && dispatched_ms / TICK_MS != now / TICK_MS {
                l.service.index.touch(&plan.blocks, l.instance.key, now);
            }
            // The hit-rate figures of every routed request, per service.
            let c = &l.service.counters;
            let bt = plan.runtime.block_tokens as u64;
            c.prefix_prompt
                .inc_by(u64::from(l.prefix.prompt_blocks) * bt);
            c.prefix_ceiling.inc_by(u64::from(l.prefix.best) * bt);
            c.prefix_predicted.inc_by(u64::from(l.prefix.matched) * bt);
            if let (Some(prompt), Some(cached)) = (u.prompt, u.cached) {
                c.engine_prompt.inc_by(prompt);
                c.engine_cached.inc_by(cached);
                // The index's prediction for the same request in the engine's units.
                c.engine_predicted
                    .inc_by(calibration(&l, plan, prompt, cached).expected);
            }
            if let Some(p) = u.prompt {
                c.tokens_prompt.inc_by(p);
            }
            if let Some(x) = u.completion {
                c.tokens_completion.inc_by(x);
                if outcome == Outcome::Completed {
                    l.service.output.observe(x);
                }
            }
            if let Some(x) = u.cached {
                c.tokens_cached.inc_by(x);
            }
            served.service = Some(l.service.clone());
        }
        match (role, l.guard) {
            // A dispatched prefill's load is released by whoever ends it (below).
            (LegRole::Prefill, Guard::Shared(_)) => {}
            (LegRole::Main, g) if dispatched.is_some() && lingering.is_some() => {
                if let Some(held) = lingering.take() {
                    linger::release_after(
                        held,
                        plan.runtime.timeouts.idle,
                        linger::step_allowance(ctx.response.max_gap),
                        move || g.finish(outcome),
                    );
                }
            }
            (_, g) => g.finish(outcome),
        }
    }
    served
}

/// `logging`: completes the request. Runs exactly once per request (for a request whose
/// body went to a subrequest, in the subrequest).
pub fn finish(shared: &Shared, session: &Session, e: Option<&Error>, ctx: &mut Ctx) {
    if ctx.delegated {
        return; // the subrequest that carried this request completes it
    }
    let status = ctx
        .local_status
        .or_else(|| session.response_written().map(|r| r.status.as_u16()))
        .unwrap_or(0);
    let client_left = e.is_some_and(|e| e.esource() == &pingora::ErrorSource::Downstream);
    let outcome = if ctx.deadline_hit || upstream_failed(e, ctx.response.upstream_status) {
        Outcome::Failed
    } else if client_left {
        Outcome::Cancelled
    } else if e.is_some() || status == 0 {
        Outcome::Failed
    } else {
        Outcome::Completed
    };
    let u = ctx.response.usage;
    let legs = std::mem::take(&mut ctx.legs);
    // A disaggregated pair: the prefill's own usage (its cached tokens are the prefix
    // cache's truth), and whether the decode failed because its prefill did.
    let pd = ctx.pd.take();
    if ctx.trace.is_some() {
        let state = pd.as_ref().map(|a| a.side.state());
        trace_prefill(ctx.trace.as_mut(), state);
    }
    let prefill = PrefillEnd {
        usage: pd.as_ref().and_then(|a| match a.side.state() {
            pd::State::Done { usage, .. } => Some(usage),
            _ => None,
        }),
        failed: pd.as_ref().is_some_and(|a| a.side.failure().is_some()),
    };
    // The tenant's ticket first: once the load table shows the request gone, so does
    // its tenant.
    let ticket = ctx.plan.as_mut().and_then(|p| p.ticket.take());
    let dispatched = legs
        .iter()
        .any(|l| l.role == LegRole::Main && l.dispatched.is_some());
    tenant_accounting(shared, ctx, ticket, outcome, u, dispatched);
    // The traced request's served leg: the engine's model, its address, the predicted hit.
    let traced = match (&ctx.trace, ctx.plan.as_ref()) {
        (Some(t), Some(plan)) if t.recording() => legs
            .iter()
            .filter(|l| l.role == LegRole::Main && l.dispatched.is_some())
            .find_map(|l| l.local())
            .map(|l| {
                (
                    l.service.served.clone(),
                    l.instance.addr.to_string(),
                    u64::from(l.prefix.matched) * plan.runtime.block_tokens as u64,
                )
            }),
        _ => None,
    };
    // An answer that did not reach its end: the engine may still be running it; the main
    // leg's load and slot are held until it lets go ([`super::linger`]).
    let lingering = if outcome != Outcome::Completed && !ctx.response.ended {
        ctx.upstream.take()
    } else {
        None
    };
    let served = match ctx.plan.as_ref() {
        Some(plan) => settle_legs(shared, ctx, plan, legs, outcome, u, prefill, lingering),
        None => Served::default(),
    };
    if let Some(a) = pd {
        a.end(outcome);
    }
    let instance = served.by.as_deref().unwrap_or("-");
    let ended = ended_as(ctx, e, status, client_left);
    let dur = ctx.start.elapsed();
    count(shared, ctx, &served, status, outcome, ended, dur);
    // Nothing of the access line is formatted when its target is off: the ids neither.
    let access = log::log_enabled!(target: "access", log::Level::Info);
    let trace_ids = finish_trace(
        ctx,
        e,
        status,
        outcome,
        traced,
        served.by.as_deref(),
        access,
    );
    if access {
        access_line(session, ctx, e, status, ended, instance, dur, trace_ids);
    }
}

/// The request in the metrics (`tokengate_requests_total`, duration, TTFT, the GenAI
/// histograms, the split proxy's local entry), to its followers (a mirror copy), and on the
/// status page's recent requests.
fn count(
    shared: &Shared,
    ctx: &mut Ctx,
    served: &Served,
    status: u16,
    outcome: Outcome,
    ended: &str,
    dur: std::time::Duration,
) {
    let m = &shared.metrics;
    let u = ctx.response.usage;
    let instance = served.by.as_deref().unwrap_or("-");
    let mut model: &str = match (&ctx.plan, &ctx.refused) {
        (Some(p), _) => p.dest.name(),
        (None, Some(r)) => &r.model,
        (None, None) => "-",
    };
    if let Some(s) = served.service.as_ref() {
        model = s.name.as_str();
        // The split proxy's local entry.
        if ctx.plan.as_ref().is_some_and(|p| p.runtime.split.is_some()) {
            let o = match outcome {
                Outcome::Completed => "ok",
                Outcome::Cancelled => "cancelled",
                _ => "error",
            };
            m.split_requests.with_label_values(&["local", o]).inc();
        }
    }
    let code = status.to_string();
    let metric_instance = served.id.as_deref().unwrap_or(instance);
    m.requests
        .with_label_values(&[model, metric_instance, code.as_str(), ended])
        .inc();
    if !ctx.followers.is_empty() {
        let ended = crate::hook::Ended {
            instance: instance.to_string(),
            status,
            ttft: ctx.response.ttft,
            duration: dur,
            usage: u,
        };
        for f in ctx.followers.drain(..) {
            f.on_complete(&ended);
        }
    }
    if ctx.plan.is_some() {
        m.duration
            .with_label_values(&[model])
            .observe(dur.as_secs_f64());
    }
    let stream = ctx.plan.as_ref().is_some_and(|r| r.info.stream);
    if let (true, Some(t)) = (stream, ctx.response.ttft) {
        m.ttft.with_label_values(&[model]).observe(t.as_secs_f64());
    }
    if let Some(p) = ctx.plan.as_ref() {
        let (operation, provider) = crate::genai_metrics::operation_of(p.api);
        shared.genai.observe(&crate::genai_metrics::Observation {
            operation,
            provider,
            model,
            error_type: if status >= 400 {
                code.as_str()
            } else if outcome == Outcome::Failed {
                "error"
            } else {
                ""
            },
            ttft: ctx.response.ttft.filter(|_| stream),
            duration: dur,
            input_tokens: u.prompt,
            output_tokens: u.completion,
        });
    }
    shared.status.record(&crate::status::recent::Finished {
        request_id: &ctx.request_id,
        model: ctx.plan.as_ref().map_or("-", |r| r.info.model.as_str()),
        instance,
        status,
        // A request the gateway answered itself: its error says why.
        reason: match ctx.local_error.as_deref() {
            Some(e) if ctx.reason.is_empty() => e,
            _ => &ctx.reason,
        },
        stream,
        routed: ctx.plan.is_some(),
        ttft: ctx.response.ttft,
        duration: dur,
        prompt_tokens: u.prompt,
        completion_tokens: u.completion,
        cached_tokens: u.cached,
    });
}

/// The served leg of a traced request: the engine's model, its address, the predicted hit.
type Traced = (String, String, u64);

/// The request's trace ends: a sampled request's spans finish; the request's trace and span
/// ids for the access line (when `access`, the line being on).
fn finish_trace(
    ctx: &mut Ctx,
    e: Option<&Error>,
    status: u16,
    outcome: Outcome,
    traced: Option<Traced>,
    instance: Option<&str>,
    access: bool,
) -> Option<(String, String)> {
    let t = ctx.trace.take()?;
    let u = ctx.response.usage;
    let ids = access.then(|| t.ids());
    // An unsampled request has no span to finish.
    if t.recording() {
        let error_type = if status >= 500 {
            Some(status.to_string())
        } else if outcome == Outcome::Failed {
            Some(e.map_or_else(|| "error".to_string(), |e| e.etype().as_str().to_string()))
        } else {
            None
        };
        let (model, address, predicted) = match &traced {
            Some((m, a, p)) => (Some(m.as_str()), Some(a.clone()), Some(*p)),
            None => (None, None, None),
        };
        t.finish(&crate::otel::Finished {
            status,
            upstream_status: ctx.response.upstream_status,
            upstream_failed: upstream_failed(e, ctx.response.upstream_status),
            error_type,
            response_model: model,
            input_tokens: u.prompt,
            output_tokens: u.completion,
            cached_tokens: u.cached,
            instance,
            address,
            reason: &ctx.reason,
            predicted_tokens: predicted,
            ttft: ctx.response.ttft,
        });
    }
    ids
}

/// The access line (`access` log target, info).
#[allow(clippy::too_many_arguments)]
fn access_line(
    session: &Session,
    ctx: &Ctx,
    e: Option<&Error>,
    status: u16,
    ended: &str,
    instance: &str,
    dur: std::time::Duration,
    trace_ids: Option<(String, String)>,
) {
    let u = ctx.response.usage;
    let stream = ctx.plan.as_ref().is_some_and(|r| r.info.stream);
    let req = session.req_header();
    let mut err = match &trace_ids {
        Some((t, s)) => format!(" trace_id={t} span_id={s}"),
        None => String::new(),
    };
    match (e, ctx.local_error.as_deref()) {
        (_, Some(m)) => err.push_str(&format!(" error={m:?}")),
        (Some(e), None) => err.push_str(&format!(" error={:?}", e.to_string())),
        _ => {}
    }
    info!(
        target: "access",
        "{} {} {} model={} tenant={} instance={} status={} outcome={} ttft_ms={} dur_ms={:.1} prompt_tokens={} completion_tokens={} cached_tokens={} reason={} id={}{}",
        req.method,
        req.uri.path(),
        if stream { "stream" } else { "unary" },
        ctx.plan
            .as_ref()
            .map(|r| r.info.model.as_str())
            .or(ctx.refused.as_ref().map(|r| r.model.as_str()))
            .unwrap_or("-"),
        ctx.tenant().map_or("-", |t| t.name.as_str()),
        instance,
        status,
        ended,
        ctx.response
            .ttft
            .map_or("-".to_string(), |t| format!("{:.1}", t.as_secs_f64() * 1e3)),
        dur.as_secs_f64() * 1e3,
        u.prompt.map_or("-".into(), |v| v.to_string()),
        u.completion.map_or("-".into(), |v| v.to_string()),
        u.cached.map_or("-".into(), |v| v.to_string()),
        if ctx.reason.is_empty() { "-" } else { ctx.reason.as_ref() },
        ctx.request_id,
        err,
    );
}
