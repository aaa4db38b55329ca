//! Prefill/decode (PD) disaggregation: an engine-sim plays the prefill or the
//! decode side of SGLang's or vLLM's protocol, and engine-sims hand the KV over
//! to each other over loopback HTTP.
//!
//! **SGLang (Mooncake)** — the router injects `bootstrap_host`, `bootstrap_port`
//! (the prefill's bootstrap server) and a random `bootstrap_room` (u64 below
//! 2^63) into the request and sends the *same* body to a prefill and a decode
//! engine at once; the client gets the decode's response, the prefill's is
//! drained. Here the prefill prefills (through its prefix cache) and produces one
//! token, publishes the room's KV in its [`Registry`], and answers its HTTP
//! request only once a decode has taken the KV (SGLang finishes the prefill
//! request when the transfer succeeded, with `FINISH_LENGTH(0)`), or with a 500
//! after `pd_timeout_ms`. The decode long-polls `POST /sim/pd/rooms/{room}/claim`
//! at `bootstrap_host:bootstrap_port` until the room is published, waits the
//! simulated transfer time, confirms with `POST /sim/pd/rooms/{room}/done`, then
//! decodes without any prefill work. A room is taken by one decode only.
//!
//! **vLLM (NIXL)** — the proxy first sends the prefill the request with
//! `max_tokens: 1`, `stream: false` and `kv_transfer_params.do_remote_decode:
//! true`; the prefill answers at once with a one-token completion whose
//! `kv_transfer_params` names the KV (`remote_engine_id`, `remote_request_id`,
//! `remote_block_ids`, `remote_host`, `remote_port`) and keeps it pinned until a
//! decode read it or `pd_timeout_ms` passed (vLLM: `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`).
//! The proxy copies those params into the original request for the decode, which
//! reads the KV with `POST /sim/pd/transfers/read` at `remote_host:remote_port`,
//! waits the transfer time, frees it with `POST /sim/pd/transfers/done` and
//! decodes. As in vLLM, a decode request whose params lack a field, or name no
//! blocks (prompt shorter than a block), is simply prefilled locally.
//!
//! An SGLang prefill whose HTTP client goes away while its KV waits for a decode
//! releases the KV at once (SGLang aborts a request whose client disconnected).
//!
//! A decode whose KV does not come within `pd_timeout_ms` (wall clock) fails
//! with a 500 error; the prefill's KV that nobody took is released at the same
//! timeout. The decode checks that the KV is for its prompt (token count and
//! hash) so a wrong room or transfer id never yields an answer.
//!
//! **Abort** (`POST /abort_request`, [`crate::abort`]): a decode waiting for its
//! KV stops waiting and fails with a 500 at once (if it already took the KV, it
//! still confirms the transfer so the prefill releases it); an SGLang prefill
//! holding its KV for a decode fails the room (a decode polling it gets a 410),
//! releases the KV and ends its response with a 500 (or an error event in a
//! stream). A prefill still queued or prefilling is dropped by the scheduler and
//! its room failed the same way.

mod decode;
mod endpoint;
mod plan;
mod prefill;
mod registry;

pub(crate) use decode::{receive_kv, DecodeReq};
pub(crate) use endpoint::endpoint;
pub(crate) use plan::{plan, PdFields, Plan};
pub(crate) use prefill::{relay_prefill, PrefillJob};
pub(crate) use registry::{room_key, transfer_key, KvInfo, Registry};
