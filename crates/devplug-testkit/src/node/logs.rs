//! What the node's containers and processes printed: a container's output from the kubelet's
//! pod log folder (CRI log lines), and the logs kept after the node is gone.

use super::{fail, Node};
use std::path::PathBuf;
use std::process::{Command, Stdio};

impl Node {
    /// What container `container` of pod `namespace/pod` printed (its latest run), from the
    /// kubelet's pod log folder: the text of each CRI log line, joined by newlines.
    pub fn container_log(
        &self,
        namespace: &str,
        pod: &str,
        container: &str,
    ) -> Result<String, String> {
        let prefix = format!("{namespace}_{pod}_");
        let logs = self.layout.pod_logs();
        let entries = std::fs::read_dir(&logs).map_err(|e| fail(&logs.display().to_string(), e))?;
        let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
        for entry in entries.flatten() {
            if !entry.file_name().to_string_lossy().starts_with(&prefix) {
                continue;
            }
            let dir = entry.path().join(container);
            for file in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let modified = file.metadata().and_then(|m| m.modified()).ok();
                if let Some(modified) = modified {
                    if newest.as_ref().is_none_or(|(t, _)| modified > *t) {
                        newest = Some((modified, file.path()));
                    }
                }
            }
        }
        let Some((_, file)) = newest else {
            return Err(format!(
                "no log of {namespace}/{pod}/{container} in {}",
                logs.display()
            ));
        };
        let text =
            std::fs::read_to_string(&file).map_err(|e| fail(&file.display().to_string(), e))?;
        Ok(cri_log_text(&text))
    }

    /// Copies the processes' and the pods' logs to `target/whole-node-logs/<what>` (kept after
    /// the node is gone).
    pub fn keep_logs(&self, what: &str) -> PathBuf {
        let kept = self
            .requirements
            .repo
            .join("target/whole-node-logs")
            .join(what);
        let _ = std::fs::remove_dir_all(&kept);
        let _ = std::fs::create_dir_all(&kept);
        for dir in [self.layout.logs(), self.layout.pod_logs()] {
            let _ = Command::new("cp")
                .arg("-r")
                .arg(&dir)
                .arg(&kept)
                .stdin(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
        kept
    }
}

/// The text of CRI log lines (`<time> <stream> <P|F> <text>`): partial lines (`P`) joined with
/// what follows them.
pub fn cri_log_text(log: &str) -> String {
    let mut out = String::new();
    for line in log.lines() {
        let mut parts = line.splitn(4, ' ');
        let (_, _, tag, text) = (parts.next(), parts.next(), parts.next(), parts.next());
        out.push_str(text.unwrap_or(""));
        if tag != Some("P") {
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cri_log_lines_become_the_containers_text() {
        let log = "2026-11-25T00:21:01.5Z stdout F A=1\n\
                   2026-11-25T00:21:01.6Z stdout P half \n\
                   2026-11-25T00:21:01.7Z stdout F and half\n\
                   2026-11-25T00:21:01.8Z stderr F \n";
        assert_eq!(cri_log_text(log), "A=1\nhalf and half\n\n");
    }
}
