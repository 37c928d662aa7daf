//! `devplug inspect --socket <dra.sock> --dra-health`: a DRA driver's device health stream
//! (`DRAResourceHealth/NodeWatchResources`, in `v1` as a 1.37 kubelet asks, else `v1alpha1`
//! for a driver that serves only that), as the kubelet reads it: each device of
//! the pool with its health, the reason, when the driver determined it and how long the kubelet
//! trusts that. With `--watch`, every message until the stream ends or Ctrl-C.

use super::client::{channel, InspectError};
use super::render::table;
use super::{emit, Emitted};
use devplug_proto::dra_health_v1 as pb;
use serde::Serialize;
use std::path::Path;
use std::time::Duration;

/// One device as a health message gives it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HealthRow {
    /// The pool (for devplug: the node).
    pub pool: String,
    /// The device's name in the pool.
    pub device: String,
    /// `Healthy`, `Unhealthy` or `Unknown`.
    pub health: String,
    /// Why, as the driver says.
    pub message: String,
    /// When the driver determined it, in Unix seconds.
    pub updated_unix: i64,
    /// How long the kubelet trusts it, in seconds (0: the kubelet's default).
    pub timeout_seconds: i64,
}

/// The rows of one message.
pub fn rows(message: &pb::NodeWatchResourcesResponse) -> Vec<HealthRow> {
    message
        .devices
        .iter()
        .map(|d| {
            let id = d.device.clone().unwrap_or_default();
            let health = match d.health() {
                pb::HealthStatus::Healthy => "Healthy",
                pb::HealthStatus::Unhealthy => "Unhealthy",
                pb::HealthStatus::Unknown => "Unknown",
            };
            HealthRow {
                pool: id.pool_name,
                device: id.device_name,
                health: health.to_owned(),
                message: d.message.clone(),
                updated_unix: d.last_updated_time,
                timeout_seconds: d.health_check_timeout_seconds,
            }
        })
        .collect()
}

/// The rows as a text table.
pub fn render(socket: &Path, rows: &[HealthRow]) -> String {
    let mut lines = vec![vec![
        "POOL".to_owned(),
        "DEVICE".to_owned(),
        "HEALTH".to_owned(),
        "TIMEOUT".to_owned(),
        "MESSAGE".to_owned(),
    ]];
    for row in rows {
        lines.push(vec![
            row.pool.clone(),
            row.device.clone(),
            row.health.clone(),
            format!("{}s", row.timeout_seconds),
            row.message.clone(),
        ]);
    }
    let unhealthy = rows.iter().filter(|r| r.health != "Healthy").count();
    format!(
        "{}: DRA device health: {} devices ({} not Healthy)\n{}",
        socket.display(),
        rows.len(),
        unhealthy,
        table(&lines)
    )
}

/// Opens the stream and prints its first message, or every message with `watch`.
pub async fn show(socket: &Path, timeout: Duration, watch: bool, json: bool) -> anyhow::Result<()> {
    let channel = channel(socket, timeout).await?;
    let timed_out = |what: &'static str| InspectError::Timeout {
        secs: timeout.as_secs(),
        what,
        path: socket.to_owned(),
    };
    let mut stream = tokio::time::timeout(
        timeout,
        devplug_proto::dra_health::HealthStream::open_newest(channel),
    )
    .await
    .map_err(|_| timed_out("waiting for the health stream of"))?
    .map_err(|status| unimplemented_or(socket, status))?;
    let mut first = true;
    loop {
        let next = if first {
            tokio::time::timeout(timeout, stream.message())
                .await
                .map_err(|_| timed_out("waiting for the first health message from"))?
        } else {
            stream.message().await
        };
        first = false;
        let Some(message) = next.map_err(|status| unimplemented_or(socket, status))? else {
            if watch {
                emit(&format!("{}: the health stream ended\n", socket.display()))?;
            }
            return Ok(());
        };
        let rows = rows(&message);
        let text = match (json, watch) {
            (true, true) => format!("{}\n", serde_json::to_string(&rows)?),
            (true, false) => format!("{}\n", serde_json::to_string_pretty(&rows)?),
            (false, _) => render(socket, &rows),
        };
        if emit(&text)? == Emitted::Closed || !watch {
            return Ok(());
        }
    }
}

/// A call's error, with `Unimplemented` said in words: the socket serves no health stream.
fn unimplemented_or(socket: &Path, status: tonic::Status) -> anyhow::Error {
    if status.code() == tonic::Code::Unimplemented {
        anyhow::anyhow!(
            "{} serves no DRA device health stream (DRAResourceHealth): a device plugin socket, \
             or a DRA driver that does not report health",
            socket.display()
        )
    } else {
        anyhow::anyhow!(
            "the health stream of {}: {:?}: {}",
            socket.display(),
            status.code(),
            status.message()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_and_table() {
        let message = pb::NodeWatchResourcesResponse {
            devices: vec![pb::DeviceHealth {
                device: Some(pb::DeviceIdentifier {
                    pool_name: "node-a".into(),
                    device_name: "board-a".into(),
                }),
                health: pb::HealthStatus::Unhealthy.into(),
                last_updated_time: 1_800_000_000,
                health_check_timeout_seconds: 60,
                message: "overheated".into(),
            }],
        };
        let rows = rows(&message);
        assert_eq!(rows[0].health, "Unhealthy");
        let text = render(Path::new("/p/dra.sock"), &rows);
        assert!(
            text.starts_with("/p/dra.sock: DRA device health: 1 devices (1 not Healthy)"),
            "{text}"
        );
        assert!(text.contains("node-a  board-a  Unhealthy  60s"), "{text}");
        assert!(text.contains("overheated"), "{text}");
    }
}
