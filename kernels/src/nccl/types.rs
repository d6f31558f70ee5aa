//! Mapping of meshflow's element types and reduction operators to NCCL's.

use super::sys::{ncclDataType_t, ncclRedOp_t};
use crate::dtype::{DType, ReduceOp};

/// NCCL data type of a [`DType`].
pub fn nccl_data_type(d: DType) -> ncclDataType_t {
    match d {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::U8 => ncclDataType_t::ncclUint8,
    }
}

/// NCCL reduction operator of a [`ReduceOp`].
pub fn nccl_red_op(op: ReduceOp) -> ncclRedOp_t {
    match op {
        ReduceOp::Sum => ncclRedOp_t::ncclSum,
        ReduceOp::Prod => ncclRedOp_t::ncclProd,
        ReduceOp::Max => ncclRedOp_t::ncclMax,
        ReduceOp::Min => ncclRedOp_t::ncclMin,
        ReduceOp::Avg => ncclRedOp_t::ncclAvg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_type_codes_match_nccl_h() {
        let codes: Vec<(DType, u32)> = DType::ALL
            .iter()
            .map(|d| (*d, nccl_data_type(*d).0))
            .collect();
        assert_eq!(
            codes,
            vec![
                (DType::F32, 7),
                (DType::BF16, 9),
                (DType::F16, 6),
                (DType::I32, 2),
                (DType::I64, 4),
                (DType::U8, 1),
            ]
        );
    }

    #[test]
    fn red_op_codes_match_nccl_h() {
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Avg,
        ];
        let codes: Vec<u32> = ops.iter().map(|o| nccl_red_op(*o).0).collect();
        assert_eq!(codes, vec![0, 1, 2, 3, 4]);
    }
}
