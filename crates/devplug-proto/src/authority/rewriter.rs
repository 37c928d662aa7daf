//! The byte-level part of the `:authority` adapter: reads the client's half of an HTTP/2
//! connection frame by frame and, when the client sends an `:authority` that h2 would reject (a
//! socket path), re-encodes every request header block with `:authority: localhost`.
//!
//! Only HEADERS and CONTINUATION frames are touched; every other frame is forwarded as it comes,
//! without waiting for its payload. The first header block decides the connection's mode:
//! - a valid (or absent) authority: the block and everything after it pass through untouched,
//!   and the adapter stops looking ([`Mode::Passthrough`]);
//! - an invalid one: this and every later block is decoded with the client's HPACK state and
//!   re-encoded as literals without indexing ([`Mode::Rewrite`]). h2's dynamic table then stays
//!   empty and can never disagree with ours.
//!
//! Bytes that are not HTTP/2 as we expect it (another preface, a broken frame sequence before any
//! rewrite) are handed to h2 unchanged, so h2 reports the protocol error as it always would.

use super::hpack::{encode_literal, Decoder, HpackError};
use bytes::{BufMut, BytesMut};

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Bytes in a frame header: length (24 bits), type, flags, stream id.
const FRAME_HEADER_LEN: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Largest frame payload we emit: the HTTP/2 default `SETTINGS_MAX_FRAME_SIZE`, which every peer
/// accepts (tonic's server keeps the default).
const MAX_FRAME_PAYLOAD: usize = 16_384;
/// Largest header block we buffer before giving up on the connection.
const MAX_HEADER_BLOCK: usize = 1 << 20;
/// The HPACK dynamic table size h2 allows the client (the HTTP/2 default; tonic does not change it).
const HPACK_TABLE_SIZE: usize = 4_096;
/// What a rejected `:authority` becomes: what kubelets since 1.26 send.
const REPLACEMENT_AUTHORITY: &[u8] = b"localhost";

/// Why the adapter closed a connection it had already started rewriting.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RewriteError {
    /// The client broke HTTP/2 framing after we had rewritten a header block; passing its bytes
    /// on would desynchronise h2's HPACK state, so the connection ends here.
    #[error("HTTP/2 framing error from the client: {0}")]
    Framing(&'static str),
    /// The client's HPACK block did not decode.
    #[error("HPACK decoding error from the client: {0}")]
    Hpack(#[from] HpackError),
}

/// What the rewriter does with the next bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Waiting for the 24-byte connection preface.
    Preface,
    /// Forwarding frames until the first header block shows which authority the client sends.
    Inspect,
    /// The client sends an authority h2 rejects: every header block is re-encoded.
    Rewrite,
    /// Nothing more to do: bytes go to h2 untouched.
    Passthrough,
}

/// A header block being collected from a HEADERS frame and its CONTINUATION frames.
struct PendingBlock {
    stream_id: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
    /// The frames exactly as received, for passing the block through unchanged (kept only
    /// while inspecting: once rewriting, a block is never passed through).
    raw: Vec<u8>,
}

/// Rewrites the client-to-server bytes of one HTTP/2 connection (see the module comment).
pub(crate) struct Rewriter {
    mode: Mode,
    decoder: Decoder,
    /// Payload bytes of the current non-header frame still to forward as they arrive.
    forward: usize,
    pending: Option<PendingBlock>,
}

impl Rewriter {
    /// A rewriter for a new connection, expecting the preface first.
    pub(crate) fn new() -> Self {
        Self {
            mode: Mode::Preface,
            decoder: Decoder::new(HPACK_TABLE_SIZE),
            forward: 0,
            pending: None,
        }
    }

    /// The current mode.
    pub(crate) fn mode(&self) -> Mode {
        self.mode
    }

    /// Moves what can be processed from `input` (bytes from the client) to `output` (bytes for
    /// h2). Bytes of an incomplete frame header or header block stay in `input`.
    pub(crate) fn process(
        &mut self,
        input: &mut BytesMut,
        output: &mut BytesMut,
    ) -> Result<(), RewriteError> {
        loop {
            if self.forward > 0 {
                let n = self.forward.min(input.len());
                output.put(input.split_to(n));
                self.forward -= n;
                if self.forward > 0 {
                    return Ok(());
                }
            }
            match self.mode {
                Mode::Passthrough => {
                    output.put(input.split());
                    return Ok(());
                }
                Mode::Preface => {
                    let n = input.len().min(PREFACE.len());
                    if input[..n] != PREFACE[..n] {
                        self.mode = Mode::Passthrough;
                        continue;
                    }
                    if n < PREFACE.len() {
                        return Ok(());
                    }
                    output.put(input.split_to(PREFACE.len()));
                    self.mode = Mode::Inspect;
                }
                Mode::Inspect | Mode::Rewrite => {
                    if !self.next_frame(input, output)? {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Handles the frame at the start of `input`; false when more bytes are needed.
    fn next_frame(
        &mut self,
        input: &mut BytesMut,
        output: &mut BytesMut,
    ) -> Result<bool, RewriteError> {
        let Some(header) = input.get(..FRAME_HEADER_LEN) else {
            return Ok(false);
        };
        let len =
            (usize::from(header[0]) << 16) | (usize::from(header[1]) << 8) | usize::from(header[2]);
        let kind = header[3];
        if kind != TYPE_HEADERS && kind != TYPE_CONTINUATION {
            if self.pending.is_some() {
                return self.violation("a frame between HEADERS and CONTINUATION", input);
            }
            output.put(input.split_to(FRAME_HEADER_LEN));
            self.forward = len;
            return Ok(true);
        }
        let buffered = self.pending.as_ref().map_or(0, |p| p.fragment.len());
        if buffered + FRAME_HEADER_LEN + len > MAX_HEADER_BLOCK {
            return self.violation("a header block over 1 MiB", input);
        }
        if input.len() < FRAME_HEADER_LEN + len {
            input.reserve(FRAME_HEADER_LEN + len - input.len());
            return Ok(false);
        }
        let frame = input.split_to(FRAME_HEADER_LEN + len);
        let flags = frame[4];
        let stream_id = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[FRAME_HEADER_LEN..];
        if kind == TYPE_HEADERS {
            if self.pending.is_some() {
                put_back(input, frame);
                return self.violation("a HEADERS frame inside another header block", input);
            }
            let Some((priority, fragment)) = split_headers_payload(flags, payload) else {
                put_back(input, frame);
                return self.violation("a HEADERS frame with bad padding", input);
            };
            self.pending = Some(PendingBlock {
                stream_id,
                end_stream: flags & FLAG_END_STREAM != 0,
                priority,
                fragment: fragment.to_vec(),
                raw: Vec::new(),
            });
        } else {
            match self.pending.as_mut() {
                Some(block) if block.stream_id == stream_id => {
                    block.fragment.extend_from_slice(payload);
                }
                _ => {
                    put_back(input, frame);
                    return self.violation("a CONTINUATION frame without its HEADERS", input);
                }
            }
        }
        if self.mode == Mode::Inspect {
            if let Some(block) = self.pending.as_mut() {
                block.raw.extend_from_slice(&frame);
            }
        }
        if flags & FLAG_END_HEADERS != 0 {
            if let Some(block) = self.pending.take() {
                self.finish_block(block, output)?;
            }
        }
        Ok(true)
    }

    /// Decodes a complete header block and forwards it, rewritten or not, deciding the mode.
    fn finish_block(
        &mut self,
        block: PendingBlock,
        output: &mut BytesMut,
    ) -> Result<(), RewriteError> {
        let headers = match self.decoder.decode(&block.fragment) {
            Ok(headers) => headers,
            Err(err) if self.mode == Mode::Rewrite => return Err(err.into()),
            Err(_) => {
                // Not ours to judge: h2 sees the block as sent and answers COMPRESSION_ERROR.
                output.put_slice(&block.raw);
                self.mode = Mode::Passthrough;
                return Ok(());
            }
        };
        if self.mode == Mode::Inspect {
            match headers.iter().find(|(name, _)| name == b":authority") {
                Some((_, value)) if !authority_is_valid(value) => {
                    tracing::debug!(
                        authority = %String::from_utf8_lossy(value),
                        "client sent a socket path as :authority (a kubelet up to 1.25 or a non-Go gRPC client); serving it as localhost"
                    );
                    self.mode = Mode::Rewrite;
                }
                _ => {
                    output.put_slice(&block.raw);
                    self.mode = Mode::Passthrough;
                    return Ok(());
                }
            }
        }
        let mut encoded = Vec::with_capacity(block.fragment.len() * 2);
        for (name, value) in &headers {
            let value = if name == b":authority" && !authority_is_valid(value) {
                REPLACEMENT_AUTHORITY
            } else {
                value.as_slice()
            };
            encode_literal(&mut encoded, name, value);
        }
        write_header_block(output, &block, &encoded);
        Ok(())
    }

    /// A framing error: before any rewrite, h2 gets the bytes as sent and reports the error
    /// itself; after one, the connection has to end.
    fn violation(
        &mut self,
        what: &'static str,
        input: &mut BytesMut,
    ) -> Result<bool, RewriteError> {
        if self.mode == Mode::Rewrite {
            return Err(RewriteError::Framing(what));
        }
        if let Some(block) = self.pending.take() {
            put_back(input, BytesMut::from(&block.raw[..]));
        }
        self.mode = Mode::Passthrough;
        Ok(true)
    }
}

/// Puts `front` (bytes taken from the start of `input`) back in front of `input`.
fn put_back(input: &mut BytesMut, front: BytesMut) {
    let rest = std::mem::replace(input, front);
    input.unsplit(rest);
}

/// Whether h2 accepts `value` as an `:authority` (the check h2's server applies).
fn authority_is_valid(value: &[u8]) -> bool {
    http::uri::Authority::try_from(value).is_ok()
}

/// Splits a HEADERS payload into its priority fields and header block fragment, dropping
/// padding; `None` when the padding or priority fields do not fit.
fn split_headers_payload(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut payload = payload;
    if flags & FLAG_PADDED != 0 {
        let (&pad, rest) = payload.split_first()?;
        payload = rest.get(..rest.len().checked_sub(usize::from(pad))?)?;
    }
    let mut priority = None;
    if flags & FLAG_PRIORITY != 0 {
        let fields = payload.get(..5)?;
        priority = Some([fields[0], fields[1], fields[2], fields[3], fields[4]]);
        payload = &payload[5..];
    }
    Some((priority, payload))
}

/// Writes `block` with the header block `encoded`: one HEADERS frame, then CONTINUATION frames
/// when it does not fit in one; the stream id, END_STREAM and priority are kept, padding dropped.
fn write_header_block(output: &mut BytesMut, block: &PendingBlock, encoded: &[u8]) {
    let first_room = MAX_FRAME_PAYLOAD - if block.priority.is_some() { 5 } else { 0 };
    let (first, mut rest) = encoded.split_at(encoded.len().min(first_room));
    let mut flags = 0;
    if block.end_stream {
        flags |= FLAG_END_STREAM;
    }
    if block.priority.is_some() {
        flags |= FLAG_PRIORITY;
    }
    if rest.is_empty() {
        flags |= FLAG_END_HEADERS;
    }
    let priority = block.priority.as_ref().map_or(&[][..], |p| &p[..]);
    write_frame_header(
        output,
        priority.len() + first.len(),
        TYPE_HEADERS,
        flags,
        block.stream_id,
    );
    output.put_slice(priority);
    output.put_slice(first);
    while !rest.is_empty() {
        let (chunk, tail) = rest.split_at(rest.len().min(MAX_FRAME_PAYLOAD));
        let flags = if tail.is_empty() { FLAG_END_HEADERS } else { 0 };
        write_frame_header(
            output,
            chunk.len(),
            TYPE_CONTINUATION,
            flags,
            block.stream_id,
        );
        output.put_slice(chunk);
        rest = tail;
    }
}

fn write_frame_header(output: &mut BytesMut, len: usize, kind: u8, flags: u8, stream_id: u32) {
    output.put_uint(len as u64, 3);
    output.put_u8(kind);
    output.put_u8(flags);
    output.put_u32(stream_id);
}

#[cfg(test)]
mod tests {
    use super::*;
    use loona_hpack::{Decoder as TheirDecoder, Encoder};

    /// A frame as bytes.
    fn frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        write_frame_header(&mut out, payload.len(), kind, flags, stream_id);
        out.put_slice(payload);
        out.to_vec()
    }

    fn request_headers(authority: &str, path: &str) -> Vec<(Vec<u8>, Vec<u8>)> {
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        .iter()
        .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
        .collect()
    }

    fn encode(encoder: &mut Encoder<'_>, headers: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
        encoder.encode(headers.iter().map(|(n, v)| (&n[..], &v[..])))
    }

    /// Splits a byte stream (after the preface) into frames: (type, flags, stream, payload).
    fn frames(mut bytes: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len = (usize::from(bytes[0]) << 16)
                | (usize::from(bytes[1]) << 8)
                | usize::from(bytes[2]);
            let stream = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
            out.push((bytes[3], bytes[4], stream, bytes[9..9 + len].to_vec()));
            bytes = &bytes[9 + len..];
        }
        out
    }

    /// Runs `input` through a new rewriter in chunks of `chunk` bytes.
    fn run(input: &[u8], chunk: usize) -> (Rewriter, Vec<u8>) {
        let mut rewriter = Rewriter::new();
        let mut pending = BytesMut::new();
        let mut output = BytesMut::new();
        for piece in input.chunks(chunk) {
            pending.put_slice(piece);
            rewriter.process(&mut pending, &mut output).unwrap();
        }
        assert!(pending.is_empty(), "everything is forwarded");
        (rewriter, output.to_vec())
    }

    const SETTINGS: &[u8] = &[0, 0, 0, 0x4, 0, 0, 0, 0, 0];

    #[test]
    fn a_path_authority_becomes_localhost_in_every_block() {
        let path = "/var/lib/kubelet/device-plugins/vendor.sock";
        let mut encoder = Encoder::new();
        let first = request_headers(path, "/v1beta1.DevicePlugin/GetDevicePluginOptions");
        let second = request_headers(path, "/v1beta1.DevicePlugin/ListAndWatch");
        let mut input = PREFACE.to_vec();
        input.extend_from_slice(SETTINGS);
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &encode(&mut encoder, &first),
        ));
        input.extend(frame(0x0, FLAG_END_STREAM, 1, &[0, 0, 0, 0, 0]));
        // The second block refers to the first through the client's dynamic table.
        let block = encode(&mut encoder, &second);
        input.extend(frame(TYPE_HEADERS, 0, 3, &block[..4]));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 3, &block[4..]));

        for chunk in [1, 7, input.len()] {
            let (rewriter, output) = run(&input, chunk);
            assert_eq!(rewriter.mode(), Mode::Rewrite);
            assert_eq!(&output[..24], PREFACE);
            let frames = frames(&output[24..]);
            let kinds: Vec<_> = frames.iter().map(|f| (f.0, f.1, f.2)).collect();
            assert_eq!(
                kinds,
                [
                    (0x4, 0, 0),
                    (TYPE_HEADERS, FLAG_END_HEADERS, 1),
                    (0x0, FLAG_END_STREAM, 1),
                    (TYPE_HEADERS, FLAG_END_HEADERS, 3),
                ]
            );
            let mut server = TheirDecoder::new();
            let mut expect_first = first.clone();
            expect_first[3].1 = b"localhost".to_vec();
            assert_eq!(server.decode(&frames[1].3).unwrap(), expect_first);
            let mut expect_second = second.clone();
            expect_second[3].1 = b"localhost".to_vec();
            assert_eq!(server.decode(&frames[3].3).unwrap(), expect_second);
        }
    }

    #[test]
    fn a_valid_authority_passes_through_byte_for_byte() {
        let mut encoder = Encoder::new();
        let headers = request_headers("localhost", "/v1beta1.DevicePlugin/Allocate");
        let mut input = PREFACE.to_vec();
        input.extend_from_slice(SETTINGS);
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS | FLAG_PADDED, 1, &{
            let mut p = vec![3];
            p.extend(encode(&mut encoder, &headers));
            p.extend([0, 0, 0]);
            p
        }));
        input.extend(frame(0x0, 0, 1, &[0, 0, 0, 0, 2, 0x0a, 0x00]));
        for chunk in [1, 5, input.len()] {
            let (rewriter, output) = run(&input, chunk);
            assert_eq!(rewriter.mode(), Mode::Passthrough);
            assert_eq!(output, input);
        }
    }

    #[test]
    fn priority_is_kept_padding_dropped_and_large_blocks_split() {
        let mut encoder = Encoder::new();
        let mut headers = request_headers("/tmp/x.sock", "/v1beta1.DevicePlugin/Allocate");
        headers.push((b"x-big".to_vec(), vec![b'a'; 40_000]));
        let mut payload = vec![2, 0x80, 0, 0, 1, 15];
        payload.extend(encode(&mut encoder, &headers));
        payload.extend([0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM | FLAG_PADDED | FLAG_PRIORITY,
            5,
            &payload,
        ));
        let (_, output) = run(&input, 4096);
        let frames = frames(&output[24..]);
        assert!(frames.len() >= 3, "40 KB needs HEADERS + CONTINUATIONs");
        assert_eq!(frames[0].0, TYPE_HEADERS);
        assert_eq!(frames[0].1, FLAG_END_STREAM | FLAG_PRIORITY);
        assert_eq!(&frames[0].3[..5], &[0x80, 0, 0, 1, 15]);
        let mut block = frames[0].3[5..].to_vec();
        for (i, f) in frames.iter().enumerate().skip(1) {
            assert_eq!(f.0, TYPE_CONTINUATION);
            assert_eq!(
                f.1,
                if i + 1 == frames.len() {
                    FLAG_END_HEADERS
                } else {
                    0
                }
            );
            assert_eq!(f.2, 5);
            block.extend_from_slice(&f.3);
        }
        assert!(frames.iter().all(|f| f.3.len() <= MAX_FRAME_PAYLOAD));
        let decoded = TheirDecoder::new().decode(&block).unwrap();
        assert_eq!(decoded[3], (b":authority".to_vec(), b"localhost".to_vec()));
        assert_eq!(decoded[6].1.len(), 40_000);
    }

    #[test]
    fn bytes_that_are_not_our_http2_go_to_h2_unchanged() {
        let (rewriter, output) = run(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 3);
        assert_eq!(rewriter.mode(), Mode::Passthrough);
        assert_eq!(output, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");

        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &[0x82]));
        input.extend_from_slice(SETTINGS);
        let (rewriter, output) = run(&input, 5);
        assert_eq!(rewriter.mode(), Mode::Passthrough);
        assert_eq!(output, input);

        let mut input = PREFACE.to_vec();
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS,
            1,
            &[0xff, 0xff, 0xff, 0x0f],
        ));
        let (rewriter, output) = run(&input, 64);
        assert_eq!(
            rewriter.mode(),
            Mode::Passthrough,
            "undecodable HPACK is h2's to reject"
        );
        assert_eq!(output, input);
    }

    #[test]
    fn broken_framing_after_a_rewrite_ends_the_connection() {
        let mut encoder = Encoder::new();
        let block = encode(&mut encoder, &request_headers("/x.sock", "/a"));
        let mut input = PREFACE.to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &block));
        input.extend(frame(TYPE_HEADERS, 0, 3, &block[..2]));
        input.extend(frame(0x0, 0, 3, &[]));
        let mut rewriter = Rewriter::new();
        let mut pending = BytesMut::from(&input[..]);
        let mut output = BytesMut::new();
        let err = rewriter.process(&mut pending, &mut output).unwrap_err();
        assert!(
            err.to_string().contains("between HEADERS and CONTINUATION"),
            "{err}"
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // Pseudo-random frame sequences after a valid preface: any result but a panic.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut path_block = Vec::new();
        super::super::hpack::encode_literal(&mut path_block, b":authority", b"/x.sock");
        for _ in 0..3_000 {
            let mut input = PREFACE.to_vec();
            if next() % 2 == 0 {
                input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &path_block));
            }
            for _ in 0..(next() % 6) {
                let kind = [TYPE_HEADERS, TYPE_CONTINUATION, 0x0, 0x4][(next() % 4) as usize];
                let len = (next() % 40) as usize;
                let payload: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                input.extend(frame(kind, next() as u8, (next() % 4) as u32, &payload));
            }
            let cut = (next() as usize) % (input.len() + 1);
            let mut rewriter = Rewriter::new();
            let mut pending = BytesMut::from(&input[..cut]);
            let mut output = BytesMut::new();
            let _ = rewriter.process(&mut pending, &mut output);
            pending.put_slice(&input[cut..]);
            let _ = rewriter.process(&mut pending, &mut output);
        }
    }
}
