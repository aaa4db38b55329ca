use super::*;
use prometheus::core::Collector;

/// Each field holds the family its name says, `tokengate_` + the name here (the
/// per-feature functions hand theirs back as tuples: a swap of two of the same type
/// would compile).
#[test]
fn fields_hold_their_families() {
    let m = Metrics::new();
    let fields: [(&dyn Collector, &str); 44] = [
        (&m.requests, "requests_total"),
        (&m.duration, "request_duration_seconds"),
        (&m.ttft, "ttft_seconds"),
        (&m.tokens, "tokens_total"),
        (&m.inflight_requests, "inflight_requests"),
        (&m.inflight_tokens, "inflight_tokens"),
        (&m.waiting, "waiting_requests"),
        (&m.queued_prefill_tokens, "queued_prefill_tokens"),
        (&m.held, "held_requests"),
        (&m.learned_prefill_tps, "learned_prefill_tokens_per_second"),
        (&m.learned_decode_step, "learned_decode_step_seconds"),
        (&m.index_trimmed_blocks, "prefix_index_trimmed_blocks"),
        (
            &m.index_capacity_evicted_blocks,
            "prefix_index_capacity_evicted_blocks",
        ),
        (&m.throttle_queue, "throttle_queue_length"),
        (&m.throttle_queue_wait, "throttle_queue_wait_seconds"),
        (&m.throttle_rejections, "throttle_rejections_total"),
        (&m.slots_in_use, "slots_in_use"),
        (&m.slot_limit, "slot_limit"),
        (&m.pd_prefill, "pd_prefill_total"),
        (&m.global_requests, "global_requests_total"),
        (&m.split_requests, "split_requests_total"),
        (&m.decisions, "routing_decisions_total"),
        (&m.prefix_tokens, "prefix_tokens_total"),
        (&m.engine_tokens, "prefix_engine_tokens_total"),
        (&m.hit_ratio, "prefix_hit_ratio"),
        (&m.index_nodes, "prefix_index_nodes"),
        (&m.index_bytes, "prefix_index_bytes"),
        (&m.index_evicted_bytes, "prefix_index_evicted_bytes"),
        (&m.sessions, "sessions"),
        (&m.decision_total, "decision_total"),
        (&m.decision_latency, "decision_latency_seconds"),
        (&m.available, "instance_available"),
        (&m.ejections, "instance_ejections"),
        (&m.reloads, "config_reloads_total"),
        (&m.reload_ok, "config_last_reload_success"),
        (&m.protocol_errors, "protocol_errors_total"),
        (&m.mirror_requests, "mirror_requests_total"),
        (&m.mirror_latency, "mirror_latency_seconds"),
        (&m.mirror_queue, "mirror_queue_depth"),
        (&m.mirror_inflight, "mirror_inflight"),
        (&m.tenants.requests, "tenant_requests_total"),
        (&m.tenants.tokens, "tenant_tokens_total"),
        (&m.tenants.rejections, "tenant_rejections_total"),
        (&m.tenants.queue_wait, "queue_wait_by_class_seconds"),
    ];
    for (c, name) in fields {
        assert_eq!(c.desc()[0].fq_name, format!("tokengate_{name}"));
    }
    assert_eq!(m.reload_ok.get(), 1);
}
