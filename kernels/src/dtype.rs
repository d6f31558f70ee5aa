//! Element types, reduction operators and elementwise operators understood by the kernels, cuBLAS
//! and NCCL. Pure Rust: available without the `cuda` feature.

use std::fmt;

/// Element type of a device buffer, as the kernels, GEMMs and collectives see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// IEEE 754 binary16.
    F16,
    /// 32-bit signed integer.
    I32,
    /// 64-bit signed integer.
    I64,
    /// Unsigned byte (raw payloads, e.g. MoE token rows).
    U8,
}

impl DType {
    /// Every element type, in a fixed order.
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];

    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::I64 => 8,
            DType::U8 => 1,
        }
    }

    /// Whether this is a floating-point type (the kernels compute these in f32).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::BF16 | DType::F16)
    }

    /// Short lowercase name, also the suffix of the CUDA kernel names (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A host element type that can be copied to and from device buffers. Sealed: implemented for
/// `f32`, `half::bf16`, `half::f16`, `i32`, `i64` and `u8` (plain data without padding).
pub trait Element: Copy + Send + Sync + 'static + sealed::Sealed {
    /// The matching device element type.
    const DTYPE: DType;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = $d;
        }
    };
}
element!(f32, DType::F32);
element!(half::bf16, DType::BF16);
element!(half::f16, DType::F16);
element!(i32, DType::I32);
element!(i64, DType::I64);
element!(u8, DType::U8);

/// Reduction operator of a collective (NCCL `ncclRedOp_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
    /// Average (floating-point types only).
    Avg,
}

/// Binary elementwise operator (`out = a op b`, computed in f32 for float types).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
}

impl BinaryOp {
    /// Every binary operator.
    pub const ALL: [BinaryOp; 3] = [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul];

    /// Lowercase name, part of the CUDA kernel names.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
        }
    }
}

/// Unary elementwise operator (`out = f(x)`, computed in f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    GeluTanh,
    /// SiLU: `x / (1 + exp(-x))`.
    Silu,
}

impl UnaryOp {
    /// Every unary operator.
    pub const ALL: [UnaryOp; 2] = [UnaryOp::GeluTanh, UnaryOp::Silu];

    /// Lowercase name, part of the CUDA kernel names.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::GeluTanh => "gelu",
            UnaryOp::Silu => "silu",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_names_are_consistent() {
        let table: Vec<(DType, usize, &str)> = DType::ALL
            .iter()
            .map(|d| (*d, d.size_bytes(), d.name()))
            .collect();
        assert_eq!(
            table,
            vec![
                (DType::F32, 4, "f32"),
                (DType::BF16, 2, "bf16"),
                (DType::F16, 2, "f16"),
                (DType::I32, 4, "i32"),
                (DType::I64, 8, "i64"),
                (DType::U8, 1, "u8"),
            ]
        );
        for d in DType::ALL {
            assert_eq!(d.to_string(), d.name());
        }
    }

    #[test]
    fn element_types_match_their_dtype_size() {
        fn check<T: Element>() {
            assert_eq!(
                std::mem::size_of::<T>(),
                T::DTYPE.size_bytes(),
                "{}",
                T::DTYPE
            );
        }
        check::<f32>();
        check::<half::bf16>();
        check::<half::f16>();
        check::<i32>();
        check::<i64>();
        check::<u8>();
    }
}
