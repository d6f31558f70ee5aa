//! Multi-process GPU runs: `launch_processes` starts this test binary twice as ranks 0 and 1
//! (torchrun variables), each runs its rank of the ring all-gather + linear program through
//! the TCP rendezvous and NCCL, and rank 0 gathers the outputs and compares them with the
//! level-1 reference.
//!
//! Built with the `cuda` feature only (`cargo test --features cuda`).
#![cfg(feature = "cuda")]

use crate::support::gpu as support;
use crate::support::runtime as common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use meshflow::launch::{launch_processes, LaunchSpec, Sink};
use meshflow::runtime::compare::{compare_outputs, random_inputs};
use meshflow::runtime::cuda::run_program_cuda;
use meshflow::runtime::reference::evaluate;
use meshflow::runtime::rendezvous::TorchrunEnv;
use support::*;

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);

impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn two_processes_run_the_ring_program_and_rank_0_compares() {
    if skip_unless(2, "two_processes_run_the_ring_program_and_rank_0_compares") {
        return;
    }
    let exe = std::env::current_exe().unwrap().display().to_string();
    let spec = LaunchSpec {
        nproc: 2,
        master_addr: "127.0.0.1".into(),
        master_port: None,
        command: vec![
            exe,
            "--ignored".into(),
            "--exact".into(),
            "multiprocess::rank_process".into(),
            "--nocapture".into(),
            "--test-threads=1".into(),
        ],
    };
    let (out, err) = (Buf::default(), Buf::default());
    let out_sink: Sink = Arc::new(Mutex::new(out.clone()));
    let err_sink: Sink = Arc::new(Mutex::new(err.clone()));
    let r = launch_processes(&spec, out_sink, err_sink);
    let text = String::from_utf8_lossy(&out.0.lock().unwrap()).into_owned()
        + &String::from_utf8_lossy(&err.0.lock().unwrap());
    eprintln!("{text}");
    r.unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert!(text.contains("rank 0: ok y:"), "{text}");
    assert!(text.contains("rank 1: outputs sent to rank 0"), "{text}");
}

/// One rank (started by the test above with the torchrun variables set).
#[test]
#[ignore = "a rank process of two_processes_run_the_ring_program_and_rank_0_compares"]
fn rank_process() {
    let env = TorchrunEnv::from_env()
        .expect("valid torchrun variables")
        .expect("RANK and WORLD_SIZE are set by the launcher");
    let d = env.world_size as i64;
    let l1 = common::level1("ring_linear.mf", &[("d", d)]);
    let host = common::ring_host(d);
    let inputs = random_inputs(&l1, 17).unwrap();
    let run = run_program_cuda(
        &l1,
        &host,
        &inputs,
        env.world_size,
        &cuda_options(),
        Some(&env),
    )
    .unwrap_or_else(|e| panic!("rank {}: {e}", env.rank));
    match run.outputs {
        Some(got) => {
            let want = evaluate(&l1, &inputs).unwrap();
            let cmp = compare_outputs(&l1, &got, &want).unwrap();
            eprintln!("rank {}: {cmp}", env.rank);
            assert!(cmp.passed(), "{cmp}");
        }
        None => eprintln!("rank {}: outputs sent to rank 0", env.rank),
    }
}
