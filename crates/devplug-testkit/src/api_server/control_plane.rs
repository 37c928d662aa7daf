//! The control plane's processes: etcd and kube-apiserver (and kube-scheduler, and for a
//! [`ControlPlane`] kube-controller-manager) from `KUBEBUILDER_ASSETS`, started on free loopback
//! ports and again on others when one was taken, waited for until `/readyz` answers, stopped
//! with SIGTERM then SIGKILL, and a reaper process that stops them should this process die
//! first. [`ApiServer::shared`] is the one of a test binary; a [`ControlPlane`] is owned by a
//! value.

use super::credentials::{client, kubeconfig_text, service_account_keys, ADMIN_TOKEN};
use super::{fail, ApiServer};
use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The binaries a [`ControlPlane`] with a scheduler runs, all from one folder.
pub const CONTROL_PLANE_BINARIES: [&str; 3] = ["etcd", "kube-apiserver", "kube-scheduler"];

/// The binaries of [`CONTROL_PLANE_BINARIES`] that are not files in `assets`.
pub fn missing_binaries(assets: &Path) -> Vec<PathBuf> {
    CONTROL_PLANE_BINARIES
        .iter()
        .map(|name| assets.join(name))
        .filter(|path| !path.is_file())
        .collect()
}

static SHARED: OnceLock<Result<ApiServer, String>> = OnceLock::new();
static SCHEDULER: OnceLock<Result<(), String>> = OnceLock::new();

impl ApiServer {
    /// The API server of this test binary, started on first use; `None` (after a loud message
    /// on stderr) when `KUBEBUILDER_ASSETS` is not set. A start failure panics with the logs'
    /// location: a broken environment must fail tests, not skip them.
    pub fn shared(test: &str) -> Option<&'static ApiServer> {
        let assets = assets_or_skip(test)?;
        let started = SHARED.get_or_init(|| start(&assets));
        match started {
            Ok(server) => Some(server),
            Err(err) => panic!("cannot start the test control plane: {err}"),
        }
    }

    /// Starts `kube-scheduler` from `KUBEBUILDER_ASSETS` against this API server, once per test
    /// binary (the DRA tests need it: it allocates ResourceClaims and binds pods). Stopped by
    /// PID when the test binary exits.
    pub fn start_scheduler(&self) -> Result<(), String> {
        SCHEDULER
            .get_or_init(|| {
                let assets = std::env::var_os("KUBEBUILDER_ASSETS")
                    .ok_or_else(|| "KUBEBUILDER_ASSETS is not set".to_owned())?;
                let child = spawn_scheduler(self, Path::new(&assets))?;
                // Not waited for: it outlives us on purpose. Drop the handle only.
                reap_at_exit(Some(&self.dir), &[child.id()]).map(drop)
            })
            .clone()
    }
}

/// The folder named by `KUBEBUILDER_ASSETS`, for a test that needs the control plane's binaries.
/// Such tests carry `#[cfg_attr(no_api_server, ignore = "...")]` (the test-gates crate), so they
/// are counted as ignored where the variable is not set; this check is for other callers (the
/// benchmarks) and for a run with `--include-ignored`: `None` after a loud `SKIPPED` message on
/// stderr when the variable is not set; a panic when it is not set but
/// `DEVPLUG_REQUIRE_API_SERVER` is (CI).
pub fn assets_or_skip(test: &str) -> Option<PathBuf> {
    if let Some(assets) = std::env::var_os("KUBEBUILDER_ASSETS") {
        return Some(PathBuf::from(assets));
    }
    assert!(
        std::env::var_os("DEVPLUG_REQUIRE_API_SERVER").is_none(),
        "{test}: DEVPLUG_REQUIRE_API_SERVER is set but KUBEBUILDER_ASSETS is not"
    );
    // Written straight to stderr: the test harness hides eprintln! of passing tests.
    let _ = writeln!(
        std::io::stderr(),
        "\n*** SKIPPED {test}: KUBEBUILDER_ASSETS is not set, so there is no API server to test against.\n\
         *** Get kube-apiserver and etcd with `setup-envtest use 1.36.x -p path` (controller-runtime's\n\
         *** tool) and `export KUBEBUILDER_ASSETS=<that folder>` (docs/testing.md, \"Tests against a\n\
         *** real API server\"). This test did NOT run.\n"
    );
    None
}

/// The admin client of this test binary's [`ApiServer::shared`], or `None` (after the loud
/// `SKIPPED` message) without `KUBEBUILDER_ASSETS`.
pub async fn admin(test: &str) -> Option<kube::Client> {
    let server = ApiServer::shared(test)?;
    match client(&server.kubeconfig).await {
        Ok(client) => Some(client),
        Err(err) => panic!("{test}: the admin client: {err}"),
    }
}

/// A control plane of the test's own, for tests that stop, restart or restore it (the shared
/// [`ApiServer::shared`] must stay up for the others), in a temp folder, with its admin client.
/// `None` (after the loud `SKIPPED` message) without `KUBEBUILDER_ASSETS`; a start failure
/// panics with the logs (a test helper).
pub async fn own_control_plane(
    test: &str,
) -> Option<(tempfile::TempDir, ControlPlane, kube::Client)> {
    let assets = assets_or_skip(test)?;
    let dir = match tempfile::tempdir() {
        Ok(dir) => dir,
        Err(err) => panic!("{test}: a temp folder: {err}"),
    };
    let plane = match ControlPlane::start(&assets, dir.path()).await {
        Ok(plane) => plane,
        Err(err) => panic!("{test}: cannot start the control plane: {err}"),
    };
    let admin = match client(&plane.server().kubeconfig).await {
        Ok(admin) => admin,
        Err(err) => panic!("{test}: the admin client: {err}"),
    };
    Some((dir, plane, admin))
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| fail("free port", e))?;
    let port = listener
        .local_addr()
        .map_err(|e| fail("free port", e))?
        .port();
    Ok(port)
}

fn spawn(binary: &Path, args: &[String], log: &Path) -> Result<Child, String> {
    let out = std::fs::File::create(log).map_err(|e| fail("log file", e))?;
    let err = out.try_clone().map_err(|e| fail("log file", e))?;
    Command::new(binary)
        .args(args)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| fail(&format!("cannot run {}", binary.display()), e))
}

/// Starts `kube-scheduler` from `assets` against `server`, logging beside its other logs.
fn spawn_scheduler(server: &ApiServer, assets: &Path) -> Result<Child, String> {
    let binary = assets.join("kube-scheduler");
    if !binary.is_file() {
        return Err(format!(
            "{} is missing: DRA needs kube-scheduler beside kube-apiserver \
             (docs/testing.md, \"Tests against a real API server\", says where to get it)",
            binary.display()
        ));
    }
    spawn(
        &binary,
        &scheduler_args(server),
        &server.dir.join("kube-scheduler.log"),
    )
}

/// kube-scheduler's command line against `server`.
fn scheduler_args(server: &ApiServer) -> Vec<String> {
    vec![
        format!("--kubeconfig={}", server.kubeconfig.display()),
        "--leader-elect=false".into(),
        "--secure-port=0".into(),
    ]
}

/// `--name` of `--name=value`, so that a flag given by the caller replaces the default one.
fn flag_name(arg: &str) -> &str {
    arg.split_once('=').map_or(arg, |(name, _)| name)
}

/// The shared API server of a test binary: a temp folder kept until the reaper removes it.
fn start(assets: &Path) -> Result<ApiServer, String> {
    let dir = tempfile::Builder::new()
        .prefix("devplug-apiserver-")
        .tempdir()
        .map_err(|e| fail("temp folder", e))?
        .keep();
    let mut tries = 0;
    loop {
        tries += 1;
        let (server, mut children, _) = spawn_api_server(assets, &dir, &[])?;
        let mut reaper = reap_at_exit(Some(&dir), &children.each_ref().map(Child::id))?;
        match wait_ready(&server, &mut children, &dir) {
            // The reaper is not waited for: it outlives us on purpose.
            Ok(()) => return Ok(server),
            Err(e) if e.port_taken && tries < START_TRIES => {
                eprintln!("API server: {}; starting again on other ports", e.message);
                let _ = reaper.kill();
                let _ = reaper.wait();
                stop_all(&mut children);
                let _ = std::fs::remove_dir_all(dir.join("etcd"));
            }
            Err(e) => return Err(with_logs(e.message, &dir)),
        }
    }
}

/// How many times a control plane is started when one of its processes found its port taken:
/// the ports are picked free by binding `:0` and releasing them, so a test starting its own
/// control plane at the same moment can take one in between.
const START_TRIES: u32 = 3;

/// Why a started control plane did not become ready.
#[derive(Debug)]
struct NotReady {
    /// A process exited because its port was taken: starting again on other ports helps.
    port_taken: bool,
    message: String,
}

/// The last lines of `path`.
fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join("\n")
}

/// Waits for `/readyz` as [`wait_ready_async`] does, but fails at once when one of `children`
/// (etcd, kube-apiserver, in any order) exits, with the tail of its log.
async fn ready_or_exit(
    server: &ApiServer,
    children: &mut [Child],
    dir: &Path,
) -> Result<(), NotReady> {
    let ready = wait_ready_async(&server.kubeconfig, &server.ca);
    tokio::pin!(ready);
    loop {
        tokio::select! {
            result = &mut ready => {
                return result.map_err(|message| NotReady { port_taken: false, message });
            }
            () = tokio::time::sleep(Duration::from_millis(200)) => {
                if let Some(status) = children.iter_mut().find_map(|c| c.try_wait().ok().flatten()) {
                    let logs = ["etcd.log", "kube-apiserver.log"]
                        .map(|name| format!("{name}: {}", log_tail(&dir.join(name))))
                        .join("\n");
                    return Err(NotReady {
                        port_taken: logs.contains("address already in use"),
                        message: format!("a control-plane process exited ({status}) before the API server was ready:\n{logs}"),
                    });
                }
            }
        }
    }
}

/// `err` with where the logs are.
fn with_logs(err: String, dir: &Path) -> String {
    format!(
        "{err} (logs: {} and {})",
        dir.join("kube-apiserver.log").display(),
        dir.join("etcd.log").display()
    )
}

/// etcd's command line: its data in `dir/etcd`, on loopback.
fn etcd_args(dir: &Path, client_port: u16, peer_port: u16) -> Vec<String> {
    vec![
        format!("--data-dir={}", dir.join("etcd").display()),
        format!("--listen-client-urls=http://127.0.0.1:{client_port}"),
        format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
        "--unsafe-no-fsync".into(),
    ]
}

/// The command lines of a control plane's etcd and kube-apiserver, to start them again.
#[derive(Debug, Clone)]
struct Commands {
    etcd: Vec<String>,
    apiserver: Vec<String>,
}

/// Starts etcd and kube-apiserver from `assets` with their files in `dir` (created if missing),
/// and writes the admin kubeconfig; does not wait for them to be ready. Returns the server and
/// the two processes (etcd first). Everything that can fail before etcd starts is done first;
/// a failure after that stops what was started.
fn spawn_api_server(
    assets: &Path,
    dir: &Path,
    extra_args: &[String],
) -> Result<(ApiServer, [Child; 2], Commands), String> {
    let apiserver_bin = assets.join("kube-apiserver");
    let etcd_bin = assets.join("etcd");
    for b in [&apiserver_bin, &etcd_bin] {
        if !b.is_file() {
            return Err(format!(
                "{} is missing: KUBEBUILDER_ASSETS must hold kube-apiserver and etcd",
                b.display()
            ));
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| fail(&format!("folder {}", dir.display()), e))?;
    let (etcd_port, peer_port, api_port) = (free_port()?, free_port()?, free_port()?);
    let key = dir.join("sa.key");
    let public = dir.join("sa.pub");
    let (private_pem, public_pem) = service_account_keys()?;
    std::fs::write(&key, private_pem).map_err(|e| fail("sa.key", e))?;
    std::fs::write(&public, public_pem).map_err(|e| fail("sa.pub", e))?;
    let tokens = dir.join("tokens.csv");
    std::fs::write(
        &tokens,
        format!("{ADMIN_TOKEN},admin,admin,system:masters\n"),
    )
    .map_err(|e| fail("tokens.csv", e))?;
    let cert_dir = dir.join("certs");
    let ca = cert_dir.join("apiserver.crt");
    let url = format!("https://127.0.0.1:{api_port}");
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, kubeconfig_text(&url, &ca, ADMIN_TOKEN))
        .map_err(|e| fail("kubeconfig", e))?;
    let etcd_command = etcd_args(dir, etcd_port, peer_port);
    let etcd = spawn(&etcd_bin, &etcd_command, &dir.join("etcd.log"))?;
    let apiserver_command: Vec<String> = [
        "--bind-address=127.0.0.1".into(),
        "--advertise-address=127.0.0.1".into(),
        format!("--secure-port={api_port}"),
        format!("--cert-dir={}", cert_dir.display()),
        format!("--etcd-servers=http://127.0.0.1:{etcd_port}"),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
        format!("--service-account-key-file={}", public.display()),
        format!("--service-account-signing-key-file={}", key.display()),
        format!("--token-auth-file={}", tokens.display()),
        "--authorization-mode=RBAC".into(),
        "--service-cluster-ip-range=10.96.0.0/24".into(),
        "--allow-privileged=true".into(),
        "--endpoint-reconciler-type=none".into(),
        "--disable-admission-plugins=ServiceAccount".into(),
    ]
    .into_iter()
    .chain(extra_args.iter().cloned())
    .collect();
    let apiserver = spawn(
        &apiserver_bin,
        &apiserver_command,
        &dir.join("kube-apiserver.log"),
    );
    let apiserver = match apiserver {
        Ok(child) => child,
        Err(err) => {
            stop_all(&mut [etcd]);
            return Err(err);
        }
    };
    let server = ApiServer {
        url,
        ca,
        kubeconfig,
        dir: dir.to_owned(),
    };
    let commands = Commands {
        etcd: etcd_command,
        apiserver: apiserver_command,
    };
    Ok((server, [etcd, apiserver], commands))
}

/// A process that waits for this process to exit, then stops `pids` (TERM, then KILL after 5 s)
/// and removes `dir` if given. Returns its handle: dropping it leaves it running; killing it
/// (as [`ControlPlane`] does once it has stopped the processes itself) calls it off.
fn reap_at_exit(dir: Option<&Path>, pids: &[u32]) -> Result<Child, String> {
    let me = std::process::id();
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    let pids = pids.join(" ");
    let remove = dir
        .map(|d| format!("; rm -rf '{}'", d.display()))
        .unwrap_or_default();
    let script = format!(
        "while kill -0 {me} 2>/dev/null; do sleep 0.5; done; kill {pids} 2>/dev/null; \
         for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 {pids} 2>/dev/null || break; sleep 0.5; done; \
         kill -9 {pids} 2>/dev/null{remove}"
    );
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| fail("reaper", e))
}

/// How long [`stop_all`] lets the processes end on SIGTERM before it kills them.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// Stops `children`: SIGTERM to all, then SIGKILL to those still running after [`STOP_GRACE`];
/// each one is waited for (no zombie, no PID left to be reused under our feet).
fn stop_all(children: &mut [Child]) {
    for child in children.iter_mut() {
        if matches!(child.try_wait(), Ok(None)) {
            // std sends only SIGKILL; `kill` sends SIGTERM, as the reaper does.
            let _ = Command::new("kill")
                .arg(child.id().to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
    let deadline = Instant::now() + STOP_GRACE;
    for child in children.iter_mut() {
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if matches!(child.try_wait(), Ok(None)) {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
}

/// etcd, kube-apiserver and, once asked, kube-scheduler, owned by this value: started in a
/// folder the caller gives (and removes), stopped when the value is dropped, scheduler and API
/// server first, then etcd. A reaper process stops them too if this process dies without
/// dropping it (SIGKILL, abort). For programs, e.g. `devplug demo --dra`; tests share one
/// [`ApiServer::shared`] per test binary instead.
#[derive(Debug)]
pub struct ControlPlane {
    server: ApiServer,
    assets: PathBuf,
    /// Stopped in this order: the scheduler (when started), the API server, etcd.
    processes: Vec<Child>,
    reaper: Option<Child>,
    /// The command lines, to start etcd and the API server again.
    commands: Commands,
    /// True between [`ControlPlane::stop_api_server`] and [`ControlPlane::start_api_server`].
    api_server_stopped: bool,
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver from `assets` with their files in `dir`, and waits until
    /// the API server's `/readyz` is `ok` (60 s at most). Dropping the future while it waits
    /// stops the processes.
    pub async fn start(assets: &Path, dir: &Path) -> Result<ControlPlane, String> {
        Self::start_with(assets, dir, &[]).await
    }

    /// [`ControlPlane::start`] with `apiserver_args` added to kube-apiserver's command line
    /// (e.g. higher `--max-requests-inflight` for a benchmark of many nodes).
    pub async fn start_with(
        assets: &Path,
        dir: &Path,
        apiserver_args: &[String],
    ) -> Result<ControlPlane, String> {
        let mut tries = 0;
        loop {
            tries += 1;
            let (server, [etcd, apiserver], commands) =
                spawn_api_server(assets, dir, apiserver_args)?;
            let mut plane = ControlPlane {
                server,
                assets: assets.to_owned(),
                processes: vec![apiserver, etcd],
                reaper: None,
                commands,
                api_server_stopped: false,
            };
            plane.rearm_reaper()?;
            match ready_or_exit(&plane.server, &mut plane.processes, dir).await {
                Ok(()) => return Ok(plane),
                Err(e) if e.port_taken && tries < START_TRIES => {
                    tracing::warn!(problem = %e.message, "starting the control plane again on other ports");
                    drop(plane);
                    let _ = std::fs::remove_dir_all(dir.join("etcd"));
                }
                Err(e) => return Err(with_logs(e.message, dir)),
            }
        }
    }

    /// The API server.
    pub fn server(&self) -> &ApiServer {
        &self.server
    }

    /// Starts kube-scheduler from the same folder against this API server (it allocates
    /// ResourceClaims and binds pods). Its log is `kube-scheduler.log` in the folder.
    pub fn start_scheduler(&mut self) -> Result<(), String> {
        let child = spawn_scheduler(&self.server, &self.assets)?;
        self.processes.insert(0, child);
        self.rearm_reaper()
    }

    /// Starts kube-scheduler with `args` added to its command line (e.g. `--secure-port` and
    /// `--authorization-always-allow-paths=/metrics` to read its metrics). Its log is
    /// `kube-scheduler.log` in the folder.
    pub fn start_scheduler_with(&mut self, args: &[String]) -> Result<(), String> {
        let mut command = scheduler_args(&self.server);
        command.retain(|a| !args.iter().any(|b| flag_name(a) == flag_name(b)));
        command.extend(args.iter().cloned());
        let binary = self.assets.join("kube-scheduler");
        let child = spawn(
            &binary,
            &command,
            &self.server.dir.join("kube-scheduler.log"),
        )?;
        self.processes.insert(0, child);
        self.rearm_reaper()
    }

    /// Starts kube-controller-manager from the same folder with `args` added to its command
    /// line (`--controllers=...` picks which: the ResourceClaim controller makes the claims of
    /// pods from their templates, the node lifecycle controller lifts the not-ready taint of
    /// Ready nodes). Its log is `kube-controller-manager.log` in the folder.
    pub fn start_controller_manager(&mut self, args: &[String]) -> Result<(), String> {
        let binary = self.assets.join("kube-controller-manager");
        if !binary.is_file() {
            return Err(format!(
                "{} is missing: KUBEBUILDER_ASSETS must hold kube-controller-manager",
                binary.display()
            ));
        }
        let mut command = vec![
            format!("--kubeconfig={}", self.server.kubeconfig.display()),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            "--secure-port=0".into(),
            format!("--root-ca-file={}", self.server.ca.display()),
            format!(
                "--service-account-private-key-file={}",
                self.server.dir.join("sa.key").display()
            ),
            "--use-service-account-credentials=false".into(),
        ];
        command.retain(|a| !args.iter().any(|b| flag_name(a) == flag_name(b)));
        command.extend(args.iter().cloned());
        let child = spawn(
            &binary,
            &command,
            &self.server.dir.join("kube-controller-manager.log"),
        )?;
        self.processes.insert(0, child);
        self.rearm_reaper()
    }

    /// Stops the API server (etcd and any scheduler or controller manager keep running), as an
    /// outage or an upgrade of the control plane does; [`ControlPlane::start_api_server`] brings
    /// it back on the same address.
    pub fn stop_api_server(&mut self) -> Result<(), String> {
        if self.api_server_stopped || self.processes.len() < 2 {
            return Err("stop_api_server: the API server is not running".to_owned());
        }
        self.disarm_reaper();
        let at = self.processes.len() - 2;
        let mut apiserver = self.processes.remove(at);
        stop_all(std::slice::from_mut(&mut apiserver));
        self.api_server_stopped = true;
        self.rearm_reaper()
    }

    /// Starts the API server stopped by [`ControlPlane::stop_api_server`] again and waits until
    /// it is ready.
    pub async fn start_api_server(&mut self) -> Result<(), String> {
        if !self.api_server_stopped {
            return Err("start_api_server: the API server is not stopped".to_owned());
        }
        let apiserver = spawn(
            &self.assets.join("kube-apiserver"),
            &self.commands.apiserver,
            &self.server.dir.join("kube-apiserver-restarted.log"),
        )?;
        let at = self.processes.len() - 1;
        self.processes.insert(at, apiserver);
        self.api_server_stopped = false;
        self.rearm_reaper()?;
        wait_ready_async(&self.server.kubeconfig, &self.server.ca).await
    }

    /// Restores the cluster from nothing, as an operator restores or rebuilds a cluster's
    /// etcd: the API server and etcd stop, etcd's data is wiped, and both start again on the
    /// same addresses (every object is gone and resource versions start again; clients keep
    /// their connections' addresses and credentials). Waits until the API server is ready.
    /// Only for a control plane without a scheduler.
    pub async fn restore_empty(&mut self) -> Result<(), String> {
        if self.processes.len() != 2 {
            return Err("restore_empty: only etcd and the API server may be running".to_owned());
        }
        self.stop_processes();
        let data = self.server.dir.join("etcd");
        std::fs::remove_dir_all(&data)
            .map_err(|e| fail(&format!("remove {}", data.display()), e))?;
        let etcd = spawn(
            &self.assets.join("etcd"),
            &self.commands.etcd,
            &self.server.dir.join("etcd-restored.log"),
        )?;
        self.processes.push(etcd);
        let apiserver = spawn(
            &self.assets.join("kube-apiserver"),
            &self.commands.apiserver,
            &self.server.dir.join("kube-apiserver-restored.log"),
        )?;
        self.processes.insert(0, apiserver);
        self.rearm_reaper()?;
        wait_ready_async(&self.server.kubeconfig, &self.server.ca).await
    }

    /// Replaces the reaper by one that knows every process now running.
    fn rearm_reaper(&mut self) -> Result<(), String> {
        self.disarm_reaper();
        let pids: Vec<u32> = self.processes.iter().map(Child::id).collect();
        self.reaper = Some(reap_at_exit(None, &pids)?);
        Ok(())
    }

    fn disarm_reaper(&mut self) {
        if let Some(mut reaper) = self.reaper.take() {
            let _ = reaper.kill();
            let _ = reaper.wait();
        }
    }

    /// Stops every process now (what dropping does); returns how long that took.
    pub fn stop(mut self) -> Duration {
        let started = Instant::now();
        self.stop_processes();
        started.elapsed()
    }

    fn stop_processes(&mut self) {
        // The reaper first: once we have waited for a process its PID may be reused.
        self.disarm_reaper();
        // The API server and the scheduler together, then etcd (an API server without its etcd
        // takes long to give up).
        let etcd = self.processes.pop();
        stop_all(&mut self.processes);
        self.processes.clear();
        if let Some(etcd) = etcd {
            stop_all(&mut [etcd]);
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop_processes();
    }
}

/// [`ready_or_exit`] on a thread of its own, so that it works from inside any test runtime.
fn wait_ready(server: &ApiServer, children: &mut [Child], dir: &Path) -> Result<(), NotReady> {
    let failed = |message: String| NotReady {
        port_taken: false,
        message,
    };
    let _ = std::io::stderr().flush();
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| failed(fail("runtime", e)))?;
                runtime.block_on(ready_or_exit(server, children, dir))
            })
            .join()
            .map_err(|_| failed("the readiness thread panicked".to_owned()))?
    })
}

/// Polls `/readyz` with `kubeconfig` until it answers `ok` (60 s at most); `ca` is the serving
/// certificate the API server writes once it runs.
pub async fn wait_ready_async(kubeconfig: &Path, ca: &Path) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::from("no answer");
    while Instant::now() < deadline {
        if ca.exists() {
            match client(kubeconfig).await {
                Ok(c) => {
                    let request = http::Request::get("/readyz")
                        .body(Vec::new())
                        .map_err(|e| fail("request", e))?;
                    match c.request_text(request).await {
                        Ok(text) if text.trim() == "ok" => return Ok(()),
                        Ok(text) => last = text,
                        Err(err) => last = err.to_string(),
                    }
                }
                Err(err) => last = err,
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!("the API server was not ready in 60 s: {last}"))
}
