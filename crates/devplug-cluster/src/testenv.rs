//! A real control plane for tests, the envtest way: `etcd` and `kube-apiserver` from the folder
//! named by `KUBEBUILDER_ASSETS`, started once per test binary on loopback in a temp folder, and
//! stopped by PID when the test binary exits (a small reaper process watches it).
//!
//! Without `KUBEBUILDER_ASSETS` [`ApiServer::shared`] returns `None` after printing a loud
//! message: tests then say `SKIPPED` and how to get the binaries, never pass silently; with
//! `DEVPLUG_REQUIRE_API_SERVER` set (CI) a missing `KUBEBUILDER_ASSETS` fails them instead. Get them
//! with `../shared/k8s/setup.sh target/k8s-assets` in this repository's checkout, or
//! `setup-envtest use 1.36.x -p path` (controller-runtime's tool) anywhere.
//!
//! The API server authenticates a static admin token (`system:masters`) and service account
//! tokens (TokenRequest), and authorizes with RBAC, so permission tests are real.

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The admin token in the API server's static token file.
const ADMIN_TOKEN: &str = "devplug-test-admin";

/// A running etcd + kube-apiserver pair.
#[derive(Debug)]
pub struct ApiServer {
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    /// The serving certificate's CA bundle (PEM).
    pub ca: PathBuf,
    /// A kubeconfig for the admin.
    pub kubeconfig: PathBuf,
    /// The temp folder (etcd data, certificates, logs); removed by the reaper.
    pub dir: PathBuf,
}

static SHARED: OnceLock<Result<ApiServer, String>> = OnceLock::new();
static SCHEDULER: OnceLock<Result<(), String>> = OnceLock::new();

/// Why the control plane could not start.
fn fail(what: &str, err: impl std::fmt::Display) -> String {
    format!("{what}: {err}")
}

impl ApiServer {
    /// The API server of this test binary, started on first use; `None` (after a loud message
    /// on stderr) when `KUBEBUILDER_ASSETS` is not set. A start failure panics with the logs'
    /// location: a broken environment must fail tests, not skip them.
    pub fn shared(test: &str) -> Option<&'static ApiServer> {
        let Some(assets) = std::env::var_os("KUBEBUILDER_ASSETS") else {
            assert!(
                std::env::var_os("DEVPLUG_REQUIRE_API_SERVER").is_none(),
                "{test}: DEVPLUG_REQUIRE_API_SERVER is set but KUBEBUILDER_ASSETS is not"
            );
            // Written straight to stderr: the test harness hides eprintln! of passing tests.
            let _ = writeln!(
                std::io::stderr(),
                "\n*** SKIPPED {test}: KUBEBUILDER_ASSETS is not set, so there is no API server to test against.\n\
                 *** Get kube-apiserver and etcd with `../shared/k8s/setup.sh target/k8s-assets` and\n\
                 *** `export KUBEBUILDER_ASSETS=$PWD/target/k8s-assets` (this repository's CI does), or with\n\
                 *** `setup-envtest use 1.36.x -p path` from controller-runtime. This test did NOT run.\n"
            );
            return None;
        };
        let started = SHARED.get_or_init(|| start(Path::new(&assets)));
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
                let binary = Path::new(&assets).join("kube-scheduler");
                if !binary.is_file() {
                    return Err(format!(
                        "{} is missing: the DRA tests need kube-scheduler beside kube-apiserver \
                         (../shared/k8s/setup.sh puts it there)",
                        binary.display()
                    ));
                }
                let child = spawn(
                    &binary,
                    &[
                        format!("--kubeconfig={}", self.kubeconfig.display()),
                        "--leader-elect=false".into(),
                        "--secure-port=0".into(),
                    ],
                    &self.dir.join("kube-scheduler.log"),
                )?;
                reap_at_exit(&self.dir, &[child.id()])
            })
            .clone()
    }

    /// A kubeconfig for `token`, written beside the admin's; for permission tests.
    pub fn kubeconfig_for_token(&self, name: &str, token: &str) -> std::io::Result<PathBuf> {
        let path = self.dir.join(format!("kubeconfig-{name}"));
        std::fs::write(&path, kubeconfig_text(&self.url, &self.ca, token))?;
        Ok(path)
    }
}

/// A kube client for the kubeconfig at `path` (no context switching, no env).
pub async fn client(path: &Path) -> Result<kube::Client, String> {
    crate::from_kubeconfig(path).await
}

fn kubeconfig_text(url: &str, ca: &Path, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n    certificate-authority: {}\nusers:\n- name: test\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\ncurrent-context: test\n",
        ca.display()
    )
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| fail("free port", e))?;
    let port = listener
        .local_addr()
        .map_err(|e| fail("free port", e))?
        .port();
    Ok(port)
}

/// The DER prefix of a P-256 SubjectPublicKeyInfo (algorithm id-ecPublicKey, curve prime256v1,
/// then a 66-byte BIT STRING holding the 65-byte uncompressed point).
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

fn pem(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(chunk));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// An ECDSA P-256 key pair for service account tokens: (private PKCS#8 PEM, public SPKI PEM).
fn service_account_keys() -> Result<(String, String), String> {
    use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_ASN1_SIGNING};
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng)
        .map_err(|e| fail("service account key", e))?;
    let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref(), &rng)
        .map_err(|e| fail("service account key", e))?;
    let mut spki = P256_SPKI_PREFIX.to_vec();
    spki.extend_from_slice(pair.public_key().as_ref());
    Ok((pem("PRIVATE KEY", pkcs8.as_ref()), pem("PUBLIC KEY", &spki)))
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

fn start(assets: &Path) -> Result<ApiServer, String> {
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
    let dir = tempfile::Builder::new()
        .prefix("devplug-apiserver-")
        .tempdir()
        .map_err(|e| fail("temp folder", e))?
        .keep();
    let (etcd_port, peer_port, api_port) = (free_port()?, free_port()?, free_port()?);
    let etcd = spawn(
        &etcd_bin,
        &[
            format!("--data-dir={}", dir.join("etcd").display()),
            format!("--listen-client-urls=http://127.0.0.1:{etcd_port}"),
            format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
            "--unsafe-no-fsync".into(),
        ],
        &dir.join("etcd.log"),
    )?;
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
    let apiserver = spawn(
        &apiserver_bin,
        &[
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
        ],
        &dir.join("kube-apiserver.log"),
    )?;
    reap_at_exit(&dir, &[etcd.id(), apiserver.id()])?;
    let ca = cert_dir.join("apiserver.crt");
    let url = format!("https://127.0.0.1:{api_port}");
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, kubeconfig_text(&url, &ca, ADMIN_TOKEN))
        .map_err(|e| fail("kubeconfig", e))?;
    let server = ApiServer {
        url,
        ca,
        kubeconfig,
        dir: dir.clone(),
    };
    wait_ready(&server).map_err(|e| {
        format!(
            "{e} (logs: {} and {})",
            dir.join("kube-apiserver.log").display(),
            dir.join("etcd.log").display()
        )
    })?;
    Ok(server)
}

/// A process that waits for this test binary to exit, then stops etcd and the API server by PID
/// (TERM, then KILL after 5 s) and removes the temp folder.
fn reap_at_exit(dir: &Path, pids: &[u32]) -> Result<(), String> {
    let me = std::process::id();
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    let pids = pids.join(" ");
    let script = format!(
        "while kill -0 {me} 2>/dev/null; do sleep 0.5; done; kill {pids} 2>/dev/null; \
         for i in 1 2 3 4 5 6 7 8 9 10; do kill -0 {pids} 2>/dev/null || break; sleep 0.5; done; \
         kill -9 {pids} 2>/dev/null; rm -rf '{}'",
        dir.display()
    );
    let mut reaper = Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| fail("reaper", e))?;
    // Not waited for: it outlives us on purpose. Drop the handle only.
    let _ = reaper.stdin.take();
    Ok(())
}

/// Polls `/readyz` with the admin kubeconfig until it answers `ok` (60 s at most), on a thread of
/// its own so that it works from inside any test runtime.
fn wait_ready(server: &ApiServer) -> Result<(), String> {
    let kubeconfig = server.kubeconfig.clone();
    let ca = server.ca.clone();
    let waited = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| fail("runtime", e))?;
        runtime.block_on(async {
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut last = String::from("no answer");
            while Instant::now() < deadline {
                if ca.exists() {
                    match client(&kubeconfig).await {
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
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(format!("the API server was not ready in 60 s: {last}"))
        })
    });
    let _ = std::io::stderr().flush();
    waited
        .join()
        .map_err(|_| "the readiness thread panicked".to_owned())?
}
