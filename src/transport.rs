//! The downstream (client) connection handed to Pingora, with gathered writes.
//!
//! Pingora's own listeners give each accepted stream a small write buffer; we bind our own
//! listeners (so `127.0.0.1:0` works and the real address can be printed), and a stream built
//! with `Stream::from(TcpStream)` has none. Without one, every `write` Pingora makes is a
//! syscall: a response header and its body go out in two `sendto`s, an SSE chunk in up to
//! three (size line, data, CRLF). On loopback each send costs the sender the receiver's TCP
//! work too, so that was the biggest single cost per proxied request.
//!
//! [`Gathered`] keeps writes in memory until Pingora flushes. Pingora flushes exactly where
//! data must leave: after a response header without `Content-Length` (it may be a stream),
//! after every chunk of a chunked or close-delimited body, at the end of a `Content-Length`
//! body and when it finishes a response, so the buffer never holds data a client waits for.
//! A write that would grow the buffer past [`MAX_GATHER`] first sends what is buffered, and a
//! write at least that large goes straight through, so memory per connection stays bounded.
//!
//! It also holds the **request-head deadline** (`timeouts.client_head`, 10 s): from a
//! request's first byte, its head (request line and headers, up to the blank line) must be
//! complete within the deadline, else the client gets `408` and the connection is closed
//! (`tokengate_protocol_errors_total{reason="head_timeout"}`, one `access` log line). Without
//! it a client sending one header byte a second (slowloris) holds a connection for hours
//! while each read stays within every per-read timeout. The clock runs only while a head is
//! being read: not between keep-alive requests (the idle timeout applies there), not while
//! a body is uploaded (`timeouts.client_body`) or an answer streams.
//!
//! The head is also measured as it arrives: one larger than [`MAX_HEAD_BYTES`] or with more
//! header lines than [`MAX_HEAD_LINES`] is answered `431` here and the connection closed
//! (`reason="head_too_large"` / `"too_many_headers"`), before Pingora's own parser would
//! refuse it with an empty `400` (its limits are 1 MiB and 256 headers). And the heads
//! Pingora refuses itself (a garbage request line, two `Content-Length`s, an unknown
//! `Transfer-Encoding`: its bare `400` written before any hook of ours runs) are recognised
//! as they are written and counted (`reason="bad_request"`) with an `access` line. Every
//! request answered at the protocol level thus leaves a metric and a log line.

use async_trait::async_trait;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl,
    TimingDigest, UniqueID, UniqueIDType,
};
use std::future::Future;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

/// Largest request head (request line and headers, up to the blank line) read; a larger
/// one is answered 431. Engines refuse far smaller heads (uvicorn/h11: 64 KiB).
pub const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Most lines a request head may have (request line, headers, blank line): Pingora's parser
/// takes at most 256 headers and answers more with an empty 400; we answer 431 first.
pub const MAX_HEAD_LINES: usize = 256;

/// The most a connection gathers before it sends. A 2 KB answer with its header, or an SSE
/// chunk with its framing, fits many times over.
pub const MAX_GATHER: usize = 16 * 1024;

/// A client connection whose writes are gathered until Pingora flushes (see the module docs).
#[derive(Debug)]
pub struct Gathered {
    inner: L4Stream,
    buf: Vec<u8>,
    /// Bytes of `buf` already handed to the socket during a flush that returned `Pending`.
    sent: usize,
    head: Head,
    /// The request-head limits and `tokengate_protocol_errors_total`; `None`: no limits
    /// (a plain gathering stream).
    head_limit: Option<(Duration, prometheus::IntCounterVec)>,
    /// Bytes read by [`Peek::try_peek`] (the first read of a request, while the connection
    /// waits for it: `crate::server`) and not yet read by Pingora; `pending_at` of them
    /// were.
    pending: Vec<u8>,
    pending_at: usize,
}

/// The most [`Peek::try_peek`] reads at once: about a request head (Pingora's own first
/// read of a head is 4 KiB too).
pub const PEEK_READ: usize = 4096;

/// Where the connection is in reading a request head.
#[derive(Debug)]
enum Head {
    /// Between requests: no clock runs.
    Idle,
    /// A head has begun and not ended. `nl`: the bytes since the last `\n` are all `\r`
    /// (one more `\n` ends the head).
    Reading {
        deadline: Pin<Box<tokio::time::Sleep>>,
        nl: bool,
        /// Bytes and lines of the head so far.
        len: usize,
        lines: usize,
    },
    /// The head is complete; a body and the answer follow.
    Done,
    /// Answered at the protocol level (408, 431): every read from now on is the end of the
    /// stream.
    Expired,
}

/// Where `bytes` end a request head whose earlier bytes left `nl` (see [`Head::Reading`]):
/// the offset just past its last `\n`; updates `nl` and counts the `lines` ended. A head
/// ends at an empty line (`\r\n\r\n`, or bare `\n\n` as parsers accept).
fn head_ends(nl: &mut bool, lines: &mut usize, bytes: &[u8]) -> Option<usize> {
    let mut prev_nl = *nl;
    let mut start = 0;
    for p in memchr::memchr_iter(b'\n', bytes) {
        *lines += 1;
        if prev_nl && bytes[start..p].iter().all(|&b| b == b'\r') {
            return Some(p + 1);
        }
        prev_nl = true;
        start = p + 1;
    }
    *nl = prev_nl && bytes[start..].iter().all(|&b| b == b'\r');
    None
}

/// Why a connection was answered at the protocol level (`reason` label, access line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    HeadTimeout,
    HeadTooLarge,
    TooManyHeaders,
}

impl Refused {
    fn reason(self) -> &'static str {
        match self {
            Refused::HeadTimeout => "head_timeout",
            Refused::HeadTooLarge => "head_too_large",
            Refused::TooManyHeaders => "too_many_headers",
        }
    }

    fn status_line(self) -> &'static str {
        match self {
            Refused::HeadTimeout => "408 Request Timeout",
            _ => "431 Request Header Fields Too Large",
        }
    }

    fn body(self) -> &'static [u8] {
        match self {
            Refused::HeadTimeout => HEAD_TIMEOUT_BODY,
            Refused::HeadTooLarge => HEAD_TOO_LARGE_BODY,
            Refused::TooManyHeaders => TOO_MANY_HEADERS_BODY,
        }
    }
}

/// Whether `data` (the start of an answer being written) is Pingora's own error answer to a
/// head it could not parse: a bare 4xx with `Content-Length: 0` and its
/// `Cache-Control: private, no-store` (`pingora_core::protocols::http::error_resp`). Our
/// own answers always carry a JSON body.
fn pingora_refusal(data: &[u8]) -> Option<u16> {
    let rest = data.strip_prefix(b"HTTP/1.1 4")?;
    let code = std::str::from_utf8(rest.get(..2)?)
        .ok()?
        .parse::<u16>()
        .ok()?;
    let head = &data[..memchr::memmem::find(data, b"\r\n\r\n").unwrap_or(data.len())];
    let lower = head.to_ascii_lowercase();
    (memchr::memmem::find(&lower, b"\r\ncontent-length: 0\r").is_some()
        && memchr::memmem::find(&lower, b"\r\ncache-control: private, no-store").is_some())
    .then_some(400 + code)
}

const HEAD_TIMEOUT_BODY: &[u8] = br#"{"error":{"message":"the request head (request line and headers) was not complete within timeouts.client_head","type":"invalid_request_error","code":"request_timeout"}}"#;
const HEAD_TOO_LARGE_BODY: &[u8] = br#"{"error":{"message":"request headers too large: the request head (request line and headers) is above 64 KiB","type":"invalid_request_error","code":"request_header_too_large"}}"#;
const TOO_MANY_HEADERS_BODY: &[u8] = br#"{"error":{"message":"request headers too large: the request head has more than 255 header lines","type":"invalid_request_error","code":"request_header_too_large"}}"#;

impl Gathered {
    pub fn new(inner: L4Stream) -> Self {
        Gathered {
            inner,
            buf: Vec::new(),
            sent: 0,
            head: Head::Idle,
            head_limit: None,
            pending: Vec::new(),
            pending_at: 0,
        }
    }

    /// With the request-head deadline `limit` and size limits; `errors`
    /// (`tokengate_protocol_errors_total`) counts the connections answered here.
    pub fn with_head_deadline(
        inner: L4Stream,
        limit: Duration,
        errors: prometheus::IntCounterVec,
    ) -> Self {
        let mut g = Gathered::new(inner);
        g.head_limit = Some((limit, errors));
        g
    }

    /// Follows the head through bytes just read; `Some`: the head breaks a limit.
    fn saw(&mut self, got: &[u8]) -> Option<Refused> {
        let (limit, _) = self.head_limit.as_ref()?;
        if matches!(self.head, Head::Idle) {
            // The common case: a whole head in one read, within the limits (no timer).
            let (mut nl, mut lines) = (false, 0);
            if let Some(end) = head_ends(&mut nl, &mut lines, got) {
                if end <= MAX_HEAD_BYTES && lines <= MAX_HEAD_LINES {
                    self.head = Head::Done;
                    return None;
                }
            }
            self.head = Head::Reading {
                deadline: Box::pin(tokio::time::sleep(*limit)),
                nl: false,
                len: 0,
                lines: 0,
            };
        }
        let Head::Reading { nl, len, lines, .. } = &mut self.head else {
            return None;
        };
        let end = head_ends(nl, lines, got);
        *len += end.unwrap_or(got.len());
        // Lines first: a flood of short headers is "too many" however it was cut into reads.
        let refused = if *lines > MAX_HEAD_LINES {
            Some(Refused::TooManyHeaders)
        } else if *len > MAX_HEAD_BYTES {
            Some(Refused::HeadTooLarge)
        } else {
            None
        };
        if refused.is_none() && end.is_some() {
            self.head = Head::Done;
        }
        refused
    }

    /// An answer is being written: the next bytes read start a new head (an interim `1xx`,
    /// such as `100 Continue` before the body, does not count). Pingora's own answer to a
    /// head it refused is counted and logged here (see the module docs).
    fn answering(&mut self, data: &[u8]) {
        if matches!(self.head, Head::Reading { .. } | Head::Done) {
            if let Some(status) = pingora_refusal(data) {
                self.trace(
                    "bad_request",
                    status,
                    "request head refused by the HTTP parser",
                );
            }
        }
        if matches!(self.head, Head::Done) && !data.starts_with(b"HTTP/1.1 1") {
            self.head = Head::Idle;
        }
    }

    /// Counts a protocol-level answer and writes its access line.
    fn trace(&self, reason: &str, status: u16, error: &str) {
        if let Some((_, errors)) = &self.head_limit {
            errors.with_label_values(&[reason]).inc();
        }
        let peer = self
            .inner
            .get_socket_digest()
            .and_then(|d| d.peer_addr().map(|a| a.to_string()))
            .unwrap_or_else(|| "-".into());
        log::info!(
            target: "access",
            "- - - model=- instance=- status={status} reason={reason} outcome=refused peer={peer} error={error:?}"
        );
    }

    /// Answers at the protocol level (best effort, never blocking), counts and logs it; the
    /// connection reads as ended from now on.
    fn expire(&mut self, why: Refused) {
        self.head = Head::Expired;
        let error = match (&self.head_limit, why) {
            (None, _) => return,
            (Some((limit, _)), Refused::HeadTimeout) => {
                format!("request head not complete within {limit:?}")
            }
            (_, Refused::HeadTooLarge) => {
                format!("request head larger than {MAX_HEAD_BYTES} bytes")
            }
            (_, Refused::TooManyHeaders) => {
                format!("request head with more than {MAX_HEAD_LINES} lines")
            }
        };
        let status = if why == Refused::HeadTimeout {
            408
        } else {
            431
        };
        self.trace(why.reason(), status, &error);
        let body = why.body();
        self.buf.clear();
        self.sent = 0;
        self.buf.extend_from_slice(
            format!(
                "HTTP/1.1 {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                why.status_line(),
                body.len()
            )
            .as_bytes(),
        );
        self.buf.extend_from_slice(body);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if self.poll_drain(&mut cx).is_ready() {
            let _ = Pin::new(&mut self.inner).poll_flush(&mut cx);
        }
    }

    /// Reads from what [`Peek::try_peek`] read first, else from the socket.
    fn poll_source(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.pending_at < self.pending.len() {
            let rest = &self.pending[self.pending_at..];
            let k = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..k]);
            self.pending_at += k;
            if self.pending_at == self.pending.len() {
                self.pending = Vec::new();
                self.pending_at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }

    /// Hands the buffered bytes to the socket; `Ready(Ok)` once all of them were written.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.sent < self.buf.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.buf[self.sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.sent += n;
        }
        self.buf.clear();
        self.sent = 0;
        if self.buf.capacity() > MAX_GATHER {
            // A long-lived idle connection keeps no large buffer.
            self.buf = Vec::new();
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for Gathered {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.head_limit.is_none() {
            return this.poll_source(cx, buf);
        }
        if matches!(this.head, Head::Expired) {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match this.poll_source(cx, buf) {
            Poll::Ready(Ok(())) => {
                if let Head::Reading { deadline, .. } = &this.head {
                    if deadline.is_elapsed() {
                        buf.set_filled(before);
                        this.expire(Refused::HeadTimeout);
                        return Poll::Ready(Ok(()));
                    }
                }
                let n = buf.filled().len();
                if n > before && !matches!(this.head, Head::Done) {
                    if let Some(why) = this.saw(&buf.filled()[before..n]) {
                        buf.set_filled(before);
                        this.expire(why);
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                if let Head::Reading { deadline, .. } = &mut this.head {
                    if deadline.as_mut().poll(cx).is_ready() {
                        this.expire(Refused::HeadTimeout);
                        return Poll::Ready(Ok(()));
                    }
                }
                Poll::Pending
            }
            err => err,
        }
    }
}

impl AsyncWrite for Gathered {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        this.answering(data);
        if this.buf.len() + data.len() > MAX_GATHER {
            ready!(this.poll_drain(cx))?;
            if data.len() >= MAX_GATHER {
                return Pin::new(&mut this.inner).poll_write(cx, data);
            }
        }
        this.buf.extend_from_slice(data);
        Poll::Ready(Ok(data.len()))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let this = &mut *self;
        if let Some(first) = bufs.iter().find(|b| !b.is_empty()) {
            this.answering(first);
        }
        if this.buf.len() + total > MAX_GATHER {
            ready!(this.poll_drain(cx))?;
            if total >= MAX_GATHER {
                return Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
            }
        }
        for b in bufs {
            this.buf.extend_from_slice(b);
        }
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for Gathered {
    async fn shutdown(&mut self) {
        if let Err(e) = AsyncWriteExt::shutdown(self).await {
            log::debug!("failed to shut down a client connection: {e}");
        }
    }
}

impl UniqueID for Gathered {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for Gathered {}

#[async_trait]
impl Peek for Gathered {
    /// Waits for the client's next bytes and reads what has arrived (at most [`PEEK_READ`]),
    /// kept for the reads that follow; copies their start into `buf` (fewer bytes than
    /// `buf` holds when fewer came). The waiting connection holds no buffer of ours until
    /// bytes arrive (the read goes to a buffer on the stack, then to one of the exact size),
    /// and the read is the one Pingora would have made: no extra system call per request.
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        if self.pending_at >= self.pending.len() {
            let inner = &mut self.inner;
            let got = std::future::poll_fn(|cx| {
                // On the stack of this poll only: a connection waiting here holds no buffer.
                let mut tmp = [std::mem::MaybeUninit::<u8>::uninit(); PEEK_READ];
                let mut rb = ReadBuf::uninit(&mut tmp);
                ready!(Pin::new(&mut *inner).poll_read(cx, &mut rb))?;
                Poll::Ready(Ok::<_, io::Error>(rb.filled().to_vec()))
            })
            .await?;
            if got.is_empty() {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.pending = got;
            self.pending_at = 0;
        }
        let rest = &self.pending[self.pending_at..];
        let k = rest.len().min(buf.len());
        buf[..k].copy_from_slice(&rest[..k]);
        Ok(true)
    }
}

impl GetTimingDigest for Gathered {
    fn get_timing_digest(&self) -> Vec<Option<TimingDigest>> {
        self.inner.get_timing_digest()
    }
    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }
    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for Gathered {
    fn get_proxy_digest(&self) -> Option<Arc<ProxyDigest>> {
        self.inner.get_proxy_digest()
    }
    fn set_proxy_digest(&mut self, digest: ProxyDigest) {
        self.inner.set_proxy_digest(digest)
    }
}

impl GetSocketDigest for Gathered {
    fn get_socket_digest(&self) -> Option<Arc<SocketDigest>> {
        self.inner.get_socket_digest()
    }
    fn set_socket_digest(&mut self, digest: SocketDigest) {
        self.inner.set_socket_digest(digest)
    }
}

impl Drop for Gathered {
    fn drop(&mut self) {
        // Same courtesy as Pingora's own buffered stream: try once, never block.
        if !self.buf.is_empty() {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            let _ = self.poll_drain(&mut cx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    async fn pair() -> (Gathered, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (c, s) = tokio::join!(tokio::net::TcpStream::connect(addr), l.accept());
        (Gathered::new(L4Stream::from(s.unwrap().0)), c.unwrap())
    }

    #[test]
    fn heads_end_at_the_empty_line_across_reads() {
        let (mut nl, mut lines) = (false, 0);
        assert_eq!(
            head_ends(&mut nl, &mut lines, b"GET / HTTP/1.1\r\nhost: x\r"),
            None
        );
        assert!(!nl);
        assert_eq!(head_ends(&mut nl, &mut lines, b"\n"), None);
        assert!(nl);
        assert_eq!(head_ends(&mut nl, &mut lines, b"\r"), None);
        assert!(nl);
        assert_eq!(head_ends(&mut nl, &mut lines, b"\nbody"), Some(1));
        assert_eq!(lines, 3);
        let (mut nl, mut lines) = (false, 0);
        assert_eq!(
            head_ends(&mut nl, &mut lines, b"GET / HTTP/1.1\nhost: x\n\n"),
            Some(24)
        );
        let (mut nl, mut lines) = (false, 0);
        assert_eq!(
            head_ends(
                &mut nl,
                &mut lines,
                b"GET / HTTP/1.1\r\nhost: x\r\nx-a: \r\r"
            ),
            None
        );
        assert!(!nl);
    }

    #[test]
    fn pingoras_own_refusals_are_recognised_and_ours_are_not() {
        let theirs = b"HTTP/1.1 400 Bad Request\r\nServer: Pingora\r\nDate: Sun, 06 Nov 1994 08:49:37 GMT\r\nContent-Length: 0\r\nCache-Control: private, no-store\r\nConnection: close\r\n\r\n";
        assert_eq!(pingora_refusal(theirs), Some(400));
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 80\r\n\r\n{}";
        assert_eq!(pingora_refusal(ours), None);
        assert_eq!(pingora_refusal(b"HTTP/1.1 200 OK\r\n\r\n"), None);
    }

    #[tokio::test]
    async fn nothing_leaves_before_flush_then_everything_in_order() {
        let (mut g, mut client) = pair().await;
        g.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
            .await
            .unwrap();
        g.write_all(b"hello").await.unwrap();
        let mut probe = [0u8; 1];
        let early = tokio::time::timeout(Duration::from_millis(50), client.read(&mut probe)).await;
        assert!(early.is_err(), "bytes left before the flush");
        g.flush().await.unwrap();
        let mut got = vec![0u8; 43];
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello");
    }

    #[tokio::test]
    async fn large_writes_pass_through_in_order_and_bound_the_buffer() {
        let (mut g, mut client) = pair().await;
        let big: Vec<u8> = (0..3 * MAX_GATHER).map(|i| (i % 251) as u8).collect();
        let reader = tokio::spawn(async move {
            let mut all = Vec::new();
            client.read_to_end(&mut all).await.unwrap();
            all
        });
        g.write_all(b"head").await.unwrap();
        g.write_all(&big).await.unwrap();
        assert!(g.buf.capacity() <= MAX_GATHER);
        g.write_all(b"tail").await.unwrap();
        AsyncWriteExt::shutdown(&mut g).await.unwrap();
        drop(g);
        let all = reader.await.unwrap();
        assert_eq!(all.len(), 8 + big.len());
        assert_eq!(&all[..4], b"head");
        assert_eq!(&all[4..4 + big.len()], &big[..]);
        assert_eq!(&all[4 + big.len()..], b"tail");
    }

    #[tokio::test]
    async fn vectored_writes_are_gathered() {
        let (mut g, mut client) = pair().await;
        let parts = [
            IoSlice::new(b"5\r\n"),
            IoSlice::new(b"hello"),
            IoSlice::new(b"\r\n"),
        ];
        let n = g.write_vectored(&parts).await.unwrap();
        assert_eq!(n, 10);
        g.flush().await.unwrap();
        let mut got = [0u8; 10];
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"5\r\nhello\r\n");
    }
}
