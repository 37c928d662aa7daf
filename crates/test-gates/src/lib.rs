//! Honest test counts for tests that need what a fresh clone lacks.
//!
//! libtest cannot mark a test ignored while it runs, and a test that returns early when its
//! API server is missing is counted as passed. So a crate's build script calls [`gate`] for each
//! such need; where the need is not met, it sets a cfg, and each test that has the need carries
//! `#[cfg_attr(<cfg>, ignore = "<reason>")]`: `cargo test` then reports it as ignored, with the
//! reason, and `--include-ignored` runs it (and it fails). Where the `require` variable is set
//! (CI), the cfg is never set: the tests run, and fail when what they need is missing.
//!
//! The gates of this workspace (one place, so the build scripts and tests agree on the names):
//!
//! | cfg | set when | tests |
//! |---|---|---|
//! | `no_api_server` | `KUBEBUILDER_ASSETS` is unset and `DEVPLUG_REQUIRE_API_SERVER` too | those that start etcd and kube-apiserver |
//! | `no_helm_rendered` | `DEVPLUG_HELM_RENDERED` is unset and `DEVPLUG_REQUIRE_API_SERVER` too | those that check the chart rendered by `.ci/render-helm` |
//! | `no_promtool` | `DEVPLUG_PROMTOOL` is unset and `DEVPLUG_REQUIRE_API_SERVER` too | the alert rules' tests, run by Prometheus' `promtool` |
//! | `no_controller_manager` | `KUBEBUILDER_ASSETS` is unset or its folder has no `kube-controller-manager` or `kube-scheduler` (envtest's assets have neither), and `DEVPLUG_REQUIRE_API_SERVER` is unset | the fleet test (`devplug-bench`), which runs the whole control plane |

/// A need: the variable that meets it and the cfg set when it is not met.
#[derive(Debug, Clone, Copy)]
pub struct Gate {
    /// The environment variable that names what the tests need.
    pub var: &'static str,
    /// The cfg set when it is missing.
    pub cfg: &'static str,
    /// Files the folder the variable names must hold (none: the variable alone meets the need).
    pub files: &'static [&'static str],
}

/// The API server's binaries (etcd, kube-apiserver, kube-scheduler), envtest's variable.
pub const API_SERVER: Gate = Gate {
    var: "KUBEBUILDER_ASSETS",
    cfg: "no_api_server",
    files: &[],
};

/// The Helm chart rendered offline by `.ci/render-helm`.
pub const HELM_RENDERED: Gate = Gate {
    var: "DEVPLUG_HELM_RENDERED",
    cfg: "no_helm_rendered",
    files: &[],
};

/// Prometheus' `promtool` (the path of the binary), which runs the chart's alert rule tests.
pub const PROMTOOL: Gate = Gate {
    var: "DEVPLUG_PROMTOOL",
    cfg: "no_promtool",
    files: &[],
};

/// The whole control plane in `KUBEBUILDER_ASSETS`' folder: kube-controller-manager and
/// kube-scheduler beside etcd and kube-apiserver. envtest's assets (`setup-envtest`) have only
/// the latter two, so the tests that need the others are ignored there, saying which is missing.
pub const CONTROL_PLANE: Gate = Gate {
    var: "KUBEBUILDER_ASSETS",
    cfg: "no_controller_manager",
    files: &["kube-controller-manager", "kube-scheduler"],
};

/// Set where the gated tests must run (CI): they are never ignored.
pub const REQUIRE_VAR: &str = "DEVPLUG_REQUIRE_API_SERVER";

/// What a build script prints for `gates`, given the environment `env`; a gate's
/// [`files`](Gate::files) are looked for on the file system.
pub fn instructions(gates: &[Gate], env: impl Fn(&str) -> Option<String>) -> Vec<String> {
    instructions_with(gates, env, |path| std::path::Path::new(path).is_file())
}

/// [`instructions`], with `is_file` saying whether a path names a file.
pub fn instructions_with(
    gates: &[Gate],
    env: impl Fn(&str) -> Option<String>,
    is_file: impl Fn(&str) -> bool,
) -> Vec<String> {
    let required = env(REQUIRE_VAR).is_some_and(|v| !v.is_empty() && v != "0");
    let mut out = vec![format!("cargo:rerun-if-env-changed={REQUIRE_VAR}")];
    for gate in gates {
        out.push(format!("cargo:rerun-if-env-changed={}", gate.var));
        out.push(format!("cargo:rustc-check-cfg=cfg({})", gate.cfg));
        let folder = env(gate.var).filter(|v| !v.is_empty());
        let met = match &folder {
            None => false,
            Some(folder) => gate.files.iter().all(|file| {
                let path = format!("{}/{file}", folder.trim_end_matches('/'));
                // Built again when the file appears or goes.
                out.push(format!("cargo:rerun-if-changed={path}"));
                is_file(&path)
            }),
        };
        if !required && !met {
            out.push(format!("cargo:rustc-cfg={}", gate.cfg));
        }
    }
    out
}

/// Called from a build script: prints the instructions for `gates` from this environment.
pub fn gate(gates: &[Gate]) {
    for line in instructions(gates, |name| std::env::var(name).ok()) {
        println!("{line}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name: &str| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn a_missing_need_sets_the_cfg_unless_required() {
        let both = [API_SERVER, HELM_RENDERED];
        let missing = instructions(&both, env(&[]));
        assert!(missing.contains(&"cargo:rustc-cfg=no_api_server".to_owned()));
        assert!(missing.contains(&"cargo:rustc-cfg=no_helm_rendered".to_owned()));
        assert!(missing.contains(&"cargo:rerun-if-env-changed=KUBEBUILDER_ASSETS".to_owned()));

        let met = instructions(&both, env(&[("KUBEBUILDER_ASSETS", "/a")]));
        assert!(!met.contains(&"cargo:rustc-cfg=no_api_server".to_owned()));
        assert!(met.contains(&"cargo:rustc-cfg=no_helm_rendered".to_owned()));

        let required = instructions(&both, env(&[(REQUIRE_VAR, "1")]));
        assert!(!required.iter().any(|l| l.starts_with("cargo:rustc-cfg=")));
        let empty = instructions(
            &both,
            env(&[("KUBEBUILDER_ASSETS", ""), (REQUIRE_VAR, "0")]),
        );
        assert!(empty.contains(&"cargo:rustc-cfg=no_api_server".to_owned()));
    }

    #[test]
    fn a_folder_without_a_needed_binary_sets_the_cfg_unless_required() {
        let cfg = "cargo:rustc-cfg=no_controller_manager".to_owned();
        let assets = [("KUBEBUILDER_ASSETS", "/assets/")];
        // envtest's folder: etcd and kube-apiserver only.
        let envtest = |path: &str| ["/assets/etcd", "/assets/kube-apiserver"].contains(&path);
        let out = instructions_with(&[CONTROL_PLANE, API_SERVER], env(&assets), envtest);
        assert!(out.contains(&cfg), "{out:?}");
        assert!(!out.contains(&"cargo:rustc-cfg=no_api_server".to_owned()));
        assert!(out.contains(&"cargo:rerun-if-changed=/assets/kube-controller-manager".to_owned()));
        // One of the two is not enough.
        let half = |path: &str| path == "/assets/kube-scheduler";
        assert!(instructions_with(&[CONTROL_PLANE], env(&assets), half).contains(&cfg));
        // Both there: the test runs.
        let whole = |_: &str| true;
        assert!(!instructions_with(&[CONTROL_PLANE], env(&assets), whole).contains(&cfg));
        // No folder at all: ignored too; CI (required): never ignored.
        assert!(instructions_with(&[CONTROL_PLANE], env(&[]), whole).contains(&cfg));
        let required = [("KUBEBUILDER_ASSETS", "/assets"), (REQUIRE_VAR, "1")];
        assert!(!instructions_with(&[CONTROL_PLANE], env(&required), envtest).contains(&cfg));
    }
}
