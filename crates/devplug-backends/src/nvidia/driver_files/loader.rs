//! What the dynamic loader reads to find a library, read from a driver root: the loader cache
//! (`etc/ld.so.cache`, glibc's `glibc-ld.so.cache1.1` format, parsed here) and the folders
//! `etc/ld.so.conf` names (with the files it `include`s).
//!
//! The cache is parsed rather than asking `ldconfig -p`: the root is often not the root devplug
//! runs in (`/run/nvidia/driver`, `/driver-root`), `ldconfig -p` reads only the cache of the
//! root it runs in, and devplug's image has no `ldconfig`. The format is small and stable
//! (glibc's `elf/cache.c` and `sysdeps/generic/dl-cache.h`): a header, fixed-size entries, and
//! a string table whose offsets count from the header's start.

use std::path::{Path, PathBuf};

/// The magic and version of the current format.
const NEW_MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
/// The magic of the old format, which old `ldconfig`s write in front of the new one.
const OLD_MAGIC: &[u8] = b"ld.so-1.7.0";
/// The new format's header: magic and version (20), `nlibs`, `len_strings`, flags (4 bytes
/// with padding), `extension_offset`, three unused words.
const NEW_HEADER: usize = 48;
/// One new-format entry: flags, key, value, osversion (4 bytes each), hwcap (8).
const NEW_ENTRY: usize = 24;
/// The old format's header (magic, padded to 12, and `nlibs`) and entry (flags, key, value).
const OLD_HEADER: usize = 16;
const OLD_ENTRY: usize = 12;
/// The header's flags byte that says the cache was written big-endian.
const BIG_ENDIAN: u8 = 3;
/// The entry flags of a glibc (libc6) ELF library, in the low byte.
const FLAG_ELF_LIBC6: u32 = 0x0003;
/// The entry flags' architecture byte this build loads: x86-64 and AArch64 libraries carry
/// their own value there (32-bit libraries of a multilib system carry none); `None` accepts
/// any.
#[cfg(target_arch = "x86_64")]
const ARCH_FLAGS: Option<u32> = Some(0x0300);
#[cfg(target_arch = "aarch64")]
const ARCH_FLAGS: Option<u32> = Some(0x0a00);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const ARCH_FLAGS: Option<u32> = None;

/// How deep `include`s may nest (a file including itself stops here).
const MAX_INCLUDE_DEPTH: usize = 8;

/// One library the cache knows: its name (`libcuda.so.1`) and path, in the root's view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    /// The name a program asks for (the SONAME).
    pub name: String,
    /// The path the loader opens, absolute in the root's view.
    pub path: PathBuf,
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let end = at.checked_add(4)?;
    let b: [u8; 4] = bytes.get(at..end)?.try_into().ok()?;
    Some(u32::from_le_bytes(b))
}

/// The NUL-terminated string at `at`.
fn string_at(bytes: &[u8], at: usize) -> Option<String> {
    let rest = bytes.get(at..)?;
    let len = rest.iter().position(|b| *b == 0)?;
    std::str::from_utf8(rest.get(..len)?)
        .ok()
        .map(str::to_owned)
}

/// The libraries of this build's architecture in a loader cache, in the cache's order (the
/// order the loader tries them). Only the little-endian layout is read (x86-64 and AArch64).
pub fn parse_cache(bytes: &[u8]) -> Result<Vec<CacheEntry>, String> {
    let base = if bytes.starts_with(NEW_MAGIC) {
        0
    } else if bytes.starts_with(OLD_MAGIC) {
        // The new format follows the old one's entries, aligned to 8.
        let old = u32_at(bytes, OLD_MAGIC.len() + 1).ok_or("the old header is cut short")?;
        let end = usize::try_from(old)
            .ok()
            .and_then(|n| n.checked_mul(OLD_ENTRY))
            .and_then(|n| n.checked_add(OLD_HEADER))
            .and_then(|n| n.checked_next_multiple_of(8))
            .ok_or("the old header's library count is out of range")?;
        if !bytes.get(end..).is_some_and(|b| b.starts_with(NEW_MAGIC)) {
            return Err("only the old format (glibc before 2.2), which is not read".into());
        }
        end
    } else {
        return Err("not a loader cache (no glibc-ld.so.cache1.1 magic)".into());
    };
    let field = |offset: usize| {
        base.checked_add(offset)
            .and_then(|at| u32_at(bytes, at))
            .ok_or_else(|| "the header is cut short".to_owned())
    };
    let count = field(20)?;
    if bytes.get(base + 28) == Some(&BIG_ENDIAN) {
        return Err("a big-endian cache, which is not read".into());
    }
    let mut entries = Vec::new();
    for i in 0..count {
        let at = usize::try_from(i)
            .ok()
            .and_then(|i| i.checked_mul(NEW_ENTRY))
            .and_then(|o| o.checked_add(NEW_HEADER))
            .and_then(|o| o.checked_add(base))
            .ok_or("entry offset out of range")?;
        let word = |o: usize| {
            at.checked_add(o)
                .and_then(|p| u32_at(bytes, p))
                .ok_or_else(|| format!("entry {i} is cut short"))
        };
        let (flags, key, value) = (word(0)?, word(4)?, word(8)?);
        if flags & 0xff != FLAG_ELF_LIBC6 {
            continue;
        }
        if ARCH_FLAGS.is_some_and(|arch| flags & 0xff00 != arch) {
            continue;
        }
        let text = |offset: u32| {
            usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(base))
                .and_then(|o| string_at(bytes, o))
                .ok_or_else(|| format!("entry {i} names a string outside the cache"))
        };
        entries.push(CacheEntry {
            name: text(key)?,
            path: PathBuf::from(text(value)?),
        });
    }
    Ok(entries)
}

/// The loader cache of `root` (`<root>/etc/ld.so.cache`): empty when there is none; an
/// unreadable one is logged and read as empty (the folders are still searched).
pub fn read_cache(root: &Path) -> Vec<CacheEntry> {
    let path = root.join("etc/ld.so.cache");
    let Ok(bytes) = std::fs::read(&path) else {
        return Vec::new();
    };
    parse_cache(&bytes).unwrap_or_else(|err| {
        tracing::warn!(path = %path.display(), %err, "cannot read the loader cache");
        Vec::new()
    })
}

/// The folders `<root>/etc/ld.so.conf` names, following its `include`s (globs, relative to
/// the including file's folder, matched files in name order as `ldconfig` reads them), in
/// order, absolute in the root's view.
pub fn conf_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    read_conf(root, Path::new("/etc/ld.so.conf"), 0, &mut dirs);
    dirs
}

fn read_conf(root: &Path, file: &Path, depth: usize, dirs: &mut Vec<PathBuf>) {
    if depth > MAX_INCLUDE_DEPTH {
        return;
    }
    let Some(rel) = file.strip_prefix("/").ok() else {
        return;
    };
    let Ok(text) = std::fs::read_to_string(root.join(rel)) else {
        return;
    };
    let here = file.parent().unwrap_or(Path::new("/"));
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() || line.starts_with("hwcap") {
            continue;
        }
        if let Some(pattern) = line
            .strip_prefix("include")
            .filter(|r| r.starts_with(char::is_whitespace))
        {
            for pattern in pattern.split_whitespace() {
                let pattern = here.join(pattern);
                for included in glob_in(root, &pattern) {
                    read_conf(root, &included, depth + 1, dirs);
                }
            }
            continue;
        }
        // A folder, optionally `=TYPE` (a libc5-era suffix ldconfig still accepts).
        let dir = line.split('=').next().unwrap_or("").trim();
        if dir.starts_with('/') {
            let dir = PathBuf::from(dir);
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
    }
}

/// The files matching `pattern` (absolute in the root's view) under `root`, sorted, in the
/// root's view.
fn glob_in(root: &Path, pattern: &Path) -> Vec<PathBuf> {
    let Some(rel) = pattern.strip_prefix("/").ok().and_then(Path::to_str) else {
        return Vec::new();
    };
    let root_text = glob::Pattern::escape(&root.display().to_string());
    let full = format!("{}/{rel}", root_text.trim_end_matches('/'));
    let Ok(paths) = glob::glob(&full) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = paths
        .flatten()
        .filter(|p| p.is_file())
        .filter_map(|p| p.strip_prefix(root).ok().map(|r| Path::new("/").join(r)))
        .collect();
    found.sort();
    found
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// This build's entry flags for a library (`FLAG_ELF_LIBC6` plus its architecture).
    pub(crate) fn native_flags() -> u32 {
        FLAG_ELF_LIBC6 | ARCH_FLAGS.unwrap_or(0)
    }

    /// A loader cache in the new format, as `ldconfig` writes it: `(name, path, flags)`.
    pub(crate) fn cache_bytes(entries: &[(&str, &str, u32)]) -> Vec<u8> {
        let mut strings = Vec::new();
        let strings_at = NEW_HEADER + NEW_ENTRY * entries.len();
        let mut table = Vec::new();
        for (name, path, flags) in entries {
            let key = strings_at + strings.len();
            strings.extend_from_slice(name.as_bytes());
            strings.push(0);
            let value = strings_at + strings.len();
            strings.extend_from_slice(path.as_bytes());
            strings.push(0);
            table.extend_from_slice(&flags.to_le_bytes());
            table.extend_from_slice(&(key as u32).to_le_bytes());
            table.extend_from_slice(&(value as u32).to_le_bytes());
            table.extend_from_slice(&0u32.to_le_bytes());
            table.extend_from_slice(&0u64.to_le_bytes());
        }
        let mut out = NEW_MAGIC.to_vec();
        out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        out.extend_from_slice(&(strings.len() as u32).to_le_bytes());
        out.extend_from_slice(&[2, 0, 0, 0]); // little-endian
        out.extend_from_slice(&0u32.to_le_bytes()); // no extension
        out.extend_from_slice(&[0; 12]);
        assert_eq!(out.len(), NEW_HEADER);
        out.extend(table);
        out.extend(strings);
        out
    }

    #[test]
    fn a_cache_lists_this_architectures_libraries_in_order() {
        let bytes = cache_bytes(&[
            (
                "libcuda.so.1",
                "/usr/lib/i386-linux-gnu/libcuda.so.1",
                0x0003,
            ),
            (
                "libcuda.so.1",
                "/usr/local/nvidia/lib64/libcuda.so.1",
                native_flags(),
            ),
            (
                "libc.so.6",
                "/lib/x86_64-linux-gnu/libc.so.6",
                native_flags(),
            ),
        ]);
        let entries = parse_cache(&bytes).unwrap();
        let want = |n: &str, p: &str| CacheEntry {
            name: n.into(),
            path: p.into(),
        };
        let mut expected = vec![
            want("libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1"),
            want("libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6"),
        ];
        if ARCH_FLAGS.is_none() {
            expected.insert(
                0,
                want("libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1"),
            );
        }
        assert_eq!(entries, expected);
    }

    #[test]
    fn the_new_format_behind_the_old_one_is_found() {
        let new = cache_bytes(&[("libcuda.so.1", "/usr/lib64/libcuda.so.1", native_flags())]);
        // Two old entries: 16 + 24 = 40 bytes, aligned to 40.
        let mut bytes = OLD_MAGIC.to_vec();
        bytes.push(0);
        bytes.extend_from_slice(&2u32.to_le_bytes());
        bytes.extend_from_slice(&[0; 2 * OLD_ENTRY]);
        bytes.extend(new);
        let entries = parse_cache(&bytes).unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].path, Path::new("/usr/lib64/libcuda.so.1"));
    }

    #[test]
    fn a_broken_cache_is_an_error_not_a_panic() {
        assert!(parse_cache(b"").is_err());
        assert!(parse_cache(b"something else entirely").is_err());
        let good = cache_bytes(&[("libcuda.so.1", "/usr/lib64/libcuda.so.1", native_flags())]);
        for cut in [10, 30, NEW_HEADER + 5, good.len() - 3] {
            assert!(parse_cache(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut wild = good.clone();
        wild[NEW_HEADER + 4..NEW_HEADER + 8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_cache(&wild).is_err());
        let mut many = good;
        many[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_cache(&many).is_err());
    }

    /// The cache of the machine the tests run on, where it has one: glibc's own `ldconfig`
    /// wrote it, so the parser meets the real layout.
    #[test]
    fn this_machines_cache_lists_its_libc() {
        let Ok(bytes) = std::fs::read("/etc/ld.so.cache") else {
            return;
        };
        let entries = parse_cache(&bytes).unwrap();
        assert!(
            entries
                .iter()
                .any(|e| e.name == "libc.so.6" && std::fs::metadata(&e.path).is_ok()),
            "{entries:?}"
        );
    }

    #[test]
    fn the_configured_folders_follow_includes_in_name_order() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let etc = root.join("etc");
        std::fs::create_dir_all(etc.join("ld.so.conf.d")).unwrap();
        std::fs::write(
            etc.join("ld.so.conf"),
            "# the loader's folders\ninclude /etc/ld.so.conf.d/*.conf\n/opt/extra/lib=libc6\n",
        )
        .unwrap();
        std::fs::write(
            etc.join("ld.so.conf.d/x86_64-linux-gnu.conf"),
            "/usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu\n",
        )
        .unwrap();
        std::fs::write(
            etc.join("ld.so.conf.d/000-nvidia.conf"),
            "/usr/local/nvidia/lib64   # the driver\nhwcap 0 nosegneg\ninclude more/*.conf\n",
        )
        .unwrap();
        std::fs::create_dir_all(etc.join("ld.so.conf.d/more")).unwrap();
        std::fs::write(etc.join("ld.so.conf.d/more/a.conf"), "/usr/lib/wsl/lib\n").unwrap();
        // A loop ends at the nesting limit.
        std::fs::write(etc.join("ld.so.conf.d/more/b.conf"), "include b.conf\n").unwrap();
        std::fs::write(etc.join("ld.so.conf.d/README"), "/not/a/conf\n").unwrap();
        assert_eq!(
            conf_dirs(root),
            [
                "/usr/local/nvidia/lib64",
                "/usr/lib/wsl/lib",
                "/usr/local/lib/x86_64-linux-gnu",
                "/lib/x86_64-linux-gnu",
                "/opt/extra/lib",
            ]
            .map(PathBuf::from)
        );
        assert!(conf_dirs(&root.join("nowhere")).is_empty());
    }
}
