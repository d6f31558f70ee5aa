//! The host program the ranks of a job lowered: [`ProgramFingerprint`] and
//! [`check_same_program`] (every rank against rank 0's, before the first step).

use std::time::Duration;

use super::{field, generation, one_line, split_lines, AgreeError};
use crate::front::Compiled;
use crate::runtime::rendezvous::Rendezvous;

/// The first line of a published fingerprint.
const FINGERPRINT_HEADER: &str = "meshflow program fingerprint 1";

/// What identifies the host program a rank lowered, small enough to publish: a hash of its
/// text, the job's size and the transport its plans assume, with the reason of its machine
/// profile (to tell the user why two ranks differ).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgramFingerprint {
    /// FNV-1a (64 bits) of the host program's text, the job's size and the planned transport:
    /// the same on every build and host.
    pub hash: u64,
    /// The machine profile the plans were priced with and why
    /// ([`Compiled::profile_reason`]; `host IR loaded from text` when nothing was priced).
    pub profile: String,
}

impl ProgramFingerprint {
    /// The fingerprint of `compiled`.
    pub fn of(compiled: &Compiled) -> ProgramFingerprint {
        let transport = compiled
            .transport()
            .map_or_else(|| "none".to_string(), |t| t.to_string());
        let text = format!(
            "{}\nworld {}\ntransport {transport}\n",
            compiled.host_text(),
            compiled.world_size()
        );
        ProgramFingerprint {
            hash: fnv1a(text.as_bytes()),
            profile: compiled
                .profile_reason()
                .unwrap_or("host IR loaded from text")
                .to_string(),
        }
    }

    /// The fingerprint as published.
    pub fn encode(&self) -> Vec<u8> {
        format!(
            "{FINGERPRINT_HEADER}\nhash={:016x}\nprofile={}\n",
            self.hash,
            one_line(&self.profile)
        )
        .into_bytes()
    }

    /// Reads a fingerprint [`encode`](Self::encode) wrote.
    pub fn decode(bytes: &[u8]) -> Result<ProgramFingerprint, String> {
        let (lines, _) = split_lines(bytes, 3)?;
        if lines[0] != FINGERPRINT_HEADER {
            return Err(format!(
                "`{FINGERPRINT_HEADER}` expected, found `{}`",
                lines[0]
            ));
        }
        let hash = field(lines[1], "hash")?;
        let hash = u64::from_str_radix(hash, 16)
            .map_err(|_| format!("hash `{hash}` is not a hexadecimal number"))?;
        Ok(ProgramFingerprint {
            hash,
            profile: field(lines[2], "profile")?.to_string(),
        })
    }
}

/// 64-bit FNV-1a: a hash that every build computes alike (unlike `std`'s hasher).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Checks, before the first step, that rank `rank` of a job of `world` ranks meeting at
/// `rendezvous` lowered the same host program as rank 0: publishes `mine`, and on every rank
/// but 0 compares it with rank 0's (waiting up to `timeout` for it). A rank whose program
/// differs fails with [`AgreeError::Programs`], naming both ranks and their profiles, and
/// aborts the rendezvous with the same reason, so that every rank stops at its next wait
/// there instead of at a communication that never matches. Rank 0 does not wait (ranks made
/// one after another by one thread, rank 0 first, never block). Every rank of the job must call
/// it, in the same order as its other checks on the same store.
pub fn check_same_program(
    rendezvous: &dyn Rendezvous,
    rank: usize,
    world: usize,
    mine: &ProgramFingerprint,
    timeout: Duration,
) -> Result<(), AgreeError> {
    let base = format!(
        "meshflow/agree/program/{}",
        generation(rendezvous.namespace(), "program", rank)
    );
    rendezvous.publish(&format!("{base}/{rank}"), &mine.encode())?;
    if rank == 0 || world <= 1 {
        return Ok(());
    }
    let bytes = rendezvous.fetch(&format!("{base}/0"), timeout)?;
    let first = ProgramFingerprint::decode(&bytes)
        .map_err(|message| AgreeError::Malformed { rank: 0, message })?;
    if first.hash == mine.hash {
        return Ok(());
    }
    let message = format!(
        "rank {rank} lowered a different host program than rank 0 (rank 0: program {:016x}, \
         machine profile {}; rank {rank}: program {:016x}, machine profile {}): the ranks of one \
         job must lower the same program, so give every rank the same program, options and \
         --profile",
        first.hash, first.profile, mine.hash, mine.profile
    );
    rendezvous.abort(&message);
    Err(AgreeError::Programs(message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_round_trip_and_hash_alike_everywhere() {
        // The reference values of FNV-1a 64.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        let f = ProgramFingerprint {
            hash: 0x0123_4567_89ab_cdef,
            profile: "h100x2: built-in profile of NVIDIA H100 80GB HBM3".into(),
        };
        assert_eq!(ProgramFingerprint::decode(&f.encode()), Ok(f));
        for bad in [
            &b"nothing"[..],
            b"meshflow program fingerprint 1\nhash=xyz\nprofile=p\n",
            b"meshflow program fingerprint 1\nhash=01\n",
        ] {
            assert!(ProgramFingerprint::decode(bad).is_err(), "{bad:?}");
        }
    }
}
