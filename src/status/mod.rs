//! The live status page on the admin listener.
//!
//! - `GET /` serves [`assets/index.html`](assets/index.html); `GET /assets/status.css` and
//!   `/assets/status.js` its style and script (static, embedded in the binary: no build
//!   step, no CDN, works air-gapped). The script polls `GET /admin/status` every 2 s.
//! - `GET /admin/status` ([`status_view`], typed views in [`view`]): the fleet (every
//!   instance with health, its role — integrated, prefill or decode — in-flight requests and
//!   tokens, prefill / decode phase counts, throttling slots, completed / errors, a prefill
//!   node's prefill legs by outcome),
//!   per service the scheduler, prefix index and hit ratios (ceiling, predicted, engine), its
//!   throttle (queue, slots in use against their limits, refusals by reason, queue waits) and
//!   its prefill/decode protocol, routes, the routing reasons and decision-service calls, the
//!   member gateways of global scheduling with their answers by outcome, traffic mirroring
//!   (settings, queue, copies by outcome, latency), the config reload state, the most
//!   recent finished requests and the sampled history (requests, TTFT, tokens, in-flight
//!   and per-service prefix counters every 5 s for 15 minutes, from [`recent::Board`]).
//!
//! With `admin_token` set, `/` and `/admin/status` need it like every admin path: open
//! `/?token=TOKEN` once; the gateway answers with a redirect to `/` that sets an `HttpOnly`,
//! `SameSite=Strict` cookie holding the token, which the page's requests then carry (the
//! token leaves the address bar at once). `Authorization: Bearer` works too.
//!
//! [`run`] is the sampler: a background loop that closes an interval every
//! [`recent::SAMPLE_EVERY`].

mod families;
pub mod recent;
mod session;
pub mod view;

use crate::clock::{now_ms, sleep_or_stop};
use crate::shared::Shared;
use families::{prefix_counters, tokens_total};
use recent::{Point, SAMPLE_EVERY};
use std::sync::Arc;

pub use session::{
    cookie_token, login_html, query_param, session_ok, set_cookie, COOKIE, SESSION_SECS,
};
pub use view::{cluster_off, cluster_summary, status_view, StatusView};

const INDEX_HTML: &str = include_str!("assets/index.html");
const STATUS_CSS: &str = include_str!("assets/status.css");
const STATUS_JS: &str = include_str!("assets/status.js");

/// The page loads nothing but its own assets and its JSON (no inline script, no other
/// origin, not framed).
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// A static asset of the page by path, with its content type (no auth: code, no data).
pub fn asset(path: &str) -> Option<(&'static str, &'static str)> {
    match path {
        "/assets/status.css" => Some(("text/css; charset=utf-8", STATUS_CSS)),
        "/assets/status.js" => Some(("text/javascript; charset=utf-8", STATUS_JS)),
        _ => None,
    }
}

/// The page itself.
pub fn index_html() -> &'static str {
    INDEX_HTML
}

/// The sampler: every [`SAMPLE_EVERY`], closes the interval of [`recent::Board`] into a
/// history point. A first point is taken at once, so the charts have a start.
pub async fn run(shared: Arc<Shared>, mut stop: pingora::server::ShutdownWatch) {
    let mut prev_tokens = (0, 0);
    loop {
        let mut iv = shared.status.take_interval();
        let [t50, t95] = iv.ttft_ms.quantiles([0.5, 0.95]);
        let [d50, d95] = iv.duration_ms.quantiles([0.5, 0.95]);
        let tokens = (
            tokens_total(&shared, "prompt"),
            tokens_total(&shared, "completion"),
        );
        let (mut inflight, mut waiting) = (0, 0);
        for s in &shared.runtime.load().ordered {
            for i in &s.instances {
                let l = i.load.snapshot();
                inflight += l.inflight_requests;
                waiting += l.waiting;
            }
        }
        shared.status.push_point(Point {
            t: now_ms(),
            requests: iv.requests,
            ok: iv.ok,
            client_errors: iv.client_errors,
            server_errors: iv.server_errors,
            ttft_p50_ms: t50,
            ttft_p95_ms: t95,
            duration_p50_ms: d50,
            duration_p95_ms: d95,
            prompt_tokens: tokens.0.saturating_sub(prev_tokens.0),
            completion_tokens: tokens.1.saturating_sub(prev_tokens.1),
            inflight,
            waiting,
            prefix: prefix_counters(&shared),
        });
        prev_tokens = tokens;
        if !sleep_or_stop(SAMPLE_EVERY, &mut stop).await {
            return;
        }
    }
}
