//! Regenerates `src/gen/*.rs` from the `.proto` files in `proto/` with protox (no system `protoc`)
//! and fails if a committed file was different. Run it to regenerate:
//! `cargo test -p devplug-proto --test bootstrap`, then commit the files.
//!
//! One `.proto` per package: `v1beta1` (device plugins), `pluginregistration` (the kubelet's plugin
//! watcher), `v1` (pod resources) and the two DRA packages `k8s.io.kubelet.pkg.apis.dra.v1` and
//! `…v1beta1`, and the DRA device health packages `v1alpha1` and `v1` (in `src/gen/dra-health-v1/`,
//! beside the pod resources' `v1`); prost names each generated file after its package.

use std::path::PathBuf;

#[test]
fn generated_code_is_up_to_date() {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let proto_root = crate_dir.join("../../proto");
    let gen_dir = crate_dir.join("src/gen");
    let files = [
        ("v1beta1/api.proto", "v1beta1.rs"),
        ("pluginregistration/api.proto", "pluginregistration.rs"),
        ("podresources/api.proto", "v1.rs"),
        ("dra/v1/api.proto", "k8s.io.kubelet.pkg.apis.dra.v1.rs"),
        (
            "dra/v1beta1/api.proto",
            "k8s.io.kubelet.pkg.apis.dra.v1beta1.rs",
        ),
        ("dra-health/v1alpha1/api.proto", "v1alpha1.rs"),
        // Package `v1` like the pod resources API: a folder of its own keeps the two files apart.
        ("dra-health/v1/api.proto", "dra-health-v1/v1.rs"),
    ];
    let mut stale = Vec::new();
    for (proto, generated) in files {
        let gen_file = gen_dir.join(generated);
        let out_dir = gen_file.parent().expect("a file in src/gen").to_path_buf();
        std::fs::create_dir_all(&out_dir).expect("make the output folder");
        let before = std::fs::read_to_string(&gen_file).unwrap_or_default();
        let fds = protox::compile([proto], [&proto_root]).expect("compile the proto");
        tonic_prost_build::configure()
            .build_server(true)
            .build_client(true)
            .out_dir(&out_dir)
            .emit_rerun_if_changed(false)
            .compile_fds(fds)
            .expect("generate rust code");
        let after = std::fs::read_to_string(&gen_file).expect("read generated code");
        if before != after {
            stale.push(generated);
        }
    }
    assert!(
        stale.is_empty(),
        "src/gen/{stale:?} were stale and have been regenerated; commit the new files"
    );
}
