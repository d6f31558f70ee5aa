//! The CUDA C sources embedded in the binary (`kernels/cuda/*.cu`) and the kernels each defines.
//!
//! Adding a source: put the `.cu` file in `kernels/cuda/`, add a [`Source`] variant and its entry
//! in [`Source::text`] / [`Source::functions`], and write the launching code in a sibling module
//! (the kernels of `moe.cu` are launched from [`crate::moe`]; a file appended to another source
//! goes into that source's [`Source::text`] and `PARTS` of `scripts/kernel_units.py`). Adding a
//! typed kernel to a source that has them (`moe.cu` and the files appended to it): define it
//! with an `MF_KERNEL_<name>(T)` macro and name its kind in [`Source::typed_kinds`]; it is
//! compiled in a unit of its own per float type ([`super::units`]).

use crate::dtype::{BinaryOp, DType, UnaryOp};

/// Shared helpers prepended to every source (conversions, grid-stride helpers).
pub(crate) const COMMON: &str = include_str!("../../cuda/common.cuh");

/// One embedded kernel source file; compiled into one CUDA module per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Source {
    /// `elementwise.cu`: binary add/sub/mul, unary gelu/silu.
    Elementwise,
    /// `cast.cu`: float casts and i32/i64 casts.
    Cast,
    /// `copy.cu`: strided copy / permute of up to 4-D tensors.
    Copy,
    /// `reduce.cu`: sum over one axis.
    Reduce,
    /// `fill.cu`: fill with a raw value.
    Fill,
    /// `moe.cu` with `moe_dispatch.cu`, `moe_combine.cu`, `moe_fused.cu`, `moe_fused_warp.cu`
    /// and `moe_fused_warp_combine.cu` (appended): MoE dispatch / combine (NCCL and NVLink
    /// transports, [`crate::moe`]); its typed kernels are compiled one by one.
    Moe,
    /// `rows.cu`: max/min/avg reductions, softmax and rms_norm along one axis.
    Rows,
}

/// The float types the elementwise, cast and reduction kernels are instantiated for.
pub(crate) const FLOATS: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// `(input, output)` dtype pairs of the sum kernels.
pub(crate) const SUM_TYPES: [(DType, DType); 5] = [
    (DType::F32, DType::F32),
    (DType::BF16, DType::BF16),
    (DType::BF16, DType::F32),
    (DType::F16, DType::F16),
    (DType::F16, DType::F32),
];

impl Source {
    /// Every source.
    pub const ALL: [Source; 7] = [
        Source::Elementwise,
        Source::Cast,
        Source::Copy,
        Source::Reduce,
        Source::Fill,
        Source::Moe,
        Source::Rows,
    ];

    /// File name under `kernels/cuda/`.
    pub fn file_name(self) -> &'static str {
        match self {
            Source::Elementwise => "elementwise.cu",
            Source::Cast => "cast.cu",
            Source::Copy => "copy.cu",
            Source::Reduce => "reduce.cu",
            Source::Fill => "fill.cu",
            Source::Moe => "moe.cu",
            Source::Rows => "rows.cu",
        }
    }

    /// The source text (without the common prelude).
    pub(crate) fn text(self) -> &'static str {
        match self {
            Source::Elementwise => include_str!("../../cuda/elementwise.cu"),
            Source::Cast => include_str!("../../cuda/cast.cu"),
            Source::Copy => include_str!("../../cuda/copy.cu"),
            Source::Reduce => include_str!("../../cuda/reduce.cu"),
            Source::Fill => include_str!("../../cuda/fill.cu"),
            // Each file uses the helpers of the files before it (moe_dispatch.cu moe.cu's,
            // moe_combine.cu both, the fused kernels all three): one module, each appended file
            // its own `#line` directive.
            Source::Moe => concat!(
                include_str!("../../cuda/moe.cu"),
                "\n",
                include_str!("../../cuda/moe_dispatch.cu"),
                "\n",
                include_str!("../../cuda/moe_combine.cu"),
                "\n",
                include_str!("../../cuda/moe_fused.cu"),
                "\n",
                include_str!("../../cuda/moe_fused_warp.cu"),
                "\n",
                include_str!("../../cuda/moe_fused_warp_combine.cu")
            ),
            Source::Rows => include_str!("../../cuda/rows.cu"),
        }
    }

    /// The prefix of the source's typed kernels: kernel `<prefix>_<kind>_<dtype>`.
    pub(crate) fn typed_prefix(self) -> &'static str {
        match self {
            Source::Moe => "moe",
            _ => "",
        }
    }

    /// The kinds of the typed kernels: kernels the source defines with a macro
    /// `MF_KERNEL_<prefix>_<kind>(T)` and does not instantiate, each compiled for one float type
    /// in a unit of its own ([`super::units::Unit`]). The other kernels are instantiated by the
    /// files themselves.
    pub(crate) fn typed_kinds(self) -> &'static [&'static str] {
        match self {
            Source::Moe => &MOE_TYPED,
            _ => &[],
        }
    }

    /// Every `extern "C"` kernel the host may launch from this source.
    pub fn functions(self) -> Vec<String> {
        match self {
            Source::Elementwise => FLOATS
                .iter()
                .flat_map(|d| {
                    let bin = BinaryOp::ALL.iter().map(move |op| binary_name(*op, *d));
                    let un = UnaryOp::ALL.iter().map(move |op| unary_name(*op, *d));
                    bin.chain(un)
                })
                .collect(),
            Source::Cast => {
                let mut v: Vec<String> = FLOATS
                    .iter()
                    .flat_map(|s| {
                        FLOATS
                            .iter()
                            .filter(move |d| *d != s)
                            .map(move |d| cast_name(*s, *d))
                    })
                    .collect();
                v.push(cast_name(DType::I32, DType::I64));
                v.push(cast_name(DType::I64, DType::I32));
                v
            }
            Source::Copy => [1, 2, 4, 8]
                .iter()
                .map(|b| format!("strided_copy_b{b}"))
                .collect(),
            Source::Reduce => SUM_TYPES
                .iter()
                .flat_map(|(i, o)| [sum_name("axis", *i, *o), sum_name("rows", *i, *o)])
                .collect(),
            Source::Fill => [1, 2, 4, 8].iter().map(|b| format!("fill_b{b}")).collect(),
            Source::Moe => moe_functions(),
            Source::Rows => FLOATS
                .iter()
                .flat_map(|&d| {
                    ["max", "min", "avg", "softmax", "rms_norm"]
                        .into_iter()
                        .map(move |k| rows_name(k, d))
                })
                .collect(),
        }
    }
}

/// The dtype-generic kernels of `moe.cu`.
const MOE_PLAIN: [&str; 2] = ["moe_zero_padding", "moe_nvl_weights_send"];

/// The typed kernels of `moe.cu` (`moe_<kind>_<dtype>`, defined by `MF_KERNEL_moe_<kind>(T)`);
/// the block combine's kinds, one per block shape, are `nvl_combine_fused[_onepass]<suffix>`
/// (`crate::moe::CombineBlock`).
pub(crate) const MOE_TYPED: [&str; 34] = [
    "nccl_dispatch_send",
    "nvl_dispatch_send",
    "dispatch_recv",
    "nccl_combine_send",
    "nvl_combine_send",
    "combine_recv",
    "nvl_dispatch_fused",
    "nvl_dispatch_fused_native",
    "nvl_dispatch_fused_fp8t",
    "nvl_dispatch_fused_fp8b",
    "nvl_dispatch_fused_warp_native",
    "nvl_dispatch_fused_warp_fp8t",
    "nvl_dispatch_fused_warp_fp8b",
    "nvl_combine_fused",
    "nvl_combine_fused_onepass",
    "nvl_combine_fused_b256x2p",
    "nvl_combine_fused_onepass_b256x2p",
    "nvl_combine_fused_b448x1",
    "nvl_combine_fused_onepass_b448x1",
    "nvl_combine_fused_b448x1p",
    "nvl_combine_fused_onepass_b448x1p",
    "nvl_combine_fused_b448x2n1",
    "nvl_combine_fused_onepass_b448x2n1",
    "nvl_combine_fused_b896x1n1",
    "nvl_combine_fused_onepass_b896x1n1",
    "nvl_combine_fused_b512x1",
    "nvl_combine_fused_onepass_b512x1",
    "nvl_combine_fused_b512x1p",
    "nvl_combine_fused_onepass_b512x1p",
    "nvl_combine_fused_b224x4n1",
    "nvl_combine_fused_onepass_b224x4n1",
    "nvl_combine_fused_b128x8n1",
    "nvl_combine_fused_onepass_b128x8n1",
    "nvl_combine_fused_warp",
];

/// The kernels of `moe.cu`.
fn moe_functions() -> Vec<String> {
    let mut v: Vec<String> = MOE_PLAIN.iter().map(|s| (*s).to_owned()).collect();
    for d in FLOATS {
        v.extend(MOE_TYPED.iter().map(|k| moe_typed_name(k, d)));
    }
    v
}

/// Name of a typed MoE kernel (`moe_<kind>_<dtype>`).
pub(crate) fn moe_typed_name(kind: &str, d: DType) -> String {
    format!("moe_{kind}_{}", d.name())
}

pub(crate) fn binary_name(op: BinaryOp, d: DType) -> String {
    format!("binary_{}_{}", op.name(), d.name())
}

pub(crate) fn unary_name(op: UnaryOp, d: DType) -> String {
    format!("unary_{}_{}", op.name(), d.name())
}

pub(crate) fn cast_name(src: DType, dst: DType) -> String {
    format!("cast_{}_{}", src.name(), dst.name())
}

/// Name of a kernel of `rows.cu` (`rows_softmax_bf16`).
pub(crate) fn rows_name(kind: &str, d: DType) -> String {
    format!("rows_{kind}_{}", d.name())
}

pub(crate) fn sum_name(kind: &str, input: DType, output: DType) -> String {
    format!("sum_{kind}_{}_{}", input.name(), output.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names the host launches must appear in the sources, either literally or through the
    /// instantiation macros (`MF_ALL_OPS(bf16)` etc.): a cheap check that runs without NVRTC.
    #[test]
    fn sources_instantiate_every_launched_kernel() {
        let text = |s: Source| s.text().to_owned();
        for d in FLOATS {
            assert!(text(Source::Elementwise).contains(&format!("MF_ALL_OPS({})", d.name())));
        }
        for f in Source::Cast.functions() {
            let parts: Vec<&str> = f.trim_start_matches("cast_").split('_').collect();
            let literal = text(Source::Cast).contains(&format!("void {f}("));
            let macro_use =
                text(Source::Cast).contains(&format!("MF_CAST({}, {})", parts[0], parts[1]));
            assert!(literal || macro_use, "{f} missing from cast.cu");
        }
        for (i, o) in SUM_TYPES {
            assert!(text(Source::Reduce).contains(&format!("MF_SUM({}, {})", i.name(), o.name())));
        }
        for b in [1, 2, 4, 8] {
            assert!(text(Source::Copy).contains(&format!("MF_COPY({b},")));
            assert!(text(Source::Fill).contains(&format!("MF_FILL({b},")));
        }
        for f in MOE_PLAIN {
            assert!(
                text(Source::Moe).contains(&format!(" {f}(")),
                "{f} missing from moe.cu and its appended files"
            );
        }
        for k in MOE_TYPED {
            assert!(
                text(Source::Moe).contains(&format!(" moe_{k}_##T(")),
                "moe_{k}_##T missing from moe.cu and its appended files"
            );
        }
        for d in FLOATS {
            assert!(text(Source::Rows).contains(&format!("MF_ROWS({})", d.name())));
        }
        for f in Source::Moe.functions() {
            let plain = MOE_PLAIN.contains(&f.as_str());
            let typed = MOE_TYPED
                .iter()
                .any(|k| FLOATS.iter().any(|d| f == moe_typed_name(k, *d)));
            assert!(plain || typed, "{f} is not a moe.cu kernel");
        }
    }

    #[test]
    fn function_lists_have_no_duplicates() {
        let mut all: Vec<String> = Source::ALL.iter().flat_map(|s| s.functions()).collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
        assert_eq!(n, 15 + 8 + 4 + 10 + 4 + (2 + 34 * 3) + 15);
    }

    #[test]
    fn sources_do_not_include_cuda_headers() {
        for s in Source::ALL {
            assert!(
                !s.text().contains("#include"),
                "{} includes a header",
                s.file_name()
            );
        }
        assert!(!COMMON.contains("#include"));
    }
}
