//! Property: simplification never changes the value of an index expression, for every value
//! of the loop index and team index allowed by the facts.

use meshflow_ir::host::expr::{ExprEnv, LoopVar};
use meshflow_ir::{DeviceId, EntityRef, Expr, MeshId, ParallelType};
use meshflow_passes::index::{loop_fact, my_fact, Facts, Simplifier};
use proptest::prelude::*;

struct Env {
    i: i64,
    my: i64,
}

impl ExprEnv for Env {
    fn loop_value(&self, _: LoopVar) -> Option<i64> {
        Some(self.i)
    }
    fn my_index(&self, _: MeshId, _: ParallelType) -> Option<i64> {
        Some(self.my)
    }
    fn rank(&self) -> DeviceId {
        0
    }
}

fn leaf() -> impl Strategy<Value = Expr> {
    prop_oneof![
        (-9i64..10).prop_map(Expr::c),
        Just(Expr::var(LoopVar(0))),
        Just(Expr::my(MeshId::new(0), ParallelType::DIDx)),
    ]
}

fn expr() -> impl Strategy<Value = Expr> {
    leaf().prop_recursive(4, 24, 2, |inner| {
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| a.add(b)),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| a.sub(b)),
            (inner.clone(), -4i64..5).prop_map(|(a, k)| a.mul(Expr::c(k))),
            (inner.clone(), 1i64..9).prop_map(|(a, m)| a.rem(Expr::c(m))),
            (inner, 1i64..5).prop_map(|(a, m)| a.div(Expr::c(m))),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn simplification_preserves_values(e in expr(), d in 1usize..6, trips in 1i64..7) {
        let mut facts = Facts::new();
        my_fact(&mut facts, MeshId::new(0), ParallelType::DIDx, d);
        loop_fact(&mut facts, LoopVar(0), 0, trips);
        let s = Simplifier::new(facts).simplify(&e);
        for i in 0..trips {
            for my in 0..d as i64 {
                let env = Env { i, my };
                prop_assert_eq!(e.eval(&env).ok(), s.eval(&env).ok(), "{} vs {} at i={} my={}", e, s, i, my);
            }
        }
    }
}
