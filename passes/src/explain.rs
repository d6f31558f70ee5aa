//! Records of the decisions `choose_decompositions` takes, printed by `--explain`.

use std::fmt;

/// One candidate of a decision with its estimated cost.
#[derive(Clone, Debug, PartialEq)]
pub struct VariantCost {
    /// The variant, e.g. `ring(s=4)`.
    pub variant: String,
    /// Estimated time in µs, when the cost model applies.
    pub cost_us: Option<f64>,
}

/// One decision: which decomposition a resharding got, among which variants, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct ExplainRecord {
    /// The resharding's output tensor.
    pub tensor: String,
    /// The op, printed.
    pub op: String,
    /// The communication the decision table gives (e.g. `all_gather over DIDx`).
    pub communication: String,
    /// The candidates.
    pub variants: Vec<VariantCost>,
    /// The chosen variant.
    pub chosen: String,
    /// Why.
    pub reason: String,
}

impl fmt::Display for ExplainRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} [{}]: chose {} ({})",
            self.op, self.communication, self.chosen, self.reason
        )?;
        // One column of names, at least 48 wide.
        let w = self
            .variants
            .iter()
            .map(|v| v.variant.chars().count())
            .fold(48, usize::max);
        for v in &self.variants {
            match v.cost_us {
                Some(c) => writeln!(f, "  {:<w$} {:>10.2} us", v.variant, c)?,
                None => writeln!(f, "  {:<w$} {:>10}", v.variant, "-")?,
            }
        }
        Ok(())
    }
}
