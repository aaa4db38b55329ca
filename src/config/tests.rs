//! The config's unit tests (parsing, defaults, every error message).

use super::*;
use std::time::Duration;
use tokengate_plugins::{
    LeastTokenParams, PredictedTtftParams, PrefixCacheParams, SessionAffinityParams,
};

const MIN: &str = "services:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n";

#[test]
fn minimal_config_gets_defaults() {
    let c = Config::from_yaml(MIN).unwrap();
    assert_eq!(c.listen, vec!["127.0.0.1:8080"]);
    assert_eq!(c.admin_listen, "127.0.0.1:9090");
    assert_eq!(c.max_body_bytes, 32 * 1024 * 1024);
    assert!(c.routing.strict);
    assert_eq!(c.timeouts.connect, Duration::from_secs(3));
}

#[test]
fn unknown_key_names_its_path() {
    let y = "services:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000, weight: 3}\n";
    let e = Config::from_yaml(y).unwrap_err().to_string();
    assert!(e.starts_with("services[0].instances[0]"), "{e}");
    assert!(e.contains("unknown key `weight`"), "{e}");
}

#[test]
fn semantic_errors_are_all_reported_with_paths() {
    let y = "listen: [nope]\nservices:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n  - name: m\n    instances:\n      - {id: a, addr: localhost}\n";
    let e = Config::from_yaml(y).unwrap_err().0;
    let all = e.join("\n");
    assert!(all.contains("listen[0]: invalid socket address"), "{all}");
    assert!(all.contains("services[1].name: duplicate service"), "{all}");
    assert!(
        all.contains("services[1].instances[0].id: duplicate"),
        "{all}"
    );
    assert!(
        all.contains("services[1].instances[0].addr: invalid socket address"),
        "{all}"
    );
}

#[test]
fn instance_ids_must_fit_in_a_header() {
    let y =
        "services:\n  - name: m\n    instances:\n      - {id: \"a\\nb\", addr: 127.0.0.1:8000}\n";
    let all = Config::from_yaml(y).unwrap_err().0.join("\n");
    assert!(
        all.contains("services[0].instances[0].id: \"a\\nb\" cannot be sent in the x-tokengate-instance header"),
        "{all}"
    );
}

#[test]
fn default_model_must_exist_and_needs_non_strict() {
    let y = format!("routing: {{strict: false, default_model: x}}\n{MIN}");
    let e = Config::from_yaml(&y).unwrap_err().to_string();
    assert!(
        e.contains("routing.default_model: \"x\" is not the name"),
        "{e}"
    );
    let y = format!("routing: {{strict: false, default_model: m}}\n{MIN}");
    assert!(Config::from_yaml(&y).is_ok());
}

#[test]
fn bad_duration_names_its_path() {
    let y = format!("timeouts: {{connect: fast}}\n{MIN}");
    let e = Config::from_yaml(&y).unwrap_err().to_string();
    assert!(e.starts_with("timeouts.connect:"), "{e}");
}

#[test]
fn retry_statuses_and_client_body_timeout() {
    let c = Config::from_yaml(MIN).unwrap();
    assert_eq!(c.passive_health.retry_on_status, vec![503, 429]);
    assert_eq!(c.timeouts.client_body, Duration::from_secs(60));
    let y =
        format!("passive_health: {{retry_on_status: []}}\ntimeouts: {{client_body: 5s}}\n{MIN}");
    let c = Config::from_yaml(&y).unwrap();
    assert!(c.passive_health.retry_on_status.is_empty());
    assert_eq!(c.timeouts.client_body, Duration::from_secs(5));
    let y = format!("passive_health: {{retry_on_status: [502, 200]}}\n{MIN}");
    let e = Config::from_yaml(&y).unwrap_err().to_string();
    assert!(
        e.contains("passive_health.retry_on_status[1]: 200 cannot be retried"),
        "{e}"
    );
    let y = format!("timeouts: {{client_body: 0s}}\n{MIN}");
    let e = Config::from_yaml(&y).unwrap_err().to_string();
    assert!(
        e.contains("timeouts.client_body: must be greater than 0"),
        "{e}"
    );
}

/// Every enum-like key is a serde enum: a wrong name is an error at its YAML path that
/// lists the accepted names.
#[test]
fn enum_keys_name_their_path_and_the_accepted_values() {
    let cases = [
        (
            "services:\n  - name: m\n    load_balancing: random\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
            "services[0].load_balancing: `random` is not one of `least-token`, `least-request`, `round-robin`, `predicted-ttft`",
        ),
        (
            "services:\n  - name: m\n    scheduler: {mode: layered, affinity: {mode: sticky}}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
            "`sticky` is not one of `soft`, `strict`",
        ),
        (
            "services:\n  - name: m\n    scheduler: {mode: policy, plugins: [{kind: fastest}]}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
            "`fastest` is not one of `session-affinity`, `least-inflight`, `least-token`, `predicted-ttft`, `least-cached`, `prefix-cache`, `decision-service`, `least-waiting`",
        ),
        (
            "services:\n  - name: m\n    scheduler: {mode: policy, plugins: [{kind: least-inflight, token_scale: 5}]}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
            "unknown key `token_scale`",
        ),
        (
            "services:\n  - name: m\n    scheduler: {mode: policy, plugins: [{kind: least-inflight}], session_keys: [cookie:x]}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n",
            "\"cookie:x\" is not header:NAME, body:prompt_cache_key, body:user or body:metadata.user_id",
        ),
        (
            "services:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\nroutes:\n  - {name: r, route_by: random, targets: [{service: m}]}\n",
            "routes[0].route_by: `random` is not one of `round-robin`, `weight`, `policy`",
        ),
    ];
    for (y, want) in cases {
        let e = Config::from_yaml(y).unwrap_err().to_string();
        assert!(e.contains(want), "{y}\n=> {e}");
    }
}

#[test]
fn least_cached_and_the_ttft_temperature_are_parsed_and_checked() {
    let y = "services:\n  - name: m\n    scheduler: {mode: layered, least_cached: {enabled: true, ttft_tolerance: 1.0, ttft_slack: 20ms}}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n  - name: p\n    scheduler: {mode: policy, plugins: [{kind: predicted-ttft, temperature: 250ms, tolerance: 0.5, slack: 50ms}, {kind: least-cached, weight: 0.25}]}\n    instances:\n      - {id: b, addr: 127.0.0.1:8001}\n";
    let c = Config::from_yaml(y).unwrap();
    let Some(SchedulerConfig::Layered { least_cached, .. }) = &c.services[0].scheduler else {
        panic!("layered expected")
    };
    assert!(least_cached.enabled);
    assert_eq!(least_cached.ttft_tolerance, Some(1.0));
    assert_eq!(least_cached.ttft_slack, Some(Duration::from_millis(20)));
    let Some(SchedulerConfig::Policy(ps)) = &c.services[1].scheduler else {
        panic!("policy expected")
    };
    assert!(matches!(
        ps.plugins[0],
        PluginSettings::PredictedTtft(PredictedTtftParams { temperature: Some(t), tolerance: Some(tol), slack: Some(sl), .. })
            if t == Duration::from_millis(250) && tol == 0.5 && sl == Duration::from_millis(50)
    ));
    assert_eq!(ps.plugins[1].kind(), "least-cached");
    assert_eq!(ps.plugins[1].weight(), Some(0.25));
    // On unless turned off.
    for (with, on) in [
        ("prefix: {}", true),
        ("least_cached: {enabled: false}", false),
    ] {
        let plain = Config::from_yaml(&y.replace(
            "least_cached: {enabled: true, ttft_tolerance: 1.0, ttft_slack: 20ms}",
            with,
        ))
        .unwrap();
        let Some(SchedulerConfig::Layered { least_cached, .. }) = &plain.services[0].scheduler
        else {
            panic!("layered expected")
        };
        assert_eq!(least_cached.enabled, on, "{with}");
    }
    let bad = y
        .replace("ttft_tolerance: 1.0", "ttft_tolerance: -1")
        .replace("temperature: 250ms", "temperature: 0s")
        .replace("tolerance: 0.5", "tolerance: -0.5");
    let e = Config::from_yaml(&bad).unwrap_err().to_string();
    assert!(
        e.contains("services[0].scheduler.least_cached.ttft_tolerance: must be >= 0"),
        "{e}"
    );
    assert!(
        e.contains("services[1].scheduler.plugins[0].temperature: must be longer than 0"),
        "{e}"
    );
    assert!(
        e.contains("services[1].scheduler.plugins[0].tolerance: must be a number >= 0"),
        "{e}"
    );
}

#[test]
fn an_instance_cache_size_is_at_least_one_prefix_block() {
    let y = "prefix_index: {block_size: 16}\nservices:\n  - name: m\n    instances:\n      - {id: a, addr: 127.0.0.1:8001, cache_tokens: 262144}\n";
    let c = Config::from_yaml(y).unwrap();
    assert_eq!(c.services[0].instances[0].cache_tokens, Some(262_144));
    let e = Config::from_yaml(&y.replace("262144", "8"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("services[0].instances[0].cache_tokens: 8 is less than one prefix block"),
        "{e}"
    );
}

#[test]
fn the_ttft_filter_and_unbound_affinity_are_parsed_and_checked() {
    let y = "services:\n  - name: p\n    scheduler: {mode: policy, plugins: [{kind: predicted-ttft, filter: true, tolerance: 0.25, slack: 25ms}, {kind: session-affinity, weight: 2, unbound: abstain}]}\n    instances:\n      - {id: b, addr: 127.0.0.1:8001}\n";
    let c = Config::from_yaml(y).unwrap();
    let Some(SchedulerConfig::Policy(ps)) = &c.services[0].scheduler else {
        panic!("policy expected")
    };
    assert!(matches!(
        ps.plugins[0],
        PluginSettings::PredictedTtft(PredictedTtftParams { filter: true, .. })
    ));
    assert!(matches!(
        ps.plugins[1],
        PluginSettings::SessionAffinity(SessionAffinityParams {
            unbound: UnboundSessions::Abstain,
            weight: Some(2.0)
        })
    ));
    // Defaults: not a filter, rendezvous for unbound sessions.
    let plain = Config::from_yaml(
        &y.replace("filter: true, ", "")
            .replace(", unbound: abstain", ""),
    )
    .unwrap();
    let Some(SchedulerConfig::Policy(ps)) = &plain.services[0].scheduler else {
        panic!("policy expected")
    };
    assert!(matches!(
        ps.plugins[0],
        PluginSettings::PredictedTtft(PredictedTtftParams { filter: false, .. })
    ));
    assert!(matches!(
        ps.plugins[1],
        PluginSettings::SessionAffinity(SessionAffinityParams {
            unbound: UnboundSessions::Rendezvous,
            ..
        })
    ));
    let e = Config::from_yaml(&y.replace("unbound: abstain", "unbound: hash"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`hash` is not one of `rendezvous`, `abstain`"),
        "{e}"
    );
}

#[test]
fn plugin_parameters_are_typed_and_checked() {
    let y = "services:\n  - name: m\n    scheduler:\n      mode: policy\n      plugins:\n        - {kind: least-token, token_scale: 500, weight: 2}\n        - {kind: prefix-cache, min_hit_ratio: 0.2}\n    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n";
    let c = Config::from_yaml(y).unwrap();
    let Some(SchedulerConfig::Policy(ps)) = &c.services[0].scheduler else {
        panic!("policy expected")
    };
    assert!(matches!(
        ps.plugins[0],
        PluginSettings::LeastToken(LeastTokenParams { weight: Some(w), token_scale }) if w == 2.0 && token_scale == 500.0
    ));
    assert!(matches!(
        ps.plugins[1],
        PluginSettings::PrefixCache(PrefixCacheParams { weight: None, min_hit_ratio, max_waiting: None }) if min_hit_ratio == 0.2
    ));
    assert_eq!(ps.session_max_entries, 100_000);
    let bad = y
        .replace("token_scale: 500", "token_scale: 0")
        .replace("0.2", "1.5");
    let e = Config::from_yaml(&bad).unwrap_err().to_string();
    assert!(
        e.contains("services[0].scheduler.plugins[0].token_scale: must be a positive number"),
        "{e}"
    );
    assert!(
        e.contains("services[0].scheduler.plugins[1].min_hit_ratio: must be in [0, 1]"),
        "{e}"
    );
}

#[test]
fn decision_service_is_a_filter_with_a_model_per_route() {
    let base = "services:\n  - name: a\n    instances:\n      - {id: a1, addr: 127.0.0.1:8000}\n  - name: b\n    instances:\n      - {id: b1, addr: 127.0.0.1:8001}\nproviders:\n  - {name: p, base_url: \"http://127.0.0.1:1/v1\"}\n";
    let route = |plugins: &str, decision: &str| {
        format!("{base}routes:\n  - name: r\n    targets: [{{service: a}}, {{service: b}}]\n    policy: {{plugins: [{plugins}]}}\n{decision}")
    };
    // A provider without a model needs the route to name one.
    let e = Config::from_yaml(&route(
        "{kind: decision-service}, {kind: least-inflight}",
        "    decision: {provider: p}\n",
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("routes[0].decision.model: required"), "{e}");
    let c = Config::from_yaml(&route(
        "{kind: decision-service}, {kind: least-inflight}",
        "    decision: {provider: p, model: judge-1}\n",
    ))
    .unwrap();
    assert!(c.routes[0].uses_decision());
    assert!(c.warnings().is_empty());
    // A weight on the filter is explained, not ignored.
    let e = Config::from_yaml(&route(
        "{kind: decision-service, weight: 10}, {kind: least-inflight}",
        "    decision: {provider: p, model: m}\n",
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("routes[0].policy.plugins[0].weight: decision-service has no weight"),
        "{e}"
    );
    // The filter alone cannot pick an instance.
    let e = Config::from_yaml(&route(
        "{kind: decision-service}",
        "    decision: {provider: p, model: m}\n",
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("at least one scoring plugin"), "{e}");
    // A decision block nothing uses: valid, with a warning.
    let c = Config::from_yaml(&route(
        "{kind: least-inflight}",
        "    decision: {provider: p, model: m}\n",
    ))
    .unwrap();
    assert!(!c.routes[0].uses_decision());
    assert!(
        c.warnings()[0].contains("the decision model is never asked"),
        "{:?}",
        c.warnings()
    );
}

#[test]
fn mirror_settings_are_checked_with_paths() {
    let base = "services:\n  - name: m\n    instances:\n      - {id: a, addr: \"127.0.0.1:1\"}\n";
    let c = Config::from_yaml(&format!(
        "{base}mirror: {{target: \"http://127.0.0.1:19400\", ratio: 10, auth_token: sk-x, log: true}}\n"
    ))
    .unwrap();
    let m = c.mirror.unwrap();
    assert_eq!(m.ratio, 10.0);
    assert_eq!(m.timeout_ms, 5000);
    assert!(m.target_model.is_empty());
    assert!(m.log);
    let e = Config::from_yaml(&format!(
        "{base}mirror: {{target: \"ftp://x\", ratio: 101, timeout_ms: 0, auth_token: \"a b\"}}\n"
    ))
    .unwrap_err()
    .to_string();
    for want in [
        "mirror.target: \"ftp://x\" must start with http:// or https://",
        "mirror.ratio: 101 is not a percentage",
        "mirror.timeout_ms: must be greater than 0",
        "mirror.auth_token: must be non-empty without whitespace",
    ] {
        assert!(e.contains(want), "{want} not in {e}");
    }
    let e = Config::from_yaml(&format!(
        "{base}mirror: {{target: \"http://h\", rate: 5}}\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("mirror.rate: unknown key `rate`"), "{e}");
    let e = Config::from_yaml(&format!("{base}mirror: {{ratio: 5}}\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("mirror.target: `target` is required"), "{e}");
    let c = Config::from_yaml(&format!(
        "{base}mirror: {{target: \"https://shadow.example.com/shadow\", ratio: 0.001}}\n"
    ))
    .unwrap();
    assert!(
        c.warnings()[0].contains("mirror.ratio"),
        "{:?}",
        c.warnings()
    );
}

#[test]
fn the_engine_queue_holds_while_the_fleet_is_saturated_unless_told_and_is_checked() {
    let inst = "    instances:\n      - {id: a, addr: 127.0.0.1:8000}\n      - {id: b, addr: 127.0.0.1:8001}\n";
    let svc = |keys: &str| format!("services:\n  - name: m\n{keys}{inst}");
    let held = |keys: &str| Config::from_yaml(&svc(keys)).unwrap().services[0].engine_queue();
    use crate::throttle::Scope;
    // On by default, scoped to the service (held only while every instance is saturated),
    // whatever the scheduler.
    let d = held("");
    assert!(d.hold);
    assert_eq!(d.scope, Scope::Service);
    assert_eq!(d.depth, crate::engine_queue::DEFAULT_DEPTH);
    assert_eq!(d.min_queued_ms, 250.0);
    assert_eq!(d, crate::engine_queue::Settings::default());
    assert!(held("    scheduler: {mode: layered}\n").hold);
    assert!(held("    load_balancing: least-token\n").hold);
    let i = held("    engine_queue: {scope: instance}\n");
    assert_eq!((i.hold, i.scope), (true, Scope::Instance));
    let set = held("    engine_queue: {hold: true, depth: 3, min_queued: 1s}\n");
    assert_eq!(
        (set.depth, set.min_queued_ms, set.scope),
        (3, 1000.0, Scope::Service)
    );
    assert!(!held("    engine_queue: {hold: false}\n").hold);
    // Never for a prefill/decode pair (sent as one), unless asked, which is an error.
    let pd = "    pd: {mode: vllm-nixl}\n    instances:\n      - {id: p, addr: 127.0.0.1:8000, role: prefill}\n      - {id: d, addr: 127.0.0.1:8001, role: decode}\n";
    let pd_held = |keys: &str| Config::from_yaml(&format!("services:\n  - name: m\n{keys}{pd}"));
    assert!(!pd_held("").unwrap().services[0].engine_queue().hold);
    let e = pd_held("    engine_queue: {hold: true}\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("services[0].engine_queue.hold: not with pd"),
        "{e}"
    );
    let e = Config::from_yaml(&svc("    engine_queue: {scope: fleet}\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("scope"), "{e}");
    let e = Config::from_yaml(&svc("    engine_queue: {depth: 0}\n"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("services[0].engine_queue.depth: must be at least 1"),
        "{e}"
    );
    let e = Config::from_yaml(&svc("    engine_queue: {holds: true}\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("holds"), "{e}");
}
