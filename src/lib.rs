//! tokengate: an LLM inference gateway on Cloudflare Pingora.
//!
//! `src/` holds the gateway only (Pingora glue, config, APIs, state, control loops);
//! `plugins/` the pure routing logic; `sim/` engine-sim; `bench/` the benchmark tool.
//!
//! Modules, bottom-up (each imports only modules above it; `tests/module_graph.rs` checks it):
//!
//! | layer | modules |
//! |---|---|
//! | leaves | [`clock`], [`error`], [`api`], [`usage`], [`rename`], [`metrics`], [`load`], [`logging`], [`health`], [`memory`], [`engine_metrics`], [`throttle`], [`engine_queue`], [`tls`], [`transport`], [`resolve`], [`upstream`], [`config_source`], [`config_report`], [`config`], [`decision`], [`mirror`], [`split`] |
//! | state | [`pipelines`] (config → pipelines), [`runtime`] (services, routes, instances), [`shared`] |
//! | one request | [`request`] (admit → plan → dispatch → complete), [`bigbody`], [`proxy`] (Pingora hooks) |
//! | around requests | [`background`] (health checks, maintenance), [`reload`], [`status`] (the live status page; [`status::recent`] is a leaf the request path writes to), [`admin`] |
//! | process | [`server`], [`demo`], [`probe`] (the container health check) |

pub mod admin;
pub mod api;
pub mod background;
pub mod bigbody;
pub mod clock;
pub mod cluster;
pub mod config;
pub mod config_report;
pub mod config_source;
pub mod decision;
/// Needs the `sim` cargo feature (default on): it starts engine-sims.
#[cfg(feature = "sim")]
pub mod demo;
pub mod engine_metrics;
pub mod engine_queue;
pub mod error;
pub mod genai_metrics;
pub mod health;
pub mod hook;
pub mod load;
pub mod logging;
pub mod memory;
pub mod metrics;
pub mod mirror;
pub mod otel;
pub mod pipelines;
pub mod probe;
pub mod proxy;
pub mod reload;
pub mod rename;
pub mod request;
pub mod resolve;
pub mod runtime;
pub mod server;
pub mod shared;
pub mod split;
pub mod status;
pub mod tenants;
pub mod throttle;
pub mod tls;
pub mod transport;
pub mod upstream;
pub mod usage;
