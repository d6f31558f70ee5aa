//! [`Transport`]: how the bytes of a communication move between devices. One meaning for the
//! whole project: the cost model prices decompositions for a transport, and the GPU runtime
//! selects one per team when it prepares a program (and reports which one executed each
//! communication).

use std::fmt;
use std::str::FromStr;

/// How the bytes of a communication move between devices.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Transport {
    /// NCCL kernels: every collective kind, collective permutes as grouped send/recv, MoE
    /// dispatch/combine as padded blocks. Uses SMs.
    Nccl,
    /// Copy-engine peer copies between GPUs of one process with peer access: collective
    /// permutes, broadcasts and sum reduce-scatters, without SMs (but for the reduction).
    CopyEngine,
    /// Staged through pinned host memory and the inter-node host proxy (over a wire: TCP or
    /// ibverbs): collective permutes and MoE rows between ranks of different nodes.
    HostProxy,
    /// Kernel stores into peer-mapped memory over NVLink with device-side flags: MoE dispatch
    /// and combine between GPUs of one process.
    Nvlink,
}

impl Transport {
    /// Every transport, in declaration order.
    pub const ALL: [Transport; 4] = [
        Transport::Nccl,
        Transport::CopyEngine,
        Transport::HostProxy,
        Transport::Nvlink,
    ];

    /// The name used in options, reports and traces (`nccl`, `copy-engine`, `host-proxy`,
    /// `nvlink`).
    pub fn name(self) -> &'static str {
        match self {
            Transport::Nccl => "nccl",
            Transport::CopyEngine => "copy-engine",
            Transport::HostProxy => "host-proxy",
            Transport::Nvlink => "nvlink",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown transport name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown transport `{0}` (expected one of nccl, copy-engine, host-proxy, nvlink)")]
pub struct UnknownTransport(pub String);

impl FromStr for Transport {
    type Err = UnknownTransport;

    fn from_str(s: &str) -> Result<Transport, UnknownTransport> {
        let key = s.trim().to_ascii_lowercase().replace('_', "-");
        Transport::ALL
            .into_iter()
            .find(|t| t.name() == key)
            .ok_or_else(|| UnknownTransport(s.chars().take(40).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for t in Transport::ALL {
            assert_eq!(t.name().parse::<Transport>(), Ok(t));
            assert_eq!(t.to_string(), t.name());
        }
        assert_eq!(
            "copy_engine".parse::<Transport>(),
            Ok(Transport::CopyEngine)
        );
        assert_eq!(" NVLink ".parse::<Transport>(), Ok(Transport::Nvlink));
        let e = "rdma".parse::<Transport>().unwrap_err();
        assert!(e.to_string().contains("unknown transport `rdma`"), "{e}");
    }
}
