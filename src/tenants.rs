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
//! and in-flight count as they were; new limits apply from the next request.
//!
//! With `cluster:` the limits hold for the fleet of replicas: after the local admission
//! (which still holds per replica, and alone while Redis is away) the request is taken off
//! the tenant's fleet-wide buckets and leases on Redis ([`crate::cluster::TenantHold`]) in
//! the round trip that also reads its session's binding, and settled there off the
//! request's path.

use crate::config::{Priority, TenantConfig, TenantLimits, IMPLICIT_TENANT};
use crate::metrics::TenantMetrics;
use http::HeaderValue;
use parking_lot::Mutex;
use prometheus::IntCounter;
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
    /// The `x-ratelimit-limit-*` values of its per-minute limits (requests, input tokens,
    /// output tokens), made once: they change only with the config.
    limit_values: [Option<HeaderValue>; 3],
    /// Its `tokengate_tenant_*` counters by model, looked up once per model (a labelled
    /// counter's lookup hashes its labels under a lock; this is a short scan).
    counters: Mutex<Vec<(Box<str>, [IntCounter; 3])>>,
}

impl Tenant {
    /// Whether the tenant may call `model` (any of the names it goes by).
    pub fn allows(&self, model: &str) -> bool {
        self.models.iter().any(|p| p.matches(model))
    }

    /// Counts a settled request of `model` (`input`, `output` tokens) in the tenant's
    /// `tokengate_tenant_{requests,tokens}_total`.
    pub fn count(&self, m: &TenantMetrics, model: &str, input: u64, output: u64) {
        let mut cache = self.counters.lock();
        let i = match cache.iter().position(|(k, _)| &**k == model) {
            Some(i) => i,
            None => {
                let name = self.name.as_str();
                let c = [
                    m.requests.with_label_values(&[name, model]),
                    m.tokens.with_label_values(&[name, model, "input"]),
                    m.tokens.with_label_values(&[name, model, "output"]),
                ];
                if cache.len() >= MAX_CACHED_MODELS {
                    drop(cache);
                    c[0].inc();
                    c[1].inc_by(input);
                    c[2].inc_by(output);
                    return;
                }
                cache.push((model.into(), c));
                cache.len() - 1
            }
        };
        let c = &cache[i].1;
        c[0].inc();
        c[1].inc_by(input);
        c[2].inc_by(output);
    }

    fn new(
        name: &str,
        models: Vec<Pattern>,
        priority: Priority,
        limits: TenantLimits,
        state: Arc<TenantState>,
    ) -> Tenant {
        let value = |l: Option<u64>| l.map(HeaderValue::from);
        Tenant {
            name: name.to_string(),
            models,
            priority,
            limit_values: [
                value(limits.requests_per_minute),
                value(limits.input_tokens_per_minute),
                value(limits.output_tokens_per_minute),
            ],
            limits,
            state,
            counters: Mutex::new(Vec::new()),
        }
    }
}

/// Models whose counters a tenant keeps at hand (beyond: looked up each time).
const MAX_CACHED_MODELS: usize = 32;

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
    /// Refused by the fleet after the local admission: its request is given back too.
    refund: bool,
    /// Its hold on the tenant's fleet-wide limits (`cluster:`, Redis answering).
    /// (Boxed: a ticket without one, the common case, stays small in every request's state.)
    fleet: Option<Box<crate::cluster::TenantHold>>,
}

impl Ticket {
    /// Frees the tenant's in-flight slot now (the answer reached its end): a client that
    /// sends its next request as soon as it has read this one's last byte finds the slot
    /// free, though the request is settled (tokens, counters) only later, in `logging`.
    pub fn release_slot(&mut self) {
        if let Some(f) = self.fleet.as_mut() {
            f.release();
        }
        if std::mem::replace(&mut self.slot, false) {
            let mut c = self.tenant.state.inner.lock();
            c.inflight = c.inflight.saturating_sub(1);
        }
    }

    /// The (input, output) tokens reserved at admission.
    pub fn reserved(&self) -> (u64, u64) {
        (self.reserved_in, self.reserved_out)
    }

    /// Adds the tenant's fleet-wide hold, settled with this ticket.
    pub fn attach_fleet(&mut self, hold: crate::cluster::TenantHold) {
        self.fleet = Some(Box::new(hold));
    }

    /// Undoes the admission entirely (the fleet refused the request): its request, its
    /// tokens and its slot come back.
    pub fn refund(mut self) {
        self.refund = true;
        self.end(0, 0);
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
        if let Some(f) = self.fleet.take() {
            let back = |reserved: u64, used: u64| reserved as i64 - used as i64;
            f.settle([
                0,
                back(self.reserved_in, input),
                back(self.reserved_out, output),
            ]);
        }
        let now = crate::clock::now_ms();
        let l = &self.tenant.limits;
        let mut guard = self.tenant.state.inner.lock();
        let c = &mut *guard;
        if std::mem::replace(&mut self.slot, false) {
            c.inflight = c.inflight.saturating_sub(1);
        }
        if self.refund {
            if let Some(limit) = l.requests_per_minute {
                c.requests.refill(limit, now);
                c.requests.level = (c.requests.level + 1.0).min(limit as f64);
            }
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

    /// The `x-ratelimit-*` headers of the tenant's answers, given to `put`: for each
    /// per-minute limit its value, what remains and when the bucket is full again (the
    /// fleet's remainder, when the request was admitted fleet-wide, else this replica's).
    fn headers(
        &self,
        limits: &TenantLimits,
        values: &[Option<HeaderValue>; 3],
        fleet: Option<[Option<u64>; 3]>,
        now: u64,
        mut put: impl FnMut(&'static str, HeaderValue),
    ) {
        const NAMES: [[&str; 3]; 3] = [
            [
                "x-ratelimit-limit-requests",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
            ],
            [
                "x-ratelimit-limit-input-tokens",
                "x-ratelimit-remaining-input-tokens",
                "x-ratelimit-reset-input-tokens",
            ],
            [
                "x-ratelimit-limit-output-tokens",
                "x-ratelimit-remaining-output-tokens",
                "x-ratelimit-reset-output-tokens",
            ],
        ];
        // The figures under the lock, the header values after it.
        let mut figures = [None; 3];
        {
            let mut c = self.inner.lock();
            let c = &mut *c;
            let buckets = [&mut c.requests, &mut c.input, &mut c.output];
            let limits = [
                limits.requests_per_minute,
                limits.input_tokens_per_minute,
                limits.output_tokens_per_minute,
            ];
            let fleet = fleet.unwrap_or_default();
            for (((b, limit), f), in_fleet) in
                buckets.into_iter().zip(limits).zip(&mut figures).zip(fleet)
            {
                let Some(limit) = limit else { continue };
                if let Some(left) = in_fleet {
                    let full = Bucket {
                        level: left as f64,
                        at_ms: now,
                        started: true,
                    };
                    *f = Some((left, full.wait_for(limit, limit as f64)));
                    continue;
                }
                b.refill(limit, now);
                *f = Some((
                    b.level.max(0.0).floor() as u64,
                    b.wait_for(limit, limit as f64),
                ));
            }
        }
        for ((names, f), v) in NAMES.iter().zip(figures).zip(values) {
            let (Some((remaining, reset)), Some(v)) = (f, v) else {
                continue;
            };
            // Numbers become header values without a string or a check in between.
            put(names[0], v.clone());
            put(names[1], HeaderValue::from(remaining));
            put(names[2], duration_value(reset));
        }
    }

    /// Requests of the tenant in flight now.
    pub fn inflight(&self) -> u64 {
        self.inner.lock().inflight
    }
}

/// A reset time as OpenAI writes it: `250ms`, `1.5s`, `6m0s` (at most `<minutes>m59.999s`).
fn duration_value(d: Duration) -> HeaderValue {
    let mut buf = [0u8; 40];
    let n = duration_text(d, &mut buf);
    HeaderValue::from_bytes(&buf[..n]).expect("digits and letters")
}

/// Writes [`duration_value`]'s text into `buf`; its length.
fn duration_text(d: Duration, buf: &mut [u8; 40]) -> usize {
    let ms = d.as_millis().min(u64::MAX as u128) as u64;
    let mut n = 0;
    let mut put = |b: &[u8], n: &mut usize| {
        buf[*n..*n + b.len()].copy_from_slice(b);
        *n += b.len();
    };
    if ms < 1000 {
        put(itoa(ms, &mut [0; 20]), &mut n);
        put(b"ms", &mut n);
        return n;
    }
    let secs_ms = if ms < 60_000 {
        ms
    } else {
        put(itoa(ms / 60_000, &mut [0; 20]), &mut n);
        put(b"m", &mut n);
        ms % 60_000
    };
    put(itoa(secs_ms / 1000, &mut [0; 20]), &mut n);
    let frac = secs_ms % 1000;
    if frac > 0 {
        // Three digits, trailing zeros dropped.
        let digits = [frac / 100, frac / 10 % 10, frac % 10];
        let keep = if digits[2] > 0 {
            3
        } else if digits[1] > 0 {
            2
        } else {
            1
        };
        put(b".", &mut n);
        for d in &digits[..keep] {
            put(&[b'0' + *d as u8], &mut n);
        }
    }
    put(b"s", &mut n);
    n
}

/// `v` in decimal, in the end of `buf`.
fn itoa(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &buf[i..];
        }
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
    /// Each key's seeded digest, the key and its tenant's index, sorted by digest: a lookup
    /// is one digest of the presented key and a binary search, and the key itself is then
    /// compared in constant time.
    by_digest: Vec<(u64, Box<[u8]>, usize)>,
    /// The digest's seed, random per config (a client cannot aim keys at one digest).
    seed: u64,
}

impl Tenants {
    /// The tenants of `tenants` and the implicit one of `api_keys`, reusing the counters
    /// of `prev`'s tenants of the same names.
    pub fn build(api_keys: &[String], tenants: &[TenantConfig], prev: Option<&Tenants>) -> Tenants {
        let mut t = Tenants {
            seed: std::collections::hash_map::RandomState::new().hash_one(0x7e4a_u64),
            ..Tenants::default()
        };
        let state = |name: &str| {
            prev.and_then(|p| p.list.iter().find(|t| t.name == name))
                .map(|t| t.state.clone())
                .unwrap_or_default()
        };
        let mut add = |name: &str, keys: &[String], models: Vec<Pattern>, priority, limits| {
            let i = t.list.len();
            t.list.push(Arc::new(Tenant::new(
                name,
                models,
                priority,
                limits,
                state(name),
            )));
            for k in keys {
                let d = digest(k.as_bytes(), t.seed);
                t.by_digest.push((d, k.as_bytes().into(), i));
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
        t.by_digest.sort_unstable_by_key(|e| e.0);
        t
    }

    /// No keys at all: the gateway is open.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The tenant whose key this is.
    pub fn by_key(&self, key: &[u8]) -> Option<&Arc<Tenant>> {
        let d = digest(key, self.seed);
        let start = self.by_digest.partition_point(|e| e.0 < d);
        let mut found = None;
        for (_, k, i) in self.by_digest[start..].iter().take_while(|e| e.0 == d) {
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

/// A key's digest for the lookup (seeded xxh3: a few instructions per byte).
fn digest(key: &[u8], seed: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, seed)
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
        refund: false,
        fleet: None,
    })
}

/// The tenant's limits as the fleet-wide admission takes them (`None`: it has none).
pub fn fleet_limits(l: &TenantLimits) -> Option<crate::cluster::TenantLimits> {
    let per_minute = [
        l.requests_per_minute.unwrap_or(0),
        l.input_tokens_per_minute.unwrap_or(0),
        l.output_tokens_per_minute.unwrap_or(0),
    ];
    let concurrency = l.concurrency.unwrap_or(0);
    (per_minute != [0; 3] || concurrency > 0).then_some(crate::cluster::TenantLimits {
        per_minute,
        concurrency,
    })
}

/// The tenant's `x-ratelimit-*` headers now, given to `put` (none without per-minute
/// limits); with the request's `ticket`, the fleet's figures when it was admitted
/// fleet-wide.
pub fn headers(
    tenant: &Tenant,
    ticket: Option<&Ticket>,
    put: impl FnMut(&'static str, HeaderValue),
) {
    if tenant.limit_values.iter().all(Option::is_none) {
        return;
    }
    let fleet = ticket.and_then(|t| t.fleet.as_ref()).map(|f| f.remaining);
    tenant.state.headers(
        &tenant.limits,
        &tenant.limit_values,
        fleet,
        crate::clock::now_ms(),
        put,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenant(limits: TenantLimits) -> Arc<Tenant> {
        Arc::new(Tenant::new(
            "t",
            vec![Pattern::of("qwen3-*"), Pattern::of("gpt-4o")],
            Priority::Default,
            limits,
            Arc::default(),
        ))
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
        let text = |ms| duration_value(Duration::from_millis(ms));
        assert_eq!(text(0), "0ms");
        assert_eq!(text(250), "250ms");
        assert_eq!(text(1500), "1.5s");
        assert_eq!(text(1250), "1.25s");
        assert_eq!(text(1001), "1.001s");
        assert_eq!(text(2000), "2s");
        assert_eq!(text(360_000), "6m0s");
        assert_eq!(text(61_500), "1m1.5s");
        assert_eq!(text(u64::MAX), "307445734561825m51.615s");
    }

    #[test]
    fn keys_find_their_tenant() {
        let conf = |name: &str, keys: &[&str]| TenantConfig {
            name: name.into(),
            keys: keys.iter().map(|k| k.to_string()).collect(),
            models: vec!["*".into()],
            priority: Priority::Default,
            limits: TenantLimits::default(),
        };
        let t = Tenants::build(
            &["global".into()],
            &[conf("a", &["ka1", "ka2"]), conf("b", &["kb"])],
            None,
        );
        let name = |k: &str| t.by_key(k.as_bytes()).map(|t| t.name.clone());
        assert_eq!(name("global").as_deref(), Some(IMPLICIT_TENANT));
        assert_eq!(name("ka2").as_deref(), Some("a"));
        assert_eq!(name("kb").as_deref(), Some("b"));
        assert_eq!(name("kb "), None);
        assert_eq!(name(""), None);
    }
}
