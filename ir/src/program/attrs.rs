//! Op attributes that are not integers.

use std::fmt;

/// A positive, finite `f32` (the `eps` of `rms_norm`), stored by its bits so that ops stay
/// `Eq` and `Hash`. Printed with `{:?}` (`1e-6`, `0.5`), which always reads back as a float
/// literal of the same value.
#[derive(Copy, Clone, PartialEq, Eq, Hash)]
pub struct Epsilon(u32);

impl Epsilon {
    /// The default `eps` of `rms_norm`: `1e-6`.
    pub const DEFAULT: Epsilon = Epsilon(0x3586_37bd);

    /// `value`, when it is positive and finite.
    pub fn new(value: f32) -> Option<Epsilon> {
        (value.is_finite() && value > 0.0).then(|| Epsilon(value.to_bits()))
    }

    /// The value.
    pub fn value(self) -> f32 {
        f32::from_bits(self.0)
    }
}

impl Default for Epsilon {
    fn default() -> Epsilon {
        Epsilon::DEFAULT
    }
}

impl fmt::Debug for Epsilon {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.value())
    }
}

impl fmt::Display for Epsilon {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.value())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_one_in_a_million() {
        assert_eq!(Epsilon::DEFAULT.value(), 1e-6);
        assert_eq!(Epsilon::DEFAULT.to_string(), "1e-6");
        assert!(Epsilon::new(0.0).is_none());
        assert!(Epsilon::new(f32::NAN).is_none());
        assert!(Epsilon::new(-1.0).is_none());
        assert_eq!(Epsilon::new(0.5).map(|e| e.to_string()), Some("0.5".into()));
    }
}
