//! deploy/systemd/install, run as an operator runs it, into a folder (`--root`) with a
//! `systemctl` on PATH that writes down what it was asked: a first install puts the binary, the
//! unit and the config in place and enables the unit; the same command with a new binary is
//! the upgrade (the binary replaced, the config kept); `--uninstall` removes the unit and the
//! binary, `--purge` the config too; a missing source or config is refused with the fix. An
//! upgrade whose new binary refuses the config in force (a new one or the one kept) changes
//! nothing on the node; `--rollback` puts back the pair an upgrade replaced; `--sha256` refuses
//! a binary with another hash. Its `--archive` route (containerd's `ctr`) runs on the whole node
//! (crates/devplug-testkit).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use deploy_check::repo_root;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

struct Setup {
    dir: tempfile::TempDir,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("bin")).unwrap();
        // systemctl: writes its arguments down.
        script(
            &dir.path().join("bin/systemctl"),
            &format!(
                "#!/bin/sh\necho \"$*\" >> {}\n",
                dir.path().join("systemctl.log").display()
            ),
        );
        std::fs::write(dir.path().join("config.yaml"), "resources: []\n").unwrap();
        Setup { dir }
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    /// A stand-in devplug binary saying `version`, whose check-config accepts any file.
    fn binary(&self, version: &str) -> PathBuf {
        let path = self.dir.path().join(format!("devplug-{version}"));
        script(
            &path,
            &format!(
                "#!/bin/sh\ncase \"$1\" in --version) echo 'devplug-lite {version}' ;; check-config) exit 0 ;; esac\n"
            ),
        );
        path
    }

    /// A stand-in devplug binary saying `version`, whose check-config refuses (exit 1, the reason
    /// on stderr) a config containing `refused`, as a release that dropped a field would.
    fn binary_refusing(&self, version: &str, refused: &str) -> PathBuf {
        let path = self.dir.path().join(format!("devplug-{version}"));
        script(
            &path,
            &format!(
                "#!/bin/sh\ncase \"$1\" in\n--version) echo 'devplug-lite {version}' ;;\n\
                 check-config)\n  [ \"$2\" = --config ] || exit 2\n  \
                 if grep -q '{refused}' \"$3\"; then echo \"$3: unknown field {refused}\" >&2; exit 1; fi ;;\n\
                 esac\n"
            ),
        );
        path
    }

    /// A config file named `name` in the test's folder (outside the root).
    fn config(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Every file under the root with its bytes, and what systemctl was asked: all that an
    /// install can change.
    fn snapshot(&self) -> (Vec<(PathBuf, Vec<u8>)>, String) {
        fn walk(dir: &Path, into: &mut Vec<(PathBuf, Vec<u8>)>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for entry in entries {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    walk(&path, into);
                } else {
                    into.push((path.clone(), std::fs::read(&path).unwrap()));
                }
            }
        }
        let mut files = Vec::new();
        walk(&self.root(), &mut files);
        files.sort();
        (files, self.systemctl_calls())
    }

    fn install(&self, args: &[&str]) -> Output {
        let path = format!(
            "{}:{}",
            self.dir.path().join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        Command::new(repo_root().join("deploy/systemd/install"))
            .args(["--root", self.root().to_str().unwrap()])
            .args(args)
            .env("PATH", path)
            .output()
            .unwrap()
    }

    fn systemctl_calls(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("systemctl.log")).unwrap_or_default()
    }

    fn read(&self, path: &str) -> String {
        std::fs::read_to_string(self.root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
    }
}

fn script(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The output of a run that must fail: what it said on stderr.
fn refused(output: &Output) -> String {
    let said = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        !output.status.success(),
        "install succeeded: {}{said}",
        String::from_utf8_lossy(&output.stdout)
    );
    said
}

fn sha256(file: &Path) -> String {
    let out = Command::new("sha256sum").arg(file).output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

fn ok(output: &Output) -> String {
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "install failed: {said}");
    said
}

#[test]
fn install_upgrade_and_removal() {
    let s = Setup::new();
    let config = s.dir.path().join("config.yaml");
    let v1 = s.binary("1.0.0");
    let said = ok(&s.install(&[
        "--binary",
        v1.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ]));
    assert!(said.contains("devplug-lite 1.0.0"), "{said}");
    let bin = s.root().join("usr/local/bin/devplug");
    assert_eq!(
        std::fs::metadata(&bin).unwrap().permissions().mode() & 0o777,
        0o755
    );
    assert!(s.read("usr/local/bin/devplug").contains("1.0.0"));
    assert_eq!(s.read("etc/devplug/config.yaml"), "resources: []\n");
    let unit = s.read("etc/systemd/system/devplug.service");
    assert_eq!(
        unit,
        std::fs::read_to_string(repo_root().join("deploy/systemd/devplug.service")).unwrap()
    );
    assert!(
        unit.lines().any(|l| l
            == "ExecStart=/usr/local/bin/devplug run --config /etc/devplug/config.yaml --kubelet-dir /var/lib/kubelet/device-plugins"),
        "{unit}"
    );
    assert!(unit.contains("Before=kubelet.service"));
    assert_eq!(
        s.systemctl_calls(),
        format!("--root={} enable devplug.service\n", s.root().display())
    );

    // The upgrade: the same command with the new binary, no --config: the config stays.
    std::fs::write(s.root().join("etc/devplug/config.yaml"), "edited\n").unwrap();
    let v2 = s.binary("2.0.0");
    let said = ok(&s.install(&["--binary", v2.to_str().unwrap()]));
    assert!(said.contains("devplug-lite 2.0.0"), "{said}");
    assert!(s.read("usr/local/bin/devplug").contains("2.0.0"));
    assert_eq!(s.read("etc/devplug/config.yaml"), "edited\n");
    // The pair replaced is kept for --rollback: the old binary, the config it ran with.
    assert!(s.read("usr/local/bin/devplug.previous").contains("1.0.0"));
    assert_eq!(s.read("etc/devplug/config.yaml.previous"), "edited\n");
    for (dir, files) in [
        ("usr/local/bin", ["devplug", "devplug.previous"]),
        ("etc/devplug", ["config.yaml", "config.yaml.previous"]),
    ] {
        let mut left: Vec<_> = std::fs::read_dir(s.root().join(dir))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        left.sort();
        assert_eq!(left, files, "no temporary file left in {dir}");
    }

    // Removal keeps the config; --purge removes it.
    ok(&s.install(&["--uninstall"]));
    assert!(!bin.exists());
    assert!(!s.root().join("usr/local/bin/devplug.previous").exists());
    assert!(!s.root().join("etc/systemd/system/devplug.service").exists());
    assert!(s.root().join("etc/devplug/config.yaml").exists());
    assert!(s.systemctl_calls().ends_with(&format!(
        "--root={} disable devplug.service\n",
        s.root().display()
    )));
    ok(&s.install(&["--uninstall", "--purge"]));
    assert!(!s.root().join("etc/devplug").exists());
}

#[test]
fn a_missing_source_or_config_is_refused_with_the_fix() {
    let s = Setup::new();
    let out = s.install(&[]);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("give one of --image, --archive or --binary"),
        "{said}"
    );

    let v1 = s.binary("1.0.0");
    let out = s.install(&["--binary", v1.to_str().unwrap()]);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("no config: give --config FILE"), "{said}");
    assert!(!s.root().join("usr/local/bin/devplug").exists());

    // A binary that does not run is not put in place.
    let broken = s.dir.path().join("broken");
    script(&broken, "#!/bin/sh\nexit 1\n");
    let config = s.dir.path().join("config.yaml");
    let out = s.install(&[
        "--binary",
        broken.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(!s.root().join("usr/local/bin/devplug").exists());
}

#[test]
fn an_upgrade_with_a_config_the_new_binary_refuses_changes_nothing() {
    let s = Setup::new();
    let good = s.config("good.yaml", "resources: []\n");
    let v1 = s.binary("1.0.0");
    ok(&s.install(&["--binary", path(&v1), "--config", path(&good)]));
    let before = s.snapshot();

    let bad = s.config("bad.yaml", "resources: []\nlegacy: true\n");
    let v2 = s.binary_refusing("2.0.0", "legacy");
    let said = refused(&s.install(&["--binary", path(&v2), "--config", path(&bad)]));
    assert!(
        said.contains("unknown field legacy"),
        "check-config's reason shown: {said}"
    );
    assert!(
        said.contains("check 2 of 2 failed: the new binary (devplug-lite 2.0.0) refuses"),
        "{said}"
    );
    assert!(said.contains("Nothing was changed"), "{said}");
    assert!(
        said.contains(&format!(
            "Fix: correct {} and run the same command again",
            path(&bad)
        )),
        "{said}"
    );
    // The old binary and config byte for byte, the unit, no previous pair, no temporary file,
    // and systemctl not asked anything more.
    assert_eq!(s.snapshot(), before);
    assert!(s.read("usr/local/bin/devplug").contains("1.0.0"));
    assert_eq!(s.read("etc/devplug/config.yaml"), "resources: []\n");

    // A new binary that does not run: the same.
    let broken = s.dir.path().join("broken");
    script(&broken, "#!/bin/sh\nexit 1\n");
    let said = refused(&s.install(&["--binary", path(&broken), "--config", path(&good)]));
    assert!(
        said.contains("check 1 of 2 failed: the new binary does not run on this node"),
        "{said}"
    );
    assert_eq!(s.snapshot(), before);
}

#[test]
fn an_upgrade_whose_binary_refuses_the_config_in_place_changes_nothing() {
    let s = Setup::new();
    // The config in place has a field the next release dropped.
    let old = s.config("old.yaml", "resources: []\nlegacy: true\n");
    let v1 = s.binary("1.0.0");
    ok(&s.install(&["--binary", path(&v1), "--config", path(&old)]));
    let before = s.snapshot();

    // The upgrade without --config checks the new binary with the config kept.
    let v2 = s.binary_refusing("2.0.0", "legacy");
    let said = refused(&s.install(&["--binary", path(&v2)]));
    let in_place = s.root().join("etc/devplug/config.yaml");
    assert!(
        said.contains(&format!(
            "check 2 of 2 failed: the new binary (devplug-lite 2.0.0) refuses {}",
            path(&in_place)
        )),
        "{said}"
    );
    assert!(
        said.contains(
            "Fix: run the same command with --config FILE, a config this version accepts"
        ),
        "{said}"
    );
    assert_eq!(s.snapshot(), before);

    // Given a config it accepts, the same upgrade goes through.
    let new = s.config("new.yaml", "resources: []\n");
    ok(&s.install(&["--binary", path(&v2), "--config", path(&new)]));
    assert!(s.read("usr/local/bin/devplug").contains("2.0.0"));
    assert_eq!(s.read("etc/devplug/config.yaml"), "resources: []\n");
}

#[test]
fn rollback_puts_the_previous_binary_and_config_back() {
    let s = Setup::new();
    // Nothing to roll back to after a first install.
    let c1 = s.config("c1.yaml", "resources: []\n# one\n");
    let v1 = s.binary("1.0.0");
    ok(&s.install(&["--binary", path(&v1), "--config", path(&c1)]));
    let first = s.snapshot();
    let said = refused(&s.install(&["--rollback"]));
    assert!(said.contains("nothing to roll back to"), "{said}");
    assert_eq!(s.snapshot(), first);

    // The upgrade keeps the pair it replaces.
    let c2 = s.config("c2.yaml", "resources: []\n# two\n");
    let v2 = s.binary("2.0.0");
    ok(&s.install(&["--binary", path(&v2), "--config", path(&c2)]));
    assert!(s.read("usr/local/bin/devplug.previous").contains("1.0.0"));
    assert_eq!(
        s.read("etc/devplug/config.yaml.previous"),
        "resources: []\n# one\n"
    );
    // The same command again (configuration management rerunning it) keeps that pair.
    ok(&s.install(&["--binary", path(&v2), "--config", path(&c2)]));
    ok(&s.install(&["--binary", path(&v2)]));
    assert!(s.read("usr/local/bin/devplug.previous").contains("1.0.0"));
    assert_eq!(
        s.read("etc/devplug/config.yaml.previous"),
        "resources: []\n# one\n"
    );
    let upgraded = s.snapshot();

    // --rollback: the first pair in force again, the second kept as the previous one.
    let said = ok(&s.install(&["--rollback"]));
    assert!(said.contains("rolled back to devplug-lite 1.0.0"), "{said}");
    assert_eq!(
        std::fs::read(s.root().join("usr/local/bin/devplug")).unwrap(),
        std::fs::read(&v1).unwrap()
    );
    assert_eq!(
        std::fs::metadata(s.root().join("usr/local/bin/devplug"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o755
    );
    assert_eq!(s.read("etc/devplug/config.yaml"), "resources: []\n# one\n");
    assert!(s.read("usr/local/bin/devplug.previous").contains("2.0.0"));
    assert_eq!(
        s.read("etc/devplug/config.yaml.previous"),
        "resources: []\n# two\n"
    );
    // A second --rollback undoes the first: everything as after the upgrade.
    ok(&s.install(&["--rollback"]));
    assert_eq!(s.snapshot().0, upgraded.0);

    // --rollback takes no source; a previous binary that refuses its config is not put back.
    let said = refused(&s.install(&["--rollback", "--binary", path(&v1)]));
    assert!(said.contains("--rollback takes no"), "{said}");
    std::fs::write(
        s.root().join("etc/devplug/config.yaml.previous"),
        "resources: []\nlegacy: true\n",
    )
    .unwrap();
    let v0 = s.binary_refusing("0.9.0", "legacy");
    std::fs::copy(&v0, s.root().join("usr/local/bin/devplug.previous")).unwrap();
    let before = s.snapshot();
    let said = refused(&s.install(&["--rollback"]));
    assert!(
        said.contains("check 2 of 2 failed: the previous binary (devplug-lite 0.9.0) refuses"),
        "{said}"
    );
    assert_eq!(s.snapshot(), before);

    // --uninstall removes the previous binary too, and keeps the configs.
    ok(&s.install(&["--uninstall"]));
    assert!(!s.root().join("usr/local/bin/devplug").exists());
    assert!(!s.root().join("usr/local/bin/devplug.previous").exists());
    assert!(s.root().join("etc/devplug/config.yaml.previous").exists());
    ok(&s.install(&["--uninstall", "--purge"]));
    assert!(!s.root().join("etc/devplug").exists());
}

#[test]
fn sha256_refuses_another_binary() {
    let s = Setup::new();
    let config = s.config("config.yaml", "resources: []\n");
    let v1 = s.binary("1.0.0");
    let v2 = s.binary("2.0.0");
    let (sum1, sum2) = (sha256(&v1), sha256(&v2));
    assert_ne!(sum1, sum2);

    let said = refused(&s.install(&[
        "--binary",
        path(&v2),
        "--config",
        path(&config),
        "--sha256",
        &sum1,
    ]));
    assert!(
        said.contains(&format!("has sha256 {sum2}, --sha256 says {sum1}")),
        "both hashes named: {said}"
    );
    assert_eq!(
        s.snapshot(),
        (Vec::new(), String::new()),
        "nothing installed"
    );
    let said = refused(&s.install(&["--binary", path(&v2), "--sha256", "abc"]));
    assert!(said.contains("not a sha256"), "{said}");

    // The right one, in capitals as some publish it, is taken.
    let said = ok(&s.install(&[
        "--binary",
        path(&v2),
        "--config",
        path(&config),
        "--sha256",
        &sum2.to_uppercase(),
    ]));
    assert!(said.contains("devplug-lite 2.0.0"), "{said}");
    assert_eq!(sha256(&s.root().join("usr/local/bin/devplug")), sum2);
}

#[test]
fn help_is_the_comment_at_the_top_and_nothing_after_it() {
    let script = std::fs::read_to_string(repo_root().join("deploy/systemd/install")).unwrap();
    let header: Vec<&str> = script
        .lines()
        .skip(1)
        .take_while(|l| l.starts_with('#'))
        .map(|l| l.strip_prefix("# ").unwrap_or(l.trim_start_matches('#')))
        .collect();
    let s = Setup::new();
    let help = ok(&s.install(&["--help"]));
    assert_eq!(help.lines().collect::<Vec<_>>(), header);
    for word in [
        "--rollback",
        "--sha256",
        "devplug.previous",
        "config.yaml.previous",
    ] {
        assert!(help.contains(word), "--help names {word}: {help}");
    }
}
