//! The binaries' errors are sentences on stderr, not Rust's Debug output of an error value.

use std::process::Command;

#[test]
fn npu_dra_without_a_node_name_says_what_to_set() {
    let out = Command::new(env!("CARGO_BIN_EXE_npu-dra"))
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr, "npu-dra: set NODE_NAME to this node's name\n");
}
