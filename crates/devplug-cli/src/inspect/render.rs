//! Text rendering of what `devplug inspect` found: aligned tables for people. (The `--json`
//! output is the [`model`](super::model) structs serialized as they are.)

use super::model::{AllocationView, Change, Counts, DeviceView, EditsView, OptionsView, Summary};
use devplug_proto::constants::{HEALTHY, UNHEALTHY};
use std::fmt::Write;

/// The options on one line.
pub fn options(o: &OptionsView) -> String {
    format!(
        "pre_start_required={} get_preferred_allocation_available={}",
        o.pre_start_required, o.get_preferred_allocation_available
    )
}

/// A health string as shown in tables; the empty string is made visible.
fn health(h: &str) -> String {
    if h.is_empty() {
        "(empty)".to_owned()
    } else {
        h.to_owned()
    }
}

/// NUMA nodes as `0,1`, or `-` for none.
fn numa(nodes: &[i64]) -> String {
    if nodes.is_empty() {
        "-".to_owned()
    } else {
        nodes
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `4 (Healthy 3, Unhealthy 1)`: the total, then each health string with `Healthy` first.
pub fn counts(c: &Counts) -> String {
    let mut parts: Vec<String> = Vec::new();
    if let Some(n) = c.by_health.get(HEALTHY) {
        parts.push(format!("{HEALTHY} {n}"));
    }
    for (h, n) in c.by_health.iter().filter(|(h, _)| *h != HEALTHY) {
        parts.push(format!("{} {n}", health(h)));
    }
    let noun = if c.total == 1 { "device" } else { "devices" };
    if parts.is_empty() {
        format!("{} {noun}", c.total)
    } else {
        format!("{} {noun} ({})", c.total, parts.join(", "))
    }
}

/// Rows as columns padded to the widest cell; the last column is not padded.
pub fn table(rows: &[Vec<String>]) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<width$}  ", width = widths[i]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The device table: id, health, NUMA nodes.
pub fn devices(list: &[DeviceView]) -> String {
    if list.is_empty() {
        return "(no devices)\n".to_owned();
    }
    let mut rows = vec![vec![
        "ID".to_owned(),
        "HEALTH".to_owned(),
        "NUMA".to_owned(),
    ]];
    rows.extend(
        list.iter()
            .map(|d| vec![d.id.clone(), health(&d.health), numa(&d.numa_nodes)]),
    );
    table(&rows)
}

/// A note when some health string is neither `Healthy` nor `Unhealthy`.
fn odd_health_note(c: &Counts) -> Option<String> {
    let odd: Vec<String> = c
        .by_health
        .keys()
        .filter(|h| *h != HEALTHY && *h != UNHEALTHY)
        .map(|h| format!("{h:?}"))
        .collect();
    (!odd.is_empty()).then(|| {
        format!(
            "note: the kubelet counts every health other than \"Healthy\" as unhealthy ({})\n",
            odd.join(", ")
        )
    })
}

/// The whole `inspect --socket` report.
pub fn summary(s: &Summary) -> String {
    let mut header = vec![
        vec!["socket".into(), s.socket.clone()],
        vec!["options".into(), options(&s.options)],
        vec!["devices".into(), counts(&s.counts)],
    ];
    let Some(pr) = &s.pod_resources else {
        let mut out = table(&header);
        out.push('\n');
        out.push_str(&devices(&s.devices));
        if let Some(note) = odd_health_note(&s.counts) {
            out.push_str(&note);
        }
        return out;
    };
    match (&pr.resource, &pr.error) {
        (_, Some(err)) => header.push(vec!["pod resources".into(), format!("unavailable: {err}")]),
        (Some(resource), None) => header.push(vec![
            "pod resources".into(),
            format!("{resource}: {} in use", pr.holders.len()),
        ]),
        (None, None) => header.push(vec![
            "pod resources".into(),
            "no resource at the kubelet has these device ids (give --resource)".into(),
        ]),
    }
    let mut out = table(&header);
    out.push('\n');
    if pr.error.is_none() && !s.devices.is_empty() {
        let mut rows = vec![vec![
            "ID".to_owned(),
            "HEALTH".to_owned(),
            "NUMA".to_owned(),
            "HOLDER".to_owned(),
        ]];
        rows.extend(s.devices.iter().map(|d| {
            let holder = pr.holders.get(&d.id).map_or_else(
                || "-".to_owned(),
                |h| format!("{}/{}/{}", h.namespace, h.pod, h.container),
            );
            vec![d.id.clone(), health(&d.health), numa(&d.numa_nodes), holder]
        }));
        out.push_str(&table(&rows));
    } else {
        out.push_str(&devices(&s.devices));
    }
    if let Some(note) = odd_health_note(&s.counts) {
        out.push_str(&note);
    }
    out
}

/// One `--watch` update: a header line with the time and counts, then one line per change.
pub fn change(time: &str, update: u64, change: &Change, now: &Counts) -> String {
    let mut out = format!("{time}  update {update}: {}\n", counts(now));
    let mut rows: Vec<Vec<String>> = Vec::new();
    for c in &change.changed {
        let mut what = Vec::new();
        if c.before.health != c.after.health {
            what.push(format!(
                "health {} -> {}",
                health(&c.before.health),
                health(&c.after.health)
            ));
        }
        if c.before.numa_nodes != c.after.numa_nodes {
            what.push(format!(
                "NUMA {} -> {}",
                numa(&c.before.numa_nodes),
                numa(&c.after.numa_nodes)
            ));
        }
        rows.push(vec!["  changed".into(), c.id.clone(), what.join(", ")]);
    }
    for d in &change.appeared {
        rows.push(vec![
            "  appeared".into(),
            d.id.clone(),
            format!("{}, NUMA {}", health(&d.health), numa(&d.numa_nodes)),
        ]);
    }
    for id in &change.vanished {
        rows.push(vec!["  vanished".into(), id.clone()]);
    }
    if rows.is_empty() {
        out.push_str("  no change (the plugin sent the same list again)\n");
    } else {
        out.push_str(&table(&rows));
    }
    out
}

/// The `--allocate` report.
pub fn allocation(a: &AllocationView) -> String {
    let mut out = format!(
        "Allocate {} on {}: {} container response{}\n",
        a.requested.join(","),
        a.socket,
        a.container_responses.len(),
        if a.container_responses.len() == 1 {
            ""
        } else {
            "s"
        }
    );
    let many = a.container_responses.len() > 1;
    for (i, edits) in a.container_responses.iter().enumerate() {
        if many {
            let _ = writeln!(out, "\ncontainer response {i}:");
        }
        out.push_str(&container_edits(edits));
    }
    out
}

fn section(out: &mut String, title: &str, rows: Vec<Vec<String>>) {
    let _ = writeln!(out, "{title}:");
    if rows.is_empty() {
        out.push_str("  (none)\n");
        return;
    }
    let indented: Vec<Vec<String>> = rows
        .into_iter()
        .map(|mut r| {
            if let Some(first) = r.first_mut() {
                first.insert_str(0, "  ");
            }
            r
        })
        .collect();
    out.push_str(&table(&indented));
}

fn container_edits(e: &EditsView) -> String {
    let mut out = String::new();
    section(
        &mut out,
        "env",
        e.envs
            .iter()
            .map(|(k, v)| vec![format!("{k}={v}")])
            .collect(),
    );
    section(
        &mut out,
        "device nodes (host -> container, permissions)",
        e.devices
            .iter()
            .map(|d| {
                vec![
                    d.host_path.clone(),
                    "->".into(),
                    d.container_path.clone(),
                    d.permissions.clone(),
                ]
            })
            .collect(),
    );
    section(
        &mut out,
        "mounts (host -> container)",
        e.mounts
            .iter()
            .map(|m| {
                vec![
                    m.host_path.clone(),
                    "->".into(),
                    m.container_path.clone(),
                    if m.read_only { "ro" } else { "rw" }.into(),
                ]
            })
            .collect(),
    );
    section(
        &mut out,
        "annotations",
        e.annotations
            .iter()
            .map(|(k, v)| vec![format!("{k}={v}")])
            .collect(),
    );
    section(
        &mut out,
        "CDI devices",
        e.cdi_devices.iter().map(|n| vec![n.clone()]).collect(),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_and_trim() {
        let rows = vec![
            vec!["ID".to_owned(), "HEALTH".to_owned(), "NUMA".to_owned()],
            vec!["long-id-0".to_owned(), "Healthy".to_owned(), "-".to_owned()],
        ];
        assert_eq!(
            table(&rows),
            "ID         HEALTH   NUMA\nlong-id-0  Healthy  -\n"
        );
    }

    #[test]
    fn counts_put_healthy_first_and_show_empty_health() {
        let list = [
            DeviceView {
                id: "a".into(),
                health: String::new(),
                numa_nodes: vec![],
            },
            DeviceView {
                id: "b".into(),
                health: "Healthy".into(),
                numa_nodes: vec![0, 1],
            },
        ];
        let c = Counts::of(&list);
        assert_eq!(counts(&c), "2 devices (Healthy 1, (empty) 1)");
        assert!(odd_health_note(&c).is_some());
        assert!(devices(&list).contains("(empty)"));
        assert!(devices(&list).contains("0,1"));
    }
}
