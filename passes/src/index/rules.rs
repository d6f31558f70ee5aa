//! The named rewrite rules of index simplification.
//!
//! Affine arithmetic (collecting terms, folding constants, reducing coefficients modulo `d`,
//! dropping `% d` on values known to lie in `[0, d)`) is done by the e-class analysis; these
//! rules let it see through nested remainders and normalize the shape of sums. Remainder rules
//! only fire for a positive constant modulus. Every rule is unit-tested on its own (with no
//! analysis) below.

use egg::{rewrite as rw, Analysis, EGraph, Id, Rewrite, Subst, Var};

use super::{IndexAnalysis, IndexLang};

/// True when `?var` is bound to a class holding a positive constant.
fn is_pos_const<N: Analysis<IndexLang>>(
    var: &'static str,
) -> impl Fn(&mut EGraph<IndexLang, N>, Id, &Subst) -> bool {
    let var: Var = var.parse().expect("a valid pattern variable name");
    move |egraph, _, subst| {
        egraph[subst[var]]
            .nodes
            .iter()
            .any(|n| matches!(n, IndexLang::Num(k) if *k > 0))
    }
}

/// Every rule, generic over the analysis (tests use `()`).
pub fn rules_for<N: Analysis<IndexLang> + 'static>() -> Vec<Rewrite<IndexLang, N>> {
    vec![
        rw!("add-comm"; "(+ ?a ?b)" => "(+ ?b ?a)"),
        rw!("add-assoc"; "(+ (+ ?a ?b) ?c)" => "(+ ?a (+ ?b ?c))"),
        rw!("add-zero"; "(+ ?a 0)" => "?a"),
        rw!("sub-zero"; "(- ?a 0)" => "?a"),
        rw!("mul-one"; "(* ?a 1)" => "?a"),
        rw!("mul-zero"; "(* ?a 0)" => "0"),
        rw!("mod-mod"; "(% (% ?a ?m) ?m)" => "(% ?a ?m)" if is_pos_const("?m")),
        rw!("mod-add-mod"; "(% (+ (% ?a ?m) ?b) ?m)" => "(% (+ ?a ?b) ?m)" if is_pos_const("?m")),
        rw!("mod-sub-mod-left"; "(% (- (% ?a ?m) ?b) ?m)" => "(% (- ?a ?b) ?m)" if is_pos_const("?m")),
        rw!("mod-sub-mod-right"; "(% (- ?a (% ?b ?m)) ?m)" => "(% (- ?a ?b) ?m)" if is_pos_const("?m")),
        rw!("mod-mul-mod"; "(% (* ?k (% ?a ?m)) ?m)" => "(% (* ?k ?a) ?m)" if is_pos_const("?m")),
    ]
}

/// The rules used by the simplifier.
pub fn rules() -> Vec<Rewrite<IndexLang, IndexAnalysis>> {
    rules_for::<IndexAnalysis>()
}

/// The names of the rules, in order.
pub fn rule_names() -> Vec<String> {
    rules_for::<()>()
        .iter()
        .map(|r| r.name.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use egg::{RecExpr, Runner};

    use super::*;

    /// Proves `lhs == rhs` with exactly one rule and no analysis, and checks that without any
    /// rule the two are not equal (so the rule did the work).
    fn check(rule: &str, lhs: &str, rhs: &str) {
        let lhs: RecExpr<IndexLang> = lhs.parse().expect("valid lhs");
        let rhs: RecExpr<IndexLang> = rhs.parse().expect("valid rhs");
        let prove = |rules: &[Rewrite<IndexLang, ()>]| {
            let runner = Runner::<IndexLang, (), ()>::default()
                .with_expr(&lhs)
                .with_expr(&rhs)
                .with_iter_limit(5)
                .run(rules);
            runner.egraph.find(runner.roots[0]) == runner.egraph.find(runner.roots[1])
        };
        let one: Vec<_> = rules_for::<()>()
            .into_iter()
            .filter(|r| r.name.as_str() == rule)
            .collect();
        assert_eq!(one.len(), 1, "rule {rule} exists");
        assert!(!prove(&[]), "{rule}: not equal without rules");
        assert!(prove(&one), "{rule}: proves {lhs} == {rhs}");
    }

    #[test]
    fn add_comm() {
        check("add-comm", "(+ i0 my)", "(+ my i0)");
    }

    #[test]
    fn add_assoc() {
        check("add-assoc", "(+ (+ i0 my) 3)", "(+ i0 (+ my 3))");
    }

    #[test]
    fn add_zero() {
        check("add-zero", "(+ i0 0)", "i0");
    }

    #[test]
    fn sub_zero() {
        check("sub-zero", "(- i0 0)", "i0");
    }

    #[test]
    fn mul_one() {
        check("mul-one", "(* my 1)", "my");
    }

    #[test]
    fn mul_zero() {
        check("mul-zero", "(* my 0)", "0");
    }

    #[test]
    fn mod_mod() {
        check("mod-mod", "(% (% (+ i0 my) 4) 4)", "(% (+ i0 my) 4)");
    }

    #[test]
    fn mod_add_mod() {
        check(
            "mod-add-mod",
            "(% (+ (% (- my i0) 4) i0) 4)",
            "(% (+ (- my i0) i0) 4)",
        );
    }

    #[test]
    fn mod_sub_mod_left() {
        check(
            "mod-sub-mod-left",
            "(% (- (% my 4) i0) 4)",
            "(% (- my i0) 4)",
        );
    }

    #[test]
    fn mod_sub_mod_right() {
        check(
            "mod-sub-mod-right",
            "(% (- my (% i0 4)) 4)",
            "(% (- my i0) 4)",
        );
    }

    #[test]
    fn mod_mul_mod() {
        check("mod-mul-mod", "(% (* 3 (% my 4)) 4)", "(% (* 3 my) 4)");
    }

    #[test]
    fn remainder_rules_need_a_positive_constant_modulus() {
        let lhs: RecExpr<IndexLang> = "(% (% i0 d) d)".parse().expect("valid");
        let rhs: RecExpr<IndexLang> = "(% i0 d)".parse().expect("valid");
        let runner = Runner::<IndexLang, (), ()>::default()
            .with_expr(&lhs)
            .with_expr(&rhs)
            .run(&rules_for::<()>());
        assert_ne!(
            runner.egraph.find(runner.roots[0]),
            runner.egraph.find(runner.roots[1])
        );
    }

    #[test]
    fn every_rule_is_named_uniquely() {
        let mut names = rule_names();
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n);
    }
}
