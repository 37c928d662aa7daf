//! The GPU image's two builds (deploy/Dockerfile.gpu, and .ci/build-image with
//! deploy/Containerfile.gpu-prebuilt) make the same image from the same script
//! (deploy/build-gpu), and that image is the main one's apart from its glibc files.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use deploy_check::repo_root;

fn read(path: &str) -> String {
    std::fs::read_to_string(repo_root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The instructions of a Dockerfile stage, continuation lines joined, comments dropped.
fn instructions(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part.trim_end());
                current.push(' ');
            }
            None => {
                current.push_str(line);
                out.push(std::mem::take(&mut current));
            }
        }
    }
    out
}

fn final_stage(dockerfile: &str) -> Vec<String> {
    let stages: Vec<&str> = dockerfile.split("\nFROM ").collect();
    instructions(&format!("FROM {}", stages.last().unwrap()))
}

#[test]
fn both_gpu_image_builds_make_the_same_image_from_the_same_script() {
    let dockerfile = read("deploy/Dockerfile.gpu");
    let mut from_dockerfile = final_stage(&dockerfile);
    let prebuilt = instructions(&read("deploy/Containerfile.gpu-prebuilt"));
    // Only where the files come from differs.
    for copy in from_dockerfile
        .iter_mut()
        .filter(|i| i.starts_with("COPY "))
    {
        *copy = copy.replacen("COPY --from=builder /out/", "COPY ", 1);
    }
    assert_eq!(from_dockerfile, prebuilt);
    assert_eq!(
        prebuilt
            .iter()
            .filter(|i| i.starts_with("COPY "))
            .collect::<Vec<_>>(),
        [
            "COPY rootfs/ /",
            "COPY devplug /devplug",
            "COPY devplug-lite /devplug-lite"
        ]
    );
    // Both builds run deploy/build-gpu into the folder the final stage copies from.
    let runs = |text: &str| -> Vec<String> {
        text.lines()
            .map(|l| l.trim().trim_start_matches("&& ").to_owned())
            .filter(|l| l.starts_with("deploy/build-gpu "))
            .collect()
    };
    assert_eq!(runs(&dockerfile), ["deploy/build-gpu /out"]);
    assert_eq!(
        runs(&read(".ci/build-image")),
        ["deploy/build-gpu \"$gpu_context\""]
    );
}

#[test]
fn the_gpu_image_is_the_main_one_with_glibc_files() {
    let main = final_stage(&read("deploy/Dockerfile"));
    let gpu = final_stage(&read("deploy/Dockerfile.gpu"));
    let without = |stage: &[String], drop: &dyn Fn(&str) -> bool| -> Vec<String> {
        stage.iter().filter(|i| !drop(i)).cloned().collect()
    };
    // Same user, port, entrypoint and command, the same two binaries at the same paths; the
    // GPU image adds its root file system (the glibc files) and its own title.
    assert_eq!(
        without(&main, &|i| i.starts_with("LABEL ")),
        without(&gpu, &|i| {
            i.starts_with("LABEL ") || i == "COPY --from=builder /out/rootfs/ /"
        })
    );
    // build-gpu copies what the binaries load, and what NVML's DT_NEEDED lists.
    let script = read("deploy/build-gpu");
    assert!(script.contains("done < <(ldd \"$binary\")"));
    assert!(script.contains("libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1"));
}
