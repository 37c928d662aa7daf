//! Test support for devplug, kept out of every library crate's API (as kube-rs keeps its test
//! helpers out of its runtime crates). The `devplug` command links the first two modules for its
//! demos only (`demo --nvidia`, `demo --dra`, under its `tools` feature; devplug-lite has
//! neither).
//!
//! - [`fake_sysfs`]: fake sysfs and `/dev` trees (PCI devices with real symlinks, DRM nodes,
//!   AMD's KFD topology) for the backends' tests, benchmarks and the GPU demo.
//! - [`api_server`]: a real etcd + kube-apiserver (+ kube-scheduler) the envtest way, from
//!   `KUBEBUILDER_ASSETS`; its admin client, and fresh Nodes for tests.
//! - [`node`]: a whole single-node Kubernetes cluster on this machine (etcd, kube-apiserver,
//!   kube-controller-manager, kube-scheduler, containerd with runc and CNI, and a kubelet that
//!   registers its Node through the API server), so tests can install devplug as an operator
//!   does (its image, its Helm chart, its kustomize base) and check what a real container gets.

pub mod api_server;
pub mod fake_accelerators;
pub mod fake_sysfs;
pub mod node;
