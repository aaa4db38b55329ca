//! The deployment files, checked without a Docker engine or a cluster: the configs they
//! carry are valid tokengate configs whose admin listener is reachable; the compose file,
//! the Prometheus config, the Kubernetes manifests and the configs agree on names and
//! ports; the image is non-root with a health check. (`docker/validate.sh` runs the schema
//! validators: docker-compose, promtool, kubectl kustomize, kubernetes-validate.)
//! Also: instance addresses given by name reach their engine through the binary.

mod common;

use common::{check_yaml, GatewayProc};
use serde_yaml_ng::Value;
use std::collections::BTreeSet;
use std::path::Path;
use tokengate::config::Config;

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel))
        .unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn yaml(rel: &str) -> Value {
    serde_yaml_ng::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every YAML document of a multi-document file.
fn docs(rel: &str) -> Vec<Value> {
    let text = read(rel);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

/// `v[key]`, following YAML merge keys (`<<: *anchor`), which the parser keeps as they are.
fn merged<'a>(v: &'a Value, key: &str) -> &'a Value {
    if !v[key].is_null() {
        return &v[key];
    }
    match v.get("<<") {
        Some(m) => merged(m, key),
        None => &v[key],
    }
}

fn config(text: &str, what: &str) -> Config {
    Config::from_yaml(text).unwrap_or_else(|e| panic!("{what}: {e}"))
}

fn port(addr: &str) -> u16 {
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn container_configs_are_valid_and_their_admin_listener_is_reachable() {
    for rel in [
        "docker/tokengate.yaml",
        "docker/demo.yaml",
        "docker/cluster.yaml",
    ] {
        let c = config(&read(rel), rel);
        assert!(
            c.admin_listen.starts_with("0.0.0.0:"),
            "{rel}: admin_listen {} is not reachable from outside the container",
            c.admin_listen
        );
        assert_eq!(port(&c.admin_listen), 9090, "{rel}");
        assert_eq!(c.listen, vec!["0.0.0.0:8080".to_string()], "{rel}");
    }
    // The demo config is the built-in one with other listeners.
    let demo = config(&read("docker/demo.yaml"), "docker/demo.yaml");
    let builtin = config(tokengate::demo::DEMO_YAML, "conf/demo.yaml");
    let ids = |c: &Config| -> Vec<(String, String)> {
        c.services
            .iter()
            .flat_map(|s| {
                s.instances
                    .iter()
                    .map(|i| (i.id.clone(), i.addr.to_string()))
            })
            .collect()
    };
    assert_eq!(ids(&demo), ids(&builtin));
}

#[test]
fn the_image_is_non_root_with_a_health_check_and_a_small_context() {
    let d = read("docker/Dockerfile");
    assert!(d.contains("cargo build --profile dist"), "the dist profile");
    assert!(d.contains("/src/target/dist/tokengate"));
    assert!(d.contains("USER 10001"), "non-root");
    let hc = d
        .lines()
        .skip_while(|l| !l.starts_with("HEALTHCHECK"))
        .take(2)
        .collect::<String>();
    assert!(
        hc.contains("tokengate\", \"probe\", \"http://127.0.0.1:9090/health"),
        "{hc}"
    );
    for copied in ["docker/tokengate.yaml", "docker/demo.yaml", "conf"] {
        assert!(d.contains(copied), "{copied}");
    }
    let ignore = read(".dockerignore");
    assert!(
        ignore.lines().any(|l| l.trim() == "target/"),
        "target/ stays out of the context"
    );
    assert!(ignore.lines().any(|l| l.trim() == ".git/"));
}

#[test]
fn compose_prometheus_and_the_gateway_config_agree() {
    let c = yaml("docker/compose.yaml");
    let services = c["services"].as_mapping().unwrap();
    let names: BTreeSet<String> = services
        .keys()
        .map(|k| k.as_str().unwrap().to_string())
        .collect();
    for s in [
        "tokengate",
        "engine-1",
        "engine-2",
        "engine-3",
        "engine-4",
        "prometheus",
        "grafana",
        "load",
    ] {
        assert!(names.contains(s), "compose service {s}");
    }
    // Every instance of the gateway's config is an engine service listening on its port,
    // serving the instance's model.
    let gw = config(&read("docker/tokengate.yaml"), "docker/tokengate.yaml");
    for s in &gw.services {
        for i in &s.instances {
            let (host, p) = i.addr.rsplit_once(':').unwrap();
            let svc = &c["services"][host];
            let cmd: Vec<&str> = svc["command"]
                .as_sequence()
                .unwrap_or_else(|| panic!("compose service {host} for {}", i.addr))
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            assert_eq!(cmd[0], "engine-sim", "{host}");
            let arg = |f: &str| cmd.iter().position(|a| *a == f).map(|k| cmd[k + 1]);
            assert_eq!(
                arg("--listen").map(port),
                Some(p.parse().unwrap()),
                "{host}"
            );
            assert_eq!(arg("--model"), Some(s.name.as_str()), "{host}");
            assert!(merged(svc, "healthcheck")["test"]
                .as_sequence()
                .unwrap()
                .iter()
                .any(|t| t.as_str().unwrap().ends_with(&format!(":{p}/health"))));
        }
    }
    // The gateway runs the mounted config; its admin port is where Prometheus scrapes.
    let t = &c["services"]["tokengate"];
    let cmd: Vec<&str> = t["command"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(cmd, ["serve", "-c", "/etc/tokengate/tokengate.yaml"]);
    assert!(t["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|v| v.as_str().unwrap() == "./tokengate.yaml:/etc/tokengate/tokengate.yaml:ro"));
    for s in names
        .iter()
        .filter(|s| s.starts_with("engine-") || *s == "tokengate" || *s == "load")
    {
        assert_eq!(
            merged(&c["services"][s.as_str()], "read_only"),
            &Value::Bool(true),
            "{s}"
        );
    }
    let p = yaml("docker/prometheus/prometheus.yml");
    let jobs = p["scrape_configs"].as_sequence().unwrap();
    let job = jobs.iter().find(|j| j["job_name"] == "tokengate").unwrap();
    assert_eq!(
        job["static_configs"][0]["targets"][0].as_str().unwrap(),
        format!("tokengate:{}", port(&gw.admin_listen))
    );
    let engines = jobs.iter().find(|j| j["job_name"] == "engines").unwrap();
    for t in engines["static_configs"][0]["targets"]
        .as_sequence()
        .unwrap()
    {
        let host = t.as_str().unwrap().split(':').next().unwrap();
        assert!(names.contains(host), "prometheus target {host}");
    }
    // Grafana: the provisioning and the dashboard it mounts exist; the datasource uid is
    // the dashboard's.
    let g = &c["services"]["grafana"];
    for v in g["volumes"].as_sequence().unwrap() {
        let src = v.as_str().unwrap().split(':').next().unwrap();
        if let Some(rel) = src.strip_prefix("./") {
            assert!(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("docker")
                    .join(rel)
                    .is_dir(),
                "{src}"
            );
        }
    }
    let ds = yaml("docker/grafana/provisioning/datasources/prometheus.yaml");
    let uid = ds["datasources"][0]["uid"].as_str().unwrap();
    assert!(
        read("docker/grafana/dashboards/tokengate.json").contains(&format!("\"uid\": \"{uid}\""))
    );
    assert_eq!(ds["datasources"][0]["url"], "http://prometheus:9090");
    let dp = yaml("docker/grafana/provisioning/dashboards/tokengate.yaml");
    assert_eq!(
        dp["providers"][0]["options"]["path"],
        "/var/lib/grafana/dashboards"
    );
    assert!(g["volumes"].as_sequence().unwrap().iter().any(|v| v
        .as_str()
        .unwrap()
        .starts_with("./grafana/dashboards:/var/lib/grafana/dashboards")));
}

#[test]
fn kubernetes_manifests_agree_with_the_config_they_carry() {
    let cm = yaml("docker/k8s/configmap.yaml");
    let cfg = config(
        cm["data"]["tokengate.yaml"].as_str().unwrap(),
        "ConfigMap tokengate.yaml",
    );
    let admin_port = port(&cfg.admin_listen);
    assert!(cfg.admin_listen.starts_with("0.0.0.0:"));
    let d = yaml("docker/k8s/deployment.yaml");
    assert_eq!(d["kind"], "Deployment");
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], Value::Bool(true));
    let c = &pod["containers"][0];
    assert_eq!(
        c["securityContext"]["readOnlyRootFilesystem"],
        Value::Bool(true)
    );
    assert_eq!(
        c["securityContext"]["allowPrivilegeEscalation"],
        Value::Bool(false)
    );
    assert!(c["resources"]["requests"]["cpu"].as_str().is_some());
    assert!(c["resources"]["limits"]["memory"].as_str().is_some());
    let ports = c["ports"].as_sequence().unwrap();
    let named = |n: &str| {
        ports
            .iter()
            .find(|p| p["name"] == n)
            .map(|p| p["containerPort"].as_u64().unwrap())
    };
    assert_eq!(named("admin"), Some(u64::from(admin_port)));
    assert_eq!(named("http"), Some(u64::from(port(&cfg.listen[0]))));
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health");
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], "admin");
    let args: Vec<&str> = c["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(args, ["serve", "-c", "/etc/tokengate/tokengate.yaml"]);
    let mounts = c["volumeMounts"].as_sequence().unwrap();
    assert!(
        mounts
            .iter()
            .any(|m| m["mountPath"] == "/etc/tokengate" && m["subPath"].is_null()),
        "the ConfigMap is mounted as a directory (subPath mounts never see updates)"
    );
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        cfg.shutdown_grace.as_secs() < grace,
        "shutdown_grace below the pod's grace period"
    );
    let tmpl = &d["spec"]["template"]["metadata"];
    assert_eq!(
        tmpl["annotations"]["prometheus.io/port"].as_str().unwrap(),
        admin_port.to_string()
    );
    // The Service selects the pods and exposes the admin port by name.
    let svc = yaml("docker/k8s/service.yaml");
    for (k, v) in svc["spec"]["selector"].as_mapping().unwrap() {
        assert_eq!(&tmpl["labels"][k.as_str().unwrap()], v);
    }
    assert!(svc["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|p| p["targetPort"] == "admin"));
    // Engines by name: <statefulset>-<ordinal>.<headless service>:<port>.
    let eng = docs("docker/k8s/engines.yaml");
    let headless = eng.iter().find(|d| d["kind"] == "Service").unwrap();
    assert_eq!(headless["spec"]["clusterIP"], "None");
    let hname = headless["metadata"]["name"].as_str().unwrap();
    let hport = headless["spec"]["ports"][0]["port"].as_u64().unwrap();
    for s in &cfg.services {
        for i in &s.instances {
            let (host, p) = i.addr.rsplit_once(':').unwrap();
            assert_eq!(p.parse::<u64>().unwrap(), hport, "{}", i.addr);
            let (pod_name, svc_name) = host.split_once('.').unwrap();
            assert_eq!(svc_name, hname, "{}", i.addr);
            let (set, ordinal) = pod_name.rsplit_once('-').unwrap();
            let ss = eng
                .iter()
                .find(|d| d["kind"] == "StatefulSet" && d["metadata"]["name"] == set)
                .unwrap_or_else(|| panic!("no StatefulSet {set} for {}", i.addr));
            assert_eq!(ss["spec"]["serviceName"], hname);
            assert!(ordinal.parse::<u64>().unwrap() < ss["spec"]["replicas"].as_u64().unwrap());
            let args: Vec<&str> = ss["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            let model = args
                .iter()
                .position(|a| *a == "--model")
                .map(|k| args[k + 1]);
            assert_eq!(model, Some(s.name.as_str()), "{set} serves {}", s.name);
            for (k, v) in headless["spec"]["selector"].as_mapping().unwrap() {
                assert_eq!(
                    &ss["spec"]["template"]["metadata"]["labels"][k.as_str().unwrap()],
                    v
                );
            }
        }
    }
    // The ServiceMonitor selects the Service and scrapes its admin port.
    let sm = yaml("docker/k8s/servicemonitor.yaml");
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_mapping().unwrap() {
        assert_eq!(&svc["metadata"]["labels"][k.as_str().unwrap()], v);
    }
    assert_eq!(sm["spec"]["endpoints"][0]["port"], "admin");
    assert_eq!(sm["spec"]["endpoints"][0]["path"], "/metrics");
    // The kustomization lists files that exist.
    let k = yaml("docker/k8s/kustomization.yaml");
    for r in k["resources"].as_sequence().unwrap() {
        read(&format!("docker/k8s/{}", r.as_str().unwrap()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_addressed_by_name_are_resolved() {
    let sims = common::sims(1, "m", "e", 50.0).await;
    let gw = GatewayProc::start(&format!(
        "services:\n  - name: m\n    instances:\n      - {{ id: by-name, addr: \"localhost:{}\" }}\n",
        sims[0].addr.port()
    ));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(&serde_json::json!({"model": "m", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-tokengate-instance"], "by-name");
    let v = gw.instances().await;
    assert_eq!(
        v["instances"][0]["addr"],
        format!("127.0.0.1:{}", sims[0].addr.port())
    );

    // A name that does not resolve: `check` passes (the gateway would start and keep the
    // instance unavailable until it resolves) but warns with the YAML path; a malformed one is
    // rejected without a lookup.
    for (addr, ok, want) in [
        (
            "no-such-engine.invalid:8000",
            true,
            "warning: services[0].instances[0].addr: cannot resolve",
        ),
        (
            "bad_name:8000",
            false,
            "services[0].instances[0].addr: invalid socket address",
        ),
    ] {
        let (passed, err) = check_yaml(&format!(
            "services:\n  - name: m\n    instances:\n      - {{ id: a, addr: \"{addr}\" }}\n"
        ));
        assert_eq!(passed, ok, "{addr}");
        assert!(err.contains(want), "{addr}: {err}");
    }
}

#[test]
fn the_cluster_deployments_share_state_on_their_redis() {
    // Kubernetes: the overlay's config is the base's plus `cluster:` on the overlay's Redis
    // Service, at 3 replicas.
    let base = yaml("docker/k8s/configmap.yaml");
    let over = yaml("docker/k8s-cluster/configmap.yaml");
    let text = |v: &Value| v["data"]["tokengate.yaml"].as_str().unwrap().to_string();
    let (b, o) = (
        config(&text(&base), "k8s ConfigMap"),
        config(&text(&over), "k8s-cluster ConfigMap"),
    );
    let c = o.cluster.as_ref().expect("k8s-cluster: cluster block");
    assert!(b.cluster.is_none());
    let mut without = serde_yaml_ng::from_str::<Value>(&text(&over)).unwrap();
    without.as_mapping_mut().unwrap().remove("cluster");
    assert_eq!(
        without,
        serde_yaml_ng::from_str::<Value>(&text(&base)).unwrap(),
        "docker/k8s-cluster/configmap.yaml must be docker/k8s/configmap.yaml plus cluster:"
    );
    let redis = docs("docker/k8s-cluster/redis.yaml");
    let svc = redis.iter().find(|d| d["kind"] == "Service").unwrap();
    let name = svc["metadata"]["name"].as_str().unwrap();
    let p = svc["spec"]["ports"][0]["port"].as_u64().unwrap();
    assert_eq!(c.redis.as_ref().unwrap().url, format!("redis://{name}:{p}"));
    assert_eq!(
        yaml("docker/k8s-cluster/replicas.yaml")["spec"]["replicas"],
        Value::from(3)
    );
    // Compose: three replicas of docker/cluster.yaml, its Redis URL the `redis` service,
    // HAProxy's servers the replicas.
    let compose = yaml("docker/compose.yaml");
    let cfg = config(&read("docker/cluster.yaml"), "docker/cluster.yaml");
    assert_eq!(
        cfg.cluster.as_ref().unwrap().redis.as_ref().unwrap().url,
        "redis://redis:6379"
    );
    let haproxy = read("docker/haproxy.cfg");
    for r in ["tokengate-1", "tokengate-2", "tokengate-3"] {
        let s = &compose["services"][r];
        assert_eq!(
            merged(s, "command")[2].as_str(),
            Some("/etc/tokengate/cluster.yaml"),
            "{r}"
        );
        assert!(haproxy.contains(&format!("server {r} {r}:8080")), "{r}");
    }
    assert!(compose["services"]["redis"].is_mapping());
}
