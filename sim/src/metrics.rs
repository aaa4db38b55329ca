//! Prometheus text exposition of the engine state, in two name flavours.
//!
//! * [`MetricsFlavor::Vllm`] (default): vLLM's names (`vllm:num_requests_running`,
//!   `vllm:kv_cache_usage_perc`, `vllm:prefix_cache_queries_total`, …), label
//!   `model_name`.
//! * [`MetricsFlavor::Sglang`]: SGLang's scheduler gauges (names and help texts of
//!   `python/sglang/srt/metrics/collector.py`) with SGLang's scheduler label set
//!   `model_name`, `engine_type` (`unified` / `prefill` / `decode`), `tp_rank`,
//!   `pp_rank`, plus its token counters and latency histograms with `model_name`.
//!   Two values are computed differently from SGLang: `sglang:cache_hit_rate` is
//!   the cumulative prefix-cache hit rate (SGLang reports the rate of its last
//!   prefill batch) and `sglang:gen_throughput` is the generation rate over the
//!   last wall-clock second (SGLang averages over its decode log interval).
//!
//! Both flavours also carry engine-sim's own series (`engine_sim:*`): the peak and
//! current number of requests in their prefill phase, the peak running batch, the
//! role in a prefill/decode-disaggregated fleet and the PD transfer counters.

use std::fmt::Write as _;

use crate::engine::Snapshot;
use crate::{MetricsFlavor, SimConfig};

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn sample(o: &mut String, kind: &str, name: &str, help: &str, labels: &str, v: f64) {
    let _ = writeln!(
        o,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {v}"
    );
}

fn gauge(o: &mut String, name: &str, help: &str, labels: &str, v: f64) {
    sample(o, "gauge", name, help, labels, v);
}

fn counter(o: &mut String, name: &str, help: &str, labels: &str, v: u64) {
    sample(o, "counter", name, help, labels, v as f64);
}

/// Render `/metrics` for `snap` in `cfg.metrics_flavor`.
pub(crate) fn render(cfg: &SimConfig, snap: &Snapshot) -> String {
    let model = format!("model_name=\"{}\"", escape(&cfg.model));
    let mut o = String::with_capacity(8192);
    match cfg.metrics_flavor {
        MetricsFlavor::Vllm => vllm(&mut o, cfg, &model, snap),
        MetricsFlavor::Sglang => sglang(&mut o, cfg, &model, snap),
    }
    engine_sim(&mut o, cfg, &model, snap);
    o
}

fn vllm(o: &mut String, cfg: &SimConfig, l: &str, snap: &Snapshot) {
    let (st, m) = (&snap.stats, &snap.m);
    // vLLM's cache config as an info gauge (value 1, the figures in labels).
    gauge(
        o,
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        &format!(
            "block_size=\"{}\",enable_prefix_caching=\"True\",num_gpu_blocks=\"{}\"",
            cfg.block_size, cfg.kv_blocks
        ),
        1.0,
    );
    gauge(
        o,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        l,
        st.running as f64,
    );
    gauge(
        o,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        l,
        st.waiting as f64,
    );
    gauge(
        o,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        l,
        st.kv_usage,
    );
    gauge(
        o,
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage (deprecated name).",
        l,
        st.kv_usage,
    );
    counter(
        o,
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        l,
        m.prefix_queries,
    );
    counter(
        o,
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        l,
        m.prefix_hits,
    );
    counter(
        o,
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        l,
        m.prompt_tokens,
    );
    counter(
        o,
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        l,
        m.generation_tokens,
    );
    counter(
        o,
        "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.",
        l,
        0,
    );
    let _ = writeln!(
        o,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n\
         # TYPE vllm:request_success_total counter\n\
         vllm:request_success_total{{{l},finished_reason=\"length\"}} {}\n\
         vllm:request_success_total{{{l},finished_reason=\"stop\"}} {}\n\
         vllm:request_success_total{{{l},finished_reason=\"abort\"}} {}",
        m.success_length, m.success_stop, m.aborted
    );
    m.ttft.render(
        o,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        l,
    );
    m.e2e.render(
        o,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        l,
    );
}

fn sglang(o: &mut String, cfg: &SimConfig, model: &str, snap: &Snapshot) {
    let (st, m) = (&snap.stats, &snap.m);
    let l = format!(
        "{model},engine_type=\"{}\",tp_rank=\"0\",pp_rank=\"0\"",
        cfg.role.sglang_engine_type()
    );
    let l = l.as_str();
    let max_tokens = cfg.kv_blocks * cfg.block_size;
    gauge(
        o,
        "sglang:num_running_reqs",
        "The number of running requests.",
        l,
        st.running as f64,
    );
    gauge(
        o,
        "sglang:num_used_tokens",
        "The number of used tokens.",
        l,
        (st.kv_usage * max_tokens as f64).round(),
    );
    gauge(o, "sglang:token_usage", "The token usage.", l, st.kv_usage);
    gauge(
        o,
        "sglang:gen_throughput",
        "The generation throughput (token/s).",
        l,
        snap.gen_throughput,
    );
    gauge(
        o,
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        l,
        st.waiting as f64,
    );
    let hit_rate = if m.prefix_queries == 0 {
        0.0
    } else {
        m.prefix_hits as f64 / m.prefix_queries as f64
    };
    gauge(
        o,
        "sglang:cache_hit_rate",
        "The prefix cache hit rate.",
        l,
        hit_rate,
    );
    gauge(
        o,
        "sglang:max_total_num_tokens",
        "Maximum total number of tokens in the KV cache pool.",
        l,
        max_tokens as f64,
    );
    let pd = cfg.pd_active();
    gauge(
        o,
        "sglang:num_prefill_inflight_queue_reqs",
        "The number of requests in the prefill inflight queue.",
        l,
        if pd == Some(crate::Role::Prefill) {
            st.pd_kv_pinned as f64
        } else {
            0.0
        },
    );
    gauge(
        o,
        "sglang:num_decode_transfer_queue_reqs",
        "The number of requests in the decode transfer queue.",
        l,
        if pd == Some(crate::Role::Decode) {
            st.pd_awaiting_kv as f64
        } else {
            0.0
        },
    );
    counter(
        o,
        "sglang:num_transfer_failed_reqs_total",
        "The number of transfer failed requests.",
        l,
        st.pd_transfer_timeouts + st.pd_transfer_errors + st.pd_transfers_expired,
    );
    counter(
        o,
        "sglang:prompt_tokens_total",
        "Number of prefill tokens processed.",
        model,
        m.prompt_tokens,
    );
    counter(
        o,
        "sglang:generation_tokens_total",
        "Number of generation tokens processed.",
        model,
        m.generation_tokens,
    );
    counter(
        o,
        "sglang:cached_tokens_total",
        "Number of cached prompt tokens.",
        model,
        m.prefix_hits,
    );
    counter(
        o,
        "sglang:num_requests_total",
        "Number of requests processed.",
        model,
        m.success_length + m.success_stop + m.aborted,
    );
    m.ttft.render(
        o,
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        model,
    );
    m.e2e.render(
        o,
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        model,
    );
}

fn engine_sim(o: &mut String, cfg: &SimConfig, l: &str, snap: &Snapshot) {
    let st = &snap.stats;
    let _ = writeln!(
        o,
        "# HELP engine_sim:info The simulated engine: id, PD role and PD protocol.\n\
         # TYPE engine_sim:info gauge\n\
         engine_sim:info{{{l},engine_id=\"{}\",role=\"{}\",pd_mode=\"{}\"}} 1",
        escape(&cfg.id),
        cfg.role.as_str(),
        cfg.pd_mode.as_str(),
    );
    gauge(
        o,
        "engine_sim:prefill_phase",
        "Requests in their prefill phase now: waiting, or admitted without a first token.",
        l,
        st.prefill_phase as f64,
    );
    gauge(
        o,
        "engine_sim:max_prefill_phase",
        "Peak number of requests in their prefill phase at once since start.",
        l,
        st.max_prefill_phase as f64,
    );
    gauge(
        o,
        "engine_sim:max_running",
        "Peak size of the running batch since start.",
        l,
        st.max_running as f64,
    );
    counter(
        o,
        "engine_sim:prefill_computed_tokens_total",
        "Uncached prompt tokens this engine prefilled itself.",
        l,
        st.prefill_computed_tokens,
    );
    counter(
        o,
        "engine_sim:aborted_by_request_total",
        "Requests ended by POST /abort_request.",
        l,
        st.aborted_by_request,
    );
    gauge(
        o,
        "engine_sim:pd_awaiting_kv",
        "PD decode: requests waiting for their KV from a prefill engine.",
        l,
        st.pd_awaiting_kv as f64,
    );
    gauge(
        o,
        "engine_sim:pd_kv_pinned",
        "PD prefill: finished prefills whose KV waits for a decode engine.",
        l,
        st.pd_kv_pinned as f64,
    );
    for (name, help, v) in [
        (
            "engine_sim:pd_prefills_published_total",
            "PD prefill: KV published for a bootstrap room or transfer id.",
            st.pd_prefills_published,
        ),
        (
            "engine_sim:pd_transfers_sent_total",
            "PD prefill: published KV fetched by a decode engine.",
            st.pd_transfers_sent,
        ),
        (
            "engine_sim:pd_transfers_expired_total",
            "PD prefill: published KV nobody fetched in time.",
            st.pd_transfers_expired,
        ),
        (
            "engine_sim:pd_transfers_received_total",
            "PD decode: KV received from a prefill engine.",
            st.pd_transfers_received,
        ),
        (
            "engine_sim:pd_transfer_timeouts_total",
            "PD decode: requests failed waiting for their KV.",
            st.pd_transfer_timeouts,
        ),
        (
            "engine_sim:pd_transfer_errors_total",
            "PD decode: requests failed because the prefill refused the transfer.",
            st.pd_transfer_errors,
        ),
    ] {
        counter(o, name, help, l, v);
    }
}
