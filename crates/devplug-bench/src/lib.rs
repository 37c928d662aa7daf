//! The parts of the benchmarks that tests run too: the fleet simulator (`devplug-bench fleet`).

pub mod fleet;
