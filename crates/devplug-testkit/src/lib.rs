//! Test support for devplug that is not part of its API: nothing here ships in a binary.
//!
//! [`node`] runs a whole single-node Kubernetes cluster on this machine (etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler, containerd with runc and CNI, and a kubelet that
//! registers its Node through the API server), so tests can install devplug as an operator does
//! (its image, its Helm chart, its kustomize base) and check what a real container gets.

pub mod node;
