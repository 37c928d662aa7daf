//! Who talks to the API server, and how: the admin's static token and kubeconfig, kubeconfigs
//! for other tokens, the service account signing keys, TokenRequests for service account
//! tokens, and kube clients from kubeconfigs.

use super::{fail, ApiServer};
use std::path::{Path, PathBuf};

/// The admin token in the API server's static token file.
pub(super) const ADMIN_TOKEN: &str = "devplug-test-admin";

impl ApiServer {
    /// A kubeconfig for `token`, written beside the admin's; for permission tests.
    pub fn kubeconfig_for_token(&self, name: &str, token: &str) -> std::io::Result<PathBuf> {
        let path = self.dir.join(format!("kubeconfig-{name}"));
        std::fs::write(&path, kubeconfig_text(&self.url, &self.ca, token))?;
        Ok(path)
    }
}

/// A token of service account `account` (through `accounts`, its namespace's API), bound to
/// Node `node` so that it carries the node's name (`authentication.kubernetes.io/node-name`),
/// as a pod's token on that node does; bound to nothing with `None`. Panics on an API error (a
/// test helper).
pub async fn node_token(
    accounts: &kube::Api<k8s_openapi::api::core::v1::ServiceAccount>,
    account: &str,
    node: Option<&str>,
) -> String {
    use k8s_openapi::api::authentication::v1::TokenRequest;
    let mut spec = serde_json::json!({"audiences": [], "expirationSeconds": 3600});
    if let Some(node) = node {
        spec["boundObjectRef"] =
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "name": node});
    }
    let request: TokenRequest = serde_json::from_value(serde_json::json!({ "spec": spec }))
        .unwrap_or_else(|e| panic!("a TokenRequest: {e}"));
    let issued: TokenRequest = accounts
        .create_subresource(
            "token",
            account,
            &kube::api::PostParams::default(),
            &request,
        )
        .await
        .unwrap_or_else(|e| panic!("the API server issues no token for {account}: {e}"));
    issued
        .status
        .and_then(|s| s.token)
        .unwrap_or_else(|| panic!("the TokenRequest's status has no token"))
}

/// A client of `server` using `token` (its kubeconfig named `name`). Panics on an error.
pub async fn client_for_token(server: &ApiServer, name: &str, token: &str) -> kube::Client {
    let config = server
        .kubeconfig_for_token(name, token)
        .unwrap_or_else(|e| panic!("the kubeconfig {name}: {e}"));
    client(&config)
        .await
        .unwrap_or_else(|e| panic!("a client of the token {name}: {e}"))
}

/// A kube client for the kubeconfig at `path`: its current context, nothing from the
/// environment.
pub async fn client(path: &Path) -> Result<kube::Client, String> {
    let file = kube::config::Kubeconfig::read_from(path).map_err(|e| e.to_string())?;
    kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|e| e.to_string())
        .and_then(|config| kube::Client::try_from(config).map_err(|e| e.to_string()))
}

pub(super) fn kubeconfig_text(url: &str, ca: &Path, token: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n    certificate-authority: {}\nusers:\n- name: test\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: test\ncurrent-context: test\n",
        ca.display()
    )
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
pub fn service_account_keys() -> Result<(String, String), String> {
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
