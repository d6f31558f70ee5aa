//! `meshflow trace`: a Perfetto trace and an SVG timeline of a run on the CPU backend (the GPU
//! path, `--backend cuda`, writes the same files from CUDA event intervals).

use std::process::{Command, Output};

fn meshflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_meshflow"))
        .args(args)
        .current_dir(crate::support::root())
        .env_remove("RUST_LOG")
        .output()
        .expect("the binary runs")
}

#[test]
fn the_ring_on_four_cpu_ranks_gives_a_trace_and_a_timeline() {
    let dir = std::env::temp_dir().join(format!("meshflow-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("ring.json");
    let o = meshflow(&[
        "trace",
        "examples/programs/column_parallel_linear_ring.mf",
        "--ranks",
        "4",
        "-o",
        json.to_str().unwrap(),
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("timeline to"), "{out}");
    let trace = std::fs::read_to_string(&json).unwrap();
    assert!(trace.starts_with("{\"traceEvents\":["), "{trace}");
    assert!(trace.contains("\"name\":\"collective_permute\""));
    assert!(trace.contains("\"name\":\"linear\""));
    let svg = std::fs::read_to_string(json.with_extension("svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for rank in 0..4 {
        for stream in ["main", "worker 0", "worker 1"] {
            assert!(
                svg.contains(&format!("rank {rank} · {stream}")),
                "rank {rank} {stream}"
            );
        }
    }
    // Boxes for compute (blue), communication (orange) and waits (grey).
    for colour in ["#4c78a8", "#f58518", "#b0b0b0"] {
        assert!(
            svg.contains(&format!("fill=\"{colour}\" stroke")),
            "{colour}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_gpu_backend_needs_the_cuda_feature_or_a_gpu() {
    let o = meshflow(&[
        "trace",
        "examples/programs/column_parallel_linear_ring.mf",
        "--ranks",
        "2",
        "--backend",
        "cuda",
        "-o",
        std::env::temp_dir()
            .join(format!("meshflow-trace-gpu-{}.json", std::process::id()))
            .to_str()
            .unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    if cfg!(feature = "cuda") && o.status.success() {
        eprintln!("ran on GPUs");
        return;
    }
    assert_ne!(o.status.code(), Some(0));
    assert!(
        err.contains("cuda") || err.contains("GPU") || err.contains("CUDA"),
        "{err}"
    );
}
