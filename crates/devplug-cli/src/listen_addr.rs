//! Listen addresses as Kubernetes components take them: `:8080` means every IPv4 interface
//! (`0.0.0.0:8080`), as in `--metrics-bind-address=:8080`; `host:port` and `[v6]:port` as
//! usual, `localhost:port` as `127.0.0.1:port`, and `[v4]:port` as Go's programs take it, so that
//! a manifest can write `[$(POD_IP)]:8080` whatever the pod's address family.

use std::net::{Ipv4Addr, SocketAddr};

/// Parses a listen address for `--metrics-addr` and `--probe-addr`.
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
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    if let Some((host, p)) = text.strip_prefix('[').and_then(|t| t.split_once("]:")) {
        if let Ok(ip) = host.parse::<Ipv4Addr>() {
            return Ok(SocketAddr::from((ip, port(p)?)));
        }
    }
    Err(format!("{text:?} is not a listen address; {hint}"))
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
        assert_eq!(ok("[fd00:10:244::5]:8080"), "[fd00:10:244::5]:8080");
        assert_eq!(ok("[10.0.0.7]:8080"), "10.0.0.7:8080");
        assert_eq!(ok("[0.0.0.0]:8081"), "0.0.0.0:8081");
        for bad in [
            ":",
            ":http",
            ":65536",
            "8080",
            "example.com:80",
            "",
            "[]:8080",
            "[example.com]:80",
            "[$(POD_IP)]:8080",
            "[10.0.0.7]",
            "[10.0.0.7]:",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(parse(":99999").unwrap_err().contains("not a port number"));
        assert!(parse("[10.0.0.7]:99999")
            .unwrap_err()
            .contains("not a port number"));
    }
}
