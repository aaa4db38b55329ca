//! Tenants at run time: the key → tenant lookup, the models a tenant may call, and its rate
//! limits (requests, input tokens and output tokens per minute as token buckets, and
//! requests in flight).
//!
//! A request takes a [`Ticket`] at admission: one request off its bucket, its estimated
//! input and output tokens reserved, one in-flight slot held. [`Ticket::settle`] corrects
//! the reservation with the tokens the answer really used (a stream that ran long is charged
//! its length, the buckets may go below zero and refill from there); a ticket dropped
//! without being settled (the request never reached an engine) gives its tokens back. The
//! in-flight slot is released exactly once either way.
//!
//! Counters live in a [`TenantState`] kept by name across reloads ([`Tenants::build`] with
//! the previous runtime's), so a reload that leaves a tenant in place leaves its buckets
//! and in-flight count as they were; new limits apply from the next request. Counters are
//! per gateway process (several replicas each count their own).

use crate::config::{Priority, TenantConfig, TenantLimits, IMPLICIT_TENANT};
use http::HeaderValue;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

/// Output tokens reserved for a request without `max_tokens`.
pub const DEFAULT_OUTPUT_RESERVE: u64 = crate::load::DEFAULT_EXPECTED_OUTPUT;

const MINUTE_MS: f64 = 60_000.0;

/// A model pattern of `tenants[].models`.
#[derive(Debug, Clone)]
enum Pattern {
    Exact(String),
    Prefix(String),
}

impl Pattern {
    fn of(s: &str) -> Pattern {
        match s.strip_suffix('*') {
            Some(p) => Pattern::Prefix(p.to_string()),
            None => Pattern::Exact(s.to_string()),
        }
    }

    fn matches(&self, model: &str) -> bool {
        match self {
            Pattern::Exact(m) => m == model,
            Pattern::Prefix(p) => model.starts_with(p.as_str()),
        }
    }
}

/// One tenant of the current config.
#[derive(Debug)]
pub struct Tenant {
    pub name: String,
    models: Vec<Pattern>,
    pub priority: Priority,
    pub limits: TenantLimits,
    /// Its counters (shared with the previous config's tenant of the same name).
    pub state: Arc<TenantState>,
}

impl Tenant {
    /// Whether the tenant may call `model` (any of the names it goes by).
    pub fn allows(&self, model: &str) -> bool {
        self.models.iter().any(|p| p.matches(model))
    }
}

/// A tenant's counters.
#[derive(Debug, Default)]
pub struct TenantState {
    inner: Mutex<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    requests: Bucket,
    input: Bucket,
    output: Bucket,
    inflight: u64,
}

/// A per-minute token bucket: `level` units available (below zero after a request used
/// more than it reserved), refilled at the limit per minute up to the limit.
#[derive(Debug, Default, Clone, Copy)]
struct Bucket {
    level: f64,
    at_ms: u64,
    started: bool,
}

impl Bucket {
    fn refill(&mut self, limit: u64, now: u64) {
        let cap = limit as f64;
        if !self.started {
            *self = Bucket {
                level: cap,
                at_ms: now,
                started: true,
            };
            return;
        }
        let dt = now.saturating_sub(self.at_ms) as f64;
        self.level = (self.level + dt * cap / MINUTE_MS).min(cap);
        self.at_ms = now;
    }

    /// How long until `need` units are available.
    fn wait_for(&self, limit: u64, need: f64) -> Duration {
        let missing = need - self.level;
        if missing <= 0.0 {
            return Duration::ZERO;
        }
        Duration::from_millis((missing * MINUTE_MS / limit as f64).ceil() as u64)
    }
}

/// Why a request was refused (the `reason` label of `tokengate_tenant_rejections_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    Requests,
    InputTokens,
    OutputTokens,
    Concurrency,
}

impl Over {
    pub fn reason(self) -> &'static str {
        match self {
            Over::Requests => "requests_per_minute",
            Over::InputTokens => "input_tokens_per_minute",
            Over::OutputTokens => "output_tokens_per_minute",
            Over::Concurrency => "concurrency",
        }
    }
}

/// A refusal: which limit, and when to retry.
#[derive(Debug, Clone, Copy)]
pub struct Refusal {
    pub over: Over,
    pub retry_after: Duration,
}

/// A request's hold on its tenant's limits (see the module docs).
#[derive(Debug)]
pub struct Ticket {
    pub tenant: Arc<Tenant>,
    reserved_in: u64,
    reserved_out: u64,
    done: bool,
    /// The tenant's in-flight slot is still held (released at the answer's end or at
    /// settlement, whichever comes first, exactly once).
    slot: bool,
}

impl Ticket {
    /// Frees the tenant's in-flight slot now (the answer reached its end): a client that
    /// sends its next request as soon as it has read this one's last byte finds the slot
    /// free, though the request is settled (tokens, counters) only later, in `logging`.
    pub fn release_slot(&mut self) {
        if std::mem::replace(&mut self.slot, false) {
            let mut c = self.tenant.state.inner.lock();
            c.inflight = c.inflight.saturating_sub(1);
        }
    }

    /// The (input, output) tokens reserved at admission.
    pub fn reserved(&self) -> (u64, u64) {
        (self.reserved_in, self.reserved_out)
    }

    /// Charges what the request used instead of what was reserved, and releases its
    /// in-flight slot.
    pub fn settle(mut self, input: u64, output: u64) {
        self.end(input, output);
    }

    fn end(&mut self, input: u64, output: u64) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        let now = crate::clock::now_ms();
        let l = &self.tenant.limits;
        let mut guard = self.tenant.state.inner.lock();
        let c = &mut *guard;
        if std::mem::replace(&mut self.slot, false) {
            c.inflight = c.inflight.saturating_sub(1);
        }
        for (b, limit, reserved, used) in [
            (
                &mut c.input,
                l.input_tokens_per_minute,
                self.reserved_in,
                input,
            ),
            (
                &mut c.output,
                l.output_tokens_per_minute,
                self.reserved_out,
                output,
            ),
        ] {
            if let Some(limit) = limit {
                b.refill(limit, now);
                b.level = (b.level + reserved as f64 - used as f64).min(limit as f64);
            }
        }
    }
}

impl Drop for Ticket {
    /// Not settled: the request used nothing (it never reached an engine).
    fn drop(&mut self) {
        self.end(0, 0);
    }
}

impl TenantState {
    /// Admits a request of `input` estimated prompt tokens and `output` reserved output
    /// tokens, or says which limit refuses it. A request larger than a whole minute's
    /// budget is admitted once the bucket is full.
    fn admit(
        &self,
        limits: &TenantLimits,
        input: u64,
        output: u64,
        now: u64,
    ) -> Result<(), Refusal> {
        let mut guard = self.inner.lock();
        let c = &mut *guard;
        if let Some(max) = limits.concurrency {
            if c.inflight >= max {
                return Err(Refusal {
                    over: Over::Concurrency,
                    retry_after: Duration::from_secs(1),
                });
            }
        }
        let checks = [
            (Over::Requests, limits.requests_per_minute, 1),
            (Over::InputTokens, limits.input_tokens_per_minute, input),
            (Over::OutputTokens, limits.output_tokens_per_minute, output),
        ];
        for (over, limit, need) in checks {
            let Some(limit) = limit else { continue };
            let b = match over {
                Over::Requests => &mut c.requests,
                Over::InputTokens => &mut c.input,
                _ => &mut c.output,
            };
            b.refill(limit, now);
            let need = need.min(limit) as f64;
            if b.level < need {
                return Err(Refusal {
                    over,
                    retry_after: b.wait_for(limit, need),
                });
            }
        }
        c.inflight += 1;
        for (b, limit, n) in [
            (&mut c.requests, limits.requests_per_minute, 1),
            (&mut c.input, limits.input_tokens_per_minute, input),
            (&mut c.output, limits.output_tokens_per_minute, output),
        ] {
            if limit.is_some() {
                b.level -= n as f64;
            }
        }
        Ok(())
    }

    /// The `x-ratelimit-*` headers of the tenant's answers: for each per-minute limit its
    /// value, what remains and when the bucket is full again.
    fn headers(&self, limits: &TenantLimits, now: u64) -> Vec<(&'static str, HeaderValue)> {
        let mut c = self.inner.lock();
        let mut out = Vec::with_capacity(9);
        for (unit, limit) in [
            ("requests", limits.requests_per_minute),
            ("input-tokens", limits.input_tokens_per_minute),
            ("output-tokens", limits.output_tokens_per_minute),
        ] {
            let Some(limit) = limit else { continue };
            let b = match unit {
                "requests" => &mut c.requests,
                "input-tokens" => &mut c.input,
                _ => &mut c.output,
            };
            b.refill(limit, now);
            let (l, r, s) = match unit {
                "requests" => (
                    "x-ratelimit-limit-requests",
                    "x-ratelimit-remaining-requests",
                    "x-ratelimit-reset-requests",
                ),
                "input-tokens" => (
                    "x-ratelimit-limit-input-tokens",
                    "x-ratelimit-remaining-input-tokens",
                    "x-ratelimit-reset-input-tokens",
                ),
                _ => (
                    "x-ratelimit-limit-output-tokens",
                    "x-ratelimit-remaining-output-tokens",
                    "x-ratelimit-reset-output-tokens",
                ),
            };
            // Numbers become header values without a string or a check in between.
            out.push((l, HeaderValue::from(limit)));
            out.push((r, HeaderValue::from(b.level.max(0.0).floor() as u64)));
            let reset = duration_text(b.wait_for(limit, limit as f64));
            if let Ok(v) = HeaderValue::try_from(reset) {
                out.push((s, v));
            }
        }
        out
    }

    /// Requests of the tenant in flight now.
    pub fn inflight(&self) -> u64 {
        self.inner.lock().inflight
    }
}

/// A reset time as OpenAI writes it: `250ms`, `1.5s`, `6m0s`.
fn duration_text(d: Duration) -> String {
    let ms = d.as_millis() as u64;
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        let s = format!("{:.3}", ms as f64 / 1000.0);
        format!("{}s", s.trim_end_matches('0').trim_end_matches('.'))
    } else {
        let s = format!("{:.3}", (ms % 60_000) as f64 / 1000.0);
        format!(
            "{}m{}s",
            ms / 60_000,
            s.trim_end_matches('0').trim_end_matches('.')
        )
    }
}

/// Constant-time comparison of a presented key with a configured one.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Every tenant of a config and the key lookup.
#[derive(Debug, Default)]
pub struct Tenants {
    list: Vec<Arc<Tenant>>,
    /// A keyed hash of each key → (key, tenant index): the lookup costs one hash, and the
    /// key itself is compared in constant time.
    by_hash: HashMap<u64, Vec<(Vec<u8>, usize)>>,
    hasher: std::collections::hash_map::RandomState,
}

impl Tenants {
    /// The tenants of `tenants` and the implicit one of `api_keys`, reusing the counters
    /// of `prev`'s tenants of the same names.
    pub fn build(api_keys: &[String], tenants: &[TenantConfig], prev: Option<&Tenants>) -> Tenants {
        let mut t = Tenants::default();
        let state = |name: &str| {
            prev.and_then(|p| p.list.iter().find(|t| t.name == name))
                .map(|t| t.state.clone())
                .unwrap_or_default()
        };
        let mut add = |name: &str, keys: &[String], models: Vec<Pattern>, priority, limits| {
            let i = t.list.len();
            t.list.push(Arc::new(Tenant {
                name: name.to_string(),
                models,
                priority,
                limits,
                state: state(name),
            }));
            for k in keys {
                let h = t.hasher.hash_one(k.as_bytes());
                t.by_hash
                    .entry(h)
                    .or_default()
                    .push((k.as_bytes().to_vec(), i));
            }
        };
        if !api_keys.is_empty() {
            add(
                IMPLICIT_TENANT,
                api_keys,
                vec![Pattern::Prefix(String::new())],
                Priority::Default,
                TenantLimits::default(),
            );
        }
        for c in tenants {
            add(
                &c.name,
                &c.keys,
                c.models.iter().map(|m| Pattern::of(m)).collect(),
                c.priority,
                c.limits.clone(),
            );
        }
        t
    }

    /// No keys at all: the gateway is open.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The tenant whose key this is.
    pub fn by_key(&self, key: &[u8]) -> Option<&Arc<Tenant>> {
        let h = self.hasher.hash_one(key);
        let mut found = None;
        for (k, i) in self.by_hash.get(&h)? {
            if ct_eq(key, k) {
                found = Some(*i);
            }
        }
        found.map(|i| &self.list[i])
    }

    /// Every tenant, in config order (the implicit one first).
    pub fn list(&self) -> &[Arc<Tenant>] {
        &self.list
    }
}

/// Takes a ticket for a request of `tenant`, or refuses it.
pub fn admit(tenant: &Arc<Tenant>, input: u64, output: u64) -> Result<Ticket, Refusal> {
    tenant
        .state
        .admit(&tenant.limits, input, output, crate::clock::now_ms())?;
    Ok(Ticket {
        tenant: tenant.clone(),
        reserved_in: input,
        reserved_out: output,
        done: false,
        slot: true,
    })
}

/// The tenant's `x-ratelimit-*` headers now (none without per-minute limits).
pub fn headers(tenant: &Tenant) -> Vec<(&'static str, HeaderValue)> {
    let l = &tenant.limits;
    if l.requests_per_minute.is_none()
        && l.input_tokens_per_minute.is_none()
        && l.output_tokens_per_minute.is_none()
    {
        return Vec::new();
    }
    tenant.state.headers(l, crate::clock::now_ms())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(limits: TenantLimits) -> Arc<Tenant> {
        Arc::new(Tenant {
            name: "t".into(),
            models: vec![Pattern::of("qwen3-*"), Pattern::of("gpt-4o")],
            priority: Priority::Default,
            limits,
            state: Arc::default(),
        })
    }

    #[test]
    fn models() {
        let t = tenant(TenantLimits::default());
        assert!(t.allows("qwen3-8b"));
        assert!(t.allows("gpt-4o"));
        assert!(!t.allows("gpt-4o-mini"));
        assert!(!t.allows("llama"));
    }

    #[test]
    fn tickets_reserve_settle_and_release() {
        let t = tenant(TenantLimits {
            output_tokens_per_minute: Some(1000),
            concurrency: Some(2),
            ..Default::default()
        });
        let a = admit(&t, 10, 100).unwrap();
        let b = admit(&t, 10, 100).unwrap();
        assert_eq!(admit(&t, 10, 100).unwrap_err().over, Over::Concurrency);
        assert_eq!(t.state.inflight(), 2);
        drop(a); // never served: its 100 come back
        b.settle(10, 900); // used 900 instead of 100
        assert_eq!(t.state.inflight(), 0);
        let level = t.state.inner.lock().output.level;
        assert!((99.0..=102.0).contains(&level), "{level}");
        let r = admit(&t, 10, 200).unwrap_err();
        assert_eq!(r.over, Over::OutputTokens);
        assert!(r.retry_after >= Duration::from_secs(5), "{r:?}");
    }

    #[test]
    fn a_slot_released_early_is_released_once() {
        let t = tenant(TenantLimits {
            concurrency: Some(2),
            ..Default::default()
        });
        let mut a = admit(&t, 10, 100).unwrap();
        let _b = admit(&t, 10, 100).unwrap();
        a.release_slot();
        assert_eq!(t.state.inflight(), 1, "freed when the answer ended");
        a.release_slot();
        let c = admit(&t, 10, 100).unwrap();
        assert_eq!(admit(&t, 10, 100).unwrap_err().over, Over::Concurrency);
        a.settle(10, 5); // settled later: the slot is not freed a second time
        assert_eq!(t.state.inflight(), 2);
        drop(c);
        assert_eq!(t.state.inflight(), 1);
    }

    #[test]
    fn reset_text() {
        assert_eq!(duration_text(Duration::from_millis(250)), "250ms");
        assert_eq!(duration_text(Duration::from_millis(1500)), "1.5s");
        assert_eq!(duration_text(Duration::from_secs(2)), "2s");
        assert_eq!(duration_text(Duration::from_secs(360)), "6m0s");
    }
}
