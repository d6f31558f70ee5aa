//! The bench program (a 64-layer transformer-like stack on a 2-D mesh) lowers, verifies, and
//! has the expected communication: one all-reduce of partial sums per layer, over DIDx.

use crate::support::programs as common;

use meshflow::ir::host::{CommKind, InstKind, Team};
use meshflow::ir::{verify_host, ParallelType};
use meshflow::{compile, Options};

#[test]
fn transformer_lowers_with_one_all_reduce_per_layer() {
    let program = common::transformer(64, 2, 4);
    let compiled = compile(&program, &Options::new().check(false)).expect("lowers");
    verify_host(compiled.host()).expect("verifies");
    let mut all_reduce = 0;
    let mut other = 0;
    compiled.host().walk(&mut |i, _| match &i.kind {
        InstKind::Communication {
            kind: CommKind::AllReduce,
            team,
            ..
        } => {
            assert!(matches!(
                team,
                Team::Slice {
                    pt: ParallelType::DIDx,
                    ..
                }
            ));
            all_reduce += 1;
        }
        k if k.is_communication() => other += 1,
        _ => {}
    });
    assert_eq!(all_reduce, 64);
    assert_eq!(other, 0);
}
