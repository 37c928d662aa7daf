//! `devplug inspect --watch`: keeps ListAndWatch open and reports each new list as a change
//! against the previous one (devices that appeared, vanished or changed, and the counts), with
//! a UTC timestamp, until the plugin ends the stream or a signal arrives.

use super::client::Plugin;
use super::model::{Change, Counts, DeviceView, OptionsView};
use super::{clock, emit, render, Emitted};
use serde::Serialize;
use std::path::Path;

/// One `--json` line.
#[derive(Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
enum Event<'a> {
    /// The first list, in full.
    Initial {
        time: String,
        socket: String,
        options: OptionsView,
        devices: &'a [DeviceView],
        counts: Counts,
    },
    /// A later list, as a change.
    Update {
        time: String,
        update: u64,
        #[serde(flatten)]
        change: &'a Change,
        counts: Counts,
    },
    /// The plugin ended the stream.
    End { time: String, reason: &'static str },
}

fn json_line(event: &Event<'_>) -> anyhow::Result<String> {
    Ok(format!("{}\n", serde_json::to_string(event)?))
}

const ENDED: &str = "the plugin ended the ListAndWatch stream";

/// Watches until the stream ends (exit 0), it breaks (an error), or SIGINT/SIGTERM (exit 0).
pub async fn watch(path: &Path, timeout: std::time::Duration, json: bool) -> anyhow::Result<()> {
    let mut plugin = Plugin::connect(path, timeout).await?;
    let options = plugin.options().await?;
    let (mut devices, mut stream) = plugin.first_list().await?;
    let socket = path.display().to_string();
    let first = if json {
        json_line(&Event::Initial {
            time: clock::now(),
            socket: socket.clone(),
            options,
            devices: &devices,
            counts: Counts::of(&devices),
        })?
    } else {
        let summary = super::model::Summary {
            socket,
            options,
            counts: Counts::of(&devices),
            devices: devices.clone(),
            pod_resources: None,
        };
        format!(
            "{}\n{}  watching for changes (Ctrl-C to stop)\n",
            render::summary(&summary),
            clock::now()
        )
    };
    if emit(&first)? == Emitted::Closed {
        return Ok(());
    }

    let signal = devplug::shutdown_signal();
    tokio::pin!(signal);
    let mut update = 0;
    loop {
        let next = tokio::select! {
            _ = &mut signal => return Ok(()),
            next = plugin.next_list(&mut stream) => next?,
        };
        let Some(list) = next else {
            let time = clock::now();
            let text = if json {
                json_line(&Event::End {
                    time,
                    reason: ENDED,
                })?
            } else {
                format!("{time}  {ENDED} (the kubelet would mark every device unhealthy)\n")
            };
            emit(&text)?;
            return Ok(());
        };
        update += 1;
        let change = Change::between(&devices, &list);
        let counts = Counts::of(&list);
        let time = clock::now();
        let text = if json {
            json_line(&Event::Update {
                time,
                update,
                change: &change,
                counts,
            })?
        } else {
            render::change(&time, update, &change, &counts)
        };
        if emit(&text)? == Emitted::Closed {
            return Ok(());
        }
        devices = list;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::inspect::model::device_view as d;

    #[test]
    fn json_lines_are_flat_and_tagged() {
        let change = Change::between(&[d("a", "Healthy", &[])], &[d("a", "Unhealthy", &[])]);
        let counts = Counts::of(&[d("a", "Unhealthy", &[])]);
        let line = json_line(&Event::Update {
            time: "T".into(),
            update: 1,
            change: &change,
            counts,
        })
        .unwrap();
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["event"], "update");
        assert_eq!(value["changed"][0]["before"]["health"], "Healthy");
        assert_eq!(value["counts"]["unhealthy"], 1);
        assert!(line.ends_with("}\n") && line.matches('\n').count() == 1);
    }
}
