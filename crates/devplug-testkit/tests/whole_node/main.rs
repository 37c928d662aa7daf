//! devplug on a whole Kubernetes node: installed by its own image, Helm chart and kustomize
//! base, checked by what real containers get. One node for the whole binary
//! (`devplug_testkit::node`), the scenarios one after the other.
//!
//! Without root or the node's binaries every scenario is reported as ignored (with the reason
//! and where to get what is missing), never as passed; with `DEVPLUG_REQUIRE_CLUSTER=1` (CI) a
//! missing piece fails the run instead.

// Test code: a failed expectation is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod crio;
mod device_plugins;
mod dra;
mod dra_rollout;
mod gpu;
mod kustomize;
mod lifecycle;
mod reboot;
mod support;

use devplug_testkit::node::{requirements, Node};
use libtest_mimic::{Arguments, Failed, Trial};
use std::future::Future;
use std::io::Write;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::OnceLock;

type Outcome = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;
type Scenario = fn(&'static Node) -> Outcome;

const SCENARIOS: [(&str, Scenario); 13] = [
    (
        "device_plugins_reach_the_container",
        device_plugins::reach_the_container,
    ),
    ("gpus_reach_the_container", gpu::reach_the_container),
    (
        "gpu_mig_partitions_reach_the_container",
        gpu::mig_partitions_reach_the_container,
    ),
    ("gpu_labels_follow_the_gpus", gpu::labels_follow_the_gpus),
    ("kubelet_restart_keeps_devices", lifecycle::kubelet_restart),
    ("rolling_update_refuses_no_pod", lifecycle::rolling_update),
    (
        "node_reboot_fails_no_pod_that_can_be_kept",
        reboot::node_reboot,
    ),
    ("kustomize_base_and_overlay", kustomize::base_and_overlay),
    (
        "dra_claim_reaches_the_container",
        dra::claim_reaches_the_container,
    ),
    (
        "dra_surge_rollout_refuses_no_prepare",
        dra_rollout::surge_rollout,
    ),
    ("uninstall_removes_capacity", lifecycle::uninstall),
    (
        "dra_on_a_runtime_without_cdi_says_so",
        dra::runtime_without_cdi_says_so,
    ),
    ("devplug_on_crio", crio::devplug_on_crio),
];

/// What a scenario needs beyond the node: without it the scenario is ignored (with the
/// reason), or fails where the node is required.
fn extra_requirement(name: &str) -> Result<(), String> {
    match name {
        "dra_on_a_runtime_without_cdi_says_so" => requirements::containerd_without_cdi().map(drop),
        "devplug_on_crio" => requirements::crio().map(drop),
        _ => Ok(()),
    }
}

static NODE: OnceLock<Node> = OnceLock::new();

fn say(text: &str) {
    let mut err = std::io::stderr();
    let _ = writeln!(err, "{text}");
    let _ = err.flush();
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("runtime: {e}"))
}

fn wanted(args: &Arguments, name: &str) -> bool {
    let matches = |filter: &str| {
        if args.exact {
            name == filter
        } else {
            name.contains(filter)
        }
    };
    args.filter.as_deref().is_none_or(matches) && !args.skip.iter().any(|s| matches(s))
}

fn main() -> ExitCode {
    let mut args = Arguments::from_args();
    // One node: the scenarios take turns.
    args.test_threads = Some(1);
    let names = SCENARIOS.map(|(name, _)| name);
    if args.list || !names.iter().any(|name| wanted(&args, name)) {
        let trials = names
            .map(|name| Trial::test(name, || Ok(())))
            .into_iter()
            .collect::<Vec<_>>();
        return libtest_mimic::run(&args, trials).exit_code();
    }
    let requirements = match requirements::find() {
        Ok(found) => found,
        Err(missing) => {
            let list = missing
                .iter()
                .map(|m| format!("***   - {m}"))
                .collect::<Vec<_>>()
                .join("\n");
            if requirements::required() {
                say(&format!(
                    "\n*** FAILED: {} is set, but a whole node cannot run here:\n{list}\n",
                    requirements::REQUIRE_VAR
                ));
                let trials = names
                    .map(|name| {
                        Trial::test(name, || Err(Failed::from("no whole node here (see above)")))
                    })
                    .into_iter()
                    .collect::<Vec<_>>();
                return libtest_mimic::run(&args, trials).exit_code();
            }
            say(&format!(
                "\n*** IGNORED: the {} whole-node scenarios did NOT run; this machine lacks:\n{list}\n\
                 *** (set {}=1 to make this a failure, as CI does)\n",
                names.len(),
                requirements::REQUIRE_VAR
            ));
            let trials = names
                // Run anyway (--include-ignored), it fails: it cannot pass without a node.
                .map(|name| {
                    Trial::test(name, || Err(Failed::from("no whole node here (see above)")))
                        .with_ignored_flag(true)
                })
                .into_iter()
                .collect::<Vec<_>>();
            return libtest_mimic::run(&args, trials).exit_code();
        }
    };
    say("whole node: starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd, kubelet");
    let started = runtime().and_then(|rt| rt.block_on(Node::start(requirements)));
    let node: &'static Node = match started {
        Ok(node) => NODE.get_or_init(|| node),
        Err(err) => {
            say(&format!("*** the whole node did not start: {err}"));
            let trials = names
                .map(|name| {
                    let err = err.clone();
                    Trial::test(name, move || Err(Failed::from(format!("no node: {err}"))))
                })
                .into_iter()
                .collect::<Vec<_>>();
            return libtest_mimic::run(&args, trials).exit_code();
        }
    };
    let times = node.start_times;
    say(&format!(
        "figure: node start: API server ready {:.1} s, kubelet start → Node Ready {:.1} s, whole start (images imported) {:.1} s",
        times.api_server.as_secs_f64(),
        times.kubelet_to_ready.as_secs_f64(),
        times.total.as_secs_f64()
    ));
    let trials = SCENARIOS
        .map(|(name, scenario)| {
            if let Err(missing) = extra_requirement(name) {
                if requirements::required() {
                    return Trial::test(name, move || Err(Failed::from(missing)));
                }
                if wanted(&args, name) {
                    say(&format!(
                        "\n*** IGNORED: {name} did NOT run; missing: {missing}\n"
                    ));
                }
                return Trial::test(name, move || Err(Failed::from(missing)))
                    .with_ignored_flag(true);
            }
            Trial::test(name, move || {
                // A failed assertion panics: catch it, so the logs are kept and the node reset.
                let outcome = runtime().and_then(|rt| {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        rt.block_on(scenario(node))
                    }))
                    .unwrap_or_else(|panic| {
                        Err(panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                            .unwrap_or_else(|| "the scenario panicked".to_owned()))
                    })
                });
                let outcome = outcome.map_err(|err| {
                    let logs = node.keep_logs(name);
                    Failed::from(format!("{err}\n(the node's logs: {})", logs.display()))
                });
                // What a failed scenario left must not fail the next one.
                support::reset(node);
                outcome
            })
        })
        .into_iter()
        .collect::<Vec<_>>();
    let conclusion = libtest_mimic::run(&args, trials);
    node.stop();
    conclusion.exit_code()
}
