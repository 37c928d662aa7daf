//! The plugin's Unix socket: a per-instance name, owner-only creation, removal of our own stale
//! files, and telling whether the file we bound is still the one at the path.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::{UnixListener, UnixStream};

/// Which file is at a path: device, inode and change time (an inode number alone can be reused
/// at once after a delete).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FileIdentity {
    dev: u64,
    ino: u64,
    ctime: i64,
    ctime_nsec: i64,
}

impl FileIdentity {
    /// The identity of the file at `path`, if there is one.
    pub(crate) fn of(path: &Path) -> Option<FileIdentity> {
        let meta = std::fs::symlink_metadata(path).ok()?;
        Some(FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            ctime: meta.ctime(),
            ctime_nsec: meta.ctime_nsec(),
        })
    }
}

/// The file-name prefix of every socket this resource's instances create.
pub(crate) fn name_prefix(resource: &str) -> String {
    let slug: String = resource
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("devplug-{slug}-")
}

/// Eight hex digits unique to this process instance and `what` (a resource or a DRA driver),
/// for socket names that two instances of one plugin (a rolling update with surge) never share.
pub fn instance_tag(what: &str) -> String {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.write(what.as_bytes());
    format!("{:08x}", hasher.finish() as u32)
}

/// Whether `tag` is one [`instance_tag`] makes: eight lowercase hex digits.
pub fn is_instance_tag(tag: &str) -> bool {
    tag.len() == 8 && tag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A socket file name unique to this process instance, so that two instances of one plugin
/// (a rolling update with surge) never delete each other's socket.
pub(crate) fn instance_name(resource: &str) -> String {
    format!("{}{}.sock", name_prefix(resource), instance_tag(resource))
}

/// Removes sockets of earlier instances of this resource that nobody serves any more (a crashed
/// process leaves its file behind). A live socket, such as a second running instance's, is kept.
pub(crate) async fn remove_stale(dir: &Path, resource: &str, keep: &Path) {
    let prefix = name_prefix(resource);
    remove_dead_sockets(
        dir,
        |name| name.starts_with(&prefix) && name.ends_with(".sock"),
        keep,
    )
    .await;
}

/// Removes the sockets in `dir` whose file name `ours` accepts, other than `keep`, that nobody
/// serves any more (a connection to them is refused: a crashed or killed instance left them).
/// A socket that accepts, such as a second running instance's, is kept.
pub async fn remove_dead_sockets(dir: &Path, ours: impl Fn(&str) -> bool, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !ours(name) || path == keep {
            continue;
        }
        let probe = tokio::time::timeout(Duration::from_millis(200), UnixStream::connect(&path));
        if let Ok(Err(err)) = probe.await {
            if err.kind() == io::ErrorKind::ConnectionRefused {
                match std::fs::remove_file(&path) {
                    Ok(()) => {
                        tracing::info!(path = %path.display(), "removed a stale socket of an earlier instance")
                    }
                    Err(err) => {
                        tracing::debug!(path = %path.display(), %err, "could not remove a stale socket")
                    }
                }
            }
        }
    }
}

/// Binds a listener at `path`, readable and writable by its owner only. The socket is bound under
/// a hidden temporary name, restricted, then renamed into place, so it is never reachable with
/// wider permissions.
pub(crate) fn bind_owner_only(path: &Path) -> io::Result<(UnixListener, FileIdentity)> {
    check_socket_path(path)?;
    let tmp = temp_path(path);
    let _ = std::fs::remove_file(&tmp);
    let listener = std::os::unix::net::UnixListener::bind(&tmp)?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(err) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(err);
    }
    listener.set_nonblocking(true)?;
    let identity = FileIdentity::of(path)
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "socket vanished after bind"))?;
    Ok((UnixListener::from_std(listener)?, identity))
}

/// Binds a Unix socket at `path` as devplug binds all of its sockets: owner-only, under a
/// dot-name (which the kubelet's plugin watcher ignores) renamed into place, replacing a stale
/// file there. For sockets outside the host, such as a DRA driver's `dra.sock`.
pub fn bind_socket(path: &Path) -> io::Result<UnixListener> {
    bind_owner_only(path).map(|(listener, _)| listener)
}

/// A socket file bound by [`bind_owned_socket`]: removed only while it is still the file we
/// bound, so an instance that stops never deletes the socket another instance put at the path.
#[derive(Debug, Clone)]
pub struct OwnedSocket {
    path: PathBuf,
    identity: FileIdentity,
}

impl OwnedSocket {
    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the file if it is still ours. An error means our socket is still there.
    pub fn remove(&self) -> io::Result<()> {
        remove_if_ours(&self.path, self.identity)
    }
}

/// [`bind_socket`], with the file's identity kept for [`OwnedSocket::remove`].
pub fn bind_owned_socket(path: &Path) -> io::Result<(UnixListener, OwnedSocket)> {
    let (listener, identity) = bind_owner_only(path)?;
    Ok((
        listener,
        OwnedSocket {
            path: path.to_owned(),
            identity,
        },
    ))
}

/// Removes the socket at `path` only if it is still the file we bound. An error means our
/// socket is still there.
pub(crate) fn remove_if_ours(path: &Path, identity: FileIdentity) -> io::Result<()> {
    if FileIdentity::of(path) == Some(identity) {
        std::fs::remove_file(path)?;
    }
    Ok(())
}

/// The longest path a Unix socket's address holds: `sun_path` is 108 bytes on Linux, one of
/// them the terminating NUL (`unix(7)`). The kubelet dials the same path, so a longer one could
/// not be reached even where it could be bound.
pub const MAX_SOCKET_PATH: usize = 107;

/// A socket path too long for a Unix socket, as an error that says how long and what to shorten.
pub fn check_socket_path(path: &Path) -> io::Result<()> {
    let len = path.as_os_str().len();
    if len <= MAX_SOCKET_PATH {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "socket path {} is {len} bytes; a Unix socket's path holds at most \
             {MAX_SOCKET_PATH}: use a shorter kubelet folder, resource or driver name",
            path.display()
        ),
    ))
}

/// The hidden name a socket is bound under before it is renamed into place: `.<name>.tmp`, or,
/// where that would not fit in [`MAX_SOCKET_PATH`], the name with its first character made a
/// dot (as long as the path itself).
fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    if tmp.as_os_str().len() <= MAX_SOCKET_PATH {
        return tmp;
    }
    let rest: String = name.chars().skip(1).collect();
    path.with_file_name(format!(".{rest}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder under `root` whose socket `name` makes a path of exactly `len` bytes.
    fn path_of_length(root: &Path, name: &str, len: usize) -> PathBuf {
        let base = root.as_os_str().len() + 1 + name.len();
        let pad = len
            .checked_sub(base + 1)
            .expect("root too long for this length");
        let dir = root.join("d".repeat(pad));
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join(name);
        assert_eq!(path.as_os_str().len(), len);
        path
    }

    #[test]
    fn a_socket_path_of_107_bytes_binds_and_a_longer_one_is_refused_by_name() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _guard = rt.enter();
        let root = tempfile::tempdir().unwrap();
        // dra.sock: `.dra.sock.tmp` would not fit beside a 107-byte path; the short form does.
        let longest = path_of_length(root.path(), "dra.sock", MAX_SOCKET_PATH);
        let (_listener, _) = bind_owner_only(&longest).unwrap();
        assert!(longest.exists());
        let root = tempfile::tempdir().unwrap();
        let over = path_of_length(root.path(), "dra.sock", MAX_SOCKET_PATH + 1);
        let err = bind_owner_only(&over).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        let said = err.to_string();
        assert!(
            said.contains("108 bytes") && said.contains("at most 107") && said.contains("shorter"),
            "{said}"
        );
        assert!(!over.exists());
    }

    #[test]
    fn names_are_per_instance_and_safe() {
        let a = instance_name("Example.com/NPU");
        assert!(a.starts_with("devplug-example.com_npu-"), "{a}");
        assert!(a.ends_with(".sock"));
        assert!(!a.contains('/'));
        let tag = instance_tag("npu.example.com");
        assert!(is_instance_tag(&tag), "{tag}");
        assert!(!is_instance_tag("0000000g") && !is_instance_tag("abc"));
    }

    #[tokio::test]
    async fn an_owned_socket_is_removed_only_while_it_is_ours() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dra-x.sock");
        let (_first, first) = bind_owned_socket(&path).unwrap();
        // A second instance binds the same path: the first one's removal leaves it.
        let (_second, second) = bind_owned_socket(&path).unwrap();
        first.remove().unwrap();
        assert!(path.exists(), "the second instance's socket is kept");
        second.remove().unwrap();
        assert!(!path.exists());
    }

    #[tokio::test]
    async fn binds_owner_only_and_removes_only_dead_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join(instance_name("a.com/x"));
        let (_listener, id) = bind_owner_only(&live).unwrap();
        let mode = std::fs::metadata(&live).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(FileIdentity::of(&live), Some(id));

        let dead = dir.path().join("devplug-a.com_x-deadbeef.sock");
        drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
        let other = dir.path().join("devplug-b.com_x-deadbeef.sock");
        drop(std::os::unix::net::UnixListener::bind(&other).unwrap());
        let me = dir.path().join("devplug-a.com_x-00000000.sock");
        remove_stale(dir.path(), "a.com/x", &me).await;
        assert!(live.exists(), "a live instance's socket is kept");
        assert!(!dead.exists(), "a dead socket of ours is removed");
        assert!(other.exists(), "another resource's socket is not ours");

        remove_if_ours(&live, id).unwrap();
        assert!(!live.exists());
    }
}
