//! Undoing a node: one shell script, written before anything starts, that stops every process
//! the node started (by PID file, then every process left in its cgroups, every shim of its
//! containerd and every conmon of its CRI-O), unmounts what lies under the kubelet's root and the node's folder, removes the
//! bridge, the CNI state, the cgroups, the test device nodes, CDI specs the tests left and the
//! folders. It is idempotent: run at start (a run killed before it could clean up), by
//! [`super::Node::stop`], and by a reaper process when the test binary dies without stopping.

use super::{Layout, BRIDGE, CGROUP_ROOT, KUBELET_ROOT};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

/// The processes in the order they are stopped (PID files `pids/<name>` in the node's folder).
pub const STOP_ORDER: [&str; 8] = [
    "devplug-host",
    "kubelet",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "containerd",
    "crio",
    "etcd",
];

/// The prefix of device nodes the tests make under /dev (removed by the cleanup).
pub const TEST_DEVICE_PREFIX: &str = "/dev/devplug-test-";

/// The cleanup script for the node in `layout`.
pub fn script(layout: &Layout) -> String {
    let dir = layout.dir.display();
    let socket = layout.containerd_socket().display().to_string();
    let order = STOP_ORDER.join(" ");
    format!(
        r#"#!/bin/sh
# Undoes the whole-node test node in {dir}. Idempotent; safe to run while nothing is up.
set +e
dir='{dir}'
# A PID is only signalled while its command line names this folder (a stale PID file of a run
# killed long ago may name a PID that is now another program's).
ours() {{ [ -f "$1" ] && tr '\0' ' ' < "/proc/$(cat "$1")/cmdline" 2>/dev/null | grep -qF "$dir"; }}
for name in {order}; do
  f="$dir/pids/$name"
  ours "$f" && kill "$(cat "$f")" 2>/dev/null
done
for i in 1 2 3 4 5 6 7 8 9 10; do
  alive=""
  for f in "$dir"/pids/*; do ours "$f" && alive=1; done
  [ -z "$alive" ] && break
  sleep 0.5
done
for f in "$dir"/pids/*; do ours "$f" && kill -9 "$(cat "$f")" 2>/dev/null; rm -f "$f"; done
# Containers: every process in the node's cgroups, the shims of its containerd, CRI-O's conmons.
for round in 1 2 3; do
  for procs in $(find /sys/fs/cgroup -path '*/{CGROUP_ROOT}/*' -name cgroup.procs 2>/dev/null); do
    for pid in $(cat "$procs" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
  done
  pkill -9 -f '[c]ontainerd-shim-runc-v2 .*{socket}' 2>/dev/null
  pkill -9 -f "[c]onmon .*$dir" 2>/dev/null
  sleep 0.2
done
# Mounts below the kubelet's root and the node's folder, deepest first.
awk '{{print $5}}' /proc/self/mountinfo | grep -E '^({KUBELET_ROOT}|'"$dir"')(/|$)' | sort -r | while read -r m; do
  umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
done
ip link delete {BRIDGE} 2>/dev/null
rm -rf /var/lib/cni/networks/devplug-test
rm -f /var/lib/cni/results/devplug-test-* 2>/dev/null
# cgroups, deepest first.
find /sys/fs/cgroup -depth -type d -path '*/{CGROUP_ROOT}*' 2>/dev/null | while read -r c; do rmdir "$c" 2>/dev/null; done
rm -f {device_prefix}*
# Claims' CDI specs of the tests' DRA drivers (all under example.com) that no unprepare removed:
# a scenario deleted its driver while the kubelet still held a claim.
rm -f /var/run/cdi/devplug-*.example.com-*.json
for spec in "$dir"/cdi-specs-made; do
  [ -f "$spec" ] && while read -r f; do [ -n "$f" ] && rm -rf "$f"; done < "$spec"
done
find /var/log/containers /var/log/pods -maxdepth 1 2>/dev/null | while read -r l; do
  case "$(readlink "$l")" in "$dir"/*) rm -f "$l";; esac
done
if [ -f '{KUBELET_ROOT}/{marker}' ]; then rm -rf '{KUBELET_ROOT}'; fi
rm -rf "$dir"
exit 0
"#,
        device_prefix = TEST_DEVICE_PREFIX,
        marker = super::MARKER,
    )
}

/// Runs the cleanup script at `path` and waits for it.
pub fn run(path: &std::path::Path) -> Result<(), String> {
    let status = Command::new("sh")
        .arg(path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("cleanup {}: {e}", path.display()))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("cleanup {} failed: {status}", path.display()))
    }
}

/// A process that waits for this process to exit, then runs the cleanup script at `path`.
/// Killing it calls it off (after [`super::Node::stop`] cleaned up itself).
pub fn reaper(path: &std::path::Path) -> Result<Child, String> {
    let me = std::process::id();
    Command::new("sh")
        .arg("-c")
        .arg(format!(
            "while kill -0 {me} 2>/dev/null; do sleep 0.5; done; sh '{}'",
            path.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C to the test run must not stop the net first.
        .process_group(0)
        .spawn()
        .map_err(|e| format!("reaper: {e}"))
}
