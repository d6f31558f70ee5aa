//! The lowering's invariants on random sharded programs.
//!
//! Each case is a level-1 program built by [`gen`]: a mesh of 1 to 3 axes (some of extent 1),
//! a tensor of 1 to 3 axes (extents from 1 to 7, so many shards are uneven or empty), a
//! source placement and a target placement (per mesh axis: replicated, a split of some axis
//! in a random chain order, sometimes inside a serial piece (a strided layout), or partial
//! sums for the source), a `set` between them, optionally a Stream split on the target and
//! elementwise ops around the `set`, compiled with or without merging collectives over
//! flattened teams. The run has the mesh's devices plus maybe an idle one. For every case:
//!
//! - lowering either refuses with a clear error (it names a tensor or op in backquotes and is
//!   not an internal error), or
//! - emits a host program that the cross-rank check accepts (lowering never emits a program
//!   its own check rejects), and that program runs on the CPU backend and matches the
//!   unsharded reference (a program that passes the check never fails in its run).
//!
//! [`gen`] is meant to grow: a new placement kind or op is one more variant and one more
//! arm of its `text`.

use meshflow::check::check_program;
use meshflow::ir::parse::parse_program;
use meshflow::runtime::compare::run_and_compare;
use meshflow::runtime::ranks::CpuOptions;
use meshflow::{compile, Options};
use proptest::prelude::*;

mod gen {
    use proptest::prelude::*;

    /// Where a tensor lies along one mesh axis.
    #[derive(Clone, Debug)]
    pub enum Place {
        /// Replicated.
        R,
        /// Split on `axis`; splits of one axis are chained in ascending `order`. With
        /// `serial > 1` the split lies inside a serial piece (`outer_split(.., serial)`
        /// before it: a strided layout, DTensor's `_StridedShard`).
        S { axis: usize, order: u8, serial: u64 },
        /// Partial sums (sources only).
        P,
    }

    /// An elementwise op around the resharding.
    #[derive(Clone, Copy, Debug)]
    pub enum Unary {
        Gelu,
        Silu,
    }

    impl Unary {
        fn name(self) -> &'static str {
            match self {
                Unary::Gelu => "gelu",
                Unary::Silu => "silu",
            }
        }
    }

    /// One random program (see the test's module docs).
    #[derive(Clone, Debug)]
    pub struct Case {
        /// Mesh extents, outermost first.
        pub mesh: Vec<u64>,
        /// Tensor extents.
        pub extents: Vec<u64>,
        /// Source placement, per mesh axis.
        pub src: Vec<Place>,
        /// Target placement, per mesh axis (never partial).
        pub dst: Vec<Place>,
        /// A Stream split of the target: `(axis, chunks)`.
        pub stream: Option<(usize, u64)>,
        /// An op applied to the source before the `set`.
        pub pre: Option<Unary>,
        /// An op applied to the target after the `set`.
        pub post: Option<Unary>,
        /// Idle ranks beyond the mesh.
        pub idle: usize,
        /// Merge consecutive collectives over flattened teams (the pass option).
        pub merge: bool,
    }

    /// `DIDx` for the last mesh axis, `DIDy` before it, `DIDz` before that.
    fn pt(mesh_rank: usize, md: usize) -> &'static str {
        ["DIDx", "DIDy", "DIDz"][mesh_rank - 1 - md]
    }

    impl Case {
        /// The number of ranks of the run.
        pub fn ranks(&self) -> usize {
            self.mesh.iter().product::<u64>() as usize + self.idle
        }

        /// The schedule of a tensor placed as `places`, with partial sums on logical axis
        /// `red` (the trailing reduction axis) and an optional Stream split.
        fn schedule(
            &self,
            places: &[Place],
            red: Option<usize>,
            stream: Option<(usize, u64)>,
        ) -> String {
            let n = self.mesh.len();
            let mut chains: Vec<Vec<(u8, usize, u64)>> = vec![Vec::new(); self.extents.len() + 1];
            for (md, p) in places.iter().enumerate() {
                match *p {
                    Place::S {
                        axis,
                        order,
                        serial,
                    } => chains[axis].push((order, md, serial)),
                    Place::P => {
                        if let Some(r) = red {
                            chains[r].push((md as u8, md, 1));
                        }
                    }
                    Place::R => {}
                }
            }
            let mut out = Vec::new();
            let mut shift = 0;
            for (axis, chain) in chains.iter_mut().enumerate() {
                chain.sort();
                let mut pos = axis + shift;
                for &(_, md, serial) in chain.iter() {
                    if serial > 1 {
                        out.push(format!("outer_split({pos}, {serial})"));
                        pos += 1;
                        shift += 1;
                    }
                    out.push(format!("outer_split({pos}, {})", self.mesh[md]));
                    out.push(format!("parallelize({pos}, {})", pt(n, md)));
                    pos += 1;
                    shift += 1;
                }
                if let Some((s, chunks)) = stream {
                    if s == axis {
                        out.push(format!("outer_split({pos}, {chunks})"));
                        out.push(format!("parallelize({pos}, Stream)"));
                        shift += 1;
                    }
                }
            }
            format!("{{{}}}", out.join(", "))
        }

        /// The program's text.
        pub fn text(&self) -> String {
            let n = self.mesh.len();
            let dims: Vec<String> = self.extents.iter().map(|e| e.to_string()).collect();
            let dims = dims.join(", ");
            let mesh: Vec<String> = self.mesh.iter().map(|e| e.to_string()).collect();
            let partial: Vec<usize> = (0..n)
                .filter(|&md| matches!(self.src[md], Place::P))
                .collect();
            let mut lines = vec![
                "program random {".to_string(),
                format!("  param ranks = {}", self.ranks()),
                format!("  mesh m = iota({})", mesh.join(", ")),
            ];
            let src_sched = |red| self.schedule(&self.src, red, None);
            let mut x = "x".to_string();
            if partial.is_empty() {
                lines.push(format!("  input x: f32[{dims}] on m {}", src_sched(None)));
                if let Some(op) = self.pre {
                    lines.push(format!("  tensor xa: f32[{dims}] on m {}", src_sched(None)));
                    lines.push(format!("  xa = {}(x)", op.name()));
                    x = "xa".into();
                }
            } else {
                let ext: Vec<String> = partial
                    .iter()
                    .map(|&md| self.mesh[md].to_string())
                    .collect();
                let ext = ext.join(" * ");
                let r = self.extents.len();
                lines.push(format!(
                    "  input a: f32[{dims}, {ext}] on m {}",
                    src_sched(Some(r))
                ));
                lines.push(format!(
                    "  tensor x: f32[{dims}, r({ext})] on m {}",
                    src_sched(Some(r))
                ));
                lines.push(format!("  x = sum(a, axis={r})"));
            }
            lines.push(format!(
                "  tensor y: f32[{dims}] on m {}",
                self.schedule(&self.dst, None, self.stream)
            ));
            lines.push(format!("  y = set({x})"));
            match self.post {
                Some(op) => {
                    lines.push(format!("  z = {}(y)", op.name()));
                    lines.push("  output z".into());
                    lines.insert(lines.len() - 2, format!("  tensor z: f32[{dims}] on m"));
                }
                None => lines.push("  output y".into()),
            }
            lines.push("}".into());
            lines.join("\n")
        }
    }

    fn place(rank: usize, partial: bool) -> impl Strategy<Value = Place> {
        let serial = prop_oneof![6 => Just(1u64), 1 => 2u64..=3];
        let s = (0..rank, any::<u8>(), serial).prop_map(|(axis, order, serial)| Place::S {
            axis,
            order,
            serial,
        });
        if partial {
            prop_oneof![2 => Just(Place::R), 4 => s, 1 => Just(Place::P)].boxed()
        } else {
            prop_oneof![1 => Just(Place::R), 2 => s].boxed()
        }
    }

    fn unary() -> impl Strategy<Value = Option<Unary>> {
        prop_oneof![2 => Just(None), 1 => Just(Some(Unary::Gelu)), 1 => Just(Some(Unary::Silu))]
    }

    /// A random case.
    pub fn case() -> impl Strategy<Value = Case> {
        let mesh = prop_oneof![
            prop::collection::vec(1u64..=4, 1),
            prop::collection::vec(1u64..=3, 2),
            prop::collection::vec(1u64..=2, 3),
        ];
        (mesh, prop::collection::vec(1u64..=7, 1..=3)).prop_flat_map(|(mesh, extents)| {
            let (n, rank) = (mesh.len(), extents.len());
            let stream = prop_oneof![
                3 => Just(None),
                1 => (0..rank, 2u64..=3).prop_map(Some),
            ];
            (
                prop::collection::vec(place(rank, true), n),
                prop::collection::vec(place(rank, false), n),
                stream,
                unary(),
                unary(),
                0usize..=1,
                any::<bool>(),
            )
                .prop_map(move |(src, dst, stream, pre, post, idle, merge)| Case {
                    mesh: mesh.clone(),
                    extents: extents.clone(),
                    src,
                    dst,
                    stream,
                    pre,
                    post,
                    idle,
                    merge,
                })
        })
    }
}

/// Checks the invariants on one case; `Err` explains a violation.
fn check_case(case: &gen::Case) -> Result<(), String> {
    let text = case.text();
    let program =
        parse_program(&text).map_err(|e| format!("the generator wrote bad text: {e}\n{text}"))?;
    let mut options = Options::new().check(false);
    options.pass_options_mut().merge_collectives = case.merge;
    let compiled = match compile(&program, &options) {
        Ok(c) => c,
        Err(e) => {
            let msg = e.to_string();
            if msg.contains("internal error") || !msg.contains('`') {
                return Err(format!("unclear refusal: {msg}\n{text}"));
            }
            return Ok(());
        }
    };
    let world = case.ranks().max(compiled.host().world_size());
    check_program(compiled.host(), world).map_err(|e| {
        format!(
            "lowering emitted a program its own check rejects:\n{e}\n{text}\n{}",
            compiled.host()
        )
    })?;
    let cmp = run_and_compare(
        compiled.level1().expect("lowered"),
        compiled.host(),
        world,
        3,
        &CpuOptions::default(),
    )
    .map_err(|e| {
        format!(
            "a checked program failed to run: {e}\n{text}\n{}",
            compiled.host()
        )
    })?;
    if !cmp.passed() {
        return Err(format!("{cmp}\n{text}\n{}", compiled.host()));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_reshardings_refuse_clearly_or_check_and_run(case in gen::case()) {
        if let Err(e) = check_case(&case) {
            prop_assert!(false, "{}", e);
        }
    }
}
