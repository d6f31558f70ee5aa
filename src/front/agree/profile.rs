//! The machine profile the ranks of a job price their plans with: [`ProfileClaim`] (one rank's
//! own choice), [`agree_profiles`] (the decision, a pure function) and [`agree_profile`] (the
//! exchange at the rendezvous).

use std::fmt;
use std::time::Duration;

use meshflow_passes::Profile;

use super::{field, generation, one_line, ranks_text, split_lines, AgreeError};
use crate::runtime::rendezvous::Rendezvous;

/// The first line of a published claim (a claim of another format is refused, not misread).
const CLAIM_HEADER: &str = "meshflow profile claim 1";

/// The machine profile one rank would price its plans with on its own
/// ([`choose_profile`](crate::pipeline::choose_profile)), as it publishes it before lowering.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileClaim {
    /// The rank.
    pub rank: usize,
    /// True when the profile was given (`--profile`, [`Options::profile`](crate::Options::profile)),
    /// false when it comes from the GPU model (or is the default).
    pub given: bool,
    /// The GPU model the rank runs on, as the driver names it, when one was named
    /// ([`Options::device`](crate::Options::device)).
    pub device: Option<String>,
    /// Why this profile ([`ProfileChoice::reason`](crate::pipeline::ProfileChoice::reason)).
    pub reason: String,
    /// The profile.
    pub profile: Profile,
}

impl ProfileClaim {
    /// The claim as published: a header, `rank=`, `given=`, `device=` and `reason=` lines, then
    /// the profile's canonical JSON ([`Profile::to_json`]).
    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{CLAIM_HEADER}\nrank={}\ngiven={}\ndevice={}\nreason={}\n{}",
            self.rank,
            u8::from(self.given),
            one_line(self.device.as_deref().unwrap_or("")),
            one_line(&self.reason),
            self.profile.to_json()
        )
        .into_bytes()
    }

    /// Reads a claim [`encode`](Self::encode) wrote.
    pub fn decode(bytes: &[u8]) -> Result<ProfileClaim, String> {
        let (lines, json) = split_lines(bytes, 5)?;
        if lines[0] != CLAIM_HEADER {
            return Err(format!("`{CLAIM_HEADER}` expected, found `{}`", lines[0]));
        }
        let rank = field(lines[1], "rank")?;
        let rank = rank
            .parse()
            .map_err(|_| format!("rank `{rank}` is not a number"))?;
        let given = match field(lines[2], "given")? {
            "0" => false,
            "1" => true,
            other => return Err(format!("given `{other}` is neither 0 nor 1")),
        };
        let device = Some(field(lines[3], "device")?)
            .filter(|d| !d.is_empty())
            .map(str::to_string);
        let reason = field(lines[4], "reason")?.to_string();
        let profile = Profile::from_json(json).map_err(|e| e.to_string())?;
        Ok(ProfileClaim {
            rank,
            given,
            device,
            reason,
            profile,
        })
    }

    /// The profile's name, with the GPU model for a profile not given (`h100x2 (built-in
    /// profile of NVIDIA H100 80GB HBM3)`, `mine (given)`).
    fn describe(&self) -> String {
        let why = self
            .reason
            .strip_prefix(&format!("{}: ", self.profile.name))
            .unwrap_or(&self.reason);
        format!("{} ({why})", self.profile.name)
    }
}

/// Ranks given different machine profiles: no rank can tell which one the job meant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileDisagreement {
    /// Each distinct given profile (its name) with the ranks given it, in rank order.
    pub given: Vec<(String, Vec<usize>)>,
}

impl fmt::Display for ProfileDisagreement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let groups: Vec<String> = self
            .given
            .iter()
            .map(|(name, ranks)| format!("{} given `{name}`", ranks_text(ranks)))
            .collect();
        write!(
            f,
            "the ranks of this job were given different machine profiles ({}), so they would \
             lower different programs: give every rank the same --profile (or none, and every \
             rank takes rank 0's)",
            groups.join("; ")
        )
    }
}

impl std::error::Error for ProfileDisagreement {}

/// THE decision of the ranks of a job, from every rank's [`ProfileClaim`]: the rank whose
/// claim every rank takes. A profile given to some ranks wins over the GPU models (as it does
/// on one rank, [`choose_profile`](crate::pipeline::choose_profile)): the lowest rank given one;
/// else rank 0's (the lowest rank's), whatever the GPU models of the others. Fails when ranks
/// were given different profiles (compared by their canonical JSON, names included) or there
/// is no claim.
pub fn agree_profiles(claims: &[ProfileClaim]) -> Result<usize, ProfileDisagreement> {
    let mut given: Vec<(&ProfileClaim, Vec<usize>)> = Vec::new();
    let mut by_rank: Vec<&ProfileClaim> = claims.iter().collect();
    by_rank.sort_by_key(|c| c.rank);
    for c in by_rank.iter().filter(|c| c.given) {
        match given
            .iter_mut()
            .find(|(first, _)| first.profile == c.profile)
        {
            Some((_, ranks)) => ranks.push(c.rank),
            None => given.push((c, vec![c.rank])),
        }
    }
    match given.as_slice() {
        [] => by_rank
            .first()
            .map(|c| c.rank)
            .ok_or(ProfileDisagreement { given: Vec::new() }),
        [(first, _)] => Ok(first.rank),
        _ => Err(ProfileDisagreement {
            given: given
                .into_iter()
                .map(|(c, ranks)| (c.profile.name.clone(), ranks))
                .collect(),
        }),
    }
}

/// The first line of rank 0's decision: the rank whose claim every rank takes, or the reason
/// they cannot agree.
const AGREED: &str = "agreed ";
const DISAGREED: &str = "disagreed ";

/// Agrees on the machine profile with the other ranks of a job of `world` ranks meeting at
/// `rendezvous`, before lowering: publishes `mine` (this rank's own choice), and returns the
/// claim every rank takes ([`agree_profiles`], decided by rank 0 from every rank's claim).
/// Every rank of the job must call it, in the same order as its other agreements on the same
/// store. Fails on every rank alike when the ranks were given different profiles; waits up to
/// `timeout` for each rank's claim and for the decision.
pub fn agree_profile(
    rendezvous: &dyn Rendezvous,
    mine: &ProfileClaim,
    world: usize,
    timeout: Duration,
) -> Result<ProfileClaim, AgreeError> {
    let base = format!(
        "meshflow/agree/profile/{}",
        generation(rendezvous.namespace(), "profile", mine.rank)
    );
    let claim_key = |rank: usize| format!("{base}/claim/{rank}");
    rendezvous.publish(&claim_key(mine.rank), &mine.encode())?;
    let decision_key = format!("{base}/decision");
    if mine.rank == 0 {
        let decision = match decide(rendezvous, mine, world, timeout, &claim_key) {
            Ok(decision) => decision,
            Err(e) => {
                rendezvous.abort(&format!("rank 0: {e}"));
                return Err(e);
            }
        };
        rendezvous.publish(&decision_key, decision.as_bytes())?;
    }
    let decision = rendezvous.fetch(&decision_key, timeout)?;
    let decision = String::from_utf8_lossy(&decision).into_owned();
    let agreed = take_decision(rendezvous, mine, &decision, timeout, &claim_key);
    // Rank 0 serves the store of a launched job: nobody leaves before every rank has read the
    // decision and the claim it names (the ranks that fail leave right after).
    rendezvous.barrier(&format!("{base}/read"), world, timeout)?;
    agreed
}

/// The claim rank 0's `decision` names (read from the store unless it is `mine`), or why the
/// ranks cannot agree.
fn take_decision(
    rendezvous: &dyn Rendezvous,
    mine: &ProfileClaim,
    decision: &str,
    timeout: Duration,
    claim_key: &dyn Fn(usize) -> String,
) -> Result<ProfileClaim, AgreeError> {
    if let Some(reason) = decision.strip_prefix(DISAGREED) {
        return Err(AgreeError::Profiles(reason.to_string()));
    }
    let rank = decision
        .strip_prefix(AGREED)
        .and_then(|r| r.parse::<usize>().ok())
        .ok_or_else(|| AgreeError::Malformed {
            rank: 0,
            message: format!("a decision `{decision}`"),
        })?;
    if rank == mine.rank {
        return Ok(mine.clone());
    }
    let bytes = rendezvous.fetch(&claim_key(rank), timeout)?;
    ProfileClaim::decode(&bytes).map_err(|message| AgreeError::Malformed { rank, message })
}

/// Rank 0's decision from every rank's claim: `agreed RANK` or `disagreed REASON`.
fn decide(
    rendezvous: &dyn Rendezvous,
    mine: &ProfileClaim,
    world: usize,
    timeout: Duration,
    claim_key: &dyn Fn(usize) -> String,
) -> Result<String, AgreeError> {
    let mut claims = vec![mine.clone()];
    for rank in (0..world).filter(|&r| r != mine.rank) {
        let bytes = rendezvous.fetch(&claim_key(rank), timeout)?;
        let claim = ProfileClaim::decode(&bytes)
            .map_err(|message| AgreeError::Malformed { rank, message })?;
        claims.push(claim);
    }
    Ok(match agree_profiles(&claims) {
        Ok(rank) => {
            if let Some(chosen) = claims.iter().find(|c| c.rank == rank) {
                let other: Vec<&ProfileClaim> = claims
                    .iter()
                    .filter(|c| c.profile != chosen.profile)
                    .collect();
                if !other.is_empty() {
                    tracing::info!(
                        "the ranks take rank {rank}'s machine profile {}; {} would have taken \
                         another on their own",
                        chosen.describe(),
                        ranks_text(&other.iter().map(|c| c.rank).collect::<Vec<_>>())
                    );
                }
            }
            format!("{AGREED}{rank}")
        }
        Err(e) => format!("{DISAGREED}{e}"),
    })
}

/// The warning of a rank that takes another rank's profile instead of its own: both ranks'
/// GPU models and profiles (`None` when `mine` is what was agreed).
pub fn switch_warning(mine: &ProfileClaim, agreed: &ProfileClaim) -> Option<String> {
    if mine.profile == agreed.profile {
        return None;
    }
    let gpu = |c: &ProfileClaim| {
        c.device
            .as_deref()
            .map_or_else(|| "no GPU named".to_string(), str::to_string)
    };
    Some(format!(
        "rank {} prices its plans with rank {}'s machine profile {} instead of its own {} so that \
         every rank lowers the same program (rank {}'s GPU: {}; rank {}'s GPU: {})",
        mine.rank,
        agreed.rank,
        agreed.describe(),
        mine.describe(),
        mine.rank,
        gpu(mine),
        agreed.rank,
        gpu(agreed),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builtin(name: &str) -> Profile {
        Profile::builtin(name).unwrap()
    }

    fn on_gpu(rank: usize, device: &str) -> ProfileClaim {
        let choice = crate::pipeline::choose_profile(None, Some(device));
        ProfileClaim {
            rank,
            given: false,
            device: Some(device.to_string()),
            reason: choice.reason,
            profile: choice.profile,
        }
    }

    fn given(rank: usize, profile: Profile) -> ProfileClaim {
        ProfileClaim {
            rank,
            given: true,
            device: Some("NVIDIA H100 80GB HBM3".into()),
            reason: format!("{}: given", profile.name),
            profile,
        }
    }

    const H100: &str = "NVIDIA H100 80GB HBM3";
    const H200: &str = "NVIDIA H200";

    #[test]
    fn ranks_that_differ_by_gpu_model_take_rank_0s_profile() {
        // Rank 0 on H200, ranks 1 and 2 on H100: rank 0's, whatever the others say.
        let claims = [on_gpu(0, H200), on_gpu(1, H100), on_gpu(2, H100)];
        assert_eq!(agree_profiles(&claims), Ok(0));
        // In any order.
        let shuffled = [claims[2].clone(), claims[0].clone(), claims[1].clone()];
        assert_eq!(agree_profiles(&shuffled), Ok(0));
        // One rank, or ranks that agree already: rank 0.
        assert_eq!(agree_profiles(&claims[..1]), Ok(0));
        assert_eq!(agree_profiles(&[on_gpu(0, H100), on_gpu(1, H100)]), Ok(0));
        // The default (no GPU named, or an unknown model) is a claim like any other.
        let unknown = ProfileClaim {
            rank: 0,
            given: false,
            device: None,
            reason: crate::pipeline::ProfileChoice::unknown_target().reason,
            profile: Profile::default_builtin(),
        };
        assert_eq!(agree_profiles(&[unknown, on_gpu(1, H100)]), Ok(0));
    }

    #[test]
    fn a_given_profile_wins_over_the_gpu_models() {
        // Rank 1 was given h200x2, rank 0 chose h100x2 by its GPU: rank 1's.
        let claims = [
            on_gpu(0, H100),
            given(1, builtin("h200x2")),
            on_gpu(2, H100),
        ];
        assert_eq!(agree_profiles(&claims), Ok(1));
        // The same given profile on several ranks: the lowest of them.
        let claims = [
            on_gpu(0, H100),
            given(1, builtin("h200x2")),
            given(2, builtin("h200x2")),
        ];
        assert_eq!(agree_profiles(&claims), Ok(1));
        // Given the same profile as another rank's GPU gives: no conflict either.
        let claims = [given(0, builtin("h100x2")), on_gpu(1, H200)];
        assert_eq!(agree_profiles(&claims), Ok(0));
    }

    #[test]
    fn different_given_profiles_fail_naming_the_ranks_and_profiles() {
        let mut renamed = builtin("h200x2");
        renamed.name = "mine".into();
        let claims = [
            given(0, builtin("h200x2")),
            on_gpu(1, H100),
            given(2, builtin("h100x2")),
            given(3, builtin("h200x2")),
            given(4, renamed),
        ];
        let e = agree_profiles(&claims).unwrap_err();
        assert_eq!(
            e.given,
            vec![
                ("h200x2".to_string(), vec![0, 3]),
                ("h100x2".to_string(), vec![2]),
                ("mine".to_string(), vec![4]),
            ]
        );
        assert_eq!(
            e.to_string(),
            "the ranks of this job were given different machine profiles (ranks 0, 3 given \
             `h200x2`; rank 2 given `h100x2`; rank 4 given `mine`), so they would lower \
             different programs: give every rank the same --profile (or none, and every rank \
             takes rank 0's)"
        );
        // Two files with one name but other figures differ too.
        let mut tuned = builtin("h200x2");
        tuned.host.launch_us += 1.0;
        let e = agree_profiles(&[given(0, builtin("h200x2")), given(1, tuned)]).unwrap_err();
        assert_eq!(e.given.len(), 2, "{e}");
        assert!(agree_profiles(&[]).is_err());
    }

    #[test]
    fn claims_round_trip_and_refuse_what_is_not_one() {
        for claim in [
            on_gpu(3, H100),
            given(0, builtin("h200x2")),
            ProfileClaim {
                rank: 7,
                given: false,
                device: None,
                reason: "h200x2: default".into(),
                profile: builtin("h200x2"),
            },
        ] {
            assert_eq!(ProfileClaim::decode(&claim.encode()), Ok(claim));
        }
        // A GPU name with a line break stays on its line.
        let mut odd = on_gpu(1, H100);
        odd.device = Some("weird\ngpu".into());
        let back = ProfileClaim::decode(&odd.encode()).unwrap();
        assert_eq!(back.device.as_deref(), Some("weird gpu"));
        for bad in [
            &b"hello"[..],
            b"meshflow profile claim 2\nrank=0\ngiven=0\ndevice=\nreason=x\n{}",
            b"meshflow profile claim 1\nrank=x\ngiven=0\ndevice=\nreason=x\n{}",
            b"meshflow profile claim 1\nrank=0\ngiven=2\ndevice=\nreason=x\n{}",
            b"meshflow profile claim 1\nrank=0\ngiven=0\ndevice=\nreason=x\n{}",
        ] {
            assert!(ProfileClaim::decode(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_warning_of_a_rank_that_switches_names_both_gpus_and_profiles() {
        let (rank0, rank1) = (on_gpu(0, H200), on_gpu(1, H100));
        assert_eq!(switch_warning(&rank0, &rank0), None);
        assert_eq!(
            switch_warning(&rank1, &rank0).unwrap(),
            "rank 1 prices its plans with rank 0's machine profile h200x2 (built-in profile of \
             NVIDIA H200) instead of its own h100x2 (built-in profile of NVIDIA H100 80GB HBM3) \
             so that every rank lowers the same program (rank 1's GPU: NVIDIA H100 80GB HBM3; \
             rank 0's GPU: NVIDIA H200)"
        );
    }
}
