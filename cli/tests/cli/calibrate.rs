//! `meshflow calibrate` on the CPU backend: the profile it writes is read back by `--profile`,
//! and says that its figures are the CPU backend's, not a GPU's.

use crate::{fails, scratch, succeeds, RING};

#[test]
fn calibrate_writes_a_profile_that_lower_reads() {
    let dir = scratch("calibrate");
    let out = dir.join("cpu.json");
    let path = out.to_str().unwrap();
    let text = succeeds(&[
        "calibrate",
        "--quick",
        "--warmup",
        "0",
        "--iters",
        "1",
        "--out",
        path,
    ]);
    assert!(text.contains("NOT GPU figures"), "{text}");
    assert!(text.contains("written to"), "{text}");
    let json = std::fs::read_to_string(&out).unwrap();
    let profile = meshflow::Profile::from_json(&json).unwrap();
    assert!(profile.provisional);
    assert_eq!(profile.world, 2);
    let lowered = succeeds(&["lower", RING, "--ranks", "2", "--profile", path]);
    assert!(lowered.contains("host "), "{lowered}");
}

#[test]
fn calibrate_refuses_one_rank_and_gpus_without_cuda() {
    let err = fails(&["calibrate", "--ranks", "1", "--quick", "--out", "/dev/null"]);
    assert!(err.contains("at least 2 ranks"), "{err}");
    if !cfg!(feature = "cuda") {
        let err = fails(&["calibrate", "--backend", "cuda", "--out", "/dev/null"]);
        assert!(err.contains("cuda"), "{err}");
    }
}
