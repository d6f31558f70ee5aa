//! THE ordered list of passes ([`pipeline`]); [`compile`](crate::compile) runs it.
//!
//! | # | pass | level | what it does |
//! |---|---|---|---|
//! | 1 | `verify_program` | 1 | rejects invalid input (cannot be disabled) |
//! | 2 | `propagate_shardings` | 1 | fills in unannotated schedules (weights first, then backward) |
//! | 3 | `decompose_reshardings` | 1 | rfactors partial-sum outputs; inserts `set`s so each resharding is one decision-table row |
//! | 4 | `choose_decompositions` | 1 | the schedule search: decomposition, chunks, stream schedule and transport of least predicted time (machine profile) |
//! | 5 | `lower_to_host` | 1 -> host | stream loops, communications, compute (cannot be disabled) |
//! | 6 | `prefetch_transfers` | host | ring loops planned (or forced) with the prefetch schedule: transfers one iteration ahead on a worker, compute on the main stream |
//! | 7 | `simplify_indices` | host | egg: affine-mod canonical index expressions; proves ring peers inverse |
//! | 8 | `assign_streams` | host | worker-stream pool around loops with communication and compute |
//! | 9 | `insert_allocations` | host | allocate/deallocate at the dominating block |
//! | 10 | `defer_waits` | host | waits just before first use; ring buffers for per-iteration temporaries |
//! | 11 | `verify_host` | host | checks the result (cannot be disabled) |
//!
//! `choose_decompositions` runs at level 1 (after the decomposition, before lowering) because
//! what it decides is a schedule: the Stream split (and swizzle) of a resharding's output,
//! which the lowering then turns into a loop. `simplify_indices` runs right after lowering so
//! later passes see canonical indices, and `assign_streams` runs before `insert_allocations`
//! so buffers are allocated outside the fork/join of a loop.
//!
//! The list is a [`PassManager`]: level-1 passes, the lowering, host passes, each in a list of
//! its own type, so a pass cannot be listed on the wrong side of the phase change.

use meshflow_passes::passes::{
    AssignStreams, ChooseDecompositions, DecomposeReshardings, DeferWaits, InsertAllocations,
    LowerToHost, PrefetchTransfers, PropagateShardings, SimplifyIndices, VerifyHost, VerifyProgram,
};
use meshflow_passes::PassError;
pub use meshflow_passes::{PassManager, PassOptions, StreamSchedule};

/// The passes, in order.
pub fn pipeline() -> PassManager {
    PassManager::new(
        vec![
            Box::new(VerifyProgram),
            Box::new(PropagateShardings),
            Box::new(DecomposeReshardings),
            Box::new(ChooseDecompositions),
        ],
        Box::new(LowerToHost),
        vec![
            Box::new(PrefetchTransfers),
            Box::new(SimplifyIndices),
            Box::new(AssignStreams),
            Box::new(InsertAllocations),
            Box::new(DeferWaits),
            Box::new(VerifyHost),
        ],
    )
}

/// The pass names, in order.
pub fn pass_names() -> Vec<&'static str> {
    pipeline().pass_names()
}

/// A machine profile by built-in name (`h200x2`, `h100x2`) or JSON file path.
pub fn load_profile(name_or_path: &str) -> Result<meshflow_passes::Profile, PassError> {
    if meshflow_passes::profile::BUILTIN.contains(&name_or_path) {
        return meshflow_passes::Profile::builtin(name_or_path);
    }
    let text = std::fs::read_to_string(name_or_path).map_err(|e| {
        PassError::Options(format!(
            "profile `{name_or_path}` is neither a built-in profile ({}) nor a readable file: {e}",
            meshflow_passes::profile::BUILTIN.join(", ")
        ))
    })?;
    meshflow_passes::Profile::from_json(&text)
}

/// The machine profile a compile prices its plans with, and why (what `--explain` prints and
/// the logs say), from [`choose_profile`].
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileChoice {
    /// The profile.
    pub profile: meshflow_passes::Profile,
    /// Why this one, starting with the profile's name: `h100x2: built-in profile of NVIDIA H100
    /// 80GB HBM3`, `h200x2: default, no built-in profile for NVIDIA A100-SXM4-80GB`,
    /// `mine: given`.
    pub reason: String,
}

impl ProfileChoice {
    /// The choice of [`choose_profile`] without a profile or a GPU, and without logging it:
    /// the built-in default ([`DEFAULT`](meshflow_passes::profile::DEFAULT)).
    pub fn unknown_target() -> ProfileChoice {
        ProfileChoice {
            profile: meshflow_passes::Profile::default_builtin(),
            reason: format!(
                "{}: default, no GPU named (the target machine is unknown)",
                meshflow_passes::profile::DEFAULT
            ),
        }
    }
}

/// THE choice of the machine profile: the profile `given` (`--profile`, `profile=`,
/// [`Options::profile`](crate::Options::profile)) wins; else the built-in profile of the GPU
/// model the program runs on (`device`, as the driver names it, e.g. `NVIDIA H100 80GB HBM3`;
/// [`Profile::builtin_for_device`](meshflow_passes::Profile::builtin_for_device)); else the
/// default ([`DEFAULT`](meshflow_passes::profile::DEFAULT)), said in the reason: for a GPU no
/// built-in profile describes, and where no GPU is named (`meshflow lower`, which cannot know
/// the target). Logs the choice (`info`).
pub fn choose_profile(
    given: Option<meshflow_passes::Profile>,
    device: Option<&str>,
) -> ProfileChoice {
    use meshflow_passes::profile::DEFAULT;
    use meshflow_passes::Profile;
    let choice = match (given, device) {
        (Some(profile), _) => ProfileChoice {
            reason: format!("{}: given", profile.name),
            profile,
        },
        (None, Some(device)) => {
            match Profile::builtin_for_device(device).map(|name| (name, Profile::builtin(name))) {
                Some((name, Ok(profile))) => ProfileChoice {
                    profile,
                    reason: format!("{name}: built-in profile of {device}"),
                },
                // A built-in profile that does not read is caught by the tests; never here.
                Some((_, Err(_))) | None => ProfileChoice {
                    profile: Profile::default_builtin(),
                    reason: format!("{DEFAULT}: default, no built-in profile for {device}"),
                },
            }
        }
        (None, None) => ProfileChoice::unknown_target(),
    };
    tracing::info!("machine profile {}", choice.reason);
    choice
}

/// `MESHFLOW_GPU_MODEL`: the GPU model the runs of this process price their plans for, in
/// place of the name of its GPU 0 ([`target_gpu_model`]).
pub const GPU_MODEL_ENV: &str = "MESHFLOW_GPU_MODEL";

/// The GPU model a run on the GPUs of this process prices its plans for (the `device` of
/// [`choose_profile`], through [`Options::device`](crate::Options::device)):
/// `MESHFLOW_GPU_MODEL` when set and not blank, else the name of GPU 0 as the driver gives it
/// (feature `cuda`). The variable is the one place that overrides the GPU's name: to price for
/// the model the job's other nodes have, and for tests to give the ranks of one job different
/// models without GPUs. `Err` says why there is none.
pub fn target_gpu_model() -> Result<String, String> {
    if let Ok(name) = std::env::var(GPU_MODEL_ENV) {
        if !name.trim().is_empty() {
            return Ok(name.trim().to_string());
        }
    }
    gpu_0_model()
}

#[cfg(feature = "cuda")]
fn gpu_0_model() -> Result<String, String> {
    crate::runtime::cuda::target_device().map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn gpu_0_model() -> Result<String, String> {
    Err("this meshflow was built without the `cuda` feature, so it sees no GPU".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshflow_passes::profile::DEFAULT;
    use meshflow_passes::Profile;

    #[test]
    fn the_profile_is_the_given_one_else_the_gpu_models_else_the_default() {
        for (device, name, reason) in [
            (
                "NVIDIA H100 80GB HBM3",
                "h100x2",
                "h100x2: built-in profile of NVIDIA H100 80GB HBM3",
            ),
            (
                "NVIDIA H200",
                "h200x2",
                "h200x2: built-in profile of NVIDIA H200",
            ),
            (
                "NVIDIA A100-SXM4-80GB",
                DEFAULT,
                "h200x2: default, no built-in profile for NVIDIA A100-SXM4-80GB",
            ),
        ] {
            let c = choose_profile(None, Some(device));
            assert_eq!(c.profile, Profile::builtin(name).unwrap(), "{device}");
            assert_eq!(c.reason, reason);
        }
        // No GPU named: the default, said so.
        let c = choose_profile(None, None);
        assert_eq!(c, ProfileChoice::unknown_target());
        assert_eq!(c.profile.name, DEFAULT);
        assert_eq!(
            c.reason,
            "h200x2: default, no GPU named (the target machine is unknown)"
        );
        // A given profile wins over the GPU's, whatever its name.
        let mut mine = Profile::builtin("h200x2").unwrap();
        mine.name = "mine".into();
        let c = choose_profile(Some(mine.clone()), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!((c.profile, c.reason.as_str()), (mine, "mine: given"));
    }

    #[test]
    fn profiles_load_by_name_or_file() {
        assert_eq!(load_profile("h100x2").unwrap().name, "h100x2");
        let err = load_profile("/nonexistent/profile.json").unwrap_err();
        assert!(
            err.to_string().contains("neither a built-in profile"),
            "{err}"
        );
    }
}
