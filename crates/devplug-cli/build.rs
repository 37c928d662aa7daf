//! Sets `DEVPLUG_VERSION` for `devplug --version`: the crate version, followed by the commit when
//! built from a git checkout (`0.1.0 (1a2b3c4)`), or by `DEVPLUG_GIT_COMMIT` when that is set
//! (image builds whose context has no `.git`). Reruns only when HEAD or the branch it points at
//! moves, not on every build.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs git in `dir`; its trimmed stdout, or `None` if git is missing or fails.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(dir)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

fn main() {
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DEVPLUG_GIT_COMMIT");

    let given = std::env::var("DEVPLUG_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty());
    let commit = given.or_else(|| {
        let commit = git(&dir, &["rev-parse", "--short", "HEAD"])?;
        // Rebuild when HEAD moves (checkout) or the branch it names moves (commit). In a
        // worktree HEAD is per worktree and the branch is in the common folder: `--git-path`
        // knows both. Only existing files: a missing one would rerun the script every build.
        let mut watched = vec!["HEAD".to_owned(), "packed-refs".to_owned()];
        if let Some(branch) = git(&dir, &["symbolic-ref", "-q", "HEAD"]) {
            watched.push(branch);
        }
        for name in watched {
            if let Some(path) = git(&dir, &["rev-parse", "--git-path", &name]) {
                let path = dir.join(path);
                if path.exists() {
                    println!("cargo:rerun-if-changed={}", path.display());
                }
            }
        }
        Some(commit)
    });
    let full = match commit {
        Some(commit) => format!("{version} ({commit})"),
        None => version,
    };
    println!("cargo:rustc-env=DEVPLUG_VERSION={full}");
}
