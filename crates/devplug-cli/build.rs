//! Sets `DEVPLUG_VERSION` for `devplug --version`: the crate version, followed by the commit when
//! built from a git checkout (`0.1.0 (1a2b3c4)`), or by `DEVPLUG_GIT_COMMIT` when that is set
//! (image builds whose context has no `.git`). Reruns only when HEAD or the branch it points at
//! moves, not on every build.
//!
//! Also links the `devplug` binary with packed relative relocations where they work (see
//! [`pack_relocations`]), and marks the tests that need an API server, the rendered Helm chart
//! or promtool as ignored where those are missing (see the test-gates crate).

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

/// Packed relative relocations (`-z pack-relative-relocs`, DT_RELR): at every start the loader
/// (or a static-pie's own start code) reads a few KB instead of ~350 KB of `.rela.dyn`, which is
/// 0.3 MiB less resident memory (docs/benchmarks.md, "Memory"), and the binary stays
/// position-independent (ASLR). Used only if a probe program, built by this rustc for this
/// target with the flag, links and runs: the linker must know the flag and the C library must
/// apply such relocations (glibc 2.36+, musl 1.2.4+). Skipped when cross-compiling to another
/// architecture (the probe cannot run). `DEVPLUG_NO_RELR=1` turns it off.
fn pack_relocations() {
    println!("cargo:rerun-if-env-changed=DEVPLUG_NO_RELR");
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let (host, target) = (var("HOST"), var("TARGET"));
    let same_arch = host.split('-').next() == target.split('-').next();
    if var("DEVPLUG_NO_RELR") == "1" || var("CARGO_CFG_TARGET_OS") != "linux" || !same_arch {
        return;
    }
    let out = PathBuf::from(var("OUT_DIR"));
    let source = out.join("relr_probe.rs");
    let probe = out.join("relr_probe");
    if std::fs::write(&source, "fn main() {}\n").is_err() {
        return;
    }
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let mut build = Command::new(rustc);
    build
        .arg("--target")
        .arg(&target)
        .args(["-C", "link-arg=-Wl,-z,pack-relative-relocs", "-o"])
        .arg(&probe)
        .arg(&source);
    if let Ok(linker) = std::env::var("RUSTC_LINKER") {
        build.arg("-C").arg(format!("linker={linker}"));
    }
    let linked = build.output().is_ok_and(|o| o.status.success());
    if linked && Command::new(&probe).status().is_ok_and(|s| s.success()) {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

fn main() {
    test_gates::gate(&[
        test_gates::API_SERVER,
        test_gates::HELM_RENDERED,
        test_gates::PROMTOOL,
    ]);
    pack_relocations();
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
