//! The block shape of the fused block combine (the two-pass and one-pass kernels of
//! `moe_fused.cu`): threads per block, blocks per SM, 16-byte vectors per thread and round, and
//! whether the token loops read the next token's fan and weights ahead. Each shape is its own
//! kernel (`nvl_combine_fused[_onepass]<suffix>`, its own launch bounds); results are
//! bit-identical whichever runs (see the [fused module docs](super::fused)).

use crate::error::{KernelError, Result};

/// The environment variable choosing [`CombineBlock`] when an engine is made.
pub const COMBINE_BLOCK_ENV: &str = "MESHFLOW_MOE_COMBINE_BLOCK";

/// Threads per block, blocks per SM and vectors per thread and round of the block combine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CombineShape {
    /// 256 threads, 2 blocks per SM, 2 vectors (`ROW_KERNEL`; the kernels before shapes).
    B256x2,
    /// 448 threads, 1 block per SM, 2 vectors: a 7168-wide bf16 row (896 vectors) in one round.
    B448x1,
    /// 448 threads, 2 blocks per SM (at most 72 registers), 1 vector: such a row in two full
    /// rounds.
    B448x2N1,
    /// 896 threads, 1 block per SM, 1 vector: such a row in one round.
    B896x1N1,
    /// 512 threads, 1 block per SM, 2 vectors.
    B512x1,
    /// 224 threads, 4 blocks per SM (at most 72 registers), 1 vector: as many threads per SM
    /// as `448x2n1`, twice the blocks (tokens in flight), a 7168-wide bf16 row in four full
    /// rounds.
    B224x4N1,
    /// 128 threads, 8 blocks per SM (at most 64 registers), 1 vector: as many threads per SM
    /// as the largest shapes (32 warps), eight tokens in flight per SM, a 7168-wide bf16 row
    /// in seven full rounds.
    B128x8N1,
}

impl CombineShape {
    /// Every shape.
    pub const ALL: [CombineShape; 7] = [
        CombineShape::B256x2,
        CombineShape::B448x1,
        CombineShape::B448x2N1,
        CombineShape::B896x1N1,
        CombineShape::B512x1,
        CombineShape::B224x4N1,
        CombineShape::B128x8N1,
    ];

    /// `256x2`, `448x1`, `448x2n1`, `896x1n1`, `512x1`, `224x4n1` or `128x8n1`: threads x blocks per SM,
    /// `n1` for one vector per thread and round.
    pub fn name(self) -> &'static str {
        match self {
            CombineShape::B256x2 => "256x2",
            CombineShape::B448x1 => "448x1",
            CombineShape::B448x2N1 => "448x2n1",
            CombineShape::B896x1N1 => "896x1n1",
            CombineShape::B512x1 => "512x1",
            CombineShape::B224x4N1 => "224x4n1",
            CombineShape::B128x8N1 => "128x8n1",
        }
    }

    /// Threads per block.
    pub fn threads(self) -> u32 {
        match self {
            CombineShape::B256x2 => 256,
            CombineShape::B448x1 | CombineShape::B448x2N1 => 448,
            CombineShape::B896x1N1 => 896,
            CombineShape::B512x1 => 512,
            CombineShape::B224x4N1 => 224,
            CombineShape::B128x8N1 => 128,
        }
    }

    /// The most blocks per SM (the launch bounds' minimum; the grid keeps them all resident).
    pub fn per_sm(self) -> usize {
        match self {
            CombineShape::B256x2 | CombineShape::B448x2N1 => 2,
            CombineShape::B448x1 | CombineShape::B896x1N1 | CombineShape::B512x1 => 1,
            CombineShape::B224x4N1 => 4,
            CombineShape::B128x8N1 => 8,
        }
    }

    /// 16-byte vectors per thread and round (the kernels' `NV`).
    pub fn vectors(self) -> usize {
        match self {
            CombineShape::B448x2N1
            | CombineShape::B896x1N1
            | CombineShape::B224x4N1
            | CombineShape::B128x8N1 => 1,
            _ => 2,
        }
    }

    /// Whether the shape has a prefetching kernel: not at the 72-register bound of the
    /// one-vector shapes, where its one-pass kernel spilled (`scripts/nvrtc-check.py --verbose`).
    pub fn has_prefetch(self) -> bool {
        self.vectors() == 2
    }

    /// The launch bounds macro of the shape's kernels in `moe_fused.cu` (checked by tests).
    #[cfg(test)]
    pub(crate) fn bounds(self) -> &'static str {
        match self {
            CombineShape::B256x2 => "ROW_KERNEL",
            CombineShape::B448x1 => "COMBINE_448X1",
            CombineShape::B448x2N1 => "COMBINE_448X2",
            CombineShape::B896x1N1 => "COMBINE_896X1",
            CombineShape::B512x1 => "COMBINE_512X1",
            CombineShape::B224x4N1 => "COMBINE_224X4",
            CombineShape::B128x8N1 => "COMBINE_128X8",
        }
    }
}

/// The block combine's shape and whether its token loops prefetch (see the
/// [fused module docs](super::fused)); `MESHFLOW_MOE_COMBINE_BLOCK=<shape>[p]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CombineBlock {
    /// Threads, blocks per SM and vectors per thread.
    pub shape: CombineShape,
    /// Read the next token's fan row and weights (and, producers, its slot's token) before
    /// reducing this token's expert rows. Only where [`CombineShape::has_prefetch`].
    pub prefetch: bool,
}

impl Default for CombineBlock {
    /// `256x2`: the shape of the kernels before there were shapes.
    fn default() -> CombineBlock {
        CombineBlock {
            shape: CombineShape::B256x2,
            prefetch: false,
        }
    }
}

impl CombineBlock {
    /// Every block combine variant: each shape, and each with prefetch where it has one.
    pub fn all() -> Vec<CombineBlock> {
        CombineShape::ALL
            .iter()
            .flat_map(|&shape| {
                let p = [false, true]
                    .into_iter()
                    .filter(move |&p| !p || shape.has_prefetch());
                p.map(move |prefetch| CombineBlock { shape, prefetch })
            })
            .collect()
    }

    /// The value of `MESHFLOW_MOE_COMBINE_BLOCK`: `None` when unset, empty or `auto` (each
    /// block combine kernel in its own default shape, see
    /// [`FusedOptions::block_for`](super::FusedOptions::block_for)).
    pub fn from_env() -> Result<Option<CombineBlock>> {
        match std::env::var(COMBINE_BLOCK_ENV) {
            Err(_) => Ok(None),
            Ok(v) if matches!(v.trim(), "" | "auto") => Ok(None),
            Ok(v) => CombineBlock::parse(&v).map(Some),
        }
    }

    /// Parses a [`CombineBlock::name`] (empty: the default); an unknown value is an error
    /// naming the allowed ones.
    pub fn parse(v: &str) -> Result<CombineBlock> {
        let v = v.trim();
        if v.is_empty() {
            return Ok(CombineBlock::default());
        }
        CombineBlock::all()
            .into_iter()
            .find(|b| b.name() == v)
            .ok_or_else(|| {
                let names: Vec<String> = CombineBlock::all().iter().map(|b| b.name()).collect();
                KernelError::InvalidArgument(format!(
                    "{COMBINE_BLOCK_ENV}={v}: expected one of {} (threads x blocks per SM; n1: \
                     one vector per thread; p: prefetch, not built for the n1 shapes)",
                    names.join(", ")
                ))
            })
    }

    /// The shape's name, with `p` when prefetching (`448x1p`).
    pub fn name(self) -> String {
        format!(
            "{}{}",
            self.shape.name(),
            if self.prefetch { "p" } else { "" }
        )
    }

    /// What follows `nvl_combine_fused[_onepass]` in the kernel's kind: nothing for the
    /// default, else `_b<name>` (`_b448x1`, `_b256x2p`).
    pub(crate) fn kind_suffix(self) -> String {
        if self == CombineBlock::default() {
            String::new()
        } else {
            format!("_b{}", self.name())
        }
    }

    /// Threads per block and the most blocks per SM the kernels are launched with.
    pub(crate) fn launch(self) -> (u32, usize) {
        (self.shape.threads(), self.shape.per_sm())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Source;

    #[test]
    fn combine_blocks_parse_and_name_themselves() {
        let names: Vec<String> = CombineBlock::all().iter().map(|b| b.name()).collect();
        assert_eq!(
            names,
            [
                "256x2", "256x2p", "448x1", "448x1p", "448x2n1", "896x1n1", "512x1", "512x1p",
                "224x4n1", "128x8n1"
            ]
        );
        for b in CombineBlock::all() {
            assert_eq!(CombineBlock::parse(&b.name()).unwrap(), b);
            assert_eq!(CombineBlock::parse(&format!(" {} ", b.name())).unwrap(), b);
        }
        assert_eq!(CombineBlock::parse("").unwrap(), CombineBlock::default());
        assert_eq!(CombineBlock::default().name(), "256x2");
        assert_eq!(CombineBlock::default().kind_suffix(), "");
        let b = CombineBlock::parse("448x1p").unwrap();
        assert_eq!(b.shape, CombineShape::B448x1);
        assert!(b.prefetch);
        assert_eq!(b.kind_suffix(), "_b448x1p");
        assert_eq!(
            CombineBlock::parse("256x2p").unwrap().kind_suffix(),
            "_b256x2p"
        );
        // An unknown value (a shape without a prefetch kernel included) names the allowed ones.
        for bad in ["448x2n1p", "896x1n1p", "256", "1024x1", "448X1"] {
            let e = CombineBlock::parse(bad).unwrap_err().to_string();
            assert!(e.contains(COMBINE_BLOCK_ENV), "{e}");
            assert!(e.contains(&format!("={bad}:")), "{e}");
            for n in &names {
                assert!(e.contains(n.as_str()), "{e} lacks {n}");
            }
        }
    }

    #[test]
    fn shapes_launch_as_documented() {
        let launch = |s: &str| CombineBlock::parse(s).unwrap().launch();
        assert_eq!(launch("256x2"), (256, 2));
        assert_eq!(launch("256x2p"), (256, 2));
        assert_eq!(launch("448x1"), (448, 1));
        assert_eq!(launch("448x2n1"), (448, 2));
        assert_eq!(launch("896x1n1"), (896, 1));
        assert_eq!(launch("512x1"), (512, 1));
        for s in CombineShape::ALL {
            // Every thread of a resident grid fits an SM (2048 threads on sm_80 .. sm_90).
            assert!(s.threads() as usize * s.per_sm() <= 2048, "{}", s.name());
            assert_eq!(s.threads() % 32, 0);
            assert_eq!(s.name().ends_with("n1"), s.vectors() == 1);
        }
        // A 7168-wide bf16 row (896 vectors) fills whole rounds in the new shapes.
        for s in ["448x1", "448x2n1", "896x1n1"] {
            let s = CombineBlock::parse(s).unwrap().shape;
            assert_eq!(
                896 % (s.threads() as usize * s.vectors()),
                0,
                "{}",
                s.name()
            );
        }
    }

    /// Each shape's launch bounds macro says its threads and blocks per SM, and each kernel of
    /// the block combine has the bounds, NV and prefetch of its variant.
    #[test]
    fn kernels_match_their_shapes() {
        let text = Source::Moe.text();
        for s in CombineShape::ALL {
            let bounds = match s {
                CombineShape::B256x2 => {
                    assert!(text.contains("#define ROW_THREADS 256\n"));
                    "#define ROW_KERNEL __launch_bounds__(ROW_THREADS, 2)\n".to_owned()
                }
                _ => format!(
                    "#define {} __launch_bounds__({}, {})\n",
                    s.bounds(),
                    s.threads(),
                    s.per_sm()
                ),
            };
            assert!(text.contains(&bounds), "{bounds}");
        }
        for b in CombineBlock::all() {
            for onepass in [false, true] {
                let kind = format!(
                    "nvl_combine_fused{}{}",
                    if onepass { "_onepass" } else { "" },
                    b.kind_suffix()
                );
                let def = format!("#define MF_KERNEL_moe_{kind}(T)");
                let at = text.find(&def).unwrap_or_else(|| panic!("{def} missing"));
                let rest = &text[at + def.len()..];
                let body = &rest[..rest.find("\n#define").unwrap_or(rest.len())];
                let entry = format!("{} moe_{kind}_##T(", b.shape.bounds());
                assert!(body.contains(&entry), "{kind}: {entry}");
                let call = format!(
                    "MOE_FUSED_COMBINE_BODY(T, {onepass}, {}, {})",
                    b.shape.vectors(),
                    b.prefetch
                );
                assert!(body.contains(&call), "{kind}: {call}");
            }
        }
    }
}
