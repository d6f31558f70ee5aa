//! bf16 GEMM times on GPU 0 through [`Gemm`], for both layouts of B (`nn`: `[K, N]`, as
//! `torch.matmul(x, w)`; `nt`: `[N, K]` weights, as a linear layer), at the shapes the schedule
//! benchmarks use (whole and chunked GEMMs of AG+GEMM and GEMM+RS at 2 ranks), or the
//! `MxKxN` shapes given:
//!
//! ```text
//! cargo run --release -p meshflow-kernels --features cuda --example gemm_timing -- [MxKxN ...]
//! ```
//!
//! Inputs are random (uniform in [-1, 1)): a GEMM's power draw, hence its clock, depends on the
//! data, and constant inputs run measurably faster than random ones. Each figure is the median
//! over 20 timed runs (CUDA events) after 5 untimed ones, first right after an idle pause
//! (`burst`, the GPU at its boost clock, the way a short benchmark sees it) and then after
//! `MESHFLOW_GEMM_SUSTAIN_MS` (default 2000) of back-to-back GEMMs (`sustained`, the clock a
//! long run settles at).

// The table on stdout is what this example is for.
#![allow(clippy::print_stdout)]

use std::error::Error;
use std::time::{Duration, Instant};

use meshflow_kernels::{DType, Device, DeviceBuffer, Event, Gemm, Stream};

const DEFAULT_SHAPES: [(usize, usize, usize); 8] = [
    (16384, 8192, 4096),
    (8192, 8192, 4096),
    (4096, 8192, 4096),
    (16384, 4096, 8192),
    (8192, 4096, 8192),
    (4096, 4096, 8192),
    (2048, 4096, 8192),
    (1024, 4096, 8192),
];

fn parse(s: &str) -> Result<(usize, usize, usize), Box<dyn Error>> {
    let v: Vec<usize> = s
        .split(['x', 'X'])
        .map(|p| p.trim().parse::<usize>())
        .collect::<Result<_, _>>()?;
    match v.as_slice() {
        [m, k, n] if *m > 0 && *k > 0 && *n > 0 => Ok((*m, *k, *n)),
        _ => Err(format!("`{s}`: expected MxKxN").into()),
    }
}

/// Random bf16 values in [-1, 1) (xorshift).
fn random_bf16(count: usize, seed: u64) -> Vec<half::bf16> {
    let mut x = seed | 1;
    (0..count)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let v = (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            half::bf16::from_f32(v)
        })
        .collect()
}

fn sustain(
    stream: &Stream,
    g: &Gemm,
    bufs: [&DeviceBuffer; 3],
    ms: u64,
) -> Result<(), Box<dyn Error>> {
    let until = Instant::now() + Duration::from_millis(ms);
    while Instant::now() < until {
        for _ in 0..4 {
            g.run(stream, bufs[0], bufs[1], bufs[2])?;
        }
        stream.synchronize()?;
    }
    Ok(())
}

fn time(stream: &Stream, g: &Gemm, bufs: [&DeviceBuffer; 3]) -> Result<f64, Box<dyn Error>> {
    let dev = stream.device();
    for _ in 0..5 {
        g.run(stream, bufs[0], bufs[1], bufs[2])?;
    }
    let mut us = Vec::new();
    for _ in 0..20 {
        let (a, b) = (Event::timing(dev)?, Event::timing(dev)?);
        a.record(stream)?;
        g.run(stream, bufs[0], bufs[1], bufs[2])?;
        b.record(stream)?;
        b.synchronize()?;
        us.push(f64::from(Event::elapsed_ms(&a, &b)?) * 1000.0);
    }
    us.sort_by(f64::total_cmp);
    Ok(us[us.len() / 2])
}

fn main() -> Result<(), Box<dyn Error>> {
    let shapes = std::env::args()
        .skip(1)
        .map(|s| parse(&s))
        .collect::<Result<Vec<_>, _>>()?;
    let shapes = if shapes.is_empty() {
        DEFAULT_SHAPES.to_vec()
    } else {
        shapes
    };
    let dev = Device::new(0)?;
    let stream = Stream::new(&dev)?;
    let sustain_ms = std::env::var("MESHFLOW_GEMM_SUSTAIN_MS")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(2000);
    println!("{} (random bf16 inputs)", dev.name());
    println!(
        "{:>20} {:>6} {:>10} {:>8} {:>12} {:>8}",
        "MxKxN", "layout", "burst us", "TFLOP/s", "sustained us", "TFLOP/s"
    );
    for (m, k, n) in shapes {
        let bytes = |r: usize, c: usize| r * c * DType::BF16.size_bytes();
        let a = DeviceBuffer::from_slice(&stream, &random_bf16(m * k, 1))?;
        let b = DeviceBuffer::from_slice(&stream, &random_bf16(k * n, 2))?;
        let c = DeviceBuffer::alloc(&dev, bytes(m, n))?;
        for (name, g) in [
            ("nn", Gemm::new(m, n, k, DType::BF16)),
            ("nt", Gemm::linear(m, n, k, DType::BF16)),
        ] {
            std::thread::sleep(Duration::from_millis(500));
            let burst = time(&stream, &g, [&a, &b, &c])?;
            sustain(&stream, &g, [&a, &b, &c], sustain_ms)?;
            let steady = time(&stream, &g, [&a, &b, &c])?;
            let tf = |us: f64| g.flops() / us / 1e6;
            println!(
                "{:>20} {name:>6} {burst:>10.1} {:>8.1} {steady:>12.1} {:>8.1}",
                format!("{m}x{k}x{n}"),
                tf(burst),
                tf(steady)
            );
        }
    }
    Ok(())
}
