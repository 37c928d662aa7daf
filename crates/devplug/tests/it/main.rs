//! Integration tests: real plugin hosts against the kubelet simulator, over real Unix sockets in
//! temp folders. One test binary (`mod`s below) to keep linking cheap.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a panic in a test is a failed test

mod allocation;
mod apply;
mod faults;
mod lifecycle;
mod old_kubelet;
mod pod_resources;
mod raw_h2;
mod support;
mod watcher;
