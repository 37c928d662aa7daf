//! deploy/systemd/install, run as an operator runs it, into a folder (`--root`) with a
//! `systemctl` on PATH that writes down what it was asked: a first install puts the binary, the
//! unit and the config in place and enables the unit; the same command with a new binary is
//! the upgrade (the binary replaced, the config kept); `--uninstall` removes the unit and the
//! binary, `--purge` the config too; a missing source or config is refused with the fix. Its
//! `--archive` route (containerd's `ctr`) runs on the whole node (crates/devplug-testkit).
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
    let left: Vec<_> = std::fs::read_dir(s.root().join("usr/local/bin"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["devplug"], "no temporary file left");

    // Removal keeps the config; --purge removes it.
    ok(&s.install(&["--uninstall"]));
    assert!(!bin.exists());
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
