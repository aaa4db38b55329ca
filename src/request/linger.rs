//! A request that ends before its engine finished (the client hung up, `timeouts.total`,
//! an error after the first byte) keeps its load and its throttling slot until the engine
//! lets go of it, not merely until the client left: otherwise the next queued request is
//! dispatched while the engine still runs the abandoned one, and the engine's own batch
//! exceeds the limit the slot stands for.
//!
//! The gateway holds a duplicate of the upstream connection's socket for the request's life
//! ([`Held`], taken when Pingora connects or reuses it). Pingora drops its end of a
//! connection it cannot reuse; the duplicate keeps the socket open, and [`release_after`]
//! then half-closes it (the engine reads the end of the request stream: vLLM's and SGLang's
//! servers, and engine-sim, abort the request), reads until the engine closes its side (at
//! most `timeouts.idle`, whatever it still sends is discarded), waits two of the engine's
//! steps at least ([`step_allowance`]: an engine drops a request it found disconnected from its
//! batch at its next step, and the connection closes before that) and only then releases
//! the load guard, which wakes the throttling queue. Only requests of throttled services
//! hold their socket this way; a complete answer releases at once.

use std::os::fd::OwnedFd;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The upstream connection's socket, duplicated while the request runs.
pub struct Held(OwnedFd);

impl Held {
    /// Duplicates the socket `fd` that Pingora reports in `connected_to_upstream`.
    pub fn of(fd: std::os::fd::RawFd) -> Option<Held> {
        if fd < 0 {
            return None;
        }
        // SAFETY: Pingora passes the descriptor of the upstream connection it just connected
        // or took from its pool; the connection is open for the whole hook call, during which
        // the descriptor is only borrowed to be duplicated.
        #[allow(unsafe_code)]
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        fd.try_clone_to_owned().ok().map(Held)
    }
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Held").finish()
    }
}

/// How long after the engine closed the connection the slot is still held: two engine
/// steps (`gap`: the longest silence between the answer's chunks; the engine drops the
/// request at its next step, the second is the margin for an engine running late), within
/// 100 ms … 1 s. The floor: a client that leaves after its first chunks shows no step yet
/// (the first two chunks of a stream often come together).
pub fn step_allowance(gap: Option<Duration>) -> Duration {
    gap.map_or(Duration::ZERO, |g| g * 2)
        .clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// Ends the upstream request on `held` and calls `release` once the engine has let go (see
/// the module docs). Runs on its own task.
pub fn release_after<F>(held: Held, bound: Duration, step: Duration, release: F)
where
    F: FnOnce() + Send + 'static,
{
    tokio::spawn(async move {
        let started = tokio::time::Instant::now();
        let gone = async {
            let std = std::net::TcpStream::from(held.0);
            std.set_nonblocking(true).ok()?;
            let mut s = tokio::net::TcpStream::from_std(std).ok()?;
            let _ = s.shutdown().await;
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n) = s.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
            Some(())
        };
        let closed = tokio::time::timeout(bound, gone).await.is_ok();
        if closed {
            tokio::time::sleep(step).await;
        }
        log::debug!(
            "upstream let go after {:?}{}",
            started.elapsed(),
            if closed { "" } else { " (gave up waiting)" }
        );
        release();
    });
}
