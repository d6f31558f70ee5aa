//! Round-trip property tests: random structurally valid programs of both levels print to text
//! that parses back to an equal program and prints again byte-identically. The programs need
//! not verify.

use meshflow_ir::host::{BinOp, Expr, LoopVar};
use meshflow_ir::program::MeshDecl;
use meshflow_ir::{
    parse_host, parse_program, verify_host, verify_program, Axis, CommId, CommKind, ComputeOp,
    CustomOp, DType, DeviceMesh, EntityRef, Epsilon, HostProgram, HostTensor, HostTensorId, Inst,
    InstKind, MeshId, MoeWire, Op, OpKind, ParallelType, Program, ReduceOp, Role, SourceLoc,
    StreamRef, StreamVar, Team, TensorDecl, TensorId, TensorType, Transform,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;

/// Unique names: `{base}_{i}` (the digits after the last `_` make them unique, and a name
/// with digits is never a keyword).
fn named(bases: &[String], i: usize) -> String {
    format!("{}_{i}", bases[i % bases.len()])
}

fn bases() -> impl Strategy<Value = Vec<String>> {
    vec("[A-Za-z_][A-Za-z0-9_]{0,6}", 1..8)
}

fn pt() -> impl Strategy<Value = ParallelType> {
    select(ParallelType::ALL.to_vec())
}

fn dtype() -> impl Strategy<Value = DType> {
    select(DType::ALL.to_vec())
}

fn small_or_any_usize() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 0usize..8, 1 => any::<usize>()]
}

fn mesh() -> impl Strategy<Value = DeviceMesh> {
    (vec(1usize..4, 1..4), 0usize..100, any::<bool>()).prop_flat_map(|(shape, offset, sparse)| {
        let n: usize = shape.iter().product();
        let step = if sparse { 1_000_003 } else { 1 };
        let ids: Vec<usize> = (0..n).map(|i| offset + i * step).collect();
        Just(ids)
            .prop_shuffle()
            .prop_map(move |ids| DeviceMesh::new(shape.clone(), ids).expect("a valid mesh"))
    })
}

fn meshes(n: usize, bases: &[String]) -> impl Strategy<Value = Vec<MeshDecl>> {
    let bases = bases.to_vec();
    vec(mesh(), n).prop_map(move |ms| {
        ms.into_iter()
            .enumerate()
            .map(|(i, mesh)| MeshDecl {
                name: named(&bases, i),
                mesh,
                loc: SourceLoc::NONE,
            })
            .collect()
    })
}

// ---- level 1 ----

fn transform() -> impl Strategy<Value = Transform> {
    prop_oneof![
        (small_or_any_usize(), any::<u64>())
            .prop_map(|(axis, parts)| Transform::OuterSplit { axis, parts }),
        (small_or_any_usize(), 0u64..100)
            .prop_map(|(axis, factor)| Transform::InnerSplit { axis, factor }),
        small_or_any_usize().prop_map(|axis| Transform::Merge { axis }),
        vec(small_or_any_usize(), 0..5).prop_map(|order| Transform::Reorder { order }),
        (small_or_any_usize(), pt()).prop_map(|(axis, pt)| Transform::Swizzle1d { axis, pt }),
        (small_or_any_usize(), pt()).prop_map(|(axis, pt)| Transform::Parallelize { axis, pt }),
    ]
}

fn tensor_type() -> impl Strategy<Value = TensorType> {
    let extent = prop_oneof![4 => 1u64..200, 1 => 1u64..=u64::MAX];
    let axis = (extent, any::<bool>()).prop_map(|(extent, reduction)| Axis { extent, reduction });
    (dtype(), vec(axis, 0..5)).prop_map(|(dtype, axes)| TensorType { dtype, axes })
}

fn epsilon() -> impl Strategy<Value = Epsilon> {
    prop_oneof![
        Just(Epsilon::DEFAULT),
        (1u32..0x7f80_0000)
            .prop_filter_map("positive and finite", |b| Epsilon::new(f32::from_bits(b))),
    ]
}

fn op_kind() -> impl Strategy<Value = OpKind> {
    let u = || any::<u64>();
    prop_oneof![
        select(vec![OpKind::Reshape, OpKind::View, OpKind::Expand]),
        small_or_any_usize().prop_map(|axis| OpKind::Max { axis }),
        small_or_any_usize().prop_map(|axis| OpKind::Min { axis }),
        small_or_any_usize().prop_map(|axis| OpKind::Avg { axis }),
        small_or_any_usize().prop_map(|axis| OpKind::Softmax { axis }),
        small_or_any_usize().prop_map(|axis| OpKind::Squeeze { axis }),
        small_or_any_usize().prop_map(|axis| OpKind::Unsqueeze { axis }),
        vec(small_or_any_usize(), 0..5).prop_map(|perm| OpKind::Permute { perm }),
        (small_or_any_usize(), u(), u()).prop_map(|(axis, start, end)| OpKind::Slice {
            axis,
            start,
            end
        }),
        (small_or_any_usize(), u()).prop_map(|(axis, index)| OpKind::Select { axis, index }),
        (small_or_any_usize(), 0usize..4).prop_map(|(axis, inputs)| OpKind::Cat { axis, inputs }),
        (small_or_any_usize(), epsilon()).prop_map(|(axis, eps)| OpKind::RmsNorm { axis, eps }),
        select(vec![
            OpKind::Set,
            OpKind::Matmul,
            OpKind::Linear,
            OpKind::Add,
            OpKind::Sub,
            OpKind::Mul,
            OpKind::Gelu,
            OpKind::Silu,
            OpKind::Cast,
            OpKind::GroupedMatmul,
            OpKind::MoeCombine,
        ]),
        select(MoeWire::ALL.to_vec()).prop_map(|wire| OpKind::MoeDispatch { wire }),
        small_or_any_usize().prop_map(|axis| OpKind::Sum { axis }),
        ("\\PC{1,8}", vec(any::<i64>(), 0..3), 0usize..3, 1usize..3).prop_map(
            |(kernel, args, inputs, outputs)| OpKind::Custom(CustomOp {
                kernel,
                args,
                inputs,
                outputs,
            })
        ),
    ]
}

fn program() -> impl Strategy<Value = Program> {
    (bases(), 1usize..4, 0usize..7).prop_flat_map(|(bases, nm, nt)| {
        let tensor = (
            tensor_type(),
            0..nm,
            proptest::option::of(vec(transform(), 0..5)),
            any::<bool>(),
        );
        let tensors = vec(tensor, nt);
        let handle = move || (0..nt.max(1)).prop_map(TensorId::new);
        let op = op_kind().prop_flat_map(move |kind| {
            let (n_in, n_out) = kind.arity();
            (Just(kind), vec(handle(), n_in), vec(handle(), n_out))
        });
        let ops = if nt == 0 {
            vec(op, 0..1).boxed()
        } else {
            vec(op, 0..6).boxed()
        };
        let outputs = vec(handle(), if nt == 0 { 0..1 } else { 0..4 });
        (
            Just(bases.clone()),
            meshes(nm, &bases),
            tensors,
            ops,
            outputs,
        )
            .prop_map(move |(bases, meshes, tensors, ops, outputs)| {
                let mut p = Program::new(named(&bases, 1000));
                for m in meshes {
                    p.meshes.push(m);
                }
                for (i, (ty, mesh, schedule, is_input)) in tensors.into_iter().enumerate() {
                    p.tensors.push(TensorDecl {
                        name: named(&bases, 100 + i),
                        ty,
                        mesh: MeshId::new(mesh),
                        schedule,
                        is_input,
                        loc: SourceLoc::NONE,
                    });
                }
                for (kind, inputs, outputs) in ops {
                    p.ops.push(Op {
                        kind,
                        inputs,
                        outputs,
                        loc: SourceLoc::NONE,
                    });
                }
                p.outputs = outputs;
                p
            })
    })
}

// ---- host ----

fn expr(nm: usize) -> impl Strategy<Value = Expr> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(Expr::Const),
        (-5i64..20).prop_map(Expr::Const),
        prop_oneof![0u32..4, any::<u32>()].prop_map(|v| Expr::Loop(LoopVar(v))),
        Just(Expr::Rank),
        (0..nm, pt()).prop_map(|(m, pt)| Expr::MyIndex {
            mesh: MeshId::new(m),
            pt
        }),
    ];
    leaf.prop_recursive(6, 40, 2, |inner| {
        let op = select(vec![
            BinOp::Add,
            BinOp::Sub,
            BinOp::Mul,
            BinOp::Div,
            BinOp::Mod,
            BinOp::Min,
            BinOp::Max,
        ]);
        (op, inner.clone(), inner).prop_map(|(op, a, b)| Expr::Bin(op, Box::new(a), Box::new(b)))
    })
}

fn team(nm: usize) -> impl Strategy<Value = Team> {
    prop_oneof![
        (0..nm, pt()).prop_map(|(m, pt)| Team::Slice {
            mesh: MeshId::new(m),
            pt
        }),
        (0..nm, vec(pt(), 0..4)).prop_map(|(m, pts)| Team::Flattened {
            mesh: MeshId::new(m),
            pts
        }),
        (0..nm).prop_map(|m| Team::Mesh(MeshId::new(m))),
        vec(prop_oneof![0usize..16, any::<usize>()], 0..5).prop_map(Team::Devices),
    ]
}

fn compute_op() -> impl Strategy<Value = ComputeOp> {
    prop_oneof![
        select(vec![
            ComputeOp::Copy,
            ComputeOp::Matmul,
            ComputeOp::Linear,
            ComputeOp::LinearAccumulate,
            ComputeOp::Add,
            ComputeOp::Sub,
            ComputeOp::Mul,
            ComputeOp::Gelu,
            ComputeOp::Silu,
            ComputeOp::Cast,
            ComputeOp::GroupedMatmul,
        ]),
        small_or_any_usize().prop_map(|axis| ComputeOp::Sum { axis }),
        vec(small_or_any_usize(), 0..5).prop_map(|perm| ComputeOp::Permute { perm }),
        Just(ComputeOp::Expand),
        small_or_any_usize().prop_map(|axis| ComputeOp::Max { axis }),
        small_or_any_usize().prop_map(|axis| ComputeOp::Min { axis }),
        small_or_any_usize().prop_map(|axis| ComputeOp::Avg { axis }),
        small_or_any_usize().prop_map(|axis| ComputeOp::Softmax { axis }),
        (small_or_any_usize(), any::<u64>())
            .prop_map(|(axis, start)| ComputeOp::Slice { axis, start }),
        (small_or_any_usize(), epsilon()).prop_map(|(axis, eps)| ComputeOp::RmsNorm { axis, eps }),
    ]
}

fn simple_inst(nm: usize, nt: usize) -> BoxedStrategy<InstKind> {
    let t = move || (0..nt).prop_map(HostTensorId::new);
    let ts = move |max: usize| vec(t(), 0..max);
    let comm = || prop_oneof![0u32..8, any::<u32>()].prop_map(CommId);
    let stream_var = || prop_oneof![0u32..4, any::<u32>()].prop_map(StreamVar);
    let stream = move || {
        prop_oneof![
            stream_var().prop_map(StreamRef::Var),
            expr(nm).prop_map(StreamRef::Worker),
        ]
    };
    let reduce = select(vec![
        ReduceOp::Sum,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ]);
    prop_oneof![
        t().prop_map(|tensor| InstKind::Allocate { tensor }),
        t().prop_map(|tensor| InstKind::Deallocate { tensor }),
        stream_var().prop_map(|dst| InstKind::GetCurrentStream { dst }),
        stream().prop_map(|stream| InstKind::SetCurrentStream { stream }),
        stream().prop_map(|stream| InstKind::Synchronize { stream }),
        (t(), t(), small_or_any_usize(), any::<u64>(), expr(nm)).prop_map(
            |(out, input, axis, chunks, index)| InstKind::ShardByStream {
                out,
                input,
                axis,
                chunks,
                index
            }
        ),
        (t(), t(), small_or_any_usize(), expr(nm), expr(nm)).prop_map(
            |(out, input, axis, start, length)| InstKind::Narrow {
                out,
                input,
                axis,
                start,
                length
            }
        ),
        (
            comm(),
            select(CommKind::ALL.to_vec()),
            team(nm),
            t(),
            t(),
            proptest::option::of(expr(nm)),
            proptest::option::of(reduce),
        )
            .prop_map(|(id, kind, team, input, output, root, op)| {
                InstKind::Communication {
                    id,
                    kind,
                    team,
                    input,
                    output,
                    root,
                    op,
                }
            }),
        (comm(), team(nm), expr(nm), expr(nm), t(), t()).prop_map(
            |(id, team, send_peer, recv_peer, input, output)| InstKind::CollectivePermute {
                id,
                team,
                send_peer,
                recv_peer,
                input,
                output
            }
        ),
        comm().prop_map(|comm| InstKind::Wait { comm }),
        Just(InstKind::StartCoalescing),
        comm().prop_map(|id| InstKind::EndCoalescing { id }),
        (comm(), team(nm), vec(t(), 5), select(MoeWire::ALL.to_vec())).prop_map(
            |(id, team, v, wire)| InstKind::MoeDispatch {
                id,
                team,
                x: v[0],
                topk_idx: v[1],
                expert_x: v[2],
                expert_counts: v[3],
                routing: v[4],
                wire,
            }
        ),
        (comm(), team(nm), vec(t(), 5)).prop_map(|(id, team, v)| InstKind::MoeCombine {
            id,
            team,
            expert_y: v[0],
            expert_counts: v[1],
            routing: v[2],
            topk_weights: v[3],
            out: v[4],
        }),
        (compute_op(), ts(4), ts(3)).prop_map(|(op, inputs, outputs)| InstKind::Compute {
            op,
            inputs,
            outputs
        }),
        (small_or_any_usize(), ts(4), ts(3)).prop_map(|(axis, inputs, outputs)| {
            InstKind::Compute {
                op: ComputeOp::Cat {
                    axis,
                    inputs: inputs.len(),
                },
                inputs,
                outputs,
            }
        }),
        (any::<String>(), ts(3), ts(3), vec(expr(nm), 0..3)).prop_map(
            |(kernel, inputs, outputs, args)| InstKind::CallKernel {
                kernel,
                inputs,
                outputs,
                args
            }
        ),
    ]
    .boxed()
}

fn block(nm: usize, nt: usize) -> impl Strategy<Value = Vec<Inst>> {
    let leaf = simple_inst(nm, nt).prop_map(Inst::new);
    let inst = leaf.prop_recursive(4, 48, 6, move |inner| {
        (
            prop_oneof![0u32..4, any::<u32>()],
            expr(nm),
            expr(nm),
            vec(inner, 0..6),
        )
            .prop_map(|(i, start, stop, body)| {
                Inst::new(InstKind::ForLoop {
                    index: LoopVar(i),
                    start,
                    stop,
                    body,
                })
            })
    });
    vec(inst, 0..8)
}

fn host_program() -> impl Strategy<Value = HostProgram> {
    (bases(), 1usize..4, 1usize..7).prop_flat_map(|(bases, nm, nt)| {
        let tensor = (
            dtype(),
            vec(prop_oneof![0u64..100, any::<u64>()], 0..4),
            0..nm,
            select(vec![Role::Input, Role::Output, Role::Internal]),
        );
        (
            Just(bases.clone()),
            meshes(nm, &bases),
            vec(tensor, nt),
            block(nm, nt),
        )
            .prop_map(|(bases, meshes, tensors, body)| {
                let mut p = HostProgram::new(named(&bases, 1000));
                for m in meshes {
                    p.meshes.push(m);
                }
                for (i, (dtype, shape, mesh, role)) in tensors.into_iter().enumerate() {
                    p.tensors.push(HostTensor {
                        name: named(&bases, 100 + i),
                        dtype,
                        shape,
                        mesh: MeshId::new(mesh),
                        role,
                        loc: SourceLoc::NONE,
                    });
                }
                p.body = body;
                p
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn programs_round_trip(p in program()) {
        let text = p.to_string();
        let parsed = parse_program(&text).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(&parsed, &p, "{}", text);
        prop_assert_eq!(parsed.to_string(), text);
        // The verifier must not panic on arbitrary (mostly invalid) programs.
        let _ = verify_program(&parsed);
    }

    #[test]
    fn host_programs_round_trip(p in host_program()) {
        let text = p.to_string();
        let parsed = parse_host(&text).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(&parsed, &p, "{}", text);
        prop_assert_eq!(parsed.to_string(), text);
        let _ = verify_host(&parsed);
    }
}
