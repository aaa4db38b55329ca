//! Every example in conf/ is valid (`tokengate check` exits 0), and a bad config exits 1 with
//! every error named by its YAML path.

use std::process::Command;

fn check(path: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["check", "-c"])
        .arg(path)
        .output()
        .expect("run tokengate check")
}

#[test]
fn every_conf_example_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("conf");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            let out = check(&p);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{}: {err}", p.display());
            // Examples name the hosts of a deployment (engines.internal, compose service
            // names) that do not resolve here; `check` warns about those and nothing else.
            assert!(
                !err.lines()
                    .any(|l| l.contains("warning:") && !l.contains("cannot resolve")),
                "{}: {err}",
                p.display()
            );
            n += 1;
        }
    }
    assert!(n >= 2, "expected the conf/ examples, found {n}");
}

#[test]
fn a_bad_config_names_every_error_by_path() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.yaml");
    std::fs::write(
        &p,
        "services:\n  - name: a\n    instances:\n      - {id: x, addr: 127.0.0.1:1}\n  - name: b\n    instances:\n      - {id: y, addr: not-an-address}\ntimeouts: {connect: 0s}\n",
    )
    .unwrap();
    let out = check(&p);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    for want in [
        "services[1].instances[0].addr: invalid socket address \"not-an-address\"",
        "timeouts.connect: must be greater than 0",
    ] {
        assert!(err.contains(want), "missing {want:?} in:\n{err}");
    }
    // An enum-like key with an unknown name: its path and the accepted names.
    std::fs::write(
        &p,
        "services:\n  - name: b\n    load_balancing: fastest\n    instances:\n      - {id: y, addr: 127.0.0.1:1}\n",
    )
    .unwrap();
    let out = check(&p);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("services[0].load_balancing: `fastest` is not one of `least-token`, `least-request`, `round-robin`, `predicted-ttft`"),
        "{err}"
    );
    std::fs::write(&p, "services: []\nlisten: [1.2.3.4:5]\nbogus: 1\n").unwrap();
    let out = check(&p);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bogus: unknown key `bogus`"), "{err}");
}

#[test]
fn serve_refuses_a_bad_config_with_the_same_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.yaml");
    std::fs::write(&p, "services:\n  - name: a\n    instances: []\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["serve", "-c"])
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("services[0].instances: at least one instance is required"));
}

/// `check --print`: the effective config as YAML on stdout, defaults filled in and every
/// credential masked; that output is itself a valid config, which prints the same again.
#[test]
fn check_print_shows_the_effective_config_without_secrets_and_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("in.yaml");
    let secrets = [
        "sk-client-1",
        "admin-tok-2",
        "engine-key-3",
        "instance-key-4",
        "member-tok-5",
        "mirror-tok-6",
        "split-key-7",
        "provider-key-8",
    ];
    std::fs::write(
        &p,
        format!(
            "api_keys: [{}]\nadmin_token: {}\nservices:\n  - name: m\n    api_key: {}\n    scheduler: {{mode: policy, plugins: [{{kind: predicted-ttft, slack: 20ms}}, {{kind: session-affinity, unbound: abstain}}], session_keys: [\"header:x-s\", \"body:user\"]}}\n    instances:\n      - {{id: a, addr: 127.0.0.1:1, api_key: {}}}\n  - name: l\n    scheduler: {{mode: layered}}\n    instances:\n      - {{id: b, addr: 127.0.0.1:2}}\nglobal:\n  members:\n    - {{name: eu, url: \"http://127.0.0.1:3\", token: {}}}\nmirror: {{target: \"http://127.0.0.1:4\", auth_token: {}}}\nsplit:\n  proxies:\n    - {{local: true}}\n    - {{name: ext, address: \"http://127.0.0.1:5/v1\", api_key: {}}}\nproviders:\n  - {{name: p, base_url: \"http://127.0.0.1:6/v1\", api_key: {}, model: j}}\n",
            secrets[0], secrets[1], secrets[2], secrets[3], secrets[4], secrets[5], secrets[6], secrets[7]
        ),
    )
    .unwrap();
    let print = |path: &std::path::Path| {
        let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
            .args(["check", "--print", "-c"])
            .arg(path)
            .output()
            .expect("run tokengate check --print");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{}: {err}", path.display());
        assert!(err.contains(": ok (2 services, 2 instances)"), "{err}");
        String::from_utf8(out.stdout).unwrap()
    };
    let yaml = print(&p);
    for s in secrets {
        assert!(!yaml.contains(s), "{s} printed:\n{yaml}");
    }
    assert_eq!(yaml.matches("'***'").count(), secrets.len(), "{yaml}");
    // Defaults filled in: listeners, timeouts (humantime), health, the layered scheduler's
    // stages, a plugin's defaults, the reload watcher.
    for want in [
        "admin_listen: 127.0.0.1:9090",
        "max_body_bytes: 33554432",
        "first_byte: 2m",
        "retry_on_status:\n  - 503\n  - 429",
        "mode: layered",
        "least_cached:\n",
        "kind: predicted-ttft",
        "slack: 20ms",
        "filter: false",
        "unbound: abstain",
        "- header:x-s",
        "- body:user",
        "debounce: 2s",
    ] {
        assert!(yaml.contains(want), "{want:?} not in:\n{yaml}");
    }
    // Round trip: the printed config passes `check` and prints the same.
    let again = dir.path().join("printed.yaml");
    std::fs::write(&again, &yaml).unwrap();
    assert_eq!(print(&again), yaml);
    // The same for every example in conf/ (every feature's settings print and parse back).
    let conf = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("conf");
    for e in std::fs::read_dir(&conf).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            let yaml = print_any(&p);
            std::fs::write(&again, &yaml).unwrap();
            assert_eq!(print_any(&again), yaml, "{}", p.display());
        }
    }
}

/// `check --print` shows the scheduling a service gets when it says nothing: the layered
/// scheduler and `least-token` where there is a choice, the engine queue held while the fleet
/// is saturated, none held for a prefill/decode pair; and the printed form runs the same.
#[test]
fn check_print_fills_in_the_scheduling_a_service_gets_by_default() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("defaults.yaml");
    std::fs::write(
        &p,
        "services:\n  - name: two\n    instances:\n      - {id: a, addr: 127.0.0.1:1}\n      - {id: b, addr: 127.0.0.1:2}\n  - name: one\n    instances:\n      - {id: c, addr: 127.0.0.1:3}\n  - name: plain\n    load_balancing: round-robin\n    engine_queue: {scope: instance}\n    instances:\n      - {id: d, addr: 127.0.0.1:4}\n      - {id: e, addr: 127.0.0.1:5}\n  - name: pair\n    pd: {mode: vllm-nixl}\n    instances:\n      - {id: p, addr: 127.0.0.1:6, role: prefill}\n      - {id: q, addr: 127.0.0.1:7, role: decode}\n  - name: pool\n    instances:\n      - {id: k, addr: \"localhost:8\", expand: true}\n",
    )
    .unwrap();
    let yaml = print_any(&p);
    let c = tokengate::config::Config::from_yaml(&yaml).unwrap();
    let svc = |name: &str| c.services.iter().find(|s| s.name == name).unwrap();
    let lb = |name: &str| format!("{:?}", svc(name).load_balancing);
    let eq = |name: &str| {
        let e = svc(name)
            .engine_queue
            .clone()
            .expect("engine_queue filled in");
        (e.hold, e.scope.map(|s| format!("{s:?}")))
    };
    // Two instances and no key: the layered scheduler with its layers, held fleet-wide.
    assert!(
        matches!(
            svc("two").scheduler,
            Some(tokengate::config::SchedulerConfig::Layered { .. })
        ),
        "{yaml}"
    );
    assert_eq!(lb("two"), "Some(LeastToken)");
    assert_eq!(eq("two"), (Some(true), Some("Service".into())));
    assert!(
        yaml.contains("mode: layered") && yaml.contains("least_cached:"),
        "{yaml}"
    );
    // One instance has nothing to choose between: plain balancing, `load_balancing` left
    // unset so that a second instance would still get the layered scheduler.
    assert!(svc("one").scheduler.is_none(), "{yaml}");
    assert_eq!(lb("one"), "None");
    // What a service says is kept.
    assert!(svc("plain").scheduler.is_none(), "{yaml}");
    assert_eq!(lb("plain"), "Some(RoundRobin)");
    assert_eq!(eq("plain"), (Some(true), Some("Instance".into())));
    // One name with `expand: true` may be several instances: layered too.
    assert!(
        matches!(
            svc("pool").scheduler,
            Some(tokengate::config::SchedulerConfig::Layered { .. })
        ),
        "{yaml}"
    );
    // A prefill/decode pair is never held.
    assert_eq!(eq("pair").0, Some(false));
    // Read back, it prints the same.
    let again = dir.path().join("again.yaml");
    std::fs::write(&again, &yaml).unwrap();
    assert_eq!(print_any(&again), yaml);
}

/// `check --print` of a valid config (any instance count).
fn print_any(path: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tokengate"))
        .args(["check", "--print", "-c"])
        .arg(path)
        .output()
        .expect("run tokengate check --print");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {err}", path.display());
    String::from_utf8(out.stdout).unwrap()
}
