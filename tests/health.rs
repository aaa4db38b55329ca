//! Active health checks take an instance out of rotation and back in.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unhealthy_instances_leave_and_rejoin_the_rotation() {
    let fleet = sims(2, "m", "e", 200.0).await;
    let gw = GatewayProc::start(&format!(
        "health_check: {{interval: 100ms, timeout: 500ms, rise: 2, fall: 2}}\nservices:\n  - name: m\n    load_balancing: round-robin\n{}",
        sim_instances(&fleet)
    ));
    let c = reqwest::Client::new();
    let hit = |c: reqwest::Client| {
        let url = gw.url("/v1/chat/completions");
        async move {
            let r = c
                .post(url)
                .body(chat_body("m", 100, false))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let i = r.headers()["x-tokengate-instance"]
                .to_str()
                .unwrap()
                .to_string();
            r.bytes().await.unwrap();
            i
        }
    };
    // e1 starts refusing connections: its health checks fail.
    fleet[0].update_faults(|f| f.refuse = true);
    eventually("e1 to be marked unhealthy", || async {
        gw.instances().await["instances"][0]["health"]["healthy"] == false
    })
    .await;
    for _ in 0..6 {
        assert_eq!(hit(c.clone()).await, "e2");
    }
    let m = gw.metrics().await;
    assert!(
        m.contains("tokengate_instance_available{instance=\"e1\"} 0"),
        "{m}"
    );
    // It recovers: back in the round-robin.
    fleet[0].update_faults(|f| f.refuse = false);
    eventually("e1 to be healthy again", || async {
        gw.instances().await["instances"][0]["health"]["healthy"] == true
    })
    .await;
    let mut seen = std::collections::HashSet::new();
    for _ in 0..4 {
        seen.insert(hit(c.clone()).await);
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    // The log lines follow the state changes the test saw: poll for them under the deadline.
    eventually("both health transitions to be logged", || async {
        let log = gw.log_text();
        log.contains("instance e1 is unhealthy") && log.contains("instance e1 is healthy again")
    })
    .await;
}
