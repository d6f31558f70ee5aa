//! Index arithmetic: canonical forms, interval facts and proofs.

use meshflow_ir::{EntityRef, Expr, LoopVar, MeshId, ParallelType::DIDx};
use meshflow_passes::index::{loop_fact, my_fact, Facts, Simplifier};

fn my() -> Expr {
    Expr::my(MeshId::new(0), DIDx)
}

fn i() -> Expr {
    Expr::var(LoopVar(0))
}

fn simp(d: usize, trips: i64) -> Simplifier {
    let mut f = Facts::new();
    my_fact(&mut f, MeshId::new(0), DIDx, d);
    loop_fact(&mut f, LoopVar(0), 0, trips);
    Simplifier::new(f)
}

fn show(e: &Expr) -> String {
    e.to_string()
}

#[test]
fn ring_peers_canonicalize() {
    let mut s = simp(4, 4);
    let d = || Expr::c(4);
    let send = d().add(my()).sub(i()).rem(d());
    assert_eq!(show(&s.simplify(&send)), "(my(m0, DIDx) - i0) % 4");
    let recv = i().add(my()).rem(d());
    assert_eq!(show(&s.simplify(&recv)), "(i0 + my(m0, DIDx)) % 4");
    // Terms are collected and coefficients reduced modulo 4.
    let messy = my().mul(Expr::c(5)).add(i()).add(Expr::c(9)).rem(d());
    assert_eq!(show(&s.simplify(&messy)), "(i0 + my(m0, DIDx) + 1) % 4");
}

#[test]
fn constants_fold_and_bounded_remainders_drop() {
    let mut s = simp(4, 2);
    assert_eq!(
        s.simplify(&Expr::c(3).mul(Expr::c(4)).add(Expr::c(1))),
        Expr::c(13)
    );
    // i0 lies in [0, 2): i0 % 2 == i0, but i0 % 1 == 0.
    assert_eq!(s.simplify(&i().rem(Expr::c(2))), i());
    assert_eq!(s.simplify(&i().rem(Expr::c(1))), Expr::c(0));
    // my lies in [0, 4): (my + 8) % 4 == my.
    assert_eq!(s.simplify(&my().add(Expr::c(8)).rem(Expr::c(4))), my());
    assert_eq!(s.simplify(&i().mul(Expr::c(1)).add(Expr::c(0))), i());
}

#[test]
fn negative_leading_terms_get_the_modulus_added() {
    let mut s = simp(4, 4);
    let e = Expr::c(0).sub(i()).rem(Expr::c(4));
    assert_eq!(show(&s.simplify(&e)), "(4 - i0) % 4");
}

#[test]
fn ring_send_and_recv_are_inverse_permutations() {
    for d in 1..=8 {
        let mut s = simp(d, d as i64);
        let dd = || Expr::c(d as i64);
        let send = dd().add(my()).sub(i()).rem(dd());
        let recv = i().add(my()).rem(dd());
        assert!(s.prove_peer_inverse(&send, &recv, &my()), "d = {d}");
        // The receiver of my's data receives from my; sending to recv(my) is not the inverse.
        if d > 2 {
            assert!(!s.prove_peer_inverse(&recv, &recv, &my()), "d = {d}");
        }
    }
}

#[test]
fn equalities_are_proven_and_false_ones_are_not() {
    let mut s = simp(4, 4);
    let a = i().add(my()).rem(Expr::c(4));
    let b = my().add(i()).add(Expr::c(4)).rem(Expr::c(4));
    assert!(s.prove_equal(&a, &b));
    // A nested remainder needs the rewrite rules, not just the analysis.
    let nested = i().add(my().sub(i()).rem(Expr::c(4))).rem(Expr::c(4));
    assert!(s.prove_equal(&nested, &my()));
    assert!(!s.prove_equal(&a, &my()));
    assert!(!s.prove_equal(&i().div(Expr::c(2)), &i()));
}

#[test]
fn opaque_subterms_are_still_simplified() {
    let mut s = simp(4, 4);
    // A division is opaque, but its operand simplifies.
    let e = i().add(Expr::c(0)).mul(Expr::c(1)).div(Expr::c(2));
    assert_eq!(show(&s.simplify(&e)), "i0 / 2");
}
