//! A gRPC client written directly on HTTP/2 frames, able to send what tonic's client cannot: a
//! socket path as `:authority`, as kubelets up to 1.25 (grpc-go dialling a bare path) do. Header
//! blocks use HPACK incremental indexing, like grpc-go's encoder, so later requests on the same
//! connection refer to the first through the dynamic table.

use loona_hpack::{Decoder, Encoder};
use prost::Message;
use std::collections::HashMap;
use std::path::Path;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

/// What one stream received so far.
#[derive(Default, Debug)]
pub struct StreamState {
    /// Decoded header blocks (response headers, then trailers).
    pub header_blocks: Vec<Vec<(String, String)>>,
    data: Vec<u8>,
    /// Set when the server ended the stream.
    pub ended: bool,
    /// The error code of a RST_STREAM from the server.
    pub reset: Option<u32>,
}

impl StreamState {
    /// A header's value from any block received on this stream.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.header_blocks
            .iter()
            .flatten()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Takes the next complete gRPC message from the stream's data, if one has arrived.
    fn take_message(&mut self) -> Option<Vec<u8>> {
        let len = u32::from_be_bytes(self.data.get(1..5)?.try_into().ok()?) as usize;
        let message = self.data.get(5..5 + len)?.to_vec();
        self.data.drain(..5 + len);
        Some(message)
    }
}

/// One HTTP/2 connection to a gRPC server on a Unix socket.
pub struct RawH2Client {
    socket: UnixStream,
    authority: String,
    encoder: Encoder<'static>,
    decoder: Decoder<'static>,
    next_stream: u32,
    streams: HashMap<u32, StreamState>,
    /// A header block being received: stream id and fragment so far.
    partial: Option<(u32, Vec<u8>, bool)>,
}

impl RawH2Client {
    /// Connects and sends the preface; every request will carry `authority`.
    pub async fn connect(path: &Path, authority: &str) -> Self {
        let mut socket = UnixStream::connect(path).await.unwrap();
        socket.write_all(PREFACE).await.unwrap();
        socket.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
        RawH2Client {
            socket,
            authority: authority.to_owned(),
            encoder: Encoder::new(),
            decoder: Decoder::new(),
            next_stream: 1,
            streams: HashMap::new(),
            partial: None,
        }
    }

    /// Starts a call to `method` (a full path) with one request message; returns the stream id.
    pub async fn start(&mut self, method: &str, request: &impl Message) -> u32 {
        let id = self.next_stream;
        self.next_stream += 2;
        let headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", method),
            (":authority", self.authority.as_str()),
            ("content-type", "application/grpc"),
            ("user-agent", "grpc-go/1.40.0"),
            ("te", "trailers"),
        ];
        let block = self
            .encoder
            .encode(headers.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        let body = request.encode_to_vec();
        let mut message = vec![0];
        message.extend_from_slice(&(body.len() as u32).to_be_bytes());
        message.extend_from_slice(&body);
        let mut out = frame(HEADERS, END_HEADERS, id, &block);
        out.extend(frame(DATA, END_STREAM, id, &message));
        self.socket.write_all(&out).await.unwrap();
        self.streams.insert(id, StreamState::default());
        id
    }

    /// A unary call: the response message, or the stream's state when there is none.
    pub async fn unary<R: Message + Default>(
        &mut self,
        method: &str,
        request: &impl Message,
    ) -> Result<R, StreamState> {
        let id = self.start(method, request).await;
        while !self.streams[&id].ended {
            self.read_frame().await;
        }
        let mut state = self.streams.remove(&id).unwrap();
        match state.take_message() {
            Some(bytes) if state.header("grpc-status") == Some("0") => {
                Ok(R::decode(&bytes[..]).unwrap())
            }
            _ => Err(state),
        }
    }

    /// The next message on a server stream, or the stream's state if it ended first.
    pub async fn next_message<R: Message + Default>(&mut self, id: u32) -> Result<R, &StreamState> {
        loop {
            if let Some(bytes) = self.streams.get_mut(&id).unwrap().take_message() {
                return Ok(R::decode(&bytes[..]).unwrap());
            }
            if self.streams[&id].ended {
                return Err(&self.streams[&id]);
            }
            self.read_frame().await;
        }
    }

    /// Reads and handles one frame from the server.
    async fn read_frame(&mut self) {
        let mut header = [0u8; 9];
        self.socket.read_exact(&mut header).await.unwrap();
        let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        let (kind, flags) = (header[3], header[4]);
        let id = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        self.socket.read_exact(&mut payload).await.unwrap();
        match kind {
            SETTINGS if flags & ACK == 0 => {
                self.socket
                    .write_all(&frame(SETTINGS, ACK, 0, &[]))
                    .await
                    .unwrap();
            }
            PING if flags & ACK == 0 => {
                self.socket
                    .write_all(&frame(PING, ACK, 0, &payload))
                    .await
                    .unwrap();
            }
            GOAWAY => panic!("server sent GOAWAY: {payload:?}"),
            DATA => {
                let state = self.streams.entry(id).or_default();
                state.data.extend_from_slice(&payload);
                state.ended |= flags & END_STREAM != 0;
            }
            RST_STREAM => {
                let state = self.streams.entry(id).or_default();
                state.reset = Some(u32::from_be_bytes(payload[..4].try_into().unwrap()));
                state.ended = true;
            }
            HEADERS | CONTINUATION => {
                let (stream, mut fragment, end_stream) = match self.partial.take() {
                    Some(partial) => partial,
                    None => (id, Vec::new(), flags & END_STREAM != 0),
                };
                fragment.extend_from_slice(&payload);
                if flags & END_HEADERS == 0 {
                    self.partial = Some((stream, fragment, end_stream));
                    return;
                }
                let block = self
                    .decoder
                    .decode(&fragment)
                    .unwrap()
                    .into_iter()
                    .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                    .collect();
                let state = self.streams.entry(stream).or_default();
                state.header_blocks.push(block);
                state.ended |= end_stream;
            }
            _ => {}
        }
    }
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u32).to_be_bytes();
    let mut out = vec![len[1], len[2], len[3], kind, flags];
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}
