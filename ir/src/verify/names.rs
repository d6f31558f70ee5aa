//! Name checks shared by both verifiers.

use std::collections::HashMap;

use super::{Diagnostic, Location};
use crate::text::{clip, is_valid_name, KEYWORDS, MAX_NAME_LEN};

/// Why `name` cannot name a `kind`, if it cannot.
pub(super) fn name_problem(name: &str, kind: &str) -> Option<String> {
    let len = name.chars().count();
    if len > MAX_NAME_LEN {
        Some(format!(
            "`{}` is not a valid {kind} name: {len} characters, longer than {MAX_NAME_LEN}",
            clip(name)
        ))
    } else if KEYWORDS.contains(&name) {
        Some(format!("`{name}` is a keyword and cannot name a {kind}"))
    } else if !is_valid_name(name) {
        Some(format!(
            "`{}` is not a valid {kind} name (expected [A-Za-z_][A-Za-z0-9_]*)",
            name.escape_debug()
        ))
    } else {
        None
    }
}

/// Checks names for validity and uniqueness across every entity given (meshes and tensors
/// share one namespace). `entities` are `(kind, name, location)` in declaration order.
pub(super) fn check_names(entities: &[(&str, &str, Location)], diags: &mut Vec<Diagnostic>) {
    let mut first: HashMap<&str, (&str, &Location)> = HashMap::new();
    for (kind, name, location) in entities {
        if let Some(message) = name_problem(name, kind) {
            diags.push(Diagnostic {
                location: location.clone(),
                message,
            });
        }
        match first.get(name) {
            Some((first_kind, first_loc)) => {
                let at = match first_loc.loc().span() {
                    Some(span) => format!(" (declared at {span})"),
                    None => String::new(),
                };
                diags.push(Diagnostic {
                    location: location.clone(),
                    message: format!("name `{name}` is already used by {first_kind} `{name}`{at}"),
                });
            }
            None => {
                first.insert(name, (kind, location));
            }
        }
    }
}

/// "1 axis" / "2 axes".
pub(super) fn axes_word(n: usize) -> String {
    if n == 1 {
        "1 axis".to_string()
    } else {
        format!("{n} axes")
    }
}

/// "1 input" / "2 inputs".
pub(super) fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}
