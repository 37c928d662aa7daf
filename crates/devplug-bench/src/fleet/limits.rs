//! What a fleet of N nodes needs of this machine, checked before anything starts: an inotify
//! instance per driver, and open files for every node.

/// inotify instances left for this user's other processes when the limit is checked (the
/// default limit of 128 fits the CI-sized fleet of 20 nodes).
const INOTIFY_MARGIN: usize = 32;

/// Descriptors a simulated node may hold, for the check of the open-files limit.
const FDS_PER_NODE: usize = 24;

/// This process's soft limit of open files.
fn open_files_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Descriptors this process holds.
pub(super) fn open_files() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Fails when this machine cannot hold `n` nodes: too few inotify instances for this user, or
/// too few open files for this process.
pub(super) fn check(n: usize) -> anyhow::Result<()> {
    // Each node holds a dozen or so descriptors (its client's connection, its sockets, its
    // registration folder's inotify, the stand-in's connection to its socket).
    let want = n.saturating_mul(FDS_PER_NODE).saturating_add(256);
    // Each node's driver follows the kubelet's plugin-registry folder with an inotify instance
    // of its own, as on a real node; one user may hold `max_user_instances` of them (128 by
    // default), shared by every process of that user on the machine.
    let inotify = "/proc/sys/fs/inotify/max_user_instances";
    if let Some(limit) = std::fs::read_to_string(inotify)
        .ok()
        .and_then(|t| t.trim().parse::<usize>().ok())
    {
        let want = n.saturating_add(INOTIFY_MARGIN);
        anyhow::ensure!(
            limit >= want,
            "{n} nodes need {n} inotify instances (one per driver) beside what this user's other \
             processes hold, but {inotify} is {limit}: raise it first \
             (`sysctl -w fs.inotify.max_user_instances={want}`, as root)"
        );
    }
    if let Some(limit) = open_files_limit() {
        anyhow::ensure!(
            limit >= want,
            "{n} nodes need about {want} open files but this process may open {limit}: \
             raise the limit first (`ulimit -n {want}`)"
        );
    }
    Ok(())
}
