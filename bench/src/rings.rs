//! Hand-written ring schedules of the overlap benchmarks, checked against the same level-1
//! programs as the pipeline-lowered variants ([`agmm_program`], [`rsmm_program`]) on the CPU backend
//! backend.
//!
//! Every ring only ever talks to its neighbours (team index `my ± 1`), one chunk per step, and
//! posts its transfers on worker streams while the main stream computes:
//!
//! - [`AgVariant::RingForward`] (AG+GEMM): at step `i` a rank GEMMs the chunk it holds (its own
//!   at step 0) while forwarding that chunk to rank + 1 and receiving the next one from
//!   rank − 1 into the other of two receive slots.
//! - [`AgVariant::RingBidirectional`] (AG+GEMM): the same with every chunk cut into two row
//!   halves, the first travelling clockwise (to rank + 1) on worker 0, the second
//!   counter-clockwise (to rank − 1) on worker 1; each received half is GEMM'd on its own.
//! - [`RsVariant::Ring`](crate::programs::RsVariant::Ring) (GEMM+RS): at step `i` a rank
//!   GEMMs its partial product of row chunk `(my − i − 1) mod d` while the running sum of the
//!   previous step travels to rank + 1, then adds the sum received from rank − 1; the last
//!   step lands the full sum of chunk `my` in `z`. With `pieces` > 1 each step's GEMM and add
//!   are cut into row pieces, and the add of a piece runs on worker 1 under the GEMM of the
//!   next piece (only the last piece's add stays exposed).
//!
//! The schedules peel their first and last steps (the host IR has no conditionals), so each
//! communication label is defined once and waited on in its own block.

use meshflow::ir::{DType, HostProgram};

use crate::programs::{
    agmm_program, keep_parts, mesh_text, parse, rsmm_program, AgVariant, Gemm3, Lowered, Parts,
};
use meshflow::passes::PassError;
use meshflow::{compile, Error, Options};

/// The executing rank's team index in the host text.
const MY: &str = "my(m0, DIDx)";

/// Host program text, one instruction per line, indented by loop depth.
struct Text {
    s: String,
    depth: usize,
}

impl Text {
    fn new(head: String) -> Text {
        Text { s: head, depth: 1 }
    }

    fn line(&mut self, l: impl AsRef<str>) {
        for _ in 0..self.depth {
            self.s.push_str("  ");
        }
        self.s.push_str(l.as_ref());
        self.s.push('\n');
    }

    fn open(&mut self, l: impl AsRef<str>) {
        self.line(format!("{} {{", l.as_ref()));
        self.depth += 1;
    }

    fn close(&mut self) {
        self.depth -= 1;
        self.line("}");
    }

    fn finish(mut self) -> HostProgram {
        self.s.push_str("}\n");
        parse(&self.s)
    }

    /// `id = collective_permute(from -> to)` sending to team index `my + step` and receiving
    /// from `my - step` (`step` is ±1).
    fn permute(&mut self, id: &str, from: &str, to: &str, d: usize, step: i64) {
        let (send, recv) = if step > 0 { (1, d - 1) } else { (d - 1, 1) };
        self.line(format!(
            "{id} = collective_permute({from} -> {to}, team=slice(m0, DIDx), send=({MY} + {send}) % {d}, recv=({MY} + {recv}) % {d})"
        ));
    }

    /// Switches to worker `w`, which then waits for the main stream `s0` so far.
    fn on_worker(&mut self, w: usize) {
        self.line(format!("set_current_stream worker({w})"));
        self.line("synchronize s0");
    }
}

fn invalid(what: String) -> Error {
    PassError::Options(what).into()
}

/// Lowers a ring AG+GEMM variant ([`AgVariant::RingForward`] or
/// [`AgVariant::RingBidirectional`]): the level-1 program is [`agmm_program`] of the variant
/// (the gathered `ag` replicated), compiled for its layouts; the host program is
/// [`agmm_ring_host`] cut down to `parts`. Fails for another variant, when `d` is 0 or when
/// the sizes do not divide.
pub fn agmm_ring_lowered(
    d: usize,
    s: Gemm3,
    dtype: DType,
    variant: AgVariant,
    parts: Parts,
) -> Result<Lowered, Error> {
    let halves = match variant {
        AgVariant::RingForward => 1,
        AgVariant::RingBidirectional => 2,
        _ => {
            return Err(invalid(format!(
                "agmm {} is not a hand-written ring",
                variant.name()
            )))
        }
    };
    let du = d as u64;
    if d == 0 || !s.m.is_multiple_of(du * halves) || !s.n.is_multiple_of(du) {
        return Err(invalid(format!(
            "agmm {}: M={} must be a multiple of {} and N={} of d={d}",
            variant.name(),
            s.m,
            du * halves,
            s.n
        )));
    }
    // Only the layouts are wanted: keep `ag` a collective.
    let options = Options::new()
        .check(false)
        .decomposition("ag", meshflow::passes::Decomposition::Collective);
    let compiled = compile(&agmm_program(d, s, dtype, variant), &options)?;
    let program = compiled.level1()?.clone();
    Ok(Lowered {
        program,
        host: keep_parts(&agmm_ring_host(d, s, dtype, variant), parts),
    })
}

/// Lowers [`RsVariant::Ring`](crate::programs::RsVariant::Ring): [`rsmm_program`] (`z` split
/// on rows) and [`rsmm_ring_host`] cut down to `parts`. Fails when `d` is 0 or the sizes do
/// not divide.
pub fn rsmm_ring_lowered(
    d: usize,
    s: Gemm3,
    dtype: DType,
    pieces: u64,
    parts: Parts,
) -> Result<Lowered, Error> {
    let du = d as u64;
    if d == 0 || !s.m.is_multiple_of(du) || !s.k.is_multiple_of(du) {
        return Err(invalid(format!(
            "rsmm ring: M={} and K={} must be multiples of d={d}",
            s.m, s.k
        )));
    }
    if pieces == 0 || !(s.m / du).is_multiple_of(pieces) {
        return Err(invalid(format!(
            "rsmm ring: the M/d={} rows of a chunk cannot be cut into {pieces} pieces",
            s.m / du
        )));
    }
    Ok(Lowered {
        program: rsmm_program(d, s, dtype, None),
        host: keep_parts(&rsmm_ring_host(d, s, dtype, pieces), parts),
    })
}

/// The host program of a ring AG+GEMM variant (local shapes `x[M/d, K]`, `w[N/d, K]`,
/// `y[M, N/d]`; `y` row chunk `j` is `x_j @ w^T`). GEMMs run on the main stream `s0`, the
/// clockwise permutes on worker 0 and the counter-clockwise ones on worker 1; a permute starts
/// once the main stream has finished the previous step (its GEMMs and its waits), so it runs
/// under the GEMM(s) of its own step.
///
/// - Forward: step 0 GEMMs `x` into `y[my]` while permuting `x` into slot 0; step `i` in
///   `1..d-1` GEMMs slot `(i-1) % 2` (chunk `my - i`) while forwarding it into slot `i % 2`;
///   step `d-1` GEMMs the last slot (chunk `my + 1`). `d - 1` transfers, all to rank + 1.
/// - Bidirectional: the same per half chunk, with separate clockwise and counter-clockwise
///   slot pairs; at step `i` the clockwise slot holds the first half of chunk `my - i`, the
///   counter-clockwise one the second half of chunk `my + i`, each GEMM'd into its half of
///   `y` (step 0 GEMMs the whole own chunk). Two permutes per step, in opposite directions.
///
/// `variant` [`AgVariant::RingBidirectional`] builds the bidirectional ring, any other the
/// forward one. Panics when `M` is not a multiple of `d` (of `2d` for the bidirectional ring)
/// or `N` of `d` ([`agmm_ring_lowered`] checks it).
pub fn agmm_ring_host(d: usize, s: Gemm3, dtype: DType, variant: AgVariant) -> HostProgram {
    let d = d.max(1);
    let du = d as u64;
    let t = dtype.name();
    let (mc, nd) = (s.m / du, s.n / du);
    let both = variant == AgVariant::RingBidirectional;
    let name = if both { "bidirectional" } else { "forward" };
    let mut head = format!(
        "host agmm_ring_{name} {{\n  mesh m0 = {mesh}\n  in x: {t}[{mc}, {k}] on m0\n  in w: {t}[{nd}, {k}] on m0\n  out y: {t}[{m}, {nd}] on m0\n  tensor y_chunk: {t}[{mc}, {nd}] on m0\n",
        mesh = mesh_text(d),
        k = s.k,
        m = s.m,
    );
    if d == 1 {
        let mut p = Text::new(head);
        p.line("linear(x, w -> y)");
        return p.finish();
    }
    // Slot buffers: two receive slots per direction, each one (half) chunk.
    let dirs: &[(&str, i64)] = if both {
        &[("cw", 1), ("ccw", -1)]
    } else {
        &[("ring", 1)]
    };
    let rows = if both { mc / 2 } else { mc };
    for (dir, _) in dirs {
        head += &format!(
            "  tensor {dir}: {t}[{}, {k}] on m0\n  tensor {dir}_send: {t}[{rows}, {k}] on m0\n  tensor {dir}_recv: {t}[{rows}, {k}] on m0\n",
            2 * rows,
            k = s.k
        );
        if both {
            head += &format!("  tensor x_{dir}: {t}[{rows}, {k}] on m0\n", k = s.k);
        }
    }
    if both {
        head += &format!("  tensor y_half: {t}[{rows}, {nd}] on m0\n");
    }
    let mut p = Text::new(head);
    for (dir, _) in dirs {
        p.line(format!("allocate {dir}"));
    }
    p.line("s0 = get_current_stream");
    // The chunk GEMM'd at step `i` from direction `dir`: `y` row block (of 2d halves when
    // bidirectional) and the slot holding it.
    let gemm = |p: &mut Text, i: &str, dir: &str, step: i64| {
        let chunk = if step > 0 {
            format!("({MY} + {d} - {i}) % {d}")
        } else {
            format!("({MY} + {i}) % {d}")
        };
        if both {
            let half = usize::from(step < 0);
            p.line(format!(
                "y_half = shard_by_stream(y, axis=0, chunks={}, index=2 * ({chunk}) + {half})",
                2 * d
            ));
            p.line(format!("linear({dir}_send, w -> y_half)"));
        } else {
            p.line(format!(
                "y_chunk = shard_by_stream(y, axis=0, chunks={d}, index={chunk})"
            ));
            p.line(format!("linear({dir}_send, w -> y_chunk)"));
        }
    };
    // Step 0: the own chunk (or its halves) goes out while it is GEMM'd.
    for (w, (dir, step)) in dirs.iter().enumerate() {
        p.on_worker(w);
        let from = if both {
            p.line(format!(
                "x_{dir} = shard_by_stream(x, axis=0, chunks=2, index={w})"
            ));
            format!("x_{dir}")
        } else {
            "x".to_string()
        };
        p.line(format!(
            "{dir}_recv = shard_by_stream({dir}, axis=0, chunks=2, index=0)"
        ));
        p.permute(&format!("c{w}"), &from, &format!("{dir}_recv"), d, *step);
    }
    p.line("set_current_stream s0");
    p.line(format!(
        "y_chunk = shard_by_stream(y, axis=0, chunks={d}, index={MY})"
    ));
    p.line("linear(x, w -> y_chunk)");
    for w in 0..dirs.len() {
        p.line(format!("wait c{w}"));
    }
    // Steps 1..d-1: forward what arrived last step while GEMM'ing it.
    if d > 2 {
        p.open(format!("for i0 in 1..{}", d - 1));
        for (w, (dir, step)) in dirs.iter().enumerate() {
            p.on_worker(w);
            p.line(format!(
                "{dir}_send = shard_by_stream({dir}, axis=0, chunks=2, index=(i0 + 1) % 2)"
            ));
            p.line(format!(
                "{dir}_recv = shard_by_stream({dir}, axis=0, chunks=2, index=i0 % 2)"
            ));
            let id = format!("c{}", dirs.len() + w);
            p.permute(
                &id,
                &format!("{dir}_send"),
                &format!("{dir}_recv"),
                d,
                *step,
            );
        }
        p.line("set_current_stream s0");
        for (dir, step) in dirs {
            gemm(&mut p, "i0", dir, *step);
        }
        for w in 0..dirs.len() {
            p.line(format!("wait c{}", dirs.len() + w));
        }
        p.close();
    }
    // Step d-1: the last chunk arrived in slot (d - 2) % 2.
    for (dir, step) in dirs {
        p.line(format!(
            "{dir}_send = shard_by_stream({dir}, axis=0, chunks=2, index={})",
            d % 2
        ));
        gemm(&mut p, &(d - 1).to_string(), dir, *step);
    }
    for w in 0..dirs.len() {
        p.line(format!("synchronize worker({w})"));
    }
    for (dir, _) in dirs {
        p.line(format!("deallocate {dir}"));
    }
    p.finish()
}

/// The host program of the GEMM+RS ring (local shapes `x[M, K/d]`, `w[N, K/d]`,
/// `z[M/d, N]`). GEMMs and adds run on the main stream `s0`, the permutes (to rank + 1) on
/// worker 0 once the main stream has produced the running sum they send.
///
/// Step 0 GEMMs row chunk `my - 1` into `acc`; step `i` in `1..d-1` permutes `acc` into
/// `recv` while GEMM'ing chunk `my - i - 1` into `part`, then `acc = part + recv`; step `d-1`
/// permutes `acc` while GEMM'ing chunk `my` and writes `z = part + recv`. `d - 1` transfers of
/// `[M/d, N]`, each under the next step's GEMM.
///
/// With `pieces` > 1 a step GEMMs its chunk in `pieces` row pieces on `s0`, and worker 1
/// (after waiting for the transfer) adds each piece once `s0` has computed it, under the GEMM
/// of the next piece; `s0` waits for worker 1 at the end of the step, before the running sum
/// travels on.
///
/// Panics when `M` or `K` is not a multiple of `d`, or `M/d` of `pieces`
/// ([`rsmm_ring_lowered`] checks both).
pub fn rsmm_ring_host(d: usize, s: Gemm3, dtype: DType, pieces: u64) -> HostProgram {
    let d = d.max(1);
    let du = d as u64;
    let pieces = pieces.max(1);
    let t = dtype.name();
    let (kd, zc) = (s.k / du, s.m / du);
    let pc = zc / pieces;
    let mut p = Text::new(format!(
        "host rsmm_ring {{\n  mesh m0 = {mesh}\n  in x: {t}[{m}, {kd}] on m0\n  in w: {t}[{n}, {kd}] on m0\n  out z: {t}[{zc}, {n}] on m0\n  tensor x_chunk: {t}[{zc}, {kd}] on m0\n  tensor part: {t}[{zc}, {n}] on m0\n  tensor acc: {t}[{zc}, {n}] on m0\n  tensor recv: {t}[{zc}, {n}] on m0\n  tensor x_piece: {t}[{pc}, {kd}] on m0\n  tensor part_piece: {t}[{pc}, {n}] on m0\n  tensor recv_piece: {t}[{pc}, {n}] on m0\n  tensor sum_piece: {t}[{pc}, {n}] on m0\n",
        mesh = mesh_text(d),
        m = s.m,
        n = s.n,
    ));
    if d == 1 {
        p.line("linear(x, w -> z)");
        return p.finish();
    }
    for b in ["part", "acc", "recv"] {
        p.line(format!("allocate {b}"));
    }
    p.line("s0 = get_current_stream");
    let x_chunk = |p: &mut Text, index: String| {
        p.line(format!(
            "x_chunk = shard_by_stream(x, axis=0, chunks={d}, index={index})"
        ));
    };
    x_chunk(&mut p, format!("({MY} + {}) % {d}", d - 1));
    p.line("linear(x_chunk, w -> acc)");
    // One step: the running sum travels while the next partial product is computed.
    let step = |p: &mut Text, id: &str, chunk: String, out: &str| {
        p.on_worker(0);
        p.permute(id, "acc", "recv", d, 1);
        p.line("set_current_stream s0");
        if pieces == 1 {
            x_chunk(p, chunk);
            p.line("linear(x_chunk, w -> part)");
            p.line(format!("wait {id}"));
            p.line(format!("add(part, recv -> {out})"));
            return;
        }
        // The adds run on worker 1: it waits for the transfer once, then for each GEMM piece,
        // and adds that piece while the main stream computes the next one.
        p.line("set_current_stream worker(1)");
        p.line(format!("wait {id}"));
        p.line("set_current_stream s0");
        p.open(format!("for i1 in 0..{pieces}"));
        p.line(format!(
            "x_piece = shard_by_stream(x, axis=0, chunks={}, index=({chunk}) * {pieces} + i1)",
            du * pieces
        ));
        for (view, of) in [
            ("part_piece", "part"),
            ("recv_piece", "recv"),
            ("sum_piece", out),
        ] {
            p.line(format!(
                "{view} = shard_by_stream({of}, axis=0, chunks={pieces}, index=i1)"
            ));
        }
        p.line("linear(x_piece, w -> part_piece)");
        p.line("set_current_stream worker(1)");
        p.line("synchronize s0");
        p.line("add(part_piece, recv_piece -> sum_piece)");
        p.line("set_current_stream s0");
        p.close();
        // The next step sends `acc` (and the run ends) only after every add.
        p.line("synchronize worker(1)");
    };
    if d > 2 {
        p.open(format!("for i0 in 1..{}", d - 1));
        step(
            &mut p,
            "c0",
            format!("({MY} + {} - i0) % {d}", d - 1),
            "acc",
        );
        p.close();
    }
    step(&mut p, "c1", MY.to_string(), "z");
    p.line("synchronize worker(0)");
    for b in ["part", "acc", "recv"] {
        p.line(format!("deallocate {b}"));
    }
    p.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::programs::{agmm_lowered, rsmm_lowered, RsVariant};
    use meshflow::check::check_program;
    use meshflow::ir::host::ExprEnv;
    use meshflow::ir::{DeviceId, Expr, InstKind, LoopVar, MeshId, ParallelType};
    use meshflow::runtime::{run_and_compare, CpuOptions};

    /// Divisible by `2·d` for every `d` in `1..=4` (M), by `d` (K and N).
    const SIZES: Gemm3 = Gemm3 {
        m: 48,
        k: 24,
        n: 24,
    };

    const AG_RINGS: [AgVariant; 2] = [AgVariant::RingForward, AgVariant::RingBidirectional];

    #[test]
    fn ring_variants_match_the_reference_on_cpu_ranks() {
        for d in 1..=4usize {
            for dtype in [DType::F32, DType::BF16] {
                for v in AG_RINGS {
                    let l = agmm_lowered(d, SIZES, dtype, v, 2, Parts::Both)
                        .unwrap_or_else(|e| panic!("agmm {} d={d}: {e}", v.name()));
                    check_program(&l.host, d)
                        .unwrap_or_else(|e| panic!("agmm {} d={d}: {e}", v.name()));
                    let cmp = run_and_compare(&l.program, &l.host, d, 3, &CpuOptions::default())
                        .unwrap_or_else(|e| panic!("agmm {} d={d}: {e}\n{}", v.name(), l.host));
                    assert!(cmp.passed(), "agmm {} d={d} {dtype}: {cmp}", v.name());
                }
                for pieces in [1, 2, 4] {
                    let l = rsmm_lowered(d, SIZES, dtype, RsVariant::Ring(pieces), 2, Parts::Both)
                        .unwrap_or_else(|e| panic!("rsmm ring/{pieces} d={d}: {e}"));
                    check_program(&l.host, d)
                        .unwrap_or_else(|e| panic!("rsmm ring/{pieces} d={d}: {e}"));
                    let cmp = run_and_compare(&l.program, &l.host, d, 5, &CpuOptions::default())
                        .unwrap_or_else(|e| panic!("rsmm ring/{pieces} d={d}: {e}\n{}", l.host));
                    assert!(cmp.passed(), "rsmm ring/{pieces} d={d} {dtype}: {cmp}");
                }
            }
        }
    }

    #[test]
    fn ring_parts_keep_their_part_and_still_run() {
        let lowered = |d: usize, parts: Parts| {
            let mut v: Vec<(String, Lowered)> = AG_RINGS
                .iter()
                .map(|&a| {
                    let l = agmm_lowered(d, SIZES, DType::BF16, a, 2, parts).unwrap();
                    (format!("agmm {}", a.name()), l)
                })
                .collect();
            let l = rsmm_lowered(d, SIZES, DType::BF16, RsVariant::Ring(2), 2, parts).unwrap();
            v.push(("rsmm ring".into(), l));
            v
        };
        for d in [2usize, 3] {
            let both = lowered(d, Parts::Both);
            for parts in [Parts::CommOnly, Parts::ComputeOnly] {
                for ((what, l), (_, full)) in lowered(d, parts).iter().zip(&both) {
                    let text = l.host.to_string();
                    let count = |h: &HostProgram, kind: &str| {
                        let mut n = 0;
                        h.walk(&mut |inst, _| n += usize::from(inst.kind.name() == kind));
                        n
                    };
                    for kind in ["collective_permute", "wait", "linear", "add"] {
                        let want = match (parts, kind) {
                            (Parts::CommOnly, "linear" | "add") => 0,
                            (Parts::ComputeOnly, "collective_permute" | "wait") => 0,
                            _ => count(&full.host, kind),
                        };
                        assert_eq!(
                            count(&l.host, kind),
                            want,
                            "{what} {parts:?} {kind}\n{text}"
                        );
                    }
                    // The parts run on the CPU backend (no race, no hang); their outputs are not the
                    // reference's (nor all written, for the communications alone).
                    let mut options = CpuOptions::default();
                    options.config.poison = false;
                    run_and_compare(&l.program, &l.host, d, 3, &options)
                        .unwrap_or_else(|e| panic!("{what} {parts:?} d={d}: {e}\n{text}"));
                }
            }
        }
    }

    struct Env {
        my: i64,
        vars: Vec<(LoopVar, i64)>,
    }

    impl ExprEnv for Env {
        fn loop_value(&self, var: LoopVar) -> Option<i64> {
            self.vars.iter().find(|(v, _)| *v == var).map(|(_, x)| *x)
        }
        fn my_index(&self, _: MeshId, pt: ParallelType) -> Option<i64> {
            (pt == ParallelType::DIDx).then_some(self.my)
        }
        fn rank(&self) -> DeviceId {
            DeviceId::try_from(self.my).unwrap()
        }
    }

    /// Per executed block instance: the (send, recv) team-index offsets from `my` of its
    /// permutes, for every rank and loop iteration, `d` ranks.
    fn permute_offsets(h: &HostProgram, d: i64) -> Vec<Vec<(i64, i64)>> {
        fn block(b: &[meshflow::ir::Inst], env: &mut Env, d: i64, out: &mut Vec<Vec<(i64, i64)>>) {
            let mut mine = Vec::new();
            for inst in b {
                match &inst.kind {
                    InstKind::CollectivePermute {
                        send_peer,
                        recv_peer,
                        ..
                    } => {
                        let off = |e: &Expr| (e.eval(&*env).unwrap() - env.my).rem_euclid(d);
                        mine.push((off(send_peer), off(recv_peer)));
                    }
                    InstKind::ForLoop {
                        index,
                        start,
                        stop,
                        body,
                    } => {
                        let (a, z) = (start.eval(&*env).unwrap(), stop.eval(&*env).unwrap());
                        for i in a..z {
                            env.vars.push((*index, i));
                            block(body, env, d, out);
                            env.vars.pop();
                        }
                    }
                    _ => {}
                }
            }
            if !mine.is_empty() {
                out.push(mine);
            }
        }
        let mut out = Vec::new();
        for my in 0..d {
            let mut env = Env {
                my,
                vars: Vec::new(),
            };
            block(&h.body, &mut env, d, &mut out);
        }
        out
    }

    #[test]
    fn rings_only_talk_to_their_neighbours() {
        for d in [3usize, 4, 5] {
            let di = d as i64;
            let s = Gemm3 {
                m: 2 * 60,
                k: 60,
                n: 60,
            };
            let fwd = agmm_ring_host(d, s, DType::BF16, AgVariant::RingForward);
            let steps = permute_offsets(&fwd, di);
            // Step 0 (the prologue) and steps 1..d-1 (the loop), for every rank.
            assert_eq!(steps.len(), d * (d - 1), "{fwd}");
            for step in &steps {
                assert_eq!(step, &[(1, di - 1)], "{fwd}");
            }
            let bi = agmm_ring_host(d, s, DType::BF16, AgVariant::RingBidirectional);
            let steps = permute_offsets(&bi, di);
            assert_eq!(steps.len(), d * (d - 1), "{bi}");
            for step in &steps {
                assert_eq!(step, &[(1, di - 1), (di - 1, 1)], "{bi}");
            }
            for pieces in [1, 2] {
                let rs = rsmm_ring_host(d, s, DType::BF16, pieces);
                let steps = permute_offsets(&rs, di);
                assert_eq!(steps.len(), d * (d - 1), "{rs}");
                for step in &steps {
                    assert_eq!(step, &[(1, di - 1)], "{rs}");
                }
            }
            // The two permutes of a bidirectional step are issued together, on two workers,
            // before the step's GEMMs.
            let text = bi.to_string();
            let body = &text[text.find("for i0").expect("a loop")..];
            let first_gemm = body.find("linear(").expect("a GEMM");
            let issued = &body[..first_gemm];
            assert_eq!(issued.matches("collective_permute(").count(), 2, "{text}");
            assert!(
                issued.contains("worker(0)") && issued.contains("worker(1)"),
                "{text}"
            );
        }
    }

    #[test]
    fn bad_sizes_are_errors() {
        let s = Gemm3 { m: 6, k: 6, n: 6 };
        assert!(agmm_lowered(2, s, DType::BF16, AgVariant::RingForward, 2, Parts::Both).is_ok());
        let e = agmm_lowered(
            2,
            s,
            DType::BF16,
            AgVariant::RingBidirectional,
            2,
            Parts::Both,
        );
        assert!(e.is_err());
        assert!(rsmm_lowered(4, s, DType::BF16, RsVariant::Ring(1), 2, Parts::Both).is_err());
        assert!(rsmm_lowered(0, s, DType::BF16, RsVariant::Ring(1), 2, Parts::Both).is_err());
        // 3 rows per chunk at d = 2 do not cut into 2 pieces.
        assert!(rsmm_lowered(2, s, DType::BF16, RsVariant::Ring(2), 2, Parts::Both).is_err());
        assert!(rsmm_lowered(2, s, DType::BF16, RsVariant::Ring(0), 2, Parts::Both).is_err());
        assert!(agmm_ring_lowered(2, s, DType::BF16, AgVariant::Ring, Parts::Both).is_err());
    }
}
