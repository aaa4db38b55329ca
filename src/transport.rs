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

use async_trait::async_trait;
use pingora::protocols::l4::stream::Stream as L4Stream;
use pingora::protocols::raw_connect::ProxyDigest;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, SocketDigest, Ssl,
    TimingDigest, UniqueID, UniqueIDType,
};
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
}

impl Gathered {
    pub fn new(inner: L4Stream) -> Self {
        Gathered {
            inner,
            buf: Vec::new(),
            sent: 0,
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
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Gathered {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
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
