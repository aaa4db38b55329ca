//! End-to-end runs of the load generator against in-process engine-sims on 127.0.0.1.
//! Counts and structure only: no timing asserts (the machine may be slow and noisy).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use super::*;

const MODEL: &str = "bench-model";

async fn sims(n: usize) -> Vec<engine_sim::SimHandle> {
    let mut v = Vec::new();
    for i in 0..n {
        v.push(
            engine_sim::spawn_local(engine_sim::SimConfig {
                id: format!("sim-{i}"),
                model: MODEL.into(),
                time_scale: 100.0,
                ..Default::default()
            })
            .await
            .expect("engine-sim"),
        );
    }
    v
}

async fn stop(v: Vec<engine_sim::SimHandle>) {
    for s in v {
        s.stop().await;
    }
}

/// A small conversation-shaped trace: every request starts with block 0 (a shared system
/// prompt); conversation c's turn t repeats turn t−1's blocks and adds two.
fn small_trace(conversations: u64, turns: u64) -> Vec<TraceRecord> {
    let mut next_id = 1u64;
    let mut convs: Vec<Vec<u64>> = (0..conversations).map(|_| vec![0]).collect();
    let mut out = Vec::new();
    for t in 0..turns {
        for (c, ids) in convs.iter_mut().enumerate() {
            ids.push(next_id);
            ids.push(next_id + 1);
            next_id += 2;
            out.push(TraceRecord {
                timestamp: t * 1000 + c as u64 * 10,
                input_length: ids.len() as u64 * 512 - 100,
                output_length: 40,
                hash_ids: ids.clone(),
            });
        }
    }
    out
}

fn trace_cfg(urls: Vec<String>, records: Vec<TraceRecord>, limit: Option<usize>) -> ReplayConfig {
    let mut cfg = ReplayConfig::new(
        urls,
        MODEL,
        Workload::Trace(TraceWorkload {
            records: Arc::new(records),
            source: "test".into(),
            scaling: Scaling {
                trace_block_tokens: 512,
                block_tokens: 64,
                time_scale: 100.0,
            },
            skip: 0,
        }),
    );
    cfg.limit = limit;
    cfg.request_timeout = Duration::from_secs(20);
    cfg.drain_timeout = Duration::from_secs(20);
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_slice_against_two_sims() {
    let s = sims(2).await;
    let urls: Vec<String> = s.iter().map(|h| h.url()).collect();
    let mut cfg = trace_cfg(urls.clone(), small_trace(10, 6), Some(50));
    cfg.session_header = Some("x-session-id".into());
    cfg.url_policy = UrlPolicy::Session;
    let r = replay(cfg).await.expect("replay");
    stop(s).await;

    assert_eq!(r.counts.scheduled, 50);
    assert_eq!(r.counts.sent, 50);
    assert_eq!(
        r.counts.ok, 50,
        "errors: {:?} {:?}",
        r.errors, r.error_samples
    );
    assert_eq!(r.counts.cancelled, 0);
    assert_eq!(r.ttft_ms.count, 50);
    assert!(r.itl_ms.count > 0 && r.e2e_ms.count == 50);
    for rec in &r.requests {
        // block 64 tokens: input = ceil((512k − 100) / 8); engine adds the chat template.
        let p = rec.prompt_tokens.expect("usage in the stream");
        assert!(p >= rec.intended_input_tokens as u64, "{rec:?}");
        assert!(p <= rec.intended_input_tokens as u64 + 8, "{rec:?}");
        assert_eq!(rec.completion_tokens, Some(5)); // round(40 / 8)
        assert!(rec.session.as_deref().unwrap().starts_with("trace-"));
    }
    // Session ids are the conversation roots: 10 conversations.
    let sessions: HashSet<_> = r.requests.iter().map(|x| x.session.clone()).collect();
    assert_eq!(sessions.len(), 10);
    // Sticky by session: each conversation stays on one URL (and one engine).
    let mut by_session: HashMap<_, HashSet<_>> = HashMap::new();
    for rec in &r.requests {
        by_session
            .entry(rec.session.clone())
            .or_default()
            .insert(rec.instance.clone());
    }
    assert!(by_session.values().all(|v| v.len() == 1));
    // Repeated prefixes on the same engine hit its cache.
    assert!(
        r.tokens.cached > 0 && r.tokens.cached_ratio > 0.0,
        "{:?}",
        r.tokens
    );
    assert!(r.tokens.cached_ratio <= 1.0);
    let ideal = r.tokens.ideal_block_hit_ratio.unwrap();
    assert!(ideal > 0.5, "{ideal}");
    // Load spread was recorded for both engines.
    let names: Vec<_> = r.instances.iter().map(|i| i.instance.as_str()).collect();
    assert_eq!(names, vec!["sim-0", "sim-1"]);
    assert_eq!(r.instances.iter().map(|i| i.requests).sum::<usize>(), 50);
    assert_eq!(r.load.instances.len(), 2);
    assert!(r.load.inflight.iter().all(|v| v.iter().sum::<f64>() > 0.0));
    // Outputs render.
    let md = r.to_markdown();
    assert!(md.contains("sim-0") && md.contains("cached ratio"));
    let json: serde_json::Value = serde_json::to_value(&r).unwrap();
    assert_eq!(json["counts"]["ok"], 50);
    assert!(json["meta"]["machine"]["nproc"].as_u64().unwrap() >= 1);
    plot::ttft_cdf_svg(&r).unwrap();
    plot::inflight_svg(&r).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synthetic_sessions_against_two_sims() {
    let s = sims(2).await;
    let urls: Vec<String> = s.iter().map(|h| h.url()).collect();
    let mut cfg = ReplayConfig::new(
        urls,
        MODEL,
        Workload::Synthetic(SynthConfig {
            sessions: 6,
            turns: 3,
            system_prompts: 2,
            system_tokens: 256,
            user_tokens: 32,
            output_tokens: 8,
            rate: 0.0,
            think_time: Duration::ZERO,
        }),
    );
    cfg.session_header = Some("x-session-id".into());
    cfg.url_policy = UrlPolicy::Session;
    cfg.seed = 3;
    cfg.request_timeout = Duration::from_secs(20);
    cfg.drain_timeout = Duration::from_secs(20);
    let r = replay(cfg).await.expect("replay");
    stop(s).await;

    assert_eq!(r.counts.scheduled, 18);
    assert_eq!(r.counts.sent, 18);
    assert_eq!(
        r.counts.ok, 18,
        "errors: {:?} {:?}",
        r.errors, r.error_samples
    );
    let mut turns: HashMap<String, Vec<(usize, u64)>> = HashMap::new();
    for rec in &r.requests {
        turns
            .entry(rec.session.clone().unwrap())
            .or_default()
            .push((rec.turn.unwrap(), rec.prompt_tokens.unwrap()));
        assert_eq!(rec.completion_tokens, Some(8));
    }
    assert_eq!(turns.len(), 6);
    for v in turns.values_mut() {
        v.sort();
        assert_eq!(v.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1, 2]);
        // Each turn resends the history: prompts grow.
        assert!(v.windows(2).all(|w| w[1].1 > w[0].1), "{v:?}");
    }
    // Turn ≥ 1 on the same engine reuses the previous turn's prefix.
    assert!(r.tokens.cached_ratio > 0.3, "{:?}", r.tokens);
    // The ceiling (one infinite shared cache) is at least what the two engines found.
    let ideal = r.tokens.ideal_token_hit_ratio.expect("session ceiling");
    assert!(ideal >= r.tokens.cached_ratio - 0.02, "{:?}", r.tokens);
    assert!(r.tokens.ideal_block_hit_ratio.unwrap() > 0.5);
    assert_eq!(r.instances.iter().map(|i| i.requests).sum::<usize>(), 18);
    assert!(r.instances.iter().all(|i| i.instance.starts_with("sim-")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_cap_is_respected_and_counted() {
    let s = sims(1).await;
    let records: Vec<TraceRecord> = (0..5)
        .map(|i| TraceRecord {
            timestamp: 0,
            input_length: 300,
            output_length: 1600, // 200 tokens after scaling: ≥ 12 ms per request
            hash_ids: vec![100 + i],
        })
        .collect();
    let mut cfg = trace_cfg(vec![s[0].url()], records, None);
    cfg.concurrency = 1;
    let r = replay(cfg).await.expect("replay");
    stop(s).await;
    assert_eq!(r.counts.ok, 5);
    assert!(r.counts.waited_for_concurrency >= 1);
    let mut recs = r.requests.clone();
    recs.sort_by(|a, b| a.sent_ms.total_cmp(&b.sent_ms));
    for w in recs.windows(2) {
        assert!(w[1].sent_ms >= w[0].end_ms, "overlap under concurrency 1");
    }
    assert_eq!(
        recs.iter().filter(|x| x.waited_for_slot).count(),
        r.counts.waited_for_concurrency
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_classified() {
    let s = sims(1).await;
    // A port with nothing listening.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let records: Vec<TraceRecord> = (0..4)
        .map(|i| TraceRecord {
            timestamp: i * 10,
            input_length: 100,
            output_length: 8,
            hash_ids: vec![7],
        })
        .collect();
    let cfg = trace_cfg(vec![s[0].url(), closed], records.clone(), None);
    let r = replay(cfg).await.expect("replay");
    assert_eq!((r.counts.sent, r.counts.ok, r.counts.failed), (4, 2, 2));
    assert_eq!(r.errors.get("connect"), Some(&2), "{:?}", r.errors);
    assert!(r.instances.iter().any(|i| i.instance == "-"));

    let mut cfg = trace_cfg(vec![s[0].url()], records, Some(2));
    cfg.model = "no-such-model".into();
    let r = replay(cfg).await.expect("replay");
    stop(s).await;
    assert_eq!(r.errors.get("http_404"), Some(&2), "{:?}", r.errors);
    assert!(r.error_samples["http_404"].contains("model"));
    // Failed requests still name the engine that answered.
    assert_eq!(r.instances[0].instance, "sim-0");
}

#[test]
fn cli_flags_parse_into_a_config() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ReplayArgs,
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.jsonl");
    let lines: Vec<String> = small_trace(2, 2)
        .iter()
        .map(|r| serde_json::to_string(r).unwrap())
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    let cli = Cli::try_parse_from([
        "x",
        "--trace",
        path.to_str().unwrap(),
        "--url",
        "http://127.0.0.1:1,http://127.0.0.1:2",
        "--block-tokens",
        "64",
        "--time-scale",
        "10",
        "--sessions",
        "--limit",
        "3",
        "--duration",
        "2s",
    ])
    .unwrap();
    let cfg = cli.args.to_config().unwrap();
    assert_eq!(cfg.urls.len(), 2);
    assert_eq!(cfg.session_header.as_deref(), Some("x-session-id"));
    assert_eq!(cfg.duration, Some(Duration::from_secs(2)));
    match &cfg.workload {
        Workload::Trace(t) => {
            assert_eq!(t.records.len(), 4);
            assert_eq!(t.scaling.block_tokens, 64);
        }
        _ => panic!("trace expected"),
    }
    // Synthetic: sessions on by default; trace needed otherwise.
    let cli = Cli::try_parse_from(["x", "--synthetic", "--think-time", "250ms"]).unwrap();
    let cfg = cli.args.to_config().unwrap();
    assert!(cfg.session_header.is_some());
    assert!(
        matches!(cfg.workload, Workload::Synthetic(ref s) if s.think_time == Duration::from_millis(250))
    );
    let cli = Cli::try_parse_from(["x", "--synthetic", "--no-sessions"]).unwrap();
    assert!(cli.args.to_config().unwrap().session_header.is_none());
    assert!(Cli::try_parse_from(["x"]).is_err());
}

/// The real Mooncake trace, if present beside the repository: parse, ceiling, root heuristic.
#[test]
fn mooncake_trace_file_if_present() {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/mooncake_conversation_trace.jsonl");
    let Ok(records) = trace::load_trace(&p) else {
        eprintln!("skipped: {} not found", p.display());
        return;
    };
    assert_eq!(records.len(), 12031);
    assert_eq!(trace::common_prefix_len(&records), 1);
    let s = Scaling::default();
    let reqs: Vec<_> = records.iter().map(|r| s.scale(r, 0)).collect();
    let (blocks, _) = trace::ideal_hit_ratio(&reqs, 512);
    assert!((blocks - 0.366).abs() < 0.001, "{blocks}");
}

/// A one-shot HTTP server on 127.0.0.1:0 that answers every request with `response` and
/// closes the connection; returns its base URL.
async fn canned_server(response: &'static str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                // Read the head, then Content-Length bytes of body.
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    let n = s.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break p + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                while buf.len() < head_end + len {
                    let n = s.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                let _ = s.write_all(response.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_header_wins_and_broken_streams_are_errors() {
    let good = canned_server(concat!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-tokengate-instance: gw-a\r\n",
        "x-engine-id: engine-z\r\nconnection: close\r\n\r\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hello\"}}]}\r\n\r\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"}}]}\n\n",
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":2,",
        "\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\ndata: [DONE]\n\n",
    ))
    .await;
    let truncated = canned_server(concat!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-engine-id: engine-t\r\n",
        "connection: close\r\n\r\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
    ))
    .await;
    let error_event = canned_server(concat!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
        "data: {\"error\":{\"message\":\"upstream died\"}}\n\ndata: [DONE]\n\n",
    ))
    .await;
    let records: Vec<TraceRecord> = (0..3)
        .map(|i| TraceRecord {
            timestamp: i,
            input_length: 10,
            output_length: 512,
            hash_ids: vec![1],
        })
        .collect();
    let cfg = trace_cfg(vec![good, truncated, error_event], records, None);
    let r = replay(cfg).await.expect("replay");
    assert_eq!((r.counts.ok, r.counts.failed), (1, 2), "{:?}", r.errors);
    assert_eq!(r.errors.get("incomplete"), Some(&1));
    assert_eq!(r.errors.get("stream_error"), Some(&1));
    assert!(r.error_samples["stream_error"].contains("upstream died"));
    let ok = r.requests.iter().find(|x| x.ok()).unwrap();
    assert_eq!(ok.instance.as_deref(), Some("gw-a"));
    assert_eq!(ok.content_chunks, 2);
    assert_eq!((ok.prompt_tokens, ok.cached_tokens), (Some(20), Some(16)));
    assert_eq!(r.itl_ms.count, 1);
    assert!((r.tokens.cached_ratio - 0.8).abs() < 1e-9);
    let t = r
        .requests
        .iter()
        .find(|x| x.error.as_deref() == Some("incomplete"))
        .unwrap();
    assert_eq!(t.instance.as_deref(), Some("engine-t"));
    assert!(t.ttft_ms.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duration_and_skip_bound_the_trace() {
    let s = sims(1).await;
    let records: Vec<TraceRecord> = [0u64, 5_000, 5_010, 60_000, 120_000]
        .iter()
        .enumerate()
        .map(|(i, &ts)| TraceRecord {
            timestamp: ts,
            input_length: 100,
            output_length: 8,
            hash_ids: vec![i as u64],
        })
        .collect();
    // time scale 100 in trace_cfg: skip 1 → sent at 0, 0.1 ms, 550 ms, 1150 ms.
    let mut cfg = trace_cfg(vec![s[0].url()], records, None);
    if let Workload::Trace(t) = &mut cfg.workload {
        t.skip = 1;
    }
    cfg.duration = Some(Duration::from_secs(5) / 10); // 500 ms: the first two only
    let r = replay(cfg).await.expect("replay");
    stop(s).await;
    assert_eq!(r.counts.scheduled, 2);
    assert_eq!(r.counts.ok, 2, "{:?}", r.errors);
    assert_eq!(r.requests[0].scheduled_ms, 0.0);
    assert!((r.requests[1].scheduled_ms - 0.1).abs() < 1e-9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synthetic_limit_and_no_session_header() {
    let s = sims(1).await;
    let mut cfg = ReplayConfig::new(
        vec![s[0].url()],
        MODEL,
        Workload::Synthetic(SynthConfig {
            sessions: 4,
            turns: 3,
            system_prompts: 1,
            system_tokens: 64,
            user_tokens: 8,
            output_tokens: 4,
            rate: 0.0,
            think_time: Duration::ZERO,
        }),
    );
    cfg.limit = Some(5);
    cfg.request_timeout = Duration::from_secs(20);
    let r = replay(cfg).await.expect("replay");
    stop(s).await;
    assert_eq!((r.counts.scheduled, r.counts.sent, r.counts.ok), (5, 5, 5));
    assert!(r.meta.session_header.is_none());
    // Session keys are still recorded (they drive --url-policy session).
    assert!(r.requests.iter().all(|x| x.session.is_some()));
}

fn agentic(rate: f64) -> AgenticConfig {
    AgenticConfig {
        tenants: 4,
        zipf: 1.1,
        system_tokens: SizeRange::new(64, 160),
        user_tokens: SizeRange::new(8, 40),
        output_tokens: SizeRange::new(3, 9),
        one_shot: 0.3,
        turns: SizeRange::new(2, 4),
        rate,
        think_time: Duration::ZERO,
        ..Default::default()
    }
}

/// Agentic sessions against two engines: every request is the plan's (tenant, turn, sizes),
/// turns come in order and resend a growing history, one-shots send one request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentic_sessions_follow_the_plan() {
    let s = sims(2).await;
    let urls: Vec<String> = s.iter().map(|h| h.url()).collect();
    let ac = agentic(100.0);
    let mut cfg = ReplayConfig::new(urls, MODEL, Workload::Agentic(ac.clone()));
    cfg.session_header = Some("x-session-id".into());
    cfg.seed = 5;
    cfg.duration = Some(Duration::from_millis(400));
    cfg.request_timeout = Duration::from_secs(20);
    cfg.drain_timeout = Duration::from_secs(20);
    let r = replay(cfg).await.expect("replay");
    stop(s).await;

    let plan = ac.plan(5, Duration::from_millis(400));
    assert!(plan.len() > 10, "{}", plan.len());
    assert_eq!(r.meta.workload, "agentic");
    assert_eq!(r.meta.workload_params["plan"]["sessions"], plan.len());
    assert_eq!(r.counts.cancelled, 0);
    assert_eq!(
        r.counts.ok, r.counts.sent,
        "{:?} {:?}",
        r.errors, r.error_samples
    );
    assert!(r.counts.ok >= plan.len() / 2, "{:?}", r.counts);
    let mut by_session: HashMap<usize, Vec<&RequestRecord>> = HashMap::new();
    for rec in &r.requests {
        let key = rec.session.as_deref().unwrap();
        let sid: usize = key.strip_prefix("agt-5-").unwrap().parse().unwrap();
        by_session.entry(sid).or_default().push(rec);
    }
    for (sid, recs) in &mut by_session {
        let p = &plan[*sid];
        recs.sort_by_key(|x| x.turn);
        let turns: Vec<usize> = recs.iter().map(|x| x.turn.unwrap()).collect();
        assert_eq!(turns, (0..recs.len()).collect::<Vec<_>>());
        assert!(recs.len() <= p.turns.len());
        for rec in recs.iter() {
            assert_eq!(rec.tenant, Some(p.tenant));
            let (_, out) = p.turns[rec.turn.unwrap()];
            assert_eq!(rec.intended_output_tokens, out);
            assert_eq!(rec.completion_tokens, Some(out as u64));
        }
        // Each turn resends the history: the prompt grows by at least the last answer and
        // the new user message.
        for w in recs.windows(2) {
            let (a, b) = (w[0].prompt_tokens.unwrap(), w[1].prompt_tokens.unwrap());
            let (user, _) = p.turns[w[1].turn.unwrap()];
            let answer = w[0].completion_tokens.unwrap();
            assert!(b >= a + user as u64 + answer, "{a} → {b}");
        }
    }
    // Sessions of one tenant share its system prompt: the ceiling is high, and the engines
    // found part of it.
    let ideal = r.tokens.ideal_token_hit_ratio.expect("ceiling");
    assert!(ideal > 0.5 && ideal < 1.0, "{ideal}");
    assert!(r.tokens.cached_ratio > 0.0 && r.tokens.cached_ratio <= ideal + 0.02);
    assert_eq!(
        r.instances.iter().map(|i| i.requests).sum::<usize>(),
        r.requests.len()
    );
}

/// The ceiling is exactly what one engine with a cache that never evicts reports when the
/// requests reach it one at a time in the order they were counted: the bench renders and
/// hashes prompts like engine-sim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentic_ceiling_equals_one_engine_with_an_infinite_cache() {
    let s = sims(1).await;
    let mut cfg = ReplayConfig::new(vec![s[0].url()], MODEL, Workload::Agentic(agentic(200.0)));
    cfg.seed = 9;
    cfg.concurrency = 1;
    cfg.duration = Some(Duration::from_millis(300));
    cfg.request_timeout = Duration::from_secs(20);
    cfg.drain_timeout = Duration::from_secs(20);
    let r = replay(cfg).await.expect("replay");
    stop(s).await;
    assert!(r.counts.ok > 5, "{:?}", r.counts);
    assert_eq!(r.counts.ok, r.counts.sent, "{:?}", r.errors);
    let ideal = r.tokens.ideal_token_hit_ratio.unwrap();
    assert!(r.tokens.cached > 0);
    assert!(
        (r.tokens.cached_ratio - ideal).abs() < 1e-12,
        "engine {} vs ceiling {ideal}",
        r.tokens.cached_ratio
    );
}

#[test]
fn agentic_flags_parse() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ReplayArgs,
    }
    let parse = |a: &[&str]| Cli::try_parse_from(std::iter::once("x").chain(a.iter().copied()));
    let cli = parse(&[
        "--agentic",
        "--duration",
        "30s",
        "--tenants",
        "48",
        "--zipf",
        "1.2",
        "--system-tokens",
        "2000-4000",
        "--user-tokens",
        "300",
        "--turns",
        "3-9",
        "--one-shot",
        "0.1",
        "--rate",
        "4",
        "--engine-block-size",
        "32",
    ])
    .unwrap();
    let cfg = cli.args.to_config().unwrap();
    assert_eq!(cfg.session_header.as_deref(), Some("x-session-id"));
    assert_eq!(cfg.engine_block_size, 32);
    let Workload::Agentic(ac) = &cfg.workload else {
        panic!("agentic expected")
    };
    assert_eq!(
        (ac.tenants, ac.zipf, ac.one_shot, ac.rate),
        (48, 1.2, 0.1, 4.0)
    );
    assert_eq!(ac.system_tokens, SizeRange::new(2000, 4000));
    assert_eq!(ac.user_tokens, SizeRange::fixed(300));
    assert_eq!(ac.turns, SizeRange::new(3, 9));
    assert_eq!(ac.output_tokens, AgenticConfig::default().output_tokens);
    assert_eq!(ac.think_time, AgenticConfig::default().think_time);
    assert_eq!((ac.think_time_max, ac.header_share), (None, 1.0));
    // People who read the answer; half the sessions without the header.
    let cli = parse(&[
        "--agentic",
        "--duration",
        "5s",
        "--think-time",
        "1s",
        "--think-time-max",
        "5s",
        "--header-share",
        "0.5",
    ])
    .unwrap();
    let Workload::Agentic(ac) = cli.args.to_config().unwrap().workload else {
        panic!("agentic expected")
    };
    assert_eq!(
        (ac.think_time, ac.think_time_max, ac.header_share),
        (Duration::from_secs(1), Some(Duration::from_secs(5)), 0.5)
    );
    assert!(
        parse(&["--agentic", "--duration", "5s", "--header-share", "2"])
            .unwrap()
            .args
            .to_config()
            .is_err()
    );
    // No session header when asked; a duration is needed; no mixing with --synthetic.
    let cli = parse(&["--agentic", "--duration", "5s", "--no-sessions"]).unwrap();
    assert!(cli.args.to_config().unwrap().session_header.is_none());
    assert!(parse(&["--agentic"]).unwrap().args.to_config().is_err());
    assert!(parse(&["--agentic", "--synthetic"]).is_err());
    assert!(parse(&["--agentic", "--duration", "5s", "--one-shot", "2"])
        .unwrap()
        .args
        .to_config()
        .is_err());
    // Synthetic takes single numbers only.
    let cli = parse(&["--synthetic", "--turns", "2-4"]).unwrap();
    assert!(cli.args.to_config().is_err());
    let cli = parse(&["--synthetic", "--turns", "3"]).unwrap();
    assert!(
        matches!(cli.args.to_config().unwrap().workload, Workload::Synthetic(ref s) if s.turns == 3)
    );
}

/// Sessions keep sending until --duration; the drain timeout counts from there, not from the
/// start of the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_drain_starts_at_the_deadline() {
    let s = sims(1).await;
    let mut ac = agentic(40.0);
    ac.think_time = Duration::from_millis(20);
    let mut cfg = ReplayConfig::new(vec![s[0].url()], MODEL, Workload::Agentic(ac));
    cfg.duration = Some(Duration::from_millis(800));
    cfg.drain_timeout = Duration::from_millis(100);
    cfg.request_timeout = Duration::from_secs(20);
    let r = replay(cfg).await.expect("replay");
    stop(s).await;
    let last = r.requests.iter().map(|x| x.sent_ms).fold(0.0, f64::max);
    assert!(last > 400.0, "sending stopped at {last} ms");
    assert!(r.counts.ok > 0);
}

/// A server that answers every request with `response` and records each request's
/// `x-session-id` header (None when absent).
async fn header_recording_server(
    response: &'static str,
) -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<Option<String>>>>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    let n = s.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break p + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                let field = |name: &str| {
                    head.lines()
                        .find_map(|l| l.strip_prefix(name))
                        .map(|v| v.trim().to_string())
                };
                let len: usize = field("content-length:")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                while buf.len() < head_end + len {
                    let n = s.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                }
                log.lock().unwrap().push(field("x-session-id:"));
                let _ = s.write_all(response.as_bytes()).await;
                let _ = s.shutdown().await;
            });
        }
    });
    (url, seen)
}

/// `--header-share`: exactly the plan's header sessions send the session header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentic_header_share_sends_the_header_from_those_sessions_only() {
    let (url, seen) = header_recording_server(concat!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
        "data: [DONE]\n\n",
    ))
    .await;
    let ac = AgenticConfig {
        one_shot: 1.0,
        header_share: 0.5,
        ..agentic(100.0)
    };
    let mut cfg = ReplayConfig::new(vec![url], MODEL, Workload::Agentic(ac.clone()));
    cfg.session_header = Some("x-session-id".into());
    cfg.seed = 9;
    cfg.duration = Some(Duration::from_millis(300));
    cfg.request_timeout = Duration::from_secs(20);
    let r = replay(cfg).await.expect("replay");
    let plan = ac.plan(9, Duration::from_millis(300));
    assert_eq!(r.counts.ok, plan.len(), "{:?}", r.errors);
    let mut want: Vec<Option<String>> = plan
        .iter()
        .enumerate()
        .map(|(s, p)| p.header.then(|| AgenticConfig::session_id(9, s)))
        .collect();
    let mut got = seen.lock().unwrap().clone();
    want.sort();
    got.sort();
    assert_eq!(got, want);
    let with = want.iter().filter(|h| h.is_some()).count();
    assert!(with > 0 && with < plan.len(), "{with} of {}", plan.len());
    assert_eq!(r.meta.workload_params["plan"]["header_sessions"], with);
}
