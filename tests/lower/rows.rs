//! Every decision-table row, end to end: a small program per row is compiled, checked across
//! ranks, run on the CPU backend and compared with the unsharded reference.

use meshflow::check::check_program;
use meshflow::ir::{
    DType, DeviceMesh, MeshId, ParallelType, ParallelType::*, Program, ProgramBuilder, TensorId,
};
use meshflow::runtime::compare::run_and_compare;
use meshflow::runtime::ranks::CpuOptions;
use meshflow::{compile, Options};

/// How one side of `y = set(x)` is scheduled.
#[derive(Clone, Copy)]
enum S {
    Replicated,
    Split(usize, ParallelType),
    Stream(usize, Option<ParallelType>),
    Split2(usize, ParallelType, usize, ParallelType),
}

fn apply(b: &mut ProgramBuilder, t: TensorId, s: S, mesh: &DeviceMesh) {
    let size = |pt| mesh.size_of(pt).unwrap_or(1) as u64;
    match s {
        S::Replicated => b.replicate(t),
        S::Split(a, pt) => {
            b.schedule(t).outer_split(a, size(pt)).parallelize(a, pt);
        }
        S::Stream(a, sw) => {
            let n = size(sw.unwrap_or(DIDx));
            let s = b.schedule(t).outer_split(a, n);
            let s = match sw {
                Some(pt) => s.swizzle1d(a, pt),
                None => s,
            };
            s.parallelize(a, Stream);
        }
        S::Split2(a, p, c, q) => {
            // `c` is a logical axis > `a`: its loop position is shifted by the first split.
            b.schedule(t)
                .outer_split(a, size(p))
                .parallelize(a, p)
                .outer_split(c + 1, size(q))
                .parallelize(c + 1, q);
        }
    }
}

fn mesh(shape: &[usize], start: usize) -> DeviceMesh {
    DeviceMesh::iota(shape.to_vec(), start).unwrap()
}

/// `y = set(x)` with `x[12, 8]` on `mx` and `y` on `my`, then `z = gelu(y)` so the result is
/// consumed by compute too.
fn set_program(mx: DeviceMesh, sx: S, my: DeviceMesh, sy: S) -> Program {
    let mut b = ProgramBuilder::new("row");
    let a = b.mesh("a", mx.clone()).unwrap();
    let bm: MeshId = if mx == my {
        a
    } else {
        b.mesh("b", my.clone()).unwrap()
    };
    let x = b.input("x", DType::F32, &[12, 8], a).unwrap();
    apply(&mut b, x, sx, &mx);
    let y = b.set(x).unwrap();
    b.rename(y, "y").unwrap();
    b.place(y, bm);
    apply(&mut b, y, sy, &my);
    let z = b.gelu(y).unwrap();
    b.rename(z, "z").unwrap();
    b.place(z, bm);
    b.output(z);
    b.build().unwrap()
}

/// `p = linear(x, w)` with K split along DIDx (partial sums) on `[0, 1]`, `y = set(p)`.
fn partial_program(my: DeviceMesh, sy: S) -> Program {
    let mut b = ProgramBuilder::new("partial");
    let m = mesh(&[2], 0);
    let a = b.mesh("a", m.clone()).unwrap();
    let bm = if my == m {
        a
    } else {
        b.mesh("b", my.clone()).unwrap()
    };
    let x = b.input("x", DType::F32, &[4, 8], a).unwrap();
    let w = b.input("w", DType::F32, &[6, 8], a).unwrap();
    b.schedule(x).outer_split(1, 2).parallelize(1, DIDx);
    b.schedule(w).outer_split(1, 2).parallelize(1, DIDx);
    let p = b.linear(x, w).unwrap();
    let y = b.set(p).unwrap();
    b.rename(y, "y").unwrap();
    b.place(y, bm);
    apply(&mut b, y, sy, &my);
    b.output(y);
    b.build().unwrap()
}

fn check(name: &str, program: &Program) {
    let compiled =
        compile(program, &Options::new().check(false)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let world = compiled.host().world_size();
    check_program(compiled.host(), world)
        .unwrap_or_else(|e| panic!("{name}: cross-rank check failed:\n{e}\n{}", compiled.host()));
    let cmp = run_and_compare(
        compiled.level1().expect("lowered"),
        compiled.host(),
        world,
        11,
        &CpuOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{name}: run failed: {e}\n{}", compiled.host()));
    assert!(cmp.passed(), "{name}: {cmp}\n{}", compiled.host());
}

#[test]
fn same_mesh_rows() {
    let m = || mesh(&[4], 0);
    let cases = [
        ("all_gather", S::Split(0, DIDx), S::Replicated),
        ("all_gather inner axis", S::Split(1, DIDx), S::Replicated),
        ("local slice", S::Replicated, S::Split(0, DIDx)),
        ("all_to_all", S::Split(0, DIDx), S::Split(1, DIDx)),
        ("all_to_all back", S::Split(1, DIDx), S::Split(0, DIDx)),
        ("ring", S::Split(0, DIDx), S::Stream(0, Some(DIDx))),
        ("stream broadcast", S::Split(0, DIDx), S::Stream(0, None)),
        (
            "per-chunk all_gather",
            S::Split(1, DIDx),
            S::Stream(0, None),
        ),
    ];
    for (name, sx, sy) in cases {
        check(name, &set_program(m(), sx, m(), sy));
    }
}

#[test]
fn two_dimensional_mesh_rows() {
    let m = || mesh(&[2, 2], 0);
    let cases = [
        ("all_gather DIDy", S::Split(0, DIDy), S::Replicated),
        (
            "two types at once",
            S::Split2(0, DIDy, 1, DIDx),
            S::Replicated,
        ),
        (
            "swap types",
            S::Split2(0, DIDy, 1, DIDx),
            S::Split2(0, DIDx, 1, DIDy),
        ),
        (
            "all_to_all DIDx",
            S::Split2(0, DIDy, 1, DIDx),
            S::Split(0, DIDx),
        ),
    ];
    for (name, sx, sy) in cases {
        check(name, &set_program(m(), sx, m(), sy));
    }
}

#[test]
fn cross_mesh_rows() {
    let cases = [
        (
            "send_recv",
            mesh(&[2], 0),
            S::Split(0, DIDx),
            mesh(&[2], 2),
            S::Split(0, DIDx),
        ),
        (
            "broadcast",
            mesh(&[1], 0),
            S::Replicated,
            mesh(&[2], 1),
            S::Replicated,
        ),
        (
            "gather",
            mesh(&[4], 0),
            S::Split(0, DIDx),
            DeviceMesh::new(vec![2], vec![1, 3]).unwrap(),
            S::Replicated,
        ),
        (
            "scatter",
            mesh(&[2], 0),
            S::Replicated,
            DeviceMesh::new(vec![2], vec![1, 2]).unwrap(),
            S::Split(0, DIDx),
        ),
        (
            "disjoint gather",
            mesh(&[2], 0),
            S::Split(0, DIDx),
            mesh(&[2], 2),
            S::Replicated,
        ),
        (
            "disjoint scatter",
            mesh(&[1], 0),
            S::Replicated,
            mesh(&[2], 1),
            S::Split(0, DIDx),
        ),
        (
            "disjoint reshard",
            mesh(&[2], 0),
            S::Split(0, DIDx),
            mesh(&[2], 2),
            S::Split(1, DIDx),
        ),
        (
            "to a 2-D mesh",
            mesh(&[2], 0),
            S::Split(0, DIDx),
            mesh(&[2, 2], 2),
            S::Split(0, DIDy),
        ),
    ];
    for (name, mx, sx, my, sy) in cases {
        check(name, &set_program(mx, sx, my, sy));
    }
}

#[test]
fn reduction_rows() {
    check("all_reduce", &partial_program(mesh(&[2], 0), S::Replicated));
    check(
        "reduce_scatter",
        &partial_program(mesh(&[2], 0), S::Split(0, DIDx)),
    );
    check(
        "reduce_scatter inner",
        &partial_program(mesh(&[2], 0), S::Split(1, DIDx)),
    );
    check(
        "reduce",
        &partial_program(DeviceMesh::new(vec![1], vec![1]).unwrap(), S::Replicated),
    );
    check(
        "disjoint reduce",
        &partial_program(mesh(&[2], 2), S::Replicated),
    );
}

#[test]
fn an_op_reading_a_whole_tensor_does_not_join_the_loop_producing_it() {
    // t is computed chunk by chunk (Stream on rows); `add` links x's rows with t's rows, so
    // y's row loop has the same key, but `linear` reads all of t (as its weight): it must
    // wait for the whole loop instead of joining it.
    let mut b = ProgramBuilder::new("whole");
    let m = b.mesh("m0", mesh(&[1], 0)).unwrap();
    let a = b.input("a", DType::F32, &[8, 8], m).unwrap();
    let x = b.input("x", DType::F32, &[8, 8], m).unwrap();
    let t = b.gelu(a).unwrap();
    b.schedule(t).outer_split(0, 2).parallelize(0, Stream);
    let z = b.add(x, t).unwrap();
    let y = b.linear(x, t).unwrap();
    b.schedule(y).outer_split(0, 2).parallelize(0, Stream);
    b.output(z);
    b.output(y);
    let program = b.build().unwrap();
    let host = compile(&program, &Options::new().check(false))
        .unwrap()
        .host()
        .clone();
    let loops = host
        .body
        .iter()
        .filter(|i| matches!(i.kind, meshflow::ir::InstKind::ForLoop { .. }))
        .count();
    assert_eq!(loops, 2, "{host}");
    check("whole", &program);
}
