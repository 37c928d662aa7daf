//! `devplug-link-order`: orders the functions of a devplug release binary by a training run, so
//! that the code a running node agent touches sits together at the front of `.text`.
//!
//! Why: the kernel maps a binary's code in 64 KiB fault-around windows, and in a default link
//! the functions `devplug run` executes (about 1.1 MiB) are spread over nearly all of its 3.2 MiB
//! of code, so nearly all of it stays resident. Packed together, only those windows are.
//! `deploy/build-static` drives it (docs/benchmarks.md, "Link order"):
//!
//! 1. build the binary with its symbol table (`-C strip=none`);
//! 2. `devplug-link-order train --bin BIN --out ORDER`: runs `BIN run` under valgrind's
//!    callgrind against the kubelet simulator ([`workload`]: a core and a broad scenario), and writes the names of the
//!    functions that ran, one per line: an lld `--symbol-ordering-file`;
//! 3. link again with `-Wl,--symbol-ordering-file=ORDER` (same code, so the same names);
//! 4. `devplug-link-order check --bin BIN --order ORDER`: fails unless those functions are
//!    packed in the new binary; then strip it.

mod callgrind;
mod symbols;
mod workload;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;
use workload::Scenario;

#[derive(Parser)]
#[command(
    version,
    about = "Orders devplug's functions for a smaller resident set"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run BIN (built with its symbols) under callgrind through the training scenario and write
    /// the functions that ran, in an lld symbol ordering file
    Train {
        /// The devplug binary, with its symbol table
        #[arg(long)]
        bin: PathBuf,
        /// Where to write the ordering file
        #[arg(long)]
        out: PathBuf,
    },
    /// Check that a binary linked with ORDER has those functions packed together
    Check {
        /// The devplug binary linked with the ordering file, with its symbol table
        #[arg(long)]
        bin: PathBuf,
        /// The ordering file it was linked with
        #[arg(long)]
        order: PathBuf,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Cmd::Train { bin, out } => train(bin, out).await,
        Cmd::Check { bin, order } => check(bin, order),
    }
}

async fn train(bin: PathBuf, out: PathBuf) -> anyhow::Result<()> {
    let valgrind = Command::new("valgrind").arg("--version").output();
    if !valgrind.is_ok_and(|o| o.status.success()) {
        bail!(
            "valgrind is not installed: install it (Debian: apt-get install valgrind), or build \
             without a link order (DEVPLUG_LINK_ORDER=off deploy/build-static)"
        );
    }
    let table = symbols::read(&bin)?;
    let started = std::time::Instant::now();
    let core = functions_run(&bin, Scenario::Core).await?;
    let broad = functions_run(&bin, Scenario::Broad).await?;
    // The core first, then what only the broad run added.
    let mut ordered = symbols::order(&core, &table);
    let core_bytes: u64 = ordered.iter().map(|f| f.size).sum();
    let in_core: HashSet<&str> = ordered.iter().map(|f| f.name.as_str()).collect();
    let added: Vec<String> = broad
        .into_iter()
        .filter(|name| !in_core.contains(name.as_str()))
        .collect();
    ordered.extend(symbols::order(&added, &table));
    if ordered.is_empty() {
        bail!("callgrind saw none of {}'s functions run", bin.display());
    }
    let mut file = String::new();
    for f in &ordered {
        file.push_str(&f.name);
        file.push('\n');
    }
    std::fs::write(&out, file).with_context(|| format!("writing {}", out.display()))?;
    let bytes: u64 = ordered.iter().map(|f| f.size).sum();
    let all: u64 = table.iter().map(|f| f.size).sum();
    println!(
        "trained in {:.0} s: {} functions ran, {} KiB of {} KiB of code ({} KiB in the core run); wrote {}",
        started.elapsed().as_secs_f64(),
        ordered.len(),
        bytes / 1024,
        all / 1024,
        core_bytes / 1024,
        out.display()
    );
    Ok(())
}

/// The functions that ran in one training run, from callgrind's output.
async fn functions_run(bin: &std::path::Path, scenario: Scenario) -> anyhow::Result<Vec<String>> {
    let work = tempfile::tempdir()?;
    let output = workload::run(bin, scenario, work.path())
        .await
        .with_context(|| format!("the {scenario:?} training run"))?;
    let text = std::fs::read_to_string(&output)
        .with_context(|| format!("reading callgrind's output {}", output.display()))?;
    Ok(callgrind::functions_run(&text))
}

fn check(bin: PathBuf, order: PathBuf) -> anyhow::Result<()> {
    let listed: Vec<String> = std::fs::read_to_string(&order)
        .with_context(|| format!("reading {}", order.display()))?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect();
    let table = symbols::read(&bin)?;
    let layout = symbols::layout(&listed, &table);
    println!(
        "{}: {} of {} ordered functions found, {} KiB of code packed into {} KiB (all code: {} KiB)",
        bin.display(),
        layout.found,
        layout.listed,
        layout.bytes / 1024,
        layout.span / 1024,
        layout.all_bytes / 1024
    );
    if !layout.is_packed() {
        bail!(
            "the link order did not take: the functions of {} are not packed in {} (was it \
             linked with lld and -Wl,--symbol-ordering-file, from the same build?)",
            order.display(),
            bin.display()
        );
    }
    Ok(())
}
