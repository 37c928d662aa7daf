//! `cuda-check`: runs one CUDA kernel through the driver API alone and checks every result.
//!
//! No CUDA toolkit is needed to build or run it: it loads the driver's `libcuda.so.1` at run
//! time (the one the node's driver provides, which devplug mounts into GPU containers at
//! `/usr/local/nvidia/lib64`), JIT-compiles a hand-written PTX kernel with the driver
//! (`cuModuleLoadDataEx`), runs `y[i] = a*x[i] + y[i]` over 1 Mi floats, copies the result
//! back and compares each element with the value computed here. One line per step, with its
//! time; the last line is `cuda-check: ok <device name> <n> elements`.
//!
//! Exit codes: 0 ok; 2 bad arguments; 3 no GPU here (`libcuda.so.1` cannot be loaded, or the
//! driver reports no device: what a node with a fake driver gives, so the plumbing can still
//! be tested there); 4 a wrong result; 5 a CUDA call failed; 6 the `--mem-bytes` allocation
//! was refused (the check itself passed).

mod args;
mod driver;
mod ptx;

use driver::{Cuda, CudaError};
use std::ffi::CString;
use std::process::ExitCode;
use std::time::Instant;

/// Exit code: bad arguments.
const EXIT_USAGE: u8 = 2;
/// Exit code: no GPU here (no loadable libcuda, or no device).
const EXIT_NO_GPU: u8 = 3;
/// Exit code: the kernel's result is wrong.
const EXIT_WRONG: u8 = 4;
/// Exit code: a CUDA call failed.
const EXIT_CUDA: u8 = 5;
/// Exit code: the `--mem-bytes` allocation was refused.
const EXIT_REFUSED: u8 = 6;

/// Threads per block.
const BLOCK: u32 = 256;
/// The kernel's `a`.
const A: f32 = 2.0;

/// Why the run stopped.
enum Stop {
    NoGpu(String),
    Wrong(String),
    Cuda(CudaError),
    Other(String),
}

impl From<CudaError> for Stop {
    fn from(e: CudaError) -> Self {
        Stop::Cuda(e)
    }
}

/// `elapsed` in milliseconds, for the step lines.
fn ms(since: Instant) -> String {
    format!("{:.1} ms", since.elapsed().as_secs_f64() * 1000.0)
}

fn say(line: &str) {
    println!("cuda-check: {line}");
}

fn main() -> ExitCode {
    let parsed = args::parse(std::env::args().skip(1));
    let args = match parsed {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{}", args::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(err) => {
            eprintln!("cuda-check: {err}\n{}", args::USAGE);
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match run(&args) {
        Ok(refused) if refused => ExitCode::from(EXIT_REFUSED),
        Ok(_) => ExitCode::SUCCESS,
        Err(Stop::NoGpu(why)) => {
            say(&format!("no real GPU here: {why}"));
            ExitCode::from(EXIT_NO_GPU)
        }
        Err(Stop::Wrong(why)) => {
            say(&format!("WRONG RESULT: {why}"));
            ExitCode::from(EXIT_WRONG)
        }
        Err(Stop::Cuda(err)) => {
            say(&format!("FAILED: {err}"));
            ExitCode::from(EXIT_CUDA)
        }
        Err(Stop::Other(why)) => {
            say(&format!("FAILED: {why}"));
            ExitCode::from(EXIT_CUDA)
        }
    }
}

/// The whole check; `Ok(true)` when the `--mem-bytes` allocation was refused.
fn run(args: &args::Args) -> Result<bool, Stop> {
    let total = Instant::now();
    let t = Instant::now();
    let cuda =
        Cuda::load().map_err(|e| Stop::NoGpu(format!("libcuda.so.1 cannot be loaded: {e}")))?;
    say(&format!("loaded libcuda.so.1 in {}", ms(t)));

    let t = Instant::now();
    match cuda.init() {
        Ok(()) => {}
        Err(e) if e.code == driver::NO_DEVICE => {
            return Err(Stop::NoGpu(format!("the driver reports no device ({e})")))
        }
        Err(e) => return Err(e.into()),
    }
    let version = cuda.driver_version()?;
    say(&format!(
        "cuInit ok, the driver supports CUDA {}.{}, in {}",
        version / 1000,
        version % 1000 / 10,
        ms(t)
    ));

    let t = Instant::now();
    let count = cuda.device_count()?;
    if count == 0 {
        return Err(Stop::NoGpu("the driver reports 0 devices".into()));
    }
    let device = cuda.device(args.device)?;
    let name = cuda.device_name(device)?;
    let memory = cuda.total_memory(device)?;
    say(&format!(
        "device {} of {count}: {name}, {} MiB, in {}",
        args.device,
        memory >> 20,
        ms(t)
    ));

    let t = Instant::now();
    let context = cuda.primary_context(device)?;
    say(&format!("primary context current in {}", ms(t)));

    let n = args.elements;
    let len = usize::try_from(n).map_err(|e| Stop::Other(e.to_string()))?;
    let bytes = len
        .checked_mul(std::mem::size_of::<f32>())
        .ok_or_else(|| Stop::Other("element count overflows".into()))?;
    let t = Instant::now();
    let x_dev = cuda.alloc(bytes)?;
    let y_dev = cuda.alloc(bytes)?;
    say(&format!("allocated 2 x {bytes} bytes in {}", ms(t)));

    let (x, y): (Vec<f32>, Vec<f32>) = (0..n).map(ptx::inputs).unzip();
    let t = Instant::now();
    cuda.copy_to(&x_dev, &x)?;
    cuda.copy_to(&y_dev, &y)?;
    say(&format!(
        "copied 2 x {bytes} bytes to the device in {}",
        ms(t)
    ));

    let t = Instant::now();
    let text = CString::new(ptx::SAXPY).map_err(|e| Stop::Other(e.to_string()))?;
    let module = cuda.load_ptx(&text)?;
    let kernel_name = CString::new(ptx::KERNEL).map_err(|e| Stop::Other(e.to_string()))?;
    let saxpy = cuda.function(&module, &kernel_name)?;
    say(&format!(
        "PTX kernel {} JIT-compiled by the driver (cuModuleLoadDataEx) in {}",
        ptx::KERNEL,
        ms(t)
    ));

    let t = Instant::now();
    cuda.launch_saxpy(&saxpy, BLOCK, n, A, &x_dev, &y_dev)?;
    say(&format!(
        "kernel ran on {} blocks of {BLOCK} threads (launch and synchronize) in {}",
        n.div_ceil(BLOCK),
        ms(t)
    ));

    let t = Instant::now();
    let mut out = vec![0f32; len];
    cuda.copy_from(&y_dev, &mut out)?;
    say(&format!("copied {bytes} bytes back in {}", ms(t)));

    let t = Instant::now();
    let wrong: Vec<(u32, f32, f32)> = (0..n)
        .zip(&out)
        .filter_map(|(i, got)| {
            let want = ptx::expected(A, i);
            (got.to_bits() != want.to_bits()).then_some((i, *got, want))
        })
        .collect();
    if let Some((i, got, want)) = wrong.first() {
        return Err(Stop::Wrong(format!(
            "{} of {n} elements differ; the first: y[{i}] = {got}, expected {want}",
            wrong.len()
        )));
    }
    say(&format!(
        "checked {n} elements: each equals {A}*x[i] + y[i], in {}",
        ms(t)
    ));

    let t = Instant::now();
    x_dev.free()?;
    y_dev.free()?;
    drop(module);
    say(&format!("freed device memory in {}", ms(t)));

    let mut refused = false;
    if let Some(want) = args.mem_bytes {
        let (free, _) = cuda.memory_info()?;
        let t = Instant::now();
        let asked = usize::try_from(want).unwrap_or(usize::MAX);
        match cuda.alloc(asked) {
            Ok(buffer) => {
                buffer.free()?;
                say(&format!(
                    "mem-bytes {want} allocated ({} MiB free before) in {}",
                    free >> 20,
                    ms(t)
                ));
            }
            Err(e) if e.code == driver::OUT_OF_MEMORY => {
                refused = true;
                say(&format!(
                    "mem-bytes {want} refused: {} ({} MiB free before) in {}",
                    e.name,
                    free >> 20,
                    ms(t)
                ));
            }
            Err(e) => return Err(e.into()),
        }
    }
    drop(context);
    say(&format!("all steps in {}", ms(total)));
    say(&format!("ok {name} {n} elements"));
    Ok(refused)
}
