//! An instance whose `addr` is a name with several addresses (`expand: true`: a Kubernetes
//! headless Service, DNS round-robin) is one instance per address, ids `<id>/<ip>`, following
//! the name's answer without a config edit. The name's answer comes from a hosts file the test
//! controls (`TOKENGATE_TEST_HOSTS`); the engines listen on one port of 127.0.0.1, .2 and .3.

mod common;

use common::*;
use std::time::Duration;

/// Three engine-sims on the same port of 127.0.0.1, 127.0.0.2 and 127.0.0.3.
async fn engines_on_one_port() -> (u16, Vec<engine_sim::SimHandle>) {
    'port: for _ in 0..10 {
        let first = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = first.local_addr().unwrap().port();
        let mut listeners = vec![first];
        for ip in ["127.0.0.2", "127.0.0.3"] {
            match tokio::net::TcpListener::bind((ip, port)).await {
                Ok(l) => listeners.push(l),
                Err(_) => continue 'port,
            }
        }
        let mut sims = Vec::new();
        for (n, l) in listeners.into_iter().enumerate() {
            let cfg = engine_sim::SimConfig {
                id: format!("e{}", n + 1),
                model: "m".into(),
                time_scale: 100.0,
                ..Default::default()
            };
            sims.push(engine_sim::start(cfg, l).await.unwrap());
        }
        return (port, sims);
    }
    panic!("no port free on 127.0.0.1, .2 and .3 in 10 tries");
}

/// Replaces the hosts file at once (a rename: never read half-written).
fn write_hosts(path: &std::path::Path, line: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{line}\n")).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn ids(gw: &GatewayProc) -> Vec<String> {
    gw.instances().await["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_string())
        .collect()
}

/// The engines, the hosts file that names them and a gateway in front.
struct Pool {
    sims: Vec<engine_sim::SimHandle>,
    _dir: tempfile::TempDir,
    hosts: std::path::PathBuf,
    gw: GatewayProc,
}

/// Three engines on one port; the name `engines.test` answers 127.0.0.1 and .2 (a hosts file
/// the test may rewrite); a gateway with `config`, `ADDR` in it standing for the name and
/// port. It starts with the name's two instances.
async fn pool(config: &str) -> Pool {
    let (port, sims) = engines_on_one_port().await;
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    write_hosts(&hosts, "engines.test 127.0.0.1 127.0.0.2");
    let gw = GatewayProc::start_with_env(
        &config.replace("ADDR", &format!("engines.test:{port}")),
        &[("TOKENGATE_TEST_HOSTS", hosts.to_str().unwrap())],
    );
    assert_eq!(ids(&gw).await, ["pool/127.0.0.1", "pool/127.0.0.2"]);
    Pool {
        sims,
        _dir: dir,
        hosts,
        gw,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_grows_brings_its_new_address_into_rotation() {
    let Pool {
        sims,
        _dir,
        hosts,
        gw,
    } = pool("reload: {resolve_every: 200ms}\nhealth_check: {interval: 100ms}\nservices:\n  - name: m\n    load_balancing: round-robin\n    instances:\n      - {id: pool, addr: \"ADDR\", expand: true}\n").await;
    let c = reqwest::Client::new();
    let send = || async {
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .json(&serde_json::json!({"model": "m", "max_tokens": 1,
                "messages": [{"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.headers()["x-tokengate-instance"]
            .to_str()
            .unwrap()
            .to_string()
    };
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..4 {
        seen.insert(send().await);
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(sims[2].stats().requests_finished, 0);

    // The name gains a third address: a third instance, without a config edit.
    write_hosts(&hosts, "engines.test 127.0.0.1 127.0.0.2 127.0.0.3");
    eventually("the third address becomes an instance", || async {
        ids(&gw).await.len() == 3
    })
    .await;
    // Round-robin over three: it takes its turn once healthy (bounded by the deadline).
    eventually("the third engine serves", || async {
        send().await;
        sims[2].stats().requests_finished > 0
    })
    .await;
    assert!(ids(&gw).await.contains(&"pool/127.0.0.3".to_string()));
    assert!(gw.log_text().contains("one instance per address"));

    // It loses it again: the instance leaves, the others keep serving.
    write_hosts(&hosts, "engines.test 127.0.0.1 127.0.0.2");
    eventually("the third instance leaves", || async {
        ids(&gw).await.len() == 2
    })
    .await;
    let before = sims[2].stats().requests_finished;
    for _ in 0..4 {
        assert_ne!(send().await, "pool/127.0.0.3");
    }
    assert_eq!(sims[2].stats().requests_finished, before);
    tokio::time::timeout(Duration::from_secs(5), gw.wait_idle())
        .await
        .unwrap();
}

/// One name with `expand: true` stands for several engines: a service of it that says
/// nothing about scheduling gets the layered scheduler (as a service of two entries does),
/// so a prompt sent again goes where it is cached, by the prefix layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_of_one_expanded_name_gets_the_layered_scheduler() {
    // Kept whole: the engines and the hosts file live as long as it.
    let p = pool(
        "services:\n  - name: m\n    instances:\n      - {id: pool, addr: \"ADDR\", expand: true}\n",
    )
    .await;
    let gw = &p.gw;
    let c = reqwest::Client::new();
    let prompt = "You are the tool-using agent of a test tenant. ".repeat(40);
    let send = || async {
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .json(&serde_json::json!({"model": "m", "max_tokens": 1,
                "messages": [{"role": "system", "content": prompt},
                             {"role": "user", "content": "hi"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let h = |n: &str| r.headers()[n].to_str().unwrap().to_string();
        (h("x-tokengate-instance"), h("x-tokengate-reason"))
    };
    let (first, _) = send().await;
    let (again, reason) = send().await;
    assert!(reason.starts_with("prefix("), "{reason}");
    assert_eq!(again, first);
}

#[test]
fn expand_needs_a_name() {
    let (ok, err) = check_yaml(
        "services:\n  - name: m\n    instances:\n      - {id: a, addr: \"127.0.0.1:8000\", expand: true}\n",
    );
    assert!(!ok);
    assert!(err.contains("services[0].instances[0].expand"), "{err}");
}
