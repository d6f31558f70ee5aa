//! Machine profiles: what the cost model knows about a machine, as data.
//!
//! A [`Profile`] is a JSON document (format in `docs/schedule-search.md`) holding, for one kind
//! of machine (e.g. two H200 GPUs linked by NVLink):
//!
//! - host costs: the launch overhead of one compute op and of one stream-loop iteration;
//! - the memory bandwidth that copies and element-wise adds run at;
//! - GEMM times by shape (16-bit types; f32 as one throughput figure);
//! - per transport (`nccl`, `copy_engine`), the time of each collective over message sizes,
//!   and how much a GEMM slows down while that transport moves bytes beside it.
//!
//! Collective times are curves of `[bytes, us]` points, `bytes` being what one rank puts on
//! the wire (see [`Collective`]); between points the time is interpolated linearly, above the
//! last point it follows the last segment, below the first it is the first point's time.
//!
//! The committed profiles live in `profiles/` at the repository root and are compiled in
//! ([`Profile::builtin`]); `meshflow lower --profile FILE` and the embed API read others.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::PassError;
use crate::Transport;

/// The format version this build reads and writes.
pub const FORMAT: u32 = 1;

/// Names of the profiles compiled into the library, the default first.
pub const BUILTIN: [&str; 2] = ["h200x2", "h100x2"];

/// The profile used where no GPU says which machine this is ([`Profile::default_builtin`]):
/// compiling on a machine without GPUs, or on GPUs no built-in profile describes.
pub const DEFAULT: &str = BUILTIN[0];

const H200X2: &str = include_str!("../../profiles/h200x2.json");
const H100X2: &str = include_str!("../../profiles/h100x2.json");

/// A collective whose time a profile records. The size of a curve point is the bytes one rank
/// sends (or receives) over the wire.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Collective {
    /// A collective permute: the message's bytes.
    Permute,
    /// A broadcast: the bytes a non-root receives.
    Broadcast,
    /// A rooted reduce: the bytes each member contributes.
    Reduce,
    /// An all-gather: `(d - 1) / d` of the gathered tensor.
    AllGather,
    /// A reduce-scatter: `(d - 1) / d` of the reduced input.
    ReduceScatter,
    /// An all-reduce: `2 (d - 1) / d` of the reduced tensor (what a ring all-reduce sends).
    /// Optional: measured by `meshflow calibrate`, not used by the cost model yet.
    AllReduce,
}

impl Collective {
    /// Every collective, in a fixed order.
    pub const ALL: [Collective; 6] = [
        Collective::Permute,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllReduce,
    ];

    /// The collectives the cost model prices: every transport of a profile must reach a curve
    /// for each (itself or through its fallback).
    pub const PRICED: [Collective; 5] = [
        Collective::Permute,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::AllGather,
        Collective::ReduceScatter,
    ];

    /// Its key in a profile.
    pub fn key(self) -> &'static str {
        match self {
            Collective::Permute => "permute",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllReduce => "all_reduce",
        }
    }
}

/// The profile key of a transport: `copy_engine` for the copy engine, `nccl` for everything
/// else (transports without a curve of their own are priced as NCCL).
pub fn transport_key(t: Transport) -> &'static str {
    if t == Transport::CopyEngine {
        "copy_engine"
    } else {
        "nccl"
    }
}

/// The transport of a profile key (`None` for keys this build does not know).
pub fn transport_of(key: &str) -> Option<Transport> {
    match key {
        "nccl" => Some(Transport::Nccl),
        "copy_engine" => Some(Transport::CopyEngine),
        _ => None,
    }
}

/// Host-side overheads, µs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostCosts {
    /// Launch overhead of one compute op.
    pub launch_us: f64,
    /// Overhead of one stream-loop iteration (stream switch, events, views).
    pub loop_step_us: f64,
}

/// Memory figures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryCosts {
    /// Bandwidth copies and element-wise ops reach, GB/s.
    pub hbm_gb_s: f64,
    /// The fraction of an element-wise add's time that still slows the GEMM it runs beside.
    pub concurrent_add_slowdown: f64,
}

/// One measured GEMM: `[m, k] x [k, n]` in `us`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmPoint {
    /// Rows of the output.
    pub m: u64,
    /// Columns of the output.
    pub n: u64,
    /// Contraction extent.
    pub k: u64,
    /// Time, µs.
    pub us: f64,
}

/// GEMM throughput.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmCosts {
    /// Measured bf16/f16 GEMMs; a shape runs at the throughput of the nearest one.
    pub half: Vec<GemmPoint>,
    /// Throughput of f32 (and integer) GEMMs, TFLOP/s.
    pub tflops_f32: f64,
}

/// How a GEMM slows down while a transport moves bytes beside it: the GEMM loses this fraction
/// of the transfer's duration (0: perfect overlap; 1: the two serialize).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slowdown {
    /// The GEMM was launched before the transfer (one worker stream per loop iteration).
    pub gemm_first: f64,
    /// The transfer was launched ahead of the GEMM (prefetch schedules, neighbour rings).
    pub transfer_first: f64,
}

/// One transport of a profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportCosts {
    /// Collectives this transport does not move itself go over this transport instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub falls_back_to: Option<String>,
    /// GEMM slowdown beside this transport.
    pub gemm_slowdown: Slowdown,
    /// The fraction of a GEMM's time that the next GEMM of the same stream loop, already
    /// waiting on another worker stream, runs under it (filling its tail) while this transport
    /// moves the loop's bytes: the per-iteration schedules, whose iterations run on the workers
    /// of the pool in turn. 0 (the default, for profiles without the field): GEMMs on
    /// different workers run one after the other. Fitted, not measured by `meshflow
    /// calibrate` (see `docs/schedule-search.md`).
    #[serde(default)]
    pub gemm_overlap: f64,
    /// Time curves by collective key (`permute`, `broadcast`, `reduce`, `all_gather`,
    /// `reduce_scatter`): `[bytes, us]` points with increasing sizes.
    pub collectives: BTreeMap<String, Vec<(f64, f64)>>,
}

/// A machine profile (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Format version ([`FORMAT`]).
    pub format: u32,
    /// Short name, e.g. `h200x2`.
    pub name: String,
    /// The GPU model, as the driver names it.
    pub device: String,
    /// How many GPUs the figures were measured on.
    pub world: u64,
    /// True while the figures are estimates, not measurements of this machine.
    pub provisional: bool,
    /// Where the figures come from.
    pub notes: Vec<String>,
    /// Host overheads.
    pub host: HostCosts,
    /// Memory figures.
    pub memory: MemoryCosts,
    /// GEMM figures.
    pub gemm: GemmCosts,
    /// Transports by key (`nccl`, `copy_engine`).
    pub transports: BTreeMap<String, TransportCosts>,
}

fn bad(name: &str, what: impl std::fmt::Display) -> PassError {
    PassError::Options(format!("profile `{name}`: {what}"))
}

impl Profile {
    /// Reads a profile from JSON text and checks it (see [`Profile::check`]).
    pub fn from_json(text: &str) -> Result<Profile, PassError> {
        let p: Profile = serde_json::from_str(text)
            .map_err(|e| PassError::Options(format!("profile JSON: {e}")))?;
        p.check()?;
        Ok(p)
    }

    /// The profile as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// A compiled-in profile by name ([`BUILTIN`]).
    pub fn builtin(name: &str) -> Result<Profile, PassError> {
        let text = match name {
            "h200x2" => H200X2,
            "h100x2" => H100X2,
            _ => {
                return Err(PassError::Options(format!(
                    "no built-in profile `{name}` (built in: {})",
                    BUILTIN.join(", ")
                )))
            }
        };
        Profile::from_json(text)
    }

    /// The default profile ([`DEFAULT`]): two H200 GPUs, measured.
    pub fn default_builtin() -> Profile {
        // The compiled-in text is checked by the tests; a broken file cannot reach a user.
        Profile::builtin(DEFAULT).unwrap_or_else(|_| Profile::empty())
    }

    /// The built-in profile for a GPU model, by the name the driver gives it (`NVIDIA H100
    /// 80GB HBM3` → `h100x2`, `NVIDIA H200` → `h200x2`); `None` for a model no built-in profile
    /// describes. The built-in profiles describe pairs of GPUs; larger teams reuse their
    /// curves (see `docs/schedule-search.md`).
    pub fn builtin_for_device(device: &str) -> Option<&'static str> {
        let model = device_model(device)?;
        BUILTIN
            .into_iter()
            .find(|name| name.strip_suffix("x2") == Some(model.as_str()))
    }

    /// A profile with no measurements (every time is a launch overhead); used only if the
    /// compiled-in default cannot be read.
    fn empty() -> Profile {
        Profile {
            format: FORMAT,
            name: "empty".into(),
            device: String::new(),
            world: 1,
            provisional: true,
            notes: Vec::new(),
            host: HostCosts {
                launch_us: 5.0,
                loop_step_us: 5.0,
            },
            memory: MemoryCosts {
                hbm_gb_s: 1000.0,
                concurrent_add_slowdown: 0.5,
            },
            gemm: GemmCosts {
                half: Vec::new(),
                tflops_f32: 10.0,
            },
            transports: BTreeMap::new(),
        }
    }

    /// Checks every figure: the format version, positive finite numbers, fractions within
    /// [0, 1], curves with increasing sizes, known collective keys, fallbacks that exist, and at
    /// least one transport.
    pub fn check(&self) -> Result<(), PassError> {
        let name = &self.name;
        if self.format != FORMAT {
            return Err(bad(
                name,
                format!("format {} (this build reads {FORMAT})", self.format),
            ));
        }
        let positive = |what: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(bad(
                    name,
                    format!("{what} must be a positive number, not {v}"),
                ))
            }
        };
        let fraction = |what: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(bad(name, format!("{what} must lie in [0, 1], not {v}")))
            }
        };
        positive("world", self.world as f64)?;
        positive("host.launch_us", self.host.launch_us)?;
        positive("host.loop_step_us", self.host.loop_step_us)?;
        positive("memory.hbm_gb_s", self.memory.hbm_gb_s)?;
        fraction(
            "memory.concurrent_add_slowdown",
            self.memory.concurrent_add_slowdown,
        )?;
        positive("gemm.tflops_f32", self.gemm.tflops_f32)?;
        for g in &self.gemm.half {
            for (what, v) in [("m", g.m), ("n", g.n), ("k", g.k)] {
                positive(&format!("gemm.half {what}"), v as f64)?;
            }
            positive("gemm.half us", g.us)?;
        }
        if self.transports.is_empty() {
            return Err(bad(name, "no transport"));
        }
        for (key, t) in &self.transports {
            if transport_of(key).is_none() {
                return Err(bad(
                    name,
                    format!("unknown transport `{key}` (expected nccl or copy_engine)"),
                ));
            }
            fraction(
                &format!("{key}.gemm_slowdown.gemm_first"),
                t.gemm_slowdown.gemm_first,
            )?;
            fraction(
                &format!("{key}.gemm_slowdown.transfer_first"),
                t.gemm_slowdown.transfer_first,
            )?;
            fraction(&format!("{key}.gemm_overlap"), t.gemm_overlap)?;
            if let Some(f) = &t.falls_back_to {
                if f == key || !self.transports.contains_key(f) {
                    return Err(bad(
                        name,
                        format!("{key}.falls_back_to names `{f}`, not another transport"),
                    ));
                }
            }
            for (c, points) in &t.collectives {
                if !Collective::ALL.iter().any(|k| k.key() == c) {
                    return Err(bad(name, format!("{key}: unknown collective `{c}`")));
                }
                if points.is_empty() {
                    return Err(bad(name, format!("{key}.{c}: no points")));
                }
                let mut last = 0.0;
                for &(b, us) in points {
                    positive(&format!("{key}.{c} bytes"), b)?;
                    positive(&format!("{key}.{c} us"), us)?;
                    if b <= last {
                        return Err(bad(
                            name,
                            format!("{key}.{c}: sizes must increase ({b} after {last})"),
                        ));
                    }
                    last = b;
                }
            }
        }
        // Every transport reaches a curve for every priced collective, through its fallbacks.
        for key in self.transports.keys() {
            for c in Collective::PRICED {
                if self.curve(key, c).is_none() {
                    return Err(bad(
                        name,
                        format!("transport `{key}` has no `{}` curve", c.key()),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The transports of this profile, in key order.
    pub fn transports(&self) -> Vec<Transport> {
        self.transports
            .keys()
            .filter_map(|k| transport_of(k))
            .collect()
    }

    /// The transport (key) that moves `c` for `key`, following fallbacks, with its curve.
    fn curve(&self, key: &str, c: Collective) -> Option<(&str, &[(f64, f64)])> {
        let mut k = key;
        for _ in 0..=self.transports.len() {
            let (name, t) = self.transports.get_key_value(k)?;
            if let Some(points) = t.collectives.get(c.key()) {
                return Some((name.as_str(), points.as_slice()));
            }
            k = t.falls_back_to.as_deref()?;
        }
        None
    }

    /// The transport that actually moves collective `c` when `t` is chosen (itself, or the
    /// transport it falls back to).
    pub fn mover(&self, t: Transport, c: Collective) -> Transport {
        self.curve(transport_key(t), c)
            .and_then(|(k, _)| transport_of(k))
            .unwrap_or(t)
    }

    /// Time of collective `c` putting `bytes` on the wire per rank over transport `t`, µs
    /// (the launch overhead when the profile has no figure).
    pub fn comm_us(&self, t: Transport, c: Collective, bytes: f64) -> f64 {
        match self.curve(transport_key(t), c) {
            Some((_, points)) => interpolate(points, bytes),
            None => self.host.launch_us,
        }
    }

    /// The fraction of a GEMM that the next one, waiting on another worker stream, runs under
    /// while `t` moves the bytes ([`TransportCosts::gemm_overlap`]; 0 when the profile does
    /// not know `t`).
    pub fn gemm_overlap(&self, t: Transport) -> f64 {
        self.transports
            .get(transport_key(t))
            .map_or(0.0, |c| c.gemm_overlap)
    }

    /// The GEMM slowdown beside transport `t` (0 when the profile does not know it).
    pub fn slowdown(&self, t: Transport) -> &Slowdown {
        const NONE: Slowdown = Slowdown {
            gemm_first: 0.0,
            transfer_first: 0.0,
        };
        self.transports
            .get(transport_key(t))
            .map_or(&NONE, |c| &c.gemm_slowdown)
    }

    /// Throughput of a 16-bit GEMM of shape `m x n x k`, TFLOP/s: that of the measured shape
    /// nearest in log space (`None` without measurements).
    pub fn half_tflops(&self, m: u64, n: u64, k: u64) -> Option<f64> {
        let ln = |a: u64, b: u64| ((a.max(1) as f64) / (b.max(1) as f64)).ln().abs();
        self.gemm
            .half
            .iter()
            .map(|g| (ln(m, g.m) + ln(n, g.n) + ln(k, g.k), g))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, g)| 2.0 * (g.m * g.n * g.k) as f64 / (g.us * 1e6))
    }
}

/// The short model name of a GPU as the driver names it, lower case: the first word after
/// the vendor that holds a digit (`NVIDIA H100 80GB HBM3` → `h100`, `NVIDIA A100-SXM4-80GB` →
/// `a100`); `None` when no word holds one.
pub fn device_model(device: &str) -> Option<String> {
    device
        .split_whitespace()
        .filter(|w| !w.eq_ignore_ascii_case("nvidia"))
        .map(|w| w.split('-').next().unwrap_or(w))
        .find(|w| w.chars().any(|c| c.is_ascii_digit()))
        .map(str::to_ascii_lowercase)
}

/// Piecewise-linear interpolation of `[x, y]` points with increasing `x` (see the module docs).
fn interpolate(points: &[(f64, f64)], x: f64) -> f64 {
    let Some(&(x0, y0)) = points.first() else {
        return 0.0;
    };
    if x <= x0 {
        return y0;
    }
    for w in points.windows(2) {
        let ((xa, ya), (xb, yb)) = (w[0], w[1]);
        if x <= xb {
            return ya + (yb - ya) * (x - xa) / (xb - xa);
        }
    }
    match points {
        [.., (xa, ya), (xb, yb)] => yb + (yb - ya) * (x - xb) / (xb - xa),
        // One point: time proportional to size above it.
        _ => y0 * x / x0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profiles_read_and_check() {
        for name in BUILTIN {
            let p = Profile::builtin(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(p.name, name);
            assert_eq!(p.transports(), vec![Transport::CopyEngine, Transport::Nccl]);
            let again = Profile::from_json(&p.to_json()).unwrap();
            assert_eq!(again, p);
            // Every built-in profile is a measured one.
            assert!(!p.provisional, "{name}");
        }
        assert!(Profile::builtin("a100x8").is_err());
        assert_eq!(Profile::default_builtin().name, DEFAULT);
    }

    #[test]
    fn device_names_pick_the_builtin_profile() {
        for (device, want) in [
            ("NVIDIA H100 80GB HBM3", Some("h100x2")),
            ("NVIDIA H100 PCIe", Some("h100x2")),
            ("NVIDIA H200", Some("h200x2")),
            ("NVIDIA A100-SXM4-80GB", None),
            ("", None),
        ] {
            assert_eq!(Profile::builtin_for_device(device), want, "{device}");
        }
        assert_eq!(
            device_model("NVIDIA A100-SXM4-80GB").as_deref(),
            Some("a100")
        );
        assert_eq!(
            device_model("NVIDIA GeForce RTX 4090").as_deref(),
            Some("4090")
        );
    }

    #[test]
    fn the_all_reduce_curve_is_optional_and_read_when_present() {
        let mut p = Profile::default_builtin();
        assert!(p.check().is_ok());
        let nccl = p.transports.get_mut("nccl").unwrap();
        nccl.collectives
            .insert("all_reduce".into(), vec![(4096.0, 20.0), (8192.0, 30.0)]);
        let p = Profile::from_json(&p.to_json()).unwrap();
        assert_eq!(
            p.comm_us(Transport::Nccl, Collective::AllReduce, 6144.0),
            25.0
        );
    }

    #[test]
    fn curves_interpolate_and_extrapolate() {
        let pts = [(1.0, 10.0), (3.0, 20.0), (5.0, 40.0)];
        assert_eq!(interpolate(&pts, 0.5), 10.0);
        assert_eq!(interpolate(&pts, 2.0), 15.0);
        assert_eq!(interpolate(&pts, 4.0), 30.0);
        assert_eq!(interpolate(&pts, 7.0), 60.0);
        assert_eq!(interpolate(&[(2.0, 10.0)], 4.0), 20.0);
    }

    #[test]
    fn the_copy_engine_falls_back_to_nccl_for_what_it_does_not_move() {
        for name in BUILTIN {
            let p = Profile::builtin(name).unwrap();
            let ce = Transport::CopyEngine;
            assert_eq!(p.mover(ce, Collective::Permute), ce, "{name}");
            assert_eq!(
                p.mover(ce, Collective::AllGather),
                Transport::Nccl,
                "{name}"
            );
            assert_eq!(p.mover(ce, Collective::Reduce), Transport::Nccl, "{name}");
            let b = 64.0 * 1048576.0;
            assert_eq!(
                p.comm_us(ce, Collective::AllGather, b),
                p.comm_us(Transport::Nccl, Collective::AllGather, b)
            );
            assert!(
                p.comm_us(ce, Collective::Permute, b)
                    < p.comm_us(Transport::Nccl, Collective::Permute, b),
                "{name}"
            );
        }
    }

    #[test]
    fn bad_profiles_are_errors_naming_the_field() {
        type Edit = Box<dyn Fn(&mut Profile)>;
        let good = Profile::default_builtin();
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|p| p.format = 9), "format 9"),
            (Box::new(|p| p.host.launch_us = -1.0), "host.launch_us"),
            (
                Box::new(|p| p.memory.concurrent_add_slowdown = 2.0),
                "concurrent_add_slowdown",
            ),
            (
                Box::new(|p| {
                    if let Some(t) = p.transports.get_mut("nccl") {
                        t.collectives
                            .insert("permute".into(), vec![(2.0, 1.0), (1.0, 2.0)]);
                    }
                }),
                "sizes must increase",
            ),
            (
                Box::new(|p| {
                    if let Some(t) = p.transports.get_mut("nccl") {
                        t.collectives.remove("all_gather");
                    }
                }),
                "no `all_gather` curve",
            ),
            (
                Box::new(|p| {
                    let t = p.transports["nccl"].clone();
                    p.transports.insert("pigeon".into(), t);
                }),
                "unknown transport `pigeon`",
            ),
        ];
        for (edit, want) in cases {
            let mut p = good.clone();
            edit(&mut p);
            let e = p.check().unwrap_err().to_string();
            assert!(e.contains(want), "{e} (wanted {want})");
        }
        let e = Profile::from_json("{\"format\": 1}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("profile JSON"), "{e}");
    }
}
