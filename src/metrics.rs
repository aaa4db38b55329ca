//! Prometheus metrics, served as text on the admin listener's `/metrics`.
//!
//! Counters and histograms are updated once per request when it completes
//! ([`crate::request::complete`]); the in-flight gauges are copied from the load table when
//! scraped, so the hot path pays nothing for them.

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub duration: HistogramVec,
    pub ttft: HistogramVec,
    pub tokens: IntCounterVec,
    pub inflight_requests: IntGaugeVec,
    pub inflight_tokens: IntGaugeVec,
    pub waiting: IntGaugeVec,
    /// Uncached prompt tokens of the requests in their prefill phase, per instance.
    pub queued_prefill_tokens: IntGaugeVec,
    /// Requests held at the gateway for a saturated instance (`services[].engine_queue`).
    pub held: IntGaugeVec,
    /// What the predicted-TTFT model learned per instance.
    pub learned_prefill_tps: prometheus::GaugeVec,
    pub learned_decode_step: prometheus::GaugeVec,
    pub decisions: IntCounterVec,
    /// Throttling: requests waiting for a slot per service, their wait, refusals by reason,
    /// slots in use and their limits per instance and phase.
    pub throttle_queue: IntGaugeVec,
    pub throttle_queue_wait: HistogramVec,
    pub throttle_rejections: IntCounterVec,
    pub slots_in_use: IntGaugeVec,
    pub slot_limit: IntGaugeVec,
    /// Requests sent to another region's gateway, by member and outcome.
    pub global_requests: IntCounterVec,
    pub split_requests: IntCounterVec,
    /// Prefill legs of disaggregated services, by prefill instance and outcome.
    pub pd_prefill: IntCounterVec,
    /// Per service: estimated prompt tokens, the best match over all instances (ceiling) and
    /// the match on the chosen instance (predicted).
    pub prefix_tokens: IntCounterVec,
    /// The same requests as the engines reported them: prompt and cached tokens.
    pub engine_tokens: IntCounterVec,
    pub hit_ratio: prometheus::GaugeVec,
    pub index_nodes: IntGaugeVec,
    pub index_bytes: IntGaugeVec,
    pub index_evicted_bytes: IntGaugeVec,
    /// Blocks removed from the index by the engines' cached-token reports.
    pub index_trimmed_blocks: IntGaugeVec,
    /// Blocks removed from the index because an instance held more than its `cache_tokens`.
    pub index_capacity_evicted_blocks: IntGaugeVec,
    pub sessions: IntGaugeVec,
    pub decision_total: IntCounterVec,
    pub decision_latency: HistogramVec,
    pub reloads: IntCounterVec,
    pub available: IntGaugeVec,
    pub ejections: IntGaugeVec,
    pub reload_ok: prometheus::IntGauge,
    /// Connections closed by the gateway at the protocol level, by reason (`head_timeout`:
    /// a request head not complete within `timeouts.client_head`, answered 408).
    pub protocol_errors: IntCounterVec,
    /// Traffic mirroring: mirrored requests by outcome, their latency, the queue and the
    /// sends in flight.
    pub mirror_requests: IntCounterVec,
    pub mirror_latency: HistogramVec,
    pub mirror_queue: prometheus::IntGauge,
    pub mirror_inflight: prometheus::IntGauge,
    /// Per tenant: requests, tokens, rejections.
    pub tenants: TenantMetrics,
}

/// `tokengate_tenant_*`: what each tenant used and why it was refused (the tenant's name,
/// never its key).
pub struct TenantMetrics {
    pub requests: IntCounterVec,
    pub tokens: IntCounterVec,
    pub rejections: IntCounterVec,
    /// Throttling queue wait by priority class.
    pub queue_wait: HistogramVec,
}

impl TenantMetrics {
    fn new(registry: &Registry) -> TenantMetrics {
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels).expect("metric");
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric names");
            c
        };
        let queue_wait = HistogramVec::new(
            HistogramOpts::new(
                "tokengate_queue_wait_by_class_seconds",
                "Time spent in a throttling queue by priority class (interactive, default, batch), until a slot or the queue timeout",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["class"],
        )
        .expect("metric");
        registry
            .register(Box::new(queue_wait.clone()))
            .expect("unique metric names");
        TenantMetrics {
            queue_wait,
            requests: counter(
                "tokengate_tenant_requests_total",
                "Requests admitted per tenant (`tenants:`; `default`: the global api_keys) and model (the service or route)",
                &["tenant", "model"],
            ),
            tokens: counter(
                "tokengate_tenant_tokens_total",
                "Tokens charged to each tenant's limits per model, by kind: input (prompt), output",
                &["tenant", "model", "kind"],
            ),
            rejections: counter(
                "tokengate_tenant_rejections_total",
                "Requests refused per tenant, by reason: model_not_allowed (403), requests_per_minute, input_tokens_per_minute, output_tokens_per_minute, concurrency (429)",
                &["tenant", "reason"],
            ),
        }
    }
}

/// Creates metric families and registers them (a name registered twice panics at start).
struct Reg<'a>(&'a Registry);

impl Reg<'_> {
    fn add<C: prometheus::core::Collector + Clone + 'static>(&self, c: C) -> C {
        self.0
            .register(Box::new(c.clone()))
            .expect("unique metric names");
        c
    }

    fn counter(&self, opts: Opts, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(opts, labels).expect("metric"))
    }

    fn gauge(&self, opts: Opts, labels: &[&str]) -> IntGaugeVec {
        self.add(IntGaugeVec::new(opts, labels).expect("metric"))
    }

    /// A gauge of fractional values (rates, ratios, seconds).
    fn ratio(&self, opts: Opts, labels: &[&str]) -> GaugeVec {
        self.add(GaugeVec::new(opts, labels).expect("metric"))
    }

    /// A latency histogram ([`LATENCY_BUCKETS`]).
    fn histogram(&self, opts: HistogramOpts, labels: &[&str]) -> HistogramVec {
        let opts = opts.buckets(LATENCY_BUCKETS.to_vec());
        self.add(HistogramVec::new(opts, labels).expect("metric"))
    }

    fn int_gauge(&self, opts: Opts) -> IntGauge {
        self.add(IntGauge::with_opts(opts).expect("metric"))
    }
}

impl Metrics {
    /// Every `tokengate_*` family, registered, feature by feature.
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let r = Reg(&registry);
        let (requests, duration, ttft, tokens) = requests(&r);
        let (
            inflight_requests,
            inflight_tokens,
            waiting,
            queued_prefill_tokens,
            held,
            available,
            ejections,
        ) = instances(&r);
        let (learned_prefill_tps, learned_decode_step) = cost_model(&r);
        let (decisions, sessions) = routing(&r);
        let (decision_total, decision_latency) = decision_service(&r);
        let (prefix_tokens, engine_tokens, hit_ratio) = prefix_hits(&r);
        let (
            index_nodes,
            index_bytes,
            index_evicted_bytes,
            index_trimmed_blocks,
            index_capacity_evicted_blocks,
        ) = prefix_index(&r);
        let (throttle_queue, throttle_queue_wait, throttle_rejections, slots_in_use, slot_limit) =
            throttling(&r);
        let (pd_prefill, global_requests, split_requests) = legs(&r);
        let (reloads, reload_ok, protocol_errors) = operations(&r);
        let (mirror_requests, mirror_latency, mirror_queue, mirror_inflight) = mirror(&r);
        let tenants = TenantMetrics::new(&registry);
        Metrics {
            registry,
            requests,
            duration,
            ttft,
            tokens,
            inflight_requests,
            inflight_tokens,
            waiting,
            queued_prefill_tokens,
            held,
            available,
            ejections,
            learned_prefill_tps,
            learned_decode_step,
            decisions,
            sessions,
            decision_total,
            decision_latency,
            prefix_tokens,
            engine_tokens,
            hit_ratio,
            index_nodes,
            index_bytes,
            index_evicted_bytes,
            index_trimmed_blocks,
            index_capacity_evicted_blocks,
            throttle_queue,
            throttle_queue_wait,
            throttle_rejections,
            slots_in_use,
            slot_limit,
            pd_prefill,
            global_requests,
            split_requests,
            reloads,
            reload_ok,
            protocol_errors,
            mirror_requests,
            mirror_latency,
            mirror_queue,
            mirror_inflight,
            tenants,
        }
    }

    /// The counters one service updates on every request, resolved once (when the runtime
    /// is built): no label lookup on the hot path.
    pub fn service_counters(&self, service: &str) -> ServiceCounters {
        let t = |k| self.tokens.with_label_values(&[service, k]);
        let p = |k| self.prefix_tokens.with_label_values(&[service, k]);
        let e = |k| self.engine_tokens.with_label_values(&[service, k]);
        ServiceCounters {
            tokens_prompt: t("prompt"),
            tokens_completion: t("completion"),
            tokens_cached: t("cached"),
            prefix_prompt: p("prompt"),
            prefix_ceiling: p("ceiling"),
            prefix_predicted: p("predicted"),
            engine_prompt: e("prompt"),
            engine_cached: e("cached"),
            engine_predicted: e("predicted"),
        }
    }

    /// Refreshes the hit-ratio gauges of `services` from their counters.
    pub fn update_ratios<'a>(&self, services: impl IntoIterator<Item = &'a str>) {
        for svc in services {
            let c = |k| self.prefix_tokens.with_label_values(&[svc, k]).get() as f64;
            let p = c("prompt");
            for kind in ["ceiling", "predicted"] {
                self.hit_ratio
                    .with_label_values(&[svc, kind])
                    .set(if p > 0.0 { c(kind) / p } else { 0.0 });
            }
            let e = |k| self.engine_tokens.with_label_values(&[svc, k]).get() as f64;
            let (ep, ec) = (e("prompt"), e("cached"));
            self.hit_ratio
                .with_label_values(&[svc, "engine"])
                .set(if ep > 0.0 { ec / ep } else { 0.0 });
            self.hit_ratio
                .with_label_values(&[svc, "engine_predicted"])
                .set(if ep > 0.0 { e("predicted") / ep } else { 0.0 });
        }
    }

    /// The registry, for a feature that registers its own families ([`crate::otel`]).
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Prometheus text exposition of everything registered.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8192);
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

/// Every answered request: by outcome, its duration and time to first token, the engines' token
/// usage.
///
/// Returns `(requests, duration, ttft, tokens)`.
fn requests(r: &Reg) -> (IntCounterVec, HistogramVec, HistogramVec, IntCounterVec) {
    let requests = r.counter(
        Opts::new(
            "tokengate_requests_total",
            "Requests answered, by model, instance (\"-\" when none was chosen), status code (0: none was sent) and outcome: complete, truncated (the status was sent, then the answer broke off), client_left, left_queue (the client hung up while queued for a throttling slot), no_response",
        ),
        &["model", "instance", "code", "outcome"],
    );
    let duration = r.histogram(
        HistogramOpts::new(
            "tokengate_request_duration_seconds",
            "Time from the request's arrival to its last response byte",
        ),
        &["model"],
    );
    let ttft = r.histogram(
        HistogramOpts::new(
            "tokengate_ttft_seconds",
            "Time to first token of streaming requests: arrival to the first response body chunk",
        ),
        &["model"],
    );
    let tokens = r.counter(
        Opts::new(
            "tokengate_tokens_total",
            "Tokens reported by the engines' usage, by model (the service that served it): prompt, completion, and cached (prompt tokens served from the prefix cache)",
        ),
        &["model", "kind"],
    );
    (requests, duration, ttft, tokens)
}

/// Per instance, copied from the load table and health when scraped: in flight, waiting, queued
/// prefill, held at the gateway, available, ejections.
///
/// Returns `(inflight_requests, inflight_tokens, waiting, queued_prefill_tokens, held,
/// available, ejections)`.
fn instances(
    r: &Reg,
) -> (
    IntGaugeVec,
    IntGaugeVec,
    IntGaugeVec,
    IntGaugeVec,
    IntGaugeVec,
    IntGaugeVec,
    IntGaugeVec,
) {
    let inflight_requests = r.gauge(
        Opts::new(
            "tokengate_inflight_requests",
            "Requests dispatched to an instance and not finished",
        ),
        &["instance"],
    );
    let inflight_tokens = r.gauge(
        Opts::new(
            "tokengate_inflight_tokens",
            "Expected tokens (prompt estimate + output limit) of the requests in flight on an instance",
        ),
        &["instance"],
    );
    let waiting = r.gauge(
        Opts::new(
            "tokengate_waiting_requests",
            "Requests dispatched to an instance that have no first byte yet",
        ),
        &["instance"],
    );
    let queued_prefill_tokens = r.gauge(
        Opts::new(
            "tokengate_queued_prefill_tokens",
            "Uncached prompt tokens of the requests dispatched to an instance that have no first token yet (prefill work queued there by this gateway)",
        ),
        &["instance"],
    );
    let held = r.gauge(
        Opts::new(
            "tokengate_held_requests",
            "Requests the scheduler placed on an instance that the gateway holds back while the service's instances are saturated (services[].engine_queue); they count in tokengate_waiting_requests too",
        ),
        &["instance"],
    );
    let available = r.gauge(
        Opts::new(
            "tokengate_instance_available",
            "1 when the instance receives requests (healthy and not ejected), else 0",
        ),
        &["instance"],
    );
    let ejections = r.gauge(
        Opts::new(
            "tokengate_instance_ejections",
            "Passive ejections of the instance since start",
        ),
        &["instance"],
    );
    (
        inflight_requests,
        inflight_tokens,
        waiting,
        queued_prefill_tokens,
        held,
        available,
        ejections,
    )
}

/// What the predicted-TTFT model learned per instance.
///
/// Returns `(learned_prefill_tps, learned_decode_step)`.
fn cost_model(r: &Reg) -> (GaugeVec, GaugeVec) {
    let learned_prefill_tps = r.ratio(
        Opts::new(
            "tokengate_learned_prefill_tokens_per_second",
            "Prefill rate of an instance as the predicted-TTFT model learned it from completed streams",
        ),
        &["instance"],
    );
    let learned_decode_step = r.ratio(
        Opts::new(
            "tokengate_learned_decode_step_seconds",
            "Time per output token of an instance as the predicted-TTFT model learned it",
        ),
        &["instance"],
    );
    (learned_prefill_tps, learned_decode_step)
}

/// Routing decisions by reason, and the session bindings of each scheduler.
///
/// Returns `(decisions, sessions)`.
fn routing(r: &Reg) -> (IntCounterVec, IntGaugeVec) {
    let decisions = r.counter(
        Opts::new(
            "tokengate_routing_decisions_total",
            "Routing decisions, by the reason the instance was chosen",
        ),
        &["reason"],
    );
    let sessions = r.gauge(
        Opts::new("tokengate_sessions", "Session bindings held by a scheduler"),
        &["scheduler"],
    );
    (decisions, sessions)
}

/// Decision-service calls: outcomes and latency.
///
/// Returns `(decision_total, decision_latency)`.
fn decision_service(r: &Reg) -> (IntCounterVec, HistogramVec) {
    let decision_total = r.counter(
        Opts::new(
            "tokengate_decision_total",
            "Decision-service calls by route and outcome: target, or an abstention (timeout, error, no_target)",
        ),
        &["route", "outcome"],
    );
    let decision_latency = r.histogram(
        HistogramOpts::new(
            "tokengate_decision_latency_seconds",
            "Latency of decision-service calls (including timeouts)",
        ),
        &["route"],
    );
    (decision_total, decision_latency)
}

/// Prefix-cache hits per service: the index's view (prompt, ceiling, predicted), the engines'
/// reports, the ratios.
///
/// Returns `(prefix_tokens, engine_tokens, hit_ratio)`.
fn prefix_hits(r: &Reg) -> (IntCounterVec, IntCounterVec, GaugeVec) {
    let prefix_tokens = r.counter(
        Opts::new(
            "tokengate_prefix_tokens_total",
            "Every routed request, by service: estimated prompt tokens (kind=prompt), tokens of the best cached prefix on any instance (ceiling) and on the chosen instance (predicted), by the gateway's prefix index",
        ),
        &["service", "kind"],
    );
    let engine_tokens = r.counter(
        Opts::new(
            "tokengate_prefix_engine_tokens_total",
            "The same requests as the engines reported them (requests with usage), by service: prompt and cached tokens, and the index's prediction for them in the engines' units (kind=predicted: its match scaled to the engine's token count and rounded down to its block size)",
        ),
        &["service", "kind"],
    );
    let hit_ratio = r.ratio(
        Opts::new(
            "tokengate_prefix_hit_ratio",
            "Cached share of prompt tokens per service: ceiling (best instance for every request), predicted (chosen instance, by the index), engine (reported cached_tokens), engine_predicted (the index's prediction over the same requests as engine, in the engine's units)",
        ),
        &["service", "kind"],
    );
    (prefix_tokens, engine_tokens, hit_ratio)
}

/// Each service's prefix index: its size and what left it.
///
/// Returns `(index_nodes, index_bytes, index_evicted_bytes, index_trimmed_blocks,
/// index_capacity_evicted_blocks)`.
fn prefix_index(
    r: &Reg,
) -> (
    IntGaugeVec,
    IntGaugeVec,
    IntGaugeVec,
    IntGaugeVec,
    IntGaugeVec,
) {
    let index_nodes = r.gauge(
        Opts::new(
            "tokengate_prefix_index_nodes",
            "Nodes of a service's prefix index",
        ),
        &["service"],
    );
    let index_bytes = r.gauge(
        Opts::new(
            "tokengate_prefix_index_bytes",
            "Approximate heap bytes of a service's prefix index",
        ),
        &["service"],
    );
    let index_evicted_bytes = r.gauge(
        Opts::new(
            "tokengate_prefix_index_evicted_bytes",
            "Bytes evicted from a service's prefix index by the memory bound since start",
        ),
        &["service"],
    );
    let index_trimmed_blocks = r.gauge(
        Opts::new(
            "tokengate_prefix_index_trimmed_blocks",
            "Blocks removed from a service's prefix index because an engine reported fewer cached tokens than the index predicted (its cache evicted them), since start",
        ),
        &["service"],
    );
    let index_capacity_evicted_blocks = r.gauge(
        Opts::new(
            "tokengate_prefix_index_capacity_evicted_blocks",
            "Blocks removed from a service's prefix index because an instance held more than its cache_tokens (the least recently used first, as the engine evicts them), since start",
        ),
        &["service"],
    );
    (
        index_nodes,
        index_bytes,
        index_evicted_bytes,
        index_trimmed_blocks,
        index_capacity_evicted_blocks,
    )
}

/// Throttling: the queue, its wait, refusals, slots in use and their limits.
///
/// Returns `(throttle_queue, throttle_queue_wait, throttle_rejections, slots_in_use, slot_limit)`.
fn throttling(
    r: &Reg,
) -> (
    IntGaugeVec,
    HistogramVec,
    IntCounterVec,
    IntGaugeVec,
    IntGaugeVec,
) {
    let throttle_queue = r.gauge(
        Opts::new(
            "tokengate_throttle_queue_length",
            "Requests waiting in a service's throttling queue for a slot",
        ),
        &["service"],
    );
    let throttle_queue_wait = r.histogram(
        HistogramOpts::new(
            "tokengate_throttle_queue_wait_seconds",
            "Time requests spent in a service's throttling queue (until a slot, or the queue timeout)",
        ),
        &["service"],
    );
    let throttle_rejections = r.counter(
        Opts::new(
            "tokengate_throttle_rejections_total",
            "Requests refused by throttling, by service and reason: limit (reject mode), queue_full, queue_timeout",
        ),
        &["service", "reason"],
    );
    let slots_in_use = r.gauge(
        Opts::new(
            "tokengate_slots_in_use",
            "Throttling slots in use per instance of a throttled service and phase: prefill (dispatch to first token), decode (first token to completion), total",
        ),
        &["instance", "phase"],
    );
    let slot_limit = r.gauge(
        Opts::new(
            "tokengate_slot_limit",
            "Throttling limit per instance and phase (services[].throttling; with scope service the pool is this × the instances)",
        ),
        &["instance", "phase"],
    );
    (
        throttle_queue,
        throttle_queue_wait,
        throttle_rejections,
        slots_in_use,
        slot_limit,
    )
}

/// Legs beyond the local instance: prefill legs of disaggregated services, member gateways,
/// split-proxy entries.
///
/// Returns `(pd_prefill, global_requests, split_requests)`.
fn legs(r: &Reg) -> (IntCounterVec, IntCounterVec, IntCounterVec) {
    let pd_prefill = r.counter(
        Opts::new(
            "tokengate_pd_prefill_total",
            "Prefill legs of prefill/decode-disaggregated services, by prefill instance and outcome: ok, error (the decode is aborted; the request is retried on a new pair before any byte reached the client), aborted (the decode failed or the client left)",
        ),
        &["instance", "outcome"],
    );
    let global_requests = r.counter(
        Opts::new(
            "tokengate_global_requests_total",
            "Requests forwarded to another region's gateway (global.members), by member and outcome: ok, refused (429/503: the next member is tried), error, cancelled",
        ),
        &["member", "outcome"],
    );
    let split_requests = r.counter(
        Opts::new(
            "tokengate_split_requests_total",
            "Split proxy (split.proxies): attempts per entry (`local` for our own services) and outcome: ok, refused (5xx/429 before any byte: the request fails over), error (connect error, timeout, reset; or failed after bytes reached the client), cancelled (the client left)",
        ),
        &["entry", "outcome"],
    );
    (pd_prefill, global_requests, split_requests)
}

/// Config reloads and protocol-level connection errors (every label present from the start).
///
/// Returns `(reloads, reload_ok, protocol_errors)`.
fn operations(r: &Reg) -> (IntCounterVec, IntGauge, IntCounterVec) {
    let reloads = r.counter(
        Opts::new(
            "tokengate_config_reloads_total",
            "Config reloads (SIGHUP or file change) by result: ok, or error (the running config was kept)",
        ),
        &["result"],
    );
    let reload_ok = r.int_gauge(Opts::new(
        "tokengate_config_last_reload_success",
        "1 when the last config reload was applied (or none happened), 0 when it was rejected",
    ));
    let protocol_errors = r.counter(
        Opts::new(
            "tokengate_protocol_errors_total",
            "Client connections the gateway answered at the protocol level before any request was read, by reason: head_timeout (the request head was not complete within timeouts.client_head: 408), head_too_large (a head above 64 KiB: 431), too_many_headers (more than 256 head lines: 431), bad_request (a head the HTTP parser refused, e.g. two Content-Lengths, an unknown Transfer-Encoding, a garbage request line: 400); each closes the connection",
        ),
        &["reason"],
    );
    reload_ok.set(1);
    for reason in [
        "head_timeout",
        "head_too_large",
        "too_many_headers",
        "bad_request",
    ] {
        protocol_errors.with_label_values(&[reason]);
    }
    // Both results exist from the start (a rate over them works before any reload).
    for result in ["ok", "error"] {
        reloads.with_label_values(&[result]);
    }
    (reloads, reload_ok, protocol_errors)
}

/// Traffic mirroring: outcomes, latency, the queue and the sends in flight.
///
/// Returns `(mirror_requests, mirror_latency, mirror_queue, mirror_inflight)`.
fn mirror(r: &Reg) -> (IntCounterVec, HistogramVec, IntGauge, IntGauge) {
    let mirror_requests = r.counter(
        Opts::new(
            "tokengate_mirror_requests_total",
            "Sampled requests copied to the mirror target, by outcome: sent (a send started), then ok (2xx answered whole), http_error (another status), error (connect or read failure), timeout (mirror.timeout_ms); or dropped (the queue was full) and expired (waited in the queue longer than mirror.timeout_ms), which were never sent",
        ),
        &["outcome"],
    );
    let mirror_latency = r.histogram(
        HistogramOpts::new(
            "tokengate_mirror_latency_seconds",
            "Answered mirror requests, from their send: to the first token (phase=ttft: the first SSE event with output, or the whole body) and to the last byte (phase=total)",
        ),
        &["phase"],
    );
    let mirror_queue = r.int_gauge(Opts::new(
        "tokengate_mirror_queue_depth",
        "Mirror copies waiting in the queue for a send slot",
    ));
    let mirror_inflight = r.int_gauge(Opts::new(
        "tokengate_mirror_inflight",
        "Mirror requests being sent (at most the mirror's concurrency limit)",
    ));
    (
        mirror_requests,
        mirror_latency,
        mirror_queue,
        mirror_inflight,
    )
}

/// See [`Metrics::service_counters`].
#[derive(Clone)]
pub struct ServiceCounters {
    pub tokens_prompt: IntCounter,
    pub tokens_completion: IntCounter,
    pub tokens_cached: IntCounter,
    pub prefix_prompt: IntCounter,
    pub prefix_ceiling: IntCounter,
    pub prefix_predicted: IntCounter,
    pub engine_prompt: IntCounter,
    pub engine_cached: IntCounter,
    pub engine_predicted: IntCounter,
}

impl std::fmt::Debug for ServiceCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServiceCounters")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests;
