//! Serving clients that send a socket path as `:authority`.
//!
//! h2, under tonic, resets every request whose `:authority` is not a valid URI authority
//! (`RST_STREAM PROTOCOL_ERROR`), and no tower layer can help: the request dies in the HTTP/2 layer
//! before any service sees it. Kubelets up to 1.25 dial device plugins with the socket path as
//! authority, as do the kubelet's plugin-watcher dial and gRPC C-core clients on `unix:` targets
//!. [`AuthorityFix`] wraps each accepted connection and rewrites such an
//! authority to `localhost` before h2 reads it; a connection that sends a valid authority costs one
//! decoded header block, then passes through untouched. `rewriter.rs` handles frames, `hpack.rs`
//! header compression.

mod hpack;
mod rewriter;

use bytes::{Buf, BytesMut};
use rewriter::{Mode, Rewriter};
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// Bytes read from the client in one go while the adapter still looks at frames.
const READ_CHUNK: usize = 8_192;

/// A server-side connection whose incoming HTTP/2 requests reach h2 with an `:authority` it
/// accepts (see the module comment). Writes go to the client unchanged.
pub struct AuthorityFix<IO> {
    inner: IO,
    rewriter: Rewriter,
    /// Bytes from the client not yet processed (an incomplete frame).
    input: BytesMut,
    /// Processed bytes not yet handed to h2.
    output: BytesMut,
}

impl<IO> AuthorityFix<IO> {
    /// Wraps a freshly accepted connection, before any byte was read from it.
    pub fn new(inner: IO) -> Self {
        Self {
            inner,
            rewriter: Rewriter::new(),
            input: BytesMut::new(),
            output: BytesMut::new(),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityFix<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.output.is_empty() {
                let n = buf.remaining().min(this.output.len());
                buf.put_slice(&this.output[..n]);
                this.output.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.rewriter.mode() == Mode::Passthrough && this.input.is_empty() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            let mut chunk = [0u8; READ_CHUNK];
            let mut read = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut read))?;
            if read.filled().is_empty() {
                if this.input.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                // The client left mid-frame: h2 gets the fragment and reports the truncation.
                this.output = this.input.split();
                continue;
            }
            this.input.extend_from_slice(read.filled());
            this.rewriter
                .process(&mut this.input, &mut this.output)
                .map_err(|err| io::Error::new(io::ErrorKind::InvalidData, err))?;
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for AuthorityFix<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}
