//! Test support for devplug, kept out of every library crate's API (as kube-rs keeps its test
//! helpers out of its runtime crates) and out of every binary of the image: the `devplug`
//! command links [`fake_sysfs`] and [`api_server`] for its demos on fake GPUs and a local
//! control plane only (`demo nvidia`, `demo --dra`), under its `dev-demos` feature, which the
//! image's builds leave out.
//!
//! - [`fake_sysfs`]: fake sysfs and `/dev` trees (PCI devices with real symlinks, DRM nodes,
//!   AMD's KFD topology) for the backends' tests, benchmarks and the GPU demo.
//! - [`api_server`]: a real etcd + kube-apiserver (+ kube-scheduler) the envtest way, from
//!   `KUBEBUILDER_ASSETS`; its admin client, and fresh Nodes for tests.
//! - [`dra_node`]: a node's kubelet (the simulator) with devplug's DRA driver registered to
//!   it, and the claims, pods and waits the DRA tests against the real API server share.
//! - [`rendered`]: the rendered Helm chart's releases, and their permissions applied to a real
//!   API server for permission tests.
//! - [`node`]: a whole single-node Kubernetes cluster on this machine (etcd, kube-apiserver,
//!   kube-controller-manager, kube-scheduler, containerd with runc and CNI, and a kubelet that
//!   registers its Node through the API server), so tests can install devplug as an operator
//!   does (its image, its Helm chart, its kustomize base) and check what a real container gets.

pub mod api_server;
pub mod dra_node;
pub mod fake_accelerators;
pub mod fake_sysfs;
pub mod node;
pub mod rendered;
