//! Builds the ring variant of a column-parallel linear with the Rust API and prints it.
//!
//! `cargo run --example build_program -- 4` (the argument is the team size, default 4).

#![allow(clippy::print_stdout)] // an example binary prints its result

use meshflow::ir::{DType, DeviceMesh, ParallelType::*, ProgramBuilder};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let d: u64 = std::env::args().nth(1).map_or(Ok(4), |s| s.parse())?;
    let mut b = ProgramBuilder::new("column_parallel_linear_ring");
    let m = b.mesh("m0", DeviceMesh::iota(vec![d as usize], 0)?)?;
    let x = b.input("x", DType::BF16, &[16 * d, 32], m)?; // sequence-parallel activations
    let w = b.input("w", DType::BF16, &[12 * d, 32], m)?; // column-parallel weight
    b.schedule(x).outer_split(0, d).parallelize(0, DIDx);
    b.schedule(w).outer_split(0, d).parallelize(0, DIDx);
    let ag = b.set(x)?; // all-gather of x, decomposed over a swizzled stream axis: a ring
    b.rename(ag, "ag")?;
    b.schedule(ag)
        .outer_split(0, d)
        .swizzle1d(0, DIDx)
        .parallelize(0, Stream);
    let y = b.linear(ag, w)?;
    b.rename(y, "y")?;
    b.output(y);
    let program = b.build()?;
    print!("{program}");
    Ok(())
}
