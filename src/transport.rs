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
    /// The request-head deadline, and what counts its expiry; `None`: no deadline.
    head_limit: Option<(Duration, prometheus::IntCounter)>,
}

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
    },
    /// The head is complete; a body and the answer follow.
    Done,
    /// The deadline passed: 408 sent, every read from now on is the end of the stream.
    Expired,
}

/// Whether `bytes` end a request head whose earlier bytes left `nl` (see [`Head::Reading`]);
/// updates `nl`. A head ends at an empty line (`\r\n\r\n`, or bare `\n\n` as parsers accept).
fn head_ends(nl: &mut bool, bytes: &[u8]) -> bool {
    let mut prev_nl = *nl;
    let mut start = 0;
    for p in memchr::memchr_iter(b'\n', bytes) {
        if prev_nl && bytes[start..p].iter().all(|&b| b == b'\r') {
            return true;
        }
        prev_nl = true;
        start = p + 1;
    }
    *nl = prev_nl && bytes[start..].iter().all(|&b| b == b'\r');
    false
}

const HEAD_TIMEOUT_BODY: &[u8] = br#"{"error":{"message":"the request head (request line and headers) was not complete within timeouts.client_head","type":"invalid_request_error","code":"request_timeout"}}"#;

impl Gathered {
    pub fn new(inner: L4Stream) -> Self {
        Gathered {
            inner,
            buf: Vec::new(),
            sent: 0,
            head: Head::Idle,
            head_limit: None,
        }
    }

    /// With the request-head deadline `limit`; `expired` counts the connections it closes.
    pub fn with_head_deadline(
        inner: L4Stream,
        limit: Duration,
        expired: prometheus::IntCounter,
    ) -> Self {
        let mut g = Gathered::new(inner);
        g.head_limit = Some((limit, expired));
        g
    }

    /// Follows the head through bytes just read.
    fn saw(&mut self, got: &[u8]) {
        let Some((limit, _)) = &self.head_limit else {
            return;
        };
        match &mut self.head {
            Head::Idle => {
                let mut nl = false;
                self.head = if head_ends(&mut nl, got) {
                    Head::Done
                } else {
                    Head::Reading {
                        deadline: Box::pin(tokio::time::sleep(*limit)),
                        nl,
                    }
                };
            }
            Head::Reading { nl, .. } => {
                if head_ends(nl, got) {
                    self.head = Head::Done;
                }
            }
            Head::Done | Head::Expired => {}
        }
    }

    /// An answer is being written: the next bytes read start a new head (an interim `1xx`,
    /// such as `100 Continue` before the body, does not count).
    fn answering(&mut self, data: &[u8]) {
        if matches!(self.head, Head::Done) && !data.starts_with(b"HTTP/1.1 1") {
            self.head = Head::Idle;
        }
    }

    /// The head deadline passed: answer 408 (best effort, never blocking), count and log it.
    fn expire(&mut self) {
        self.head = Head::Expired;
        let limit = match &self.head_limit {
            Some((limit, counter)) => {
                counter.inc();
                *limit
            }
            None => return,
        };
        let peer = self
            .inner
            .get_socket_digest()
            .and_then(|d| d.peer_addr().map(|a| a.to_string()))
            .unwrap_or_else(|| "-".into());
        log::info!(
            target: "access",
            "- - - model=- instance=- status=408 reason=head_timeout peer={peer} error=\"request head not complete within {limit:?}\""
        );
        self.buf.clear();
        self.sent = 0;
        self.buf.extend_from_slice(
            format!(
                "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                HEAD_TIMEOUT_BODY.len()
            )
            .as_bytes(),
        );
        self.buf.extend_from_slice(HEAD_TIMEOUT_BODY);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if self.poll_drain(&mut cx).is_ready() {
            let _ = Pin::new(&mut self.inner).poll_flush(&mut cx);
        }
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
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        if matches!(this.head, Head::Expired) {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if let Head::Reading { deadline, .. } = &this.head {
                    if deadline.is_elapsed() {
                        buf.set_filled(before);
                        this.expire();
                        return Poll::Ready(Ok(()));
                    }
                }
                let n = buf.filled().len();
                if n > before {
                    let got = buf.filled()[before..n].to_vec();
                    this.saw(&got);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                if let Head::Reading { deadline, .. } = &mut this.head {
                    if deadline.as_mut().poll(cx).is_ready() {
                        this.expire();
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
    async fn try_peek(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        self.inner.try_peek(buf).await
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
        let mut nl = false;
        assert!(!head_ends(&mut nl, b"GET / HTTP/1.1\r\nhost: x\r"));
        assert!(!nl);
        assert!(!head_ends(&mut nl, b"\n"));
        assert!(nl);
        assert!(!head_ends(&mut nl, b"\r"));
        assert!(nl);
        assert!(head_ends(&mut nl, b"\nbody"));
        let mut nl = false;
        assert!(head_ends(&mut nl, b"GET / HTTP/1.1\nhost: x\n\n"));
        let mut nl = false;
        assert!(!head_ends(
            &mut nl,
            b"GET / HTTP/1.1\r\nhost: x\r\nx-a: \r\r"
        ));
        assert!(!nl);
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
