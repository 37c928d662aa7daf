//! MPS on a real NVIDIA GPU: devplug's `MpsDaemons` starts the driver's own
//! `nvidia-cuda-mps-control -f` for one GPU (as its own child), a CUDA client (`tests/gpu/mps_client.py`, the
//! driver's libcuda through ctypes) runs through it with the limits a 40-core, 1 GiB share gets,
//! an allocation within the limit succeeds and one beyond it fails, and the daemon quits when
//! told (and is reaped: no zombie is left). Needs a GPU and its driver, so it is ignored unless asked for:
//! `DEVPLUG_MPS_CONTROL=/usr/bin/nvidia-cuda-mps-control DEVPLUG_GPU_UUID=GPU-... \
//!  cargo test -p devplug-backends --test nvidia_mps_gpu -- --ignored --nocapture`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

use devplug_backends::nvidia::mps::{MpsDaemons, MpsProgram};
use std::path::{Path, PathBuf};
use std::process::Command;

#[test]
#[ignore = "needs an NVIDIA GPU and its driver: set DEVPLUG_MPS_CONTROL and DEVPLUG_GPU_UUID, run with --ignored"]
fn a_share_runs_through_the_gpus_mps_daemon_within_its_memory_limit() {
    let control = PathBuf::from(std::env::var("DEVPLUG_MPS_CONTROL").expect("DEVPLUG_MPS_CONTROL"));
    let uuid = std::env::var("DEVPLUG_GPU_UUID").expect("DEVPLUG_GPU_UUID");
    let lib_dir = std::env::var_os("DEVPLUG_DRIVER_LIB_DIR").map(PathBuf::from);
    let dir = tempfile::tempdir().unwrap();
    let program = MpsProgram {
        control,
        lib_dir: lib_dir.clone(),
    };
    let daemons = MpsDaemons::new(dir.path(), dir.path());
    let started = std::time::Instant::now();
    daemons.ensure(&program, &uuid).unwrap();
    eprintln!("MPS control daemon started in {:?}", started.elapsed());
    let edits = daemons.share_edits(&uuid, Some(40), Some(1 << 30));
    let pipe = dir.path().join(&uuid).join("pipe");
    let script = std::env::var_os("DEVPLUG_MPS_CLIENT").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gpu/mps_client.py"),
        PathBuf::from,
    );
    let mut client = Command::new("python3");
    client
        .arg(&script)
        .arg((512u64 << 20).to_string())
        .arg((2u64 << 30).to_string())
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            &edits.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"],
        )
        .env(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            &edits.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
        );
    if let Some(lib) = &lib_dir {
        client.env("LD_LIBRARY_PATH", lib);
    }
    let out = client.output().unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "client (limits {:?}):\n{printed}{}",
        edits.envs,
        String::from_utf8_lossy(&out.stderr)
    );
    let servers = query(&program, &pipe, "get_server_list");
    eprintln!("get_server_list: {servers:?}");
    let reaper = daemons.stop(&program, &uuid).expect("the daemon took quit");
    reaper.join().unwrap();
    let log = std::fs::read_to_string(dir.path().join(&uuid).join("log/devplug-console.log"))
        .unwrap_or_default();
    eprintln!("the daemon's console:\n{log}");
    assert!(out.status.success(), "the client ran");
    assert!(
        printed.contains("cuCtxCreate 0"),
        "a context through MPS:\n{printed}"
    );
    assert!(
        printed.contains("cuMemAlloc_small 0"),
        "512 MiB fits the 1 GiB limit:\n{printed}"
    );
    assert!(
        printed.contains("cuMemAlloc_large 2"),
        "2 GiB is out of memory under the limit:\n{printed}"
    );
    assert!(
        !servers.trim().is_empty(),
        "the daemon ran a server for the client"
    );
    assert!(daemons.running().is_empty());
}

/// One command to the daemon on `pipe`; what it answered.
fn query(program: &MpsProgram, pipe: &Path, command: &str) -> String {
    use std::io::Write;
    let mut child = Command::new(&program.control)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{command}\n").as_bytes())
        .unwrap();
    String::from_utf8_lossy(&child.wait_with_output().unwrap().stdout).into_owned()
}
