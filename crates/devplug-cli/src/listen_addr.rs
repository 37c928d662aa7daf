//! Listen addresses as Kubernetes components take them: `:8080` means every IPv4 interface
//! (`0.0.0.0:8080`), as in `--metrics-bind-address=:8080`; `host:port` and `[v6]:port` as
//! usual, and `localhost:port` as `127.0.0.1:port`.

use std::net::{Ipv4Addr, SocketAddr};

/// Parses a listen address for `--metrics-addr`.
pub fn parse(text: &str) -> Result<SocketAddr, String> {
    let hint = "write host:port or :port, e.g. :8080, 0.0.0.0:8080, 127.0.0.1:8080 or [::]:8080";
    let port = |p: &str| {
        p.parse::<u16>()
            .map_err(|_| format!("{p:?} is not a port number (0-65535); {hint}"))
    };
    if let Some(p) = text.strip_prefix(':') {
        return Ok(SocketAddr::from((Ipv4Addr::UNSPECIFIED, port(p)?)));
    }
    if let Some(p) = text.strip_prefix("localhost:") {
        return Ok(SocketAddr::from((Ipv4Addr::LOCALHOST, port(p)?)));
    }
    text.parse()
        .map_err(|_| format!("{text:?} is not a listen address; {hint}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_style_and_plain_addresses() {
        let ok = |text: &str| parse(text).unwrap().to_string();
        assert_eq!(ok(":8080"), "0.0.0.0:8080");
        assert_eq!(ok("0.0.0.0:9100"), "0.0.0.0:9100");
        assert_eq!(ok("127.0.0.1:8080"), "127.0.0.1:8080");
        assert_eq!(ok("localhost:8080"), "127.0.0.1:8080");
        assert_eq!(ok("[::]:8080"), "[::]:8080");
        for bad in [":", ":http", ":65536", "8080", "example.com:80", ""] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(parse(":99999").unwrap_err().contains("not a port number"));
    }
}
