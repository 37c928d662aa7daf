//! A minimal HTTP/1.1 server for the probe and metrics endpoints: GET (and HEAD) only, one
//! request per connection (`Connection: close`), bounded in size, time and connections.
//!
//! Kubelet probes and Prometheus scrapes need nothing more, and a web framework would cost the
//! process about 0.3 MiB of resident code (docs/benchmarks.md, "Memory"). Anything that is not a
//! well-formed GET gets a 4xx answer and the connection closed; nothing a client sends can
//! crash the process or hold it up.
//!
//! A listener never stops accepting, so that a client that opens connections and sends nothing
//! cannot leave the next ones (a kubelet probe) waiting in the kernel's backlog. Each connection
//! has [`Limits::head_timeout`] to send its request head, then [`Limits::answer_timeout`] for the
//! answer to be made and written. When [`Limits::connections`] are open, a new one closes the
//! oldest that has not sent its head yet; when every open one is being answered, the new one is
//! answered 503 at once and closed.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// The most a request's head may take (request line and headers).
const MAX_HEAD: usize = 8 * 1024;
/// The pause after a failed `accept()` (e.g. out of file descriptors), so that the loop does
/// not spin while the cause lasts.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// How many connections a listener serves at once and how long each client has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once; beyond, the oldest one that has not sent its head is closed.
    pub connections: usize,
    /// The time from accepting a connection to the end of its request head.
    pub head_timeout: Duration,
    /// The time, once the head is in, to make the answer and write it.
    pub answer_timeout: Duration,
}

impl Limits {
    /// The metrics listener (`/metrics`, and `/healthz` and `/readyz` for probes that point
    /// at it): scrapes can take a while to write.
    pub const METRICS: Limits = Limits {
        connections: 32,
        head_timeout: Duration::from_secs(1),
        answer_timeout: Duration::from_secs(5),
    };
    /// The probe listener: `/healthz` and `/readyz` only, small answers, few clients (the
    /// kubelet's probes take 2 s at most in the manifests).
    pub const PROBES: Limits = Limits {
        connections: 8,
        head_timeout: Duration::from_secs(1),
        answer_timeout: Duration::from_secs(2),
    };
}

/// An answer: status code, content type, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The status code, e.g. 200.
    pub status: u16,
    /// The `Content-Type` header.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
}

impl Response {
    /// A plain-text answer.
    pub fn text(status: u16, body: impl Into<String>) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
}

/// Serves GET requests on `listener` until `stop`, answering each path with `handler`, within
/// `limits`.
pub fn serve<H, F>(listener: TcpListener, limits: Limits, stop: CancellationToken, handler: H)
where
    H: Fn(String) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response> + Send + 'static,
{
    let table = Arc::new(Table::new(limits.connections));
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    tracing::debug!(%err, "accepting an HTTP connection failed");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(ACCEPT_RETRY) => {}
                    }
                    continue;
                }
            };
            match table.admit(&stop) {
                Some(ticket) => {
                    tokio::spawn(connection(stream, ticket, limits, handler.clone()));
                }
                None => refuse(stream),
            }
            // Let the connection just accepted read the head its client has sent before
            // accepting more: a burst of new connections would otherwise close it as idle.
            tokio::task::yield_now().await;
        }
    });
}

/// Answers 503 without waiting, and closes: every open connection is being answered.
fn refuse(stream: TcpStream) {
    let busy = encode(&Response::text(503, "busy: too many connections\n"));
    // A new connection's send buffer takes this whole; if not, the client sees the close alone.
    if let Err(err) = stream.try_write(&busy) {
        tracing::debug!(%err, "an HTTP client refused for lack of room went away");
    }
}

/// One connection: its request head within the head timeout, then its answer within the answer
/// timeout. Closed at once when a newer connection needs its room or at stop.
async fn connection<H, F>(mut stream: TcpStream, ticket: Ticket, limits: Limits, handler: H)
where
    H: Fn(String) -> F,
    F: Future<Output = Response>,
{
    let head = tokio::select! {
        _ = ticket.closed.cancelled() => return,
        head = tokio::time::timeout(limits.head_timeout, read_head(&mut stream)) => head,
    };
    let request = match head {
        Ok(Ok(Some(request))) => request,
        Ok(Ok(None)) => return,
        Ok(Err(err)) => {
            tracing::debug!(%err, "an HTTP client went away");
            return;
        }
        Err(_) => {
            tracing::debug!("an HTTP client sent no request head in time; closed");
            return;
        }
    };
    if !ticket.answering() {
        return;
    }
    let answered = tokio::select! {
        _ = ticket.closed.cancelled() => return,
        answered = tokio::time::timeout(limits.answer_timeout, respond(&mut stream, request, handler)) => answered,
    };
    match answered {
        Ok(Ok(())) => {}
        Ok(Err(err)) => tracing::debug!(%err, "an HTTP client went away"),
        Err(_) => tracing::debug!("an HTTP client did not take its answer in time; closed"),
    }
}

/// What a request head asks: `Ok((is HEAD, path))`, or the error answer.
type Request = Result<(bool, String), Response>;

/// Reads one request head; `None` when the client closed first.
async fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<Request>> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let n = stream.read(&mut buf).await?;
        let Some(read) = buf.get(..n).filter(|read| !read.is_empty()) else {
            return Ok(None);
        };
        head.extend_from_slice(read);
        if let Some(end) = find(&head, b"\r\n\r\n") {
            head.truncate(end);
            return Ok(Some(parse(&head)));
        }
        if head.len() > MAX_HEAD {
            return Ok(Some(Err(Response::text(431, "request head too large\n"))));
        }
    }
}

/// Makes the answer to `request` and writes it.
async fn respond<H, F>(stream: &mut TcpStream, request: Request, handler: H) -> std::io::Result<()>
where
    H: Fn(String) -> F,
    F: Future<Output = Response>,
{
    let response = match request {
        Ok((head_only, path)) => {
            let mut response = handler(path).await;
            if head_only {
                response.body.clear();
            }
            response
        }
        Err(response) => response,
    };
    stream.write_all(&encode(&response)).await?;
    stream.shutdown().await
}

/// The open connections of one listener, oldest first.
struct Table {
    limit: usize,
    open: Mutex<Open>,
}

/// The table's contents.
struct Open {
    next_id: u64,
    slots: VecDeque<Slot>,
}

/// One open connection.
struct Slot {
    id: u64,
    /// Still waiting for its request head: the first to go when a new connection needs room.
    reading: bool,
    /// Cancelled to close it.
    close: CancellationToken,
}

impl Table {
    fn new(limit: usize) -> Table {
        Table {
            limit,
            open: Mutex::new(Open {
                next_id: 0,
                slots: VecDeque::with_capacity(limit),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Room for a new connection, closing the oldest one still waiting for its head when the
    /// table is full; `None` when every open connection is being answered.
    fn admit(self: &Arc<Self>, stop: &CancellationToken) -> Option<Ticket> {
        let mut open = self.lock();
        if open.slots.len() >= self.limit {
            let idle = open.slots.iter().position(|slot| slot.reading)?;
            if let Some(slot) = open.slots.remove(idle) {
                slot.close.cancel();
            }
        }
        let id = open.next_id;
        open.next_id = open.next_id.wrapping_add(1);
        let closed = stop.child_token();
        open.slots.push_back(Slot {
            id,
            reading: true,
            close: closed.clone(),
        });
        Some(Ticket {
            table: Arc::clone(self),
            id,
            closed,
        })
    }
}

/// A connection's slot in its table, given back when dropped.
struct Ticket {
    table: Arc<Table>,
    id: u64,
    /// Cancelled when the connection is closed to make room for a newer one, or at stop.
    closed: CancellationToken,
}

impl Ticket {
    /// Marks the connection as being answered, so that newer ones do not close it; `false`
    /// when it was closed already.
    fn answering(&self) -> bool {
        let mut open = self.table.lock();
        match open.slots.iter_mut().find(|slot| slot.id == self.id) {
            Some(slot) => {
                slot.reading = false;
                true
            }
            None => false,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.table.lock().slots.retain(|slot| slot.id != self.id);
    }
}

/// The request line's method and path: `Ok((is HEAD, path without query))`, or the error
/// answer.
fn parse(head: &[u8]) -> Result<(bool, String), Response> {
    let bad = || Response::text(400, "bad request\n");
    let text = std::str::from_utf8(head).map_err(|_| bad())?;
    let line = text.lines().next().ok_or_else(bad)?;
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    if !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Err(bad());
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Err(Response::text(405, "only GET and HEAD\n")),
    };
    let path = target.split(['?', '#']).next().unwrap_or(target);
    Ok((head_only, path.to_owned()))
}

/// The bytes of an answer.
fn encode(response: &Response) -> Vec<u8> {
    let reason = match response.status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "",
    };
    let mut out = format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        response.status,
        response.content_type,
        response.body.len()
    )
    .into_bytes();
    out.extend_from_slice(response.body.as_bytes());
    out
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines() {
        assert_eq!(
            parse(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a"),
            Ok((false, "/metrics".to_owned()))
        );
        assert_eq!(
            parse(b"HEAD /healthz HTTP/1.0"),
            Ok((true, "/healthz".to_owned()))
        );
        assert_eq!(parse(b"POST /x HTTP/1.1").unwrap_err().status, 405);
        for bad in [
            &b"GET"[..],
            b"GET /x",
            b"GET x HTTP/1.1",
            b"GET /x SPDY/3",
            b"GET /x HTTP/1.1 extra",
            b"\xff\xfe",
        ] {
            assert_eq!(parse(bad).unwrap_err().status, 400, "{bad:?}");
        }
    }

    #[test]
    fn answers_carry_their_length() {
        let bytes = encode(&Response::text(503, "not ready\n"));
        let text = String::from_utf8(bytes).unwrap();
        assert!(text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"));
        assert!(text.contains("Content-Length: 10\r\n"));
        assert!(text.ends_with("\r\n\r\nnot ready\n"));
    }

    async fn echo(path: String) -> Response {
        Response::text(200, format!("you asked for {path}\n"))
    }

    /// Serves `echo` on a loopback port within `limits`.
    async fn echo_server(limits: Limits) -> (std::net::SocketAddr, CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        serve(listener, limits, stop.clone(), echo);
        (addr, stop)
    }

    /// GET `path`: the whole answer, or `None` if none came within 10 s.
    async fn get(addr: std::net::SocketAddr, path: &str) -> Option<String> {
        let exchange = async {
            let mut stream = TcpStream::connect(addr).await.ok()?;
            let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
            stream.write_all(request.as_bytes()).await.ok()?;
            let mut answer = String::new();
            stream.read_to_string(&mut answer).await.ok()?;
            Some(answer)
        };
        tokio::time::timeout(Duration::from_secs(10), exchange)
            .await
            .ok()
            .flatten()
    }

    /// Whether the server has closed `stream` (end of stream or reset) within `wait`.
    async fn closed_within(stream: &mut TcpStream, wait: Duration) -> bool {
        let mut buf = [0u8; 64];
        matches!(
            tokio::time::timeout(wait, stream.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    #[tokio::test]
    async fn idle_connections_do_not_keep_a_probe_waiting() {
        let (addr, stop) = echo_server(Limits::METRICS).await;
        // Twice the connection budget, open and silent, as a client starving the port would.
        let mut idle = Vec::new();
        for _ in 0..2 * Limits::METRICS.connections {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        let answer = tokio::time::timeout(Duration::from_secs(5), get(addr, "/healthz"))
            .await
            .expect("no answer within 5 s while idle connections are open")
            .expect("the connection failed");
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        assert!(answer.ends_with("you asked for /healthz\n"), "{answer}");
        drop(idle);
        stop.cancel();
    }

    #[tokio::test]
    async fn a_new_connection_closes_the_oldest_idle_one_when_the_budget_is_spent() {
        // A head timeout no test waits for: only closing the idle ones can make room.
        let limits = Limits {
            connections: 4,
            head_timeout: Duration::from_secs(600),
            answer_timeout: Duration::from_secs(5),
        };
        let (addr, stop) = echo_server(limits).await;
        let mut idle = Vec::new();
        for _ in 0..2 * limits.connections {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        let answer = get(addr, "/readyz").await.expect("no answer");
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        // The oldest went to make room; the newest is still open.
        let (first, rest) = idle.split_first_mut().unwrap();
        assert!(closed_within(first, Duration::from_secs(10)).await);
        let last = rest.last_mut().unwrap();
        assert!(!closed_within(last, Duration::from_millis(200)).await);
        // Stopping closes what is still open.
        stop.cancel();
        assert!(closed_within(last, Duration::from_secs(10)).await);
    }

    #[tokio::test]
    async fn a_connection_without_a_whole_head_is_closed_after_the_head_timeout() {
        let (addr, stop) = echo_server(Limits::METRICS).await;
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut partial = TcpStream::connect(addr).await.unwrap();
        partial
            .write_all(b"GET /healthz HTTP/1.1\r\n")
            .await
            .unwrap();
        let start = std::time::Instant::now();
        assert!(closed_within(&mut silent, Duration::from_secs(10)).await);
        assert!(closed_within(&mut partial, Duration::from_secs(10)).await);
        // Not before the deadline (the client's clock starts a little after the server's).
        assert!(start.elapsed() >= Limits::METRICS.head_timeout / 2);
        // The listener still serves.
        let answer = get(addr, "/healthz").await.expect("no answer");
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        stop.cancel();
    }

    #[tokio::test]
    async fn with_every_connection_being_answered_a_new_one_gets_503_at_once() {
        let limits = Limits {
            connections: 2,
            head_timeout: Duration::from_secs(5),
            answer_timeout: Duration::from_secs(600),
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let release = CancellationToken::new();
        let (entered, mut entries) = tokio::sync::mpsc::unbounded_channel();
        let handler = {
            let release = release.clone();
            move |path: String| {
                let release = release.clone();
                let entered = entered.clone();
                async move {
                    let _ = entered.send(());
                    release.cancelled().await;
                    Response::text(200, format!("you asked for {path}\n"))
                }
            }
        };
        serve(listener, limits, stop.clone(), handler);
        let busy: Vec<_> = (0..limits.connections)
            .map(|_| tokio::spawn(get(addr, "/metrics")))
            .collect();
        for _ in 0..limits.connections {
            tokio::time::timeout(Duration::from_secs(10), entries.recv())
                .await
                .expect("the requests never reached the handler");
        }
        let mut refused = TcpStream::connect(addr).await.unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(10), refused.read_to_string(&mut answer))
            .await
            .expect("no answer")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        release.cancel();
        for request in busy {
            let answer = request.await.unwrap().expect("no answer");
            assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
        }
        stop.cancel();
    }

    #[tokio::test]
    async fn serves_answers_and_refuses_garbage() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        serve(listener, Limits::METRICS, stop.clone(), echo);
        let exchange = |request: Vec<u8>| async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream.write_all(&request).await.unwrap();
            let mut answer = String::new();
            stream.read_to_string(&mut answer).await.unwrap();
            answer
        };
        let ok = exchange(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()).await;
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(ok.ends_with("you asked for /readyz\n"), "{ok}");
        let huge = [b"GET /", &[b'a'; 20_000][..], b" HTTP/1.1\r\n\r\n"].concat();
        assert!(exchange(huge).await.starts_with("HTTP/1.1 431"));
        assert!(exchange(b"DELETE / HTTP/1.1\r\n\r\n".to_vec())
            .await
            .starts_with("HTTP/1.1 405"));
        stop.cancel();
    }
}
