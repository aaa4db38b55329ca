//! Memory per connection through the real binary (issue 27, item 4; the figures of a release
//! build are in bench/results/reliability.md, `bench/memory.sh`):
//! - the gateway runs with transparent huge pages off (`/proc/<pid>/status`), so a huge page
//!   of mimalloc's arenas is not resident as a whole (114 → 54 KiB per open stream);
//! - an idle connection, before its first request or kept alive between two, holds no
//!   per-request state of Pingora's (~30 → ~5 KiB): hundreds of them barely move the RSS,
//!   and each still serves its next request.

mod common;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn status_field(pid: u32, field: &str) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .map(|v| v.trim().to_string())
}

fn rss_kib(pid: u32) -> u64 {
    status_field(pid, "VmRSS:")
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_runs_without_transparent_huge_pages() {
    let engine = Mock::start().await;
    let gw = GatewayProc::start(&format!(
        "services:\n{}",
        service("m", &[("e1", engine.addr)])
    ));
    let Some(thp) = status_field(gw.child.id(), "THP_enabled:") else {
        eprintln!("SKIPPED: this kernel does not report THP_enabled in /proc/<pid>/status");
        return;
    };
    assert_eq!(thp, "0", "transparent huge pages are on for the gateway");
}

/// A whole answer on `s` (Content-Length), the connection kept open.
async fn one_request(s: &mut TcpStream) -> Vec<u8> {
    let body = chat_body("m", 200, false);
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(&body);
    s.write_all(&req).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map(|v| v.trim().parse().unwrap())
                .expect("a content-length");
            if got.len() >= end + 4 + len {
                return got;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_hold_no_per_request_state() {
    const N: usize = 400;
    let engine = Mock::start().await;
    let gw = GatewayProc::start(&format!(
        "services:\n{}",
        service("m", &[("e1", engine.addr)])
    ));
    let pid = gw.child.id();
    // Warm up (allocator, the upstream pool), then the baseline.
    let mut warm = TcpStream::connect(gw.proxy).await.unwrap();
    for _ in 0..20 {
        assert!(one_request(&mut warm).await.starts_with(b"HTTP/1.1 200"));
    }
    drop(warm);
    let base = rss_kib(pid);
    // N connections that sent nothing yet, N kept alive after one answer.
    let mut fresh = Vec::new();
    for _ in 0..N {
        fresh.push(TcpStream::connect(gw.proxy).await.unwrap());
    }
    let mut kept = Vec::new();
    for _ in 0..N {
        let mut s = TcpStream::connect(gw.proxy).await.unwrap();
        assert!(one_request(&mut s).await.starts_with(b"HTTP/1.1 200"));
        kept.push(s);
    }
    // Every fresh connection was accepted before the kept ones that came after it were
    // answered (one accept loop, in order).
    let per = (rss_kib(pid).saturating_sub(base)) as f64 / (2 * N) as f64;
    eprintln!("RSS {base} KiB before, {per:.1} KiB per idle connection");
    // Pingora's request futures alone are ~20 KiB in a release build (more in this debug
    // one); without them a few KiB remain (the socket's buffers live in the kernel).
    assert!(per < 12.0, "{per:.1} KiB per idle connection");
    // Each still serves its next request.
    for s in fresh
        .iter_mut()
        .step_by(50)
        .chain(kept.iter_mut().step_by(50))
    {
        assert!(one_request(s).await.starts_with(b"HTTP/1.1 200"));
    }
}
