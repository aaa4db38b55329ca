//! tokengate: an LLM inference gateway on Cloudflare Pingora.
//!
//! `src/` holds the gateway only (Pingora glue, config, APIs, state, control loops);
//! `plugins/` the pure routing logic; `sim/` engine-sim; `bench/` the benchmark tool.
//!
//! Modules, bottom-up (each imports only modules above it; `tests/module_graph.rs` checks it):
//!
//! | layer | modules |
//! |---|---|
//! | leaves | [`clock`], [`error`], [`api`], [`usage`], [`metrics`], [`load`], [`health`], [`memory`], [`engine_metrics`], [`throttle`], [`transport`], [`upstream`], [`config`], [`decision`], [`mirror`] |
//! | state | [`pipelines`] (config → pipelines), [`runtime`] (services, routes, instances), [`shared`] |
//! | one request | [`request`] (admit → plan → dispatch → complete), [`bigbody`], [`proxy`] (Pingora hooks) |
//! | around requests | [`background`] (health checks, maintenance), [`reload`], [`admin`] |
//! | process | [`server`], [`demo`] |

pub mod admin;
pub mod api;
pub mod background;
pub mod bigbody;
pub mod clock;
pub mod config;
pub mod decision;
pub mod demo;
pub mod engine_metrics;
pub mod error;
pub mod health;
pub mod load;
pub mod memory;
pub mod metrics;
pub mod mirror;
pub mod pipelines;
pub mod proxy;
pub mod reload;
pub mod request;
pub mod runtime;
pub mod server;
pub mod shared;
pub mod throttle;
pub mod transport;
pub mod upstream;
pub mod usage;
