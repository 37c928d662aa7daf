//! NVIDIA MPS for GPUs shared by capacity: one MPS control daemon per shared GPU, started when
//! its first share is prepared and told to quit when its last share is released, and the edits
//! that put a container on it with its share's limits.
//!
//! Each GPU gets `<dir>/<uuid>/pipe` and `<dir>/<uuid>/log`. The daemon is the driver's own
//! `nvidia-cuda-mps-control`, run with `CUDA_VISIBLE_DEVICES=<uuid>` (so its clients see that
//! GPU alone, as device 0), `CUDA_MPS_PIPE_DIRECTORY` and `CUDA_MPS_LOG_DIRECTORY`, in the
//! foreground (`-f`) as devplug's own child: with `-d` it would fork away and, devplug being
//! PID 1 of its container, end as a zombie nobody reaps once it quits (seen on a real GPU). A
//! container
//! gets both folders mounted (the pipe read-write, the log read-only), the pipe folder in
//! `CUDA_MPS_PIPE_DIRECTORY`, its share of the SMs in `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and its
//! memory in `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`0=<MiB>M`), as NVIDIA's MPS documentation
//! names them. Clients come seconds after the daemon starts, when their containers start.
//!
//! A daemon an earlier devplug started is adopted, not started twice: where devplug runs as a
//! host service and is restarted alone, its child daemon outlives it, and the driver's program
//! refuses a second `-f` on a pipe folder that has one ("An instance of this daemon is already
//! running", checked on an H200 with driver 580.159.04), which would fail every share. Before
//! starting one, devplug asks the folder (`get_server_list` through the program's client mode,
//! which exits 1 with "Cannot find MPS control daemon process" where none answers, also on the
//! files a killed daemon left); one that answers is kept and told to quit like its own.

use devplug::{ContainerEdits, Mount};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

/// The MPS control program, among the driver's programs.
pub const MPS_CONTROL: &str = "nvidia-cuda-mps-control";

/// Where a container finds the pipe folder.
pub const CONTAINER_PIPE_DIR: &str = "/run/nvidia-mps";

/// Where a container finds the log folder.
pub const CONTAINER_LOG_DIR: &str = "/var/log/nvidia-mps";

/// The driver's program and libraries, as devplug runs them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsProgram {
    /// `nvidia-cuda-mps-control`.
    pub control: PathBuf,
    /// The driver's library folder (`LD_LIBRARY_PATH` of the daemon and the server it starts).
    pub lib_dir: Option<PathBuf>,
}

/// The MPS daemons devplug runs, one per shared GPU.
#[derive(Debug)]
pub struct MpsDaemons {
    dir: PathBuf,
    host_dir: PathBuf,
    running: Mutex<BTreeMap<String, Child>>,
    /// GPUs whose daemon an earlier devplug started and this one adopted.
    adopted: Mutex<BTreeSet<String>>,
}

/// How long the client mode may take to answer whether a daemon is there.
const ASK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl MpsDaemons {
    /// Daemons with their folders under `dir` (devplug's view), `host_dir` on the host.
    pub fn new(dir: &Path, host_dir: &Path) -> MpsDaemons {
        MpsDaemons {
            dir: dir.to_owned(),
            host_dir: host_dir.to_owned(),
            running: Mutex::new(BTreeMap::new()),
            adopted: Mutex::new(BTreeSet::new()),
        }
    }

    fn folders(&self, root: &Path, uuid: &str) -> (PathBuf, PathBuf) {
        let gpu = root.join(uuid);
        (gpu.join("pipe"), gpu.join("log"))
    }

    /// The GPUs with a daemon started (or adopted) by this process and not stopped.
    pub fn running(&self) -> Vec<String> {
        let mut gpus: BTreeSet<String> = self
            .running
            .lock()
            .map(|r| r.keys().cloned().collect())
            .unwrap_or_default();
        gpus.extend(self.adopted.lock().map(|a| a.clone()).unwrap_or_default());
        gpus.into_iter().collect()
    }

    /// Whether a daemon answers on GPU `uuid`'s pipe folder (`get_server_list`, exit 0).
    fn answers(&self, program: &MpsProgram, uuid: &str) -> bool {
        let (pipe, _) = self.folders(&self.dir, uuid);
        if !pipe.is_dir() {
            return false;
        }
        let Ok(mut child) = self
            .command(program, &pipe)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        else {
            return false;
        };
        if let Some(mut stdin) = child.stdin.take() {
            let _ = stdin.write_all(b"get_server_list\n");
        }
        // Its exit, waited for by a thread of its own (which reaps it whenever it ends); a client
        // that has not answered within ASK_TIMEOUT counts as no daemon.
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::Builder::new()
            .name("mps-ask".into())
            .spawn(move || {
                let _ = tx.send(child.wait());
            });
        if waiter.is_err() {
            return false;
        }
        matches!(rx.recv_timeout(ASK_TIMEOUT), Ok(Ok(status)) if status.success())
    }

    /// Starts the daemon of GPU `uuid` unless this process already did.
    pub fn ensure(&self, program: &MpsProgram, uuid: &str) -> Result<(), String> {
        let mut running = self
            .running
            .lock()
            .map_err(|_| "the MPS daemon table is poisoned".to_owned())?;
        if let Some(child) = running.get_mut(uuid) {
            match child.try_wait() {
                Ok(None) => return Ok(()),
                // It ended (its GPU lost, killed): start it again below.
                Ok(Some(status)) => {
                    tracing::warn!(gpu = uuid, %status, "the MPS control daemon had ended; starting it again");
                }
                Err(err) => return Err(format!("cannot check the MPS daemon of {uuid}: {err}")),
            }
            running.remove(uuid);
        }
        let mut adopted = self
            .adopted
            .lock()
            .map_err(|_| "the MPS daemon table is poisoned".to_owned())?;
        if self.answers(program, uuid) {
            if adopted.insert(uuid.to_owned()) {
                tracing::info!(gpu = uuid, "an MPS control daemon an earlier devplug started answers on this GPU's pipe folder; adopted, not started again");
            }
            return Ok(());
        }
        if adopted.remove(uuid) {
            tracing::warn!(
                gpu = uuid,
                "the adopted MPS control daemon no longer answers; starting one"
            );
        }
        drop(adopted);
        let (pipe, log) = self.folders(&self.dir, uuid);
        for folder in [&pipe, &log] {
            std::fs::create_dir_all(folder)
                .map_err(|e| format!("cannot create the MPS folder {}: {e}", folder.display()))?;
        }
        // The containers' processes connect to the pipes whatever their user.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&pipe, std::fs::Permissions::from_mode(0o777))
            .map_err(|e| format!("cannot open up {}: {e}", pipe.display()))?;
        let console = std::fs::File::create(log.join("devplug-console.log"))
            .map_err(|e| format!("cannot create a log in {}: {e}", log.display()))?;
        let console_err = console
            .try_clone()
            .map_err(|e| format!("cannot create a log in {}: {e}", log.display()))?;
        let mut child = self
            .command(program, &pipe)
            .arg("-f")
            .env("CUDA_VISIBLE_DEVICES", uuid)
            .env("CUDA_MPS_LOG_DIRECTORY", &log)
            .stdin(Stdio::null())
            .stdout(console)
            .stderr(console_err)
            .spawn()
            .map_err(|e| format!("cannot run {}: {e}", program.control.display()))?;
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "{} -f for GPU {uuid} ended at once ({status}); see {}",
                program.control.display(),
                log.join("devplug-console.log").display()
            ));
        }
        tracing::info!(gpu = uuid, pid = child.id(), pipe = %pipe.display(), "MPS control daemon started");
        running.insert(uuid.to_owned(), child);
        Ok(())
    }

    /// Tells the daemon of GPU `uuid` to quit (its last share is gone). Errors are logged: the
    /// daemon may have died with its GPU.
    /// Returns the thread that reaps it once it has quit (`None` when it was killed and reaped
    /// here, or was not running); nobody needs to wait for it but a test.
    pub fn stop(&self, program: &MpsProgram, uuid: &str) -> Option<std::thread::JoinHandle<()>> {
        let Ok(mut running) = self.running.lock() else {
            return None;
        };
        let (pipe, _) = self.folders(&self.dir, uuid);
        let Some(mut daemon) = running.remove(uuid) else {
            // An adopted daemon is not our child: told to quit, its parent reaps it.
            if self.adopted.lock().is_ok_and(|mut a| a.remove(uuid)) {
                self.tell_adopted_to_quit(program, &pipe, uuid);
            }
            return None;
        };
        match self.send_quit(program, &pipe) {
            Ok(out) if out.status.success() => {
                // It exits once its servers and their clients have, which a stuck client can
                // delay without end: reaped by a thread of its own (not left a zombie), so
                // that this call, made under the DRA driver's lock, never waits for it.
                let gpu = uuid.to_owned();
                let reaper = std::thread::Builder::new()
                    .name("mps-reap".into())
                    .spawn(move || match daemon.wait() {
                        Ok(status) => {
                            tracing::info!(gpu, %status, "MPS control daemon quit: no share left")
                        }
                        Err(err) => {
                            tracing::warn!(gpu, %err, "cannot reap the MPS control daemon")
                        }
                    });
                match reaper {
                    Ok(reaper) => Some(reaper),
                    Err(err) => {
                        tracing::warn!(gpu = uuid, %err, "cannot start a thread to reap the MPS control daemon");
                        None
                    }
                }
            }
            Ok(out) => {
                tracing::warn!(gpu = uuid, status = %out.status,
                    stderr = %String::from_utf8_lossy(&out.stderr).trim(),
                    "the MPS control daemon did not take quit; killing it");
                let _ = daemon.kill();
                let _ = daemon.wait();
                None
            }
            Err(err) => {
                tracing::warn!(gpu = uuid, %err, "cannot tell the MPS control daemon to quit; killing it");
                let _ = daemon.kill();
                let _ = daemon.wait();
                None
            }
        }
    }

    /// `quit` to the daemon on `pipe`, through the program's client mode.
    fn send_quit(
        &self,
        program: &MpsProgram,
        pipe: &Path,
    ) -> std::io::Result<std::process::Output> {
        self.command(program, pipe)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                if let Some(mut stdin) = child.stdin.take() {
                    stdin.write_all(b"quit\n")?;
                }
                child.wait_with_output()
            })
    }

    /// Tells the adopted daemon on `pipe` to quit, logging what went wrong.
    fn tell_adopted_to_quit(&self, program: &MpsProgram, pipe: &Path, uuid: &str) {
        match self.send_quit(program, pipe) {
            Ok(out) if out.status.success() => {
                tracing::info!(
                    gpu = uuid,
                    "the adopted MPS control daemon was told to quit: no share left"
                )
            }
            Ok(out) => tracing::warn!(gpu = uuid, status = %out.status,
                stderr = %String::from_utf8_lossy(&out.stderr).trim(),
                "the adopted MPS control daemon did not take quit"),
            Err(err) => {
                tracing::warn!(gpu = uuid, %err, "cannot tell the adopted MPS control daemon to quit")
            }
        }
    }

    fn command(&self, program: &MpsProgram, pipe: &Path) -> Command {
        let mut command = Command::new(&program.control);
        command.env("CUDA_MPS_PIPE_DIRECTORY", pipe);
        if let Some(lib) = &program.lib_dir {
            command.env("LD_LIBRARY_PATH", lib);
        }
        command
    }

    /// What a container with a share of GPU `uuid` needs beside the GPU itself: the daemon's
    /// folders and the share's limits (`cores` percent of the SMs, `memory` bytes).
    pub fn share_edits(
        &self,
        uuid: &str,
        cores: Option<u64>,
        memory: Option<u64>,
    ) -> ContainerEdits {
        let (pipe, log) = self.folders(&self.host_dir, uuid);
        let mut edits =
            ContainerEdits::default().env("CUDA_MPS_PIPE_DIRECTORY", CONTAINER_PIPE_DIR);
        if let Some(cores) = cores {
            edits = edits.env(
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                cores.clamp(1, 100).to_string(),
            );
        }
        if let Some(memory) = memory {
            // MiB, rounded down: the limit never exceeds what the scheduler counted.
            let mib = (memory / (1 << 20)).max(1);
            edits = edits.env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", format!("0={mib}M"));
        }
        edits.mounts.push(Mount {
            host_path: pipe.display().to_string(),
            container_path: CONTAINER_PIPE_DIR.to_owned(),
            read_only: false,
        });
        edits.mounts.push(Mount {
            host_path: log.display().to_string(),
            container_path: CONTAINER_LOG_DIR.to_owned(),
            read_only: true,
        });
        edits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_gets_its_limits_and_the_daemons_folders() {
        let daemons = MpsDaemons::new(Path::new("/run/devplug/mps"), Path::new("/host/mps"));
        let edits = daemons.share_edits("GPU-1", Some(40), Some(4 << 30));
        assert_eq!(edits.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "40");
        assert_eq!(edits.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=4096M");
        assert_eq!(edits.envs["CUDA_MPS_PIPE_DIRECTORY"], CONTAINER_PIPE_DIR);
        assert_eq!(edits.mounts[0].host_path, "/host/mps/GPU-1/pipe");
        assert!(!edits.mounts[0].read_only && edits.mounts[1].read_only);
        assert_eq!(edits.mounts[1].host_path, "/host/mps/GPU-1/log");
    }
}
