//! [`TorchrunEnv`]: the torchrun convention for multi-process runs.

use super::RendezvousError;

/// Which rank this process is and where the rendezvous store lives, from the torchrun
/// variables. The same variables on several hosts (each with its own `LOCAL_RANK`s and one
/// shared `MASTER_ADDR`) give a multi-node run over NCCL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchrunEnv {
    /// `RANK`: this process's rank in `0..world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: the number of processes.
    pub world_size: usize,
    /// `LOCAL_RANK`: the GPU ordinal this process uses on its host (default: `RANK`).
    pub local_rank: usize,
    /// `MASTER_ADDR`: the host of rank 0 (default `127.0.0.1`).
    pub master_addr: String,
    /// `MASTER_PORT`: the port of rank 0's store (default 29500).
    pub master_port: u16,
}

impl TorchrunEnv {
    /// Default `MASTER_PORT`.
    pub const DEFAULT_PORT: u16 = 29500;

    /// Reads the variables through `get`; `Ok(None)` when neither `RANK` nor `WORLD_SIZE` is set.
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<TorchrunEnv>, RendezvousError> {
        let (rank, world) = (get("RANK"), get("WORLD_SIZE"));
        if rank.is_none() && world.is_none() {
            return Ok(None);
        }
        fn parse<T: std::str::FromStr>(
            name: &'static str,
            v: Option<String>,
        ) -> Result<T, RendezvousError> {
            let v = v.ok_or_else(|| RendezvousError::Env {
                name,
                message: "not set (RANK and WORLD_SIZE go together)".into(),
            })?;
            v.trim().parse().map_err(|_| RendezvousError::Env {
                name,
                message: format!("`{v}` is not a valid number"),
            })
        }
        let rank: usize = parse("RANK", rank)?;
        let world_size: usize = parse("WORLD_SIZE", world)?;
        if world_size == 0 || rank >= world_size {
            return Err(RendezvousError::Env {
                name: "RANK",
                message: format!("rank {rank} is not in 0..{world_size} (WORLD_SIZE)"),
            });
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => parse("LOCAL_RANK", Some(v))?,
            None => rank,
        };
        let master_port = match get("MASTER_PORT") {
            Some(v) => parse("MASTER_PORT", Some(v))?,
            None => Self::DEFAULT_PORT,
        };
        Ok(Some(TorchrunEnv {
            rank,
            world_size,
            local_rank,
            master_addr: get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into()),
            master_port,
        }))
    }

    /// Reads the variables from the process environment.
    pub fn from_env() -> Result<Option<TorchrunEnv>, RendezvousError> {
        TorchrunEnv::from_lookup(|k| std::env::var(k).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> Result<Option<TorchrunEnv>, RendezvousError> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        TorchrunEnv::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn reads_defaults_and_rejects_bad_values() {
        assert_eq!(lookup(&[]).unwrap(), None);
        let e = lookup(&[("RANK", "1"), ("WORLD_SIZE", "2")])
            .unwrap()
            .unwrap();
        assert_eq!((e.rank, e.local_rank, e.master_port), (1, 1, 29500));
        assert_eq!(e.master_addr, "127.0.0.1");
        assert!(lookup(&[("RANK", "2"), ("WORLD_SIZE", "2")]).is_err());
        assert!(lookup(&[("RANK", "x"), ("WORLD_SIZE", "2")]).is_err());
        assert!(lookup(&[("RANK", "0")]).is_err());
        let e = lookup(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "node1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((e.local_rank, e.master_port), (3, 1234));
        assert_eq!(e.master_addr, "node1");
    }
}
