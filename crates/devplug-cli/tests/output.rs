//! What the `devplug` binary writes: plain logs when stderr is not a terminal, each OS error
//! once, config errors with their path, no panic when the reader of stdout goes away, and the
//! version, completions and man page.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod support;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;
use support::{Devplug, BIN};

const WAIT: Duration = Duration::from_secs(10);
const OK_CONFIG: &str = "resources:\n  - name: example.com/npu\n    virtual: { count: 2 }\n";

fn devplug(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[tokio::test]
async fn logs_to_a_pipe_have_no_colour_codes() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(dir.path(), "config.yaml", OK_CONFIG);
    // No kubelet: devplug logs that it runs and waits; SIGTERM ends it.
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir(&plugins).unwrap();
    let run = Devplug::run(Path::new(&config), &plugins);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, stderr) = run.terminate(WAIT).await;
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("INFO"), "{stderr}");
    assert!(
        !stderr.contains("\x1b["),
        "ANSI codes in a piped log: {stderr:?}"
    );
}

#[test]
fn an_os_error_is_printed_once() {
    let out = devplug(&["check-config", "--config", "/nonexistent/devplug.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("cannot read config file /nonexistent/devplug.yaml: "),
        "{stderr}"
    );
    assert_eq!(stderr.matches("(os error 2)").count(), 1, "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

#[test]
fn every_resource_with_a_problem_is_reported_and_json_logs_keep_the_snippet_apart() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(
        dir.path(),
        "two.yaml",
        "resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n  - name: a.com/x\n    virtual: { count: 1 }\n  - name: bad\n    virtual: { count: 1 }\n",
    );
    let out = devplug(&["check-config", "--config", &path]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(": 2 problems:"), "{stderr}");
    assert!(
        stderr.contains("resources[1] (a.com/x): name: this resource is listed twice"),
        "{stderr}"
    );
    assert!(stderr.contains("resources[2] (bad): name: "), "{stderr}");

    let path = write(
        dir.path(),
        "parse.yaml",
        "resources:\n  - name: a.com/x\n    virtual: { count: -3 }\n",
    );
    let kubelet_dir = dir.path().to_str().unwrap();
    let out = devplug(&[
        "--log-format",
        "json",
        "run",
        "--config",
        &path,
        "--kubelet-dir",
        kubelet_dir,
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "one JSON line: {stderr}");
    let line: serde_json::Value = serde_json::from_str(&stderr).unwrap();
    assert_eq!(line["level"], "ERROR", "{line}");
    let message = line["fields"]["message"].as_str().unwrap();
    assert!(message.contains("resources[0].virtual.count"), "{line}");
    assert!(!message.contains('\n'), "{line}");
    let snippet = line["fields"]["snippet"].as_str().unwrap();
    assert!(snippet.contains("3 |     virtual: { count: -3 }"), "{line}");
}

#[test]
fn config_errors_name_the_path_the_range_and_the_shape() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n  - name: a.com/y\n    virtual: { count: many }\n",
            "resources[1].virtual.count: line 5 column 23: expected a whole number of 0 or more",
        ),
        (
            "resources:\n  - name: a.com/x\n    virtual: { count: -3 }\n",
            "expected a whole number of 0 or more (no sign, no fraction)",
        ),
        (
            "resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n    health_hold_down: 18446744073709551615s\n",
            "resources[0] (a.com/x): health_hold_down: must be between 0s and 1h, got 18446744073709551615s",
        ),
        (
            "resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n    health_hold_down: 300000000000000000m\n",
            "health_hold_down: must be between 0s and 1h",
        ),
        (
            "name: a.com/x\nvirtual: { count: 1 }\n",
            "hint: this looks like one resource; put it in the list under `resources:`",
        ),
        (
            "- name: a.com/x\n  virtual: { count: 1 }\n",
            "hint: this is a list of resources",
        ),
    ];
    for (config, needle) in cases {
        let path = write(dir.path(), "bad.yaml", config);
        let kubelet_dir = dir.path().to_str().unwrap();
        for args in [
            &["check-config", "--config", &path][..],
            &["run", "--config", &path, "--kubelet-dir", kubelet_dir],
        ] {
            let out = devplug(args);
            let command = args[0];
            let stderr = text(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{command} {config:?}: {stderr}");
            assert!(
                stderr.contains(needle),
                "{command}: {stderr:?} should contain {needle:?}"
            );
        }
    }
    // The snippet under a parse error names the file, not the parser's `<input>`.
    let path = write(
        dir.path(),
        "snippet.yaml",
        "resources:\n  - name: a.com/x\n    virtual: { count: -3 }\n",
    );
    let stderr = text(&devplug(&["check-config", "--config", &path]).stderr);
    assert!(stderr.contains(&format!("--> {path}:3:")), "{stderr}");
    assert!(!stderr.contains("<input>"), "{stderr}");
    // `h` is a unit, and an hour is the most a hold-down may be.
    let path = write(
        dir.path(),
        "ok.yaml",
        "resources:\n  - name: a.com/x\n    virtual: { count: 1 }\n    health_hold_down: 1h\n",
    );
    let out = devplug(&["check-config", "--config", &path]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

/// Runs `devplug args` with a stdout whose reader is already gone.
fn with_closed_stdout(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let child = Command::new(BIN)
        .args(args)
        .stdout(writer)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn a_closed_stdout_ends_with_status_1_and_no_panic() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(dir.path(), "config.yaml", OK_CONFIG);
    for args in [
        &["check-config", "--config", &config][..],
        &["demo"],
        &["completions", "bash"],
        &["man"],
    ] {
        let out = with_closed_stdout(args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(!stderr.contains("Broken pipe"), "{args:?}: {stderr}");
    }
}

#[test]
fn version_names_the_commit_when_built_from_git() {
    let out = devplug(&["--version"]);
    assert!(out.status.success());
    let version = text(&out.stdout);
    let crate_version = env!("CARGO_PKG_VERSION");
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| text(&o.stdout).trim().to_owned());
    let expected = match commit {
        Some(commit) => format!("devplug {crate_version} ({commit})\n"),
        None => format!("devplug {crate_version}\n"),
    };
    assert_eq!(version, expected);
    // Subcommands say the same.
    let sub = devplug(&["check-config", "--version"]);
    assert_eq!(
        text(&sub.stdout),
        expected.replace("devplug ", "devplug-check-config ")
    );
}

#[test]
fn completions_for_every_shell_know_the_subcommands() {
    for (shell, marker) in [
        ("bash", "complete -F _devplug"),
        ("zsh", "#compdef devplug"),
        ("fish", "complete -c devplug"),
        ("elvish", "edit:completion:arg-completer[devplug]"),
        ("powershell", "Register-ArgumentCompleter"),
    ] {
        let out = devplug(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {}", text(&out.stderr));
        let script = text(&out.stdout);
        assert!(script.contains(marker), "{shell}: no {marker:?}");
        for word in ["check-config", "inspect", "metrics-addr", "kubelet-dir"] {
            assert!(script.contains(word), "{shell} completion lacks {word}");
        }
    }
    assert_eq!(devplug(&["completions", "tcsh"]).status.code(), Some(2));
}

#[test]
fn the_man_page_is_roff_generated_from_the_options() {
    let out = devplug(&["man"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let page = text(&out.stdout);
    assert!(page.contains(".TH devplug 1"), "{page}");
    for needle in [
        ".SH NAME",
        ".SH SYNOPSIS",
        "\\-\\-log\\-format",
        "check\\-config",
        "DEVPLUG_LOG_FORMAT",
    ] {
        assert!(page.contains(needle), "man page lacks {needle:?}:\n{page}");
    }
}

#[test]
fn every_page_the_man_page_names_is_written_and_run_has_the_config_format() {
    let dir = tempfile::tempdir().unwrap();
    let out = devplug(&["man", "--dir", dir.path().to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let written = text(&out.stdout);
    let main = std::fs::read_to_string(dir.path().join("devplug.1")).unwrap();
    // Every `devplug-<command>(1)` the main page refers to is there.
    let named: Vec<&str> = main
        .split_whitespace()
        .filter_map(|w| w.strip_suffix("(1)"))
        .collect();
    assert!(named.contains(&"devplug\\-run"), "{main}");
    for page in named {
        let file = format!("{}.1", page.replace("\\-", "-"));
        assert!(
            dir.path().join(&file).is_file(),
            "{file} not written: {written}"
        );
        assert!(
            written.lines().any(|l| l == file),
            "{file} not listed: {written}"
        );
    }
    let run = std::fs::read_to_string(dir.path().join("devplug-run.1")).unwrap();
    assert!(run.contains(".SH \"CONFIG FILE\"\n.nf\n"), "{run}");
    assert!(!run.contains(".SH EXTRA"), "{run}");
}

#[test]
fn the_config_format_in_run_help_is_a_valid_config() {
    let help = text(&devplug(&["run", "--help"]).stdout);
    let from = help
        .find("  registration:")
        .expect("the format in run --help");
    let to = help.find("Every backend").unwrap();
    let yaml: String = help[from..to]
        .lines()
        .map(|l| l.split(" #").next().unwrap().trim_end())
        .filter(|l| !l.trim().is_empty())
        .map(|l| format!("{}\n", l.strip_prefix("  ").unwrap_or(l)))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "config.yaml", &yaml);
    let out = devplug(&["check-config", "--config", &file]);
    assert!(out.status.success(), "{yaml}\n{}", text(&out.stderr));
}

#[test]
fn command_line_durations_are_bounded_too() {
    let out = devplug(&["inspect", "--timeout", "18446744073709551615"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("--timeout"), "{stderr}");
    assert!(stderr.contains("1..=3600"), "{stderr}");
}
