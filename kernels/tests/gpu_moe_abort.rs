//! GPU test of the NVLink MoE abort word: a rank whose peer never shows up gives up its wait as
//! soon as the host raises the engine's abort word (as the runtime does when it learns that the
//! peer's process is gone), and the status says why, in which phase and for which peer. Needs
//! 2 GPUs (prints why it skipped otherwise).
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use meshflow_kernels::moe::{CombineRequest, DispatchRequest, MoeShape, MoeTransport, NvlinkMoe};
use meshflow_kernels::{DType, Device, DeviceBuffer, Stream};

fn two_devices() -> Option<Vec<Device>> {
    match Device::count() {
        Ok(n) if n >= 2 => Some((0..2).map(|i| Device::new(i).unwrap()).collect()),
        Ok(n) => {
            println!("skipped: the abort test needs 2 GPUs ({n} visible)");
            None
        }
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}

fn shape() -> MoeShape {
    MoeShape {
        world: 2,
        experts: 8,
        top_k: 2,
        tokens: 16,
        hidden: 64,
        out_hidden: 64,
        capacity: 32,
        dtype: DType::BF16,
    }
}

/// Rank 0 runs a step alone (rank 1 never dispatches or combines); its host raises the abort
/// word while the kernel waits. `phase` picks where rank 0 waits: in its dispatch (rank 1
/// never dispatched) or in its combine (rank 1 dispatched, then never combined).
fn abandoned_wait(devs: &[Device], phase: &str) {
    let s = shape();
    let mut team = NvlinkMoe::team(devs, &s).unwrap();
    let mut rank1 = team.pop().unwrap();
    let mut rank0 = team.pop().unwrap();
    // Far past the test's length: only the abort word can end the wait.
    rank0.set_flag_timeout(Duration::from_secs(600));
    let bufs = |dev: &Device| {
        let st = Stream::new(dev).unwrap();
        let x = DeviceBuffer::alloc(dev, s.tokens * s.x_row_bytes()).unwrap();
        x.zero(&st).unwrap();
        let idx: Vec<i32> = (0..s.tokens * s.top_k)
            .map(|i| (i % s.experts) as i32)
            .collect();
        let idx = DeviceBuffer::from_slice(&st, &idx).unwrap();
        let w = DeviceBuffer::from_slice(&st, &vec![0.5f32; s.tokens * s.top_k]).unwrap();
        let rows = s.local_experts() * s.capacity * s.y_row_bytes();
        let y = DeviceBuffer::alloc(dev, rows).unwrap();
        y.zero(&st).unwrap();
        let out = DeviceBuffer::alloc(dev, s.tokens * s.y_row_bytes()).unwrap();
        (st, x, idx, w, y, out)
    };
    let (st0, x0, idx0, w0, y0, out0) = bufs(&devs[0]);
    let (st1, x1, idx1, w1, _, _) = bufs(&devs[1]);
    let req = |x, idx, w| DispatchRequest {
        x,
        topk_idx: idx,
        weights: Some(w),
        zero_padding: false,
        outputs: None,
    };
    if phase == "combine" {
        rank1.dispatch_with(&st1, &req(&x1, &idx1, &w1)).unwrap();
    }
    rank0.dispatch_with(&st0, &req(&x0, &idx0, &w0)).unwrap();
    if phase == "combine" {
        let c = CombineRequest {
            expert_y: &y0,
            weights: None,
        };
        rank0.combine_with(&st0, &c, &out0).unwrap();
    }
    let done = st0.record_event().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !done.is_complete().unwrap(),
        "rank 0's {phase} finished although rank 1 never sent its part"
    );
    let word = rank0.abort_word();
    let raised = Instant::now();
    word.raise();
    st0.synchronize().unwrap();
    let took = raised.elapsed();
    let status = rank0.status(&st0).unwrap();
    println!("{phase}: gave up {took:?} after the abort word was raised; status {status:?}");
    assert!(word.is_raised());
    assert!(
        status.aborted() && status.timeout(),
        "status {status:?} lacks ABORTED | TIMEOUT"
    );
    assert_eq!(status.gave_up_in(), Some(phase), "status {status:?}");
    assert_eq!(status.waited_for(), Some(1), "status {status:?}");
    st1.synchronize().unwrap();
    drop(rank0);
    drop(rank1);
}

#[test]
fn a_raised_abort_word_ends_an_nvlink_wait_for_a_missing_peer() {
    let Some(devs) = two_devices() else { return };
    abandoned_wait(&devs, "dispatch");
    abandoned_wait(&devs, "combine");
}
