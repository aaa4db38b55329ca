//! Injected faults. Settable from the CLI, at runtime with `POST /admin/faults`
//! (JSON, same field names; missing fields take their defaults, so `{}` clears
//! everything) and in-process through [`crate::SimHandle::set_faults`].
//!
//! Fault times are wall-clock milliseconds (not divided by `time_scale`).
//! Only the inference endpoints (`POST /v1/...`) are affected by the
//! per-request faults; `refuse` affects every endpoint except `/admin/*`.

use serde::{Deserialize, Serialize};

#[derive(clap::Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Fault: refuse connections. New connections are reset (RST) right after
    /// accept (unless their request line is for /admin/*), and requests on
    /// already-open keep-alive connections get the connection closed without
    /// a response.
    #[arg(long)]
    pub refuse: bool,
    /// Fault: stall every inference request this many ms before it is even
    /// read (no bytes sent, the engine does not see it yet), then serve it.
    #[arg(long, default_value_t = 0)]
    pub stall_ms: u64,
    /// Fault: streams are cut (connection closed, no terminating chunk, no
    /// [DONE]) after this many content chunks; non-stream requests get the
    /// connection closed without a response once generation finished.
    #[arg(long)]
    pub close_after_chunks: Option<u64>,
    /// Fault: fraction (0..=1) of inference requests answered with
    /// --error-status instead of being served (deterministic, seeded by
    /// --fault-seed; 1.0 = always).
    #[arg(long, default_value_t = 0.0)]
    pub error_rate: f64,
    /// Fault: HTTP status used by --error-rate.
    #[arg(long, default_value_t = 503)]
    pub error_status: u16,
    /// Fault: answer every inference request with 429 Too Many Requests and a
    /// Retry-After header.
    #[arg(long)]
    pub rate_limit: bool,
    /// Fault: value of the Retry-After header (seconds) sent with 429.
    #[arg(long, default_value_t = 1)]
    pub retry_after_s: u64,
    /// Fault: hold the response status line and headers until this many ms
    /// after the request arrived (the engine works on the request meanwhile).
    #[arg(long, default_value_t = 0)]
    pub first_byte_delay_ms: u64,
    /// Seed of the deterministic RNG behind --error-rate.
    #[arg(long, default_value_t = 0)]
    pub fault_seed: u64,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            refuse: false,
            stall_ms: 0,
            close_after_chunks: None,
            error_rate: 0.0,
            error_status: 503,
            rate_limit: false,
            retry_after_s: 1,
            first_byte_delay_ms: 0,
            fault_seed: 0,
        }
    }
}

impl Faults {
    /// Deterministic draw for the `n`-th inference request.
    pub(crate) fn should_error(&self, n: u64) -> bool {
        if self.error_rate <= 0.0 {
            return false;
        }
        if self.error_rate >= 1.0 {
            return true;
        }
        let h = xxhash_rust::xxh3::xxh3_64_with_seed(&n.to_le_bytes(), self.fault_seed);
        let u = (h >> 11) as f64 / (1u64 << 53) as f64;
        u < self.error_rate
    }
}
