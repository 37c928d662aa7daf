//! Regenerates `src/gen/v1beta1.rs` from `proto/v1beta1/api.proto` with protox (no system
//! `protoc`) and fails if the committed file was different. Run it to regenerate:
//! `cargo test -p devplug-proto --test bootstrap`, then commit the file.

use std::path::PathBuf;

#[test]
fn generated_code_is_up_to_date() {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let proto_root = crate_dir.join("../../proto");
    let gen_dir = crate_dir.join("src/gen");
    let gen_file = gen_dir.join("v1beta1.rs");
    let before = std::fs::read_to_string(&gen_file).unwrap_or_default();

    let fds = protox::compile(["v1beta1/api.proto"], [&proto_root]).expect("compile api.proto");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .out_dir(&gen_dir)
        .emit_rerun_if_changed(false)
        .compile_fds(fds)
        .expect("generate rust code");

    let after = std::fs::read_to_string(&gen_file).expect("read generated code");
    assert!(
        before == after,
        "src/gen/v1beta1.rs was stale and has been regenerated; commit the new file"
    );
}
