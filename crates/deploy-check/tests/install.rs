//! The install path as the READMEs write it: `kubectl apply -k` on folders that exist (kubectl
//! alone, no `kustomize edit`), an overlay whose image is set in one place and reaches the
//! DaemonSet, and the two image builds (deploy/Dockerfile, .ci/build-image with
//! deploy/Containerfile.prebuilt) making the same image, with the same two binaries (the full
//! `/devplug` and the device-plugin-only `/devplug-lite`), from the same cargo commands.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use deploy_check::{documents, image_transformed, repo_root, strict};
use k8s_openapi::api::apps::v1::DaemonSet;
use serde_json::Value;
use std::path::Path;

const OVERLAY: &str = "deploy/overlays/registry";

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn kustomization(dir: &Path) -> Value {
    let docs = documents(&dir.join("kustomization.yaml")).unwrap();
    assert_eq!(docs.len(), 1, "{}", dir.display());
    docs.into_iter().next().unwrap()
}

/// The container images of the kustomize base's DaemonSet.
fn base_images() -> Vec<String> {
    let docs = documents(&repo_root().join("deploy/kustomize/daemonset.yaml")).unwrap();
    let daemonset: DaemonSet = strict(&docs[0]).unwrap();
    daemonset
        .spec
        .template
        .spec
        .map(|s| s.containers.into_iter().filter_map(|c| c.image).collect())
        .unwrap_or_default()
}

/// `newName: …` in the overlay replaced as the README's `sed` does.
fn overlay_with_registry(registry: &str) -> Value {
    let text = read(&format!("{OVERLAY}/kustomization.yaml"));
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("newName: ")).collect();
    assert_eq!(
        lines.len(),
        1,
        "the README's sed edits exactly one newName line"
    );
    let edited: String = text
        .lines()
        .map(|l| match l.split_once("newName: ") {
            Some((indent, _)) => format!("{indent}newName: {registry}/devplug\n"),
            None => format!("{l}\n"),
        })
        .collect();
    serde_saphyr::from_str(&edited).unwrap()
}

#[test]
fn the_overlay_sets_the_image_in_one_place_on_top_of_the_base() {
    let dir = repo_root().join(OVERLAY);
    let k = kustomization(&dir);
    assert_eq!(k["apiVersion"], "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k["kind"], "Kustomization");
    let keys: Vec<&String> = k.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["apiVersion", "images", "kind", "resources"]);
    let resources = k["resources"].as_array().unwrap();
    assert_eq!(resources.len(), 1);
    let base = dir.join(resources[0].as_str().unwrap());
    assert!(
        base.join("kustomization.yaml").is_file(),
        "{} is not a kustomization",
        base.display()
    );
    assert_eq!(
        base.canonicalize().unwrap(),
        repo_root().join("deploy/kustomize").canonicalize().unwrap()
    );

    // One entry, for the image the DaemonSet uses; the version everywhere is the crate's.
    let images = k["images"].as_array().unwrap();
    assert_eq!(images.len(), 1);
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(images[0]["newTag"], version);
    let base_k = kustomization(&base);
    assert_eq!(base_k["images"][0]["newTag"], version, "deploy/kustomize");
    assert!(read("deploy/helm/devplug/Chart.yaml").contains(&format!("appVersion: \"{version}\"")));
    let base_images = base_images();
    assert_eq!(base_images, [format!("devplug:{version}")]);

    // After the README's one edit, the DaemonSet runs the pushed image.
    let edited = overlay_with_registry("registry.internal:5000/team");
    let entries = edited["images"].as_array().unwrap();
    assert_eq!(
        image_transformed(&base_images[0], entries),
        format!("registry.internal:5000/team/devplug:{version}")
    );
    // The base alone keeps the name every node would have to have loaded.
    assert_eq!(
        image_transformed(&base_images[0], base_k["images"].as_array().unwrap()),
        format!("devplug:{version}")
    );
}

#[test]
fn the_readmes_install_with_kubectl_alone() {
    for readme in ["README.md", "deploy/README.md"] {
        let text = read(readme);
        assert!(
            !text.contains("kustomize edit") && !text.contains("kustomize build"),
            "{readme} needs a separate kustomize binary"
        );
        let targets: Vec<&str> = text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("kubectl apply -k "))
            .map(|rest| rest.split_whitespace().next().unwrap())
            .collect();
        assert!(
            targets.contains(&OVERLAY),
            "{readme} does not install {OVERLAY}"
        );
        for target in targets {
            assert!(
                repo_root()
                    .join(target)
                    .join("kustomization.yaml")
                    .is_file(),
                "{readme}: kubectl apply -k {target}: no kustomization there"
            );
        }
        // The edit the README shows is the one the overlay test above applies, to the install's
        // overlay and the uninstall's (`registry*`: manifests.rs runs it on both).
        assert!(
            text.contains(&format!(
                "sed -i \"s|newName: .*|newName: $REGISTRY/devplug|\" {OVERLAY}*/kustomization.yaml"
            )),
            "{readme} does not show the overlay edit"
        );
    }
}

/// The instructions of a Dockerfile stage, continuation lines joined, comments dropped.
fn instructions(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part.trim_end()),
            None => {
                current.push_str(line);
                out.push(std::mem::take(&mut current));
                current.clear();
            }
        }
        if !current.is_empty() {
            current.push(' ');
        }
    }
    out
}

#[test]
fn both_image_builds_make_the_same_image_from_the_same_command() {
    let dockerfile = read("deploy/Dockerfile");
    let stages: Vec<&str> = dockerfile.split("\nFROM ").collect();
    let last = format!("FROM {}", stages.last().unwrap());
    let mut from_dockerfile = instructions(&last);
    let prebuilt = instructions(&read("deploy/Containerfile.prebuilt"));
    // Only where the binaries come from differs: both builds, at the image's root.
    let copies: Vec<&mut String> = from_dockerfile
        .iter_mut()
        .filter(|i| i.starts_with("COPY "))
        .collect();
    assert_eq!(copies.len(), 2);
    for (copy, binary) in copies.into_iter().zip(["devplug", "devplug-lite"]) {
        assert_eq!(
            *copy,
            format!("COPY --from=builder /out/{binary} /{binary}")
        );
        *copy = format!("COPY {binary} /{binary}");
    }
    assert_eq!(from_dockerfile, prebuilt);
    assert_eq!(prebuilt[0], "FROM scratch");
    assert!(prebuilt.contains(&"USER 0".to_owned()));
    // The default entrypoint is the full build; the manifests name the one they run.
    assert!(prebuilt.contains(&"ENTRYPOINT [\"/devplug\"]".to_owned()));

    // The binaries: both builds run the same script (deploy/build-static) into the folder the
    // final stage copies from, for the same target.
    let script = read(".ci/build-image");
    let runs = |text: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| {
                let l = l.trim().trim_start_matches("&& ");
                l.contains("deploy/build-static ").then(|| l.to_owned())
            })
            .filter(|l| !l.starts_with('#') && !l.starts_with("echo"))
            .collect()
    };
    assert_eq!(
        runs(&dockerfile),
        ["TARGET=\"${TARGET}\" deploy/build-static /out"]
    );
    // The other run is the linux/arm64 build (started first, in the background), cross-compiled
    // with plain links (the link order is trained by running the binary, which cannot run a
    // foreign architecture).
    assert_eq!(
        runs(&script),
        [
            "deploy/build-static \"$arm_context\"",
            "TARGET=\"${TARGET}\" deploy/build-static \"$context\""
        ]
    );
    assert!(script.contains("TARGET=\"$ARM_TARGET\" DEVPLUG_LINK_ORDER=off \\\n"));
    assert!(script.contains("ARM_TARGET=aarch64-unknown-linux-musl\n"));
    // The script: the lean build (no default features), then the full one without the demos
    // on fake hardware (no test kit in the image), each into its name.
    let build_static = read("deploy/build-static");
    let builds: Vec<&str> = build_static
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("build devplug"))
        .collect();
    assert_eq!(
        builds,
        [
            "build devplug-lite --no-default-features",
            "build devplug --no-default-features --features cluster,tools"
        ]
    );
    // Each link order build ends in its own file, relinked in the trained order, checked and
    // stripped; the plain fallback too.
    assert!(build_static.contains("strip -o \"$out/$name\" \"$linked\""));
    assert!(build_static.contains("\"$trainer\" check --bin \"$linked\""));
    assert!(build_static.contains("install -m 0755 \"$built\" \"$out/$name\""));
    // One compile of the final crate per binary (its fat LTO once): `cargo rustc` keeping what
    // LTO made and printing its link command, which the second link runs again with the order.
    let rustc: Vec<&str> = build_static
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("cargo rustc "))
        .collect();
    assert_eq!(rustc.len(), 1, "{rustc:?}");
    assert!(rustc[0]
        .contains("--release --locked --target \"${TARGET}\" -p devplug-cli --bin devplug \"$@\""));
    assert!(build_static.contains("-C save-temps --print link-args"));
    assert!(build_static.contains("--symbol-ordering-file=$work/$name.order"));
    // And the image check runs both.
    assert!(script.contains("for binary in devplug devplug-lite; do"));
    let target = |text: &str| {
        text.lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("ARG TARGET=")
                    .or_else(|| l.trim().strip_prefix("TARGET="))
            })
            .map(str::to_owned)
    };
    assert_eq!(target(&dockerfile), target(&script));
    assert!(target(&script).is_some());
    assert_eq!(
        target(&build_static),
        target(&script).map(|t| format!("${{TARGET:-{t}}}"))
    );
    // And CI runs the script (its GPU and arm64 builds as check builds, without LTO): the amd64
    // images before the tests, the arm64 ones beside them.
    let ci = read(".ci/run");
    assert!(ci
        .lines()
        .any(|l| l.trim() == "DEVPLUG_SIDE_BUILDS=check .ci/build-image amd64"));
    assert!(ci
        .lines()
        .any(|l| l.trim().starts_with("setsid nice -n 19 ")
            && l.contains(" DEVPLUG_SIDE_BUILDS=check .ci/build-image arm64 ")));
}
