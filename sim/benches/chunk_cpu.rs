//! CPU cost of the simulator per streamed chunk.
//!
//! `cargo bench -p engine-sim --bench chunk_cpu`
//!
//! The simulator runs on its own single-threaded tokio runtime in a dedicated
//! OS thread; its CPU time (user + system, `getrusage(RUSAGE_THREAD)`) is read
//! on that thread before and after K concurrent raw-TCP streaming chat
//! requests of N tokens each. Two scenarios: "paced" (decode steps spaced out
//! as in a real engine, so nearly every chunk is its own write) and
//! "saturated" (time_scale huge, the scheduler runs flat out).
//! Env: SIM_BENCH_K (default 32), SIM_BENCH_N (default 400).
// getrusage(RUSAGE_THREAD) through libc: unsafe by nature.
#![allow(unsafe_code)]

use std::time::{Duration, Instant};

use engine_sim::SimConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// (user, system) CPU time of the calling thread.
fn thread_cpu() -> (Duration, Duration) {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage struct.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    assert_eq!(rc, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    (tv(ru.ru_utime), tv(ru.ru_stime))
}

async fn stream_one(addr: std::net::SocketAddr, n: usize) -> usize {
    let body = format!(
        r#"{{"model":"sim-model","messages":[{{"role":"user","content":"bench"}}],"max_tokens":{n},"stream":true}}"#
    );
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = Vec::new();
    loop {
        let r = s.read(&mut buf).await.unwrap();
        if r == 0 {
            break;
        }
        total.extend_from_slice(&buf[..r]);
    }
    let text = String::from_utf8_lossy(&total);
    assert!(text.contains("data: [DONE]"), "incomplete stream");
    text.matches("\"delta\":{\"content\"").count()
}

fn scenario(name: &str, time_scale: f64, k: usize, n: usize) {
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let sim = engine_sim::spawn_local(SimConfig {
                time_scale,
                max_running: k,
                ..SimConfig::default()
            })
            .await
            .unwrap();
            tx.send((sim.addr, tokio::runtime::Handle::current()))
                .unwrap();
            let _ = stop_rx.await;
            sim.stop().await;
        });
    });
    let (addr, sim_rt) = rx.recv().unwrap();
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    client.block_on(async move {
        // warm up
        stream_one(addr, 10).await;
        let cpu0 = sim_rt.spawn(async { thread_cpu() }).await.unwrap();
        let t0 = Instant::now();
        let tasks: Vec<_> = (0..k).map(|_| tokio::spawn(stream_one(addr, n))).collect();
        let mut chunks = 0;
        for t in tasks {
            chunks += t.await.unwrap();
        }
        let wall = t0.elapsed();
        let cpu1 = sim_rt.spawn(async { thread_cpu() }).await.unwrap();
        assert_eq!(chunks, k * n);
        let user = cpu1.0 - cpu0.0;
        let sys = cpu1.1 - cpu0.1;
        let per = |d: Duration| d.as_secs_f64() * 1e6 / chunks as f64;
        println!(
            "{name:>9}: {k} streams x {n} tokens = {chunks} chunks in {:.2} s wall; sim thread CPU {:.2} us/chunk = {:.2} user + {:.2} kernel",
            wall.as_secs_f64(),
            per(user + sys),
            per(user),
            per(sys),
        );
    });
    let _ = stop_tx.send(());
    server.join().unwrap();
}

fn main() {
    // `cargo test --all-targets` runs benches as tests with --bench absent: stay quick.
    let quick = !std::env::args().any(|a| a == "--bench");
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (k, n) = if quick {
        (4, 20)
    } else {
        (env("SIM_BENCH_K", 32), env("SIM_BENCH_N", 400))
    };
    // paced: step = (6 + 0.35 * 32) ms / 10 = 1.7 ms
    scenario("paced", 10.0, k, n);
    scenario("saturated", 1e6, k, n);
}
