//! A minimal HTTP/1.1 server for the probe and metrics endpoints: GET (and HEAD) only, one
//! request per connection (`Connection: close`), bounded in size, time and connections.
//!
//! Kubelet probes and Prometheus scrapes need nothing more, and a web framework would cost the
//! process about 0.3 MiB of resident code (docs/benchmarks.md, "Memory"). Anything that is not a
//! well-formed GET gets a 4xx answer and the connection closed; nothing a client sends can
//! crash the process or hold it up.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// The most a request's head may take (request line and headers).
const MAX_HEAD: usize = 8 * 1024;
/// The time a client has to send its request head and read the answer.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more wait in the kernel's backlog.
const MAX_CONNECTIONS: usize = 32;

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

/// Serves GET requests on `listener` until `stop`, answering each path with `handler`.
pub fn serve<H, F>(listener: TcpListener, stop: CancellationToken, handler: H)
where
    H: Fn(String) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let permit = tokio::select! {
                _ = stop.cancelled() => return,
                permit = slots.clone().acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
            };
            let accepted = tokio::select! {
                _ = stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    tracing::debug!(%err, "accepting a metrics connection failed");
                    continue;
                }
            };
            let handler = handler.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let answered = tokio::time::timeout(CLIENT_TIMEOUT, answer(stream, handler)).await;
                if let Ok(Err(err)) = answered {
                    tracing::debug!(%err, "a metrics client went away");
                }
            });
        }
    });
}

/// Reads one request head and writes one answer.
async fn answer<H, F>(mut stream: TcpStream, handler: H) -> std::io::Result<()>
where
    H: Fn(String) -> F,
    F: Future<Output = Response>,
{
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let response = loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = find(&head, b"\r\n\r\n") {
            head.truncate(end);
            break match parse(&head) {
                Ok((head_only, path)) => {
                    let mut response = handler(path).await;
                    if head_only {
                        response.body.clear();
                    }
                    response
                }
                Err(response) => response,
            };
        }
        if head.len() > MAX_HEAD {
            break Response::text(431, "request head too large\n");
        }
    };
    stream.write_all(&encode(&response)).await?;
    stream.shutdown().await
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

    #[tokio::test]
    async fn serves_answers_and_refuses_garbage() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        serve(listener, stop.clone(), |path: String| async move {
            Response::text(200, format!("you asked for {path}\n"))
        });
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
