//! Compiles a 64-layer transformer-like program (column- and row-parallel linears per layer
//! on a 2 x 4 mesh) through the whole pipeline.

use criterion::{criterion_group, criterion_main, Criterion};
use meshflow::{compile, Options};

#[path = "../../tests/support/programs.rs"]
#[allow(dead_code)]
mod common;

fn lower_transformer(c: &mut Criterion) {
    let program = common::transformer(64, 2, 4);
    let options = Options::new().check(false).verify_each_pass(false);
    c.bench_function("lower transformer 64 layers (2x4 mesh)", |b| {
        b.iter(|| compile(&program, &options).expect("the program lowers"))
    });
}

criterion_group!(benches, lower_transformer);
criterion_main!(benches);
