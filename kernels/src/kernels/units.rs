//! Compile units: what NVRTC compiles into one module.
//!
//! A source's *base unit* is its text as is, with every kernel the file instantiates itself. A
//! source may also define *typed kernels* that no file instantiates: kernel `<stem>_<dtype>` is
//! defined by the macro `MF_KERNEL_<stem>(T)` and compiled, for one float type, in a unit of its
//! own whose text is the source followed by the line `MF_KERNEL_<stem>(<dtype>)`. A run then
//! compiles only the kernels it launches, each on first use: one dtype and one variant of each
//! MoE phase instead of every variant for every float type (a cold `moe.cu` took over 30 s).
//!
//! The unit of a kernel follows from its name ([`Unit::of_kernel`]): the launchers keep calling
//! kernels by name and source. Registering a typed kernel is naming its kind in the source's
//! list ([`Source::typed_kinds`]); `scripts/nvrtc-check.py` compiles the same units, finding the
//! kinds from the `MF_KERNEL_` macros (a test here checks that both agree).

use std::fmt;

use super::sources::{Source, COMMON, FLOATS};
use crate::dtype::DType;

/// One compile unit: a source, and the typed kernel it instantiates, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Unit {
    source: Source,
    typed: Option<Typed>,
}

/// A typed kernel of a source: its kind (the name between the source's prefix and the dtype)
/// and the float type it is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Typed {
    kind: &'static str,
    dtype: DType,
}

impl Unit {
    /// The base unit of `source`: everything its files instantiate themselves.
    pub(crate) fn base(source: Source) -> Unit {
        Unit {
            source,
            typed: None,
        }
    }

    /// The unit that defines kernel `name` of `source`: the unit of a registered typed kernel
    /// (`<prefix>_<kind>_<dtype>`, `dtype` a float type), else the base unit (which reports a
    /// name it does not define when the kernel is looked up).
    pub(crate) fn of_kernel(source: Source, name: &str) -> Unit {
        let typed = FLOATS.iter().find_map(|&dtype| {
            let stem = name.strip_suffix(dtype.name())?.strip_suffix('_')?;
            let kind = stem
                .strip_prefix(source.typed_prefix())?
                .strip_prefix('_')?;
            let kind = *source.typed_kinds().iter().find(|k| **k == kind)?;
            Some(Typed { kind, dtype })
        });
        Unit { source, typed }
    }

    /// Every unit of `source`: its base unit, then each typed kernel for each float type.
    pub(crate) fn all_of(source: Source) -> Vec<Unit> {
        let typed = source.typed_kinds().iter().flat_map(move |&kind| {
            FLOATS.iter().map(move |&dtype| Unit {
                source,
                typed: Some(Typed { kind, dtype }),
            })
        });
        std::iter::once(Unit::base(source)).chain(typed).collect()
    }

    /// The source the unit compiles.
    pub(crate) fn source(&self) -> Source {
        self.source
    }

    /// The name of the cache file: the source's file stem (`moe`) for the base unit, the
    /// kernel's name (`moe_combine_recv_bf16`) for a typed one.
    pub(crate) fn file_stem(&self) -> String {
        match self.typed {
            None => self.source.file_name().trim_end_matches(".cu").to_owned(),
            Some(t) => self.kernel_name(t),
        }
    }

    fn kernel_name(&self, t: Typed) -> String {
        format!(
            "{}_{}_{}",
            self.source.typed_prefix(),
            t.kind,
            t.dtype.name()
        )
    }

    /// The line that instantiates the unit's typed kernel, `MF_KERNEL_<stem>(<dtype>)`.
    fn instantiation(&self, t: Typed) -> String {
        format!(
            "MF_KERNEL_{}_{}({})",
            self.source.typed_prefix(),
            t.kind,
            t.dtype.name()
        )
    }

    /// The full text NVRTC compiles: the common prelude, the source, and the instantiation of
    /// the typed kernel (with a `#line` naming the unit).
    pub(crate) fn text(&self) -> String {
        let mut text = format!(
            "{COMMON}\n#line 1 \"{}\"\n{}",
            self.source.file_name(),
            self.source.text()
        );
        if let Some(t) = self.typed {
            text.push_str(&format!(
                "\n#line 1 \"{}\"\n{}\n",
                self.kernel_name(t),
                self.instantiation(t)
            ));
        }
        text
    }

    /// The kernels the host may launch from this unit.
    pub(crate) fn functions(&self) -> Vec<String> {
        match self.typed {
            Some(t) => vec![self.kernel_name(t)],
            None => self
                .source
                .functions()
                .into_iter()
                .filter(|f| Unit::of_kernel(self.source, f) == *self)
                .collect(),
        }
    }
}

impl fmt::Display for Unit {
    /// `moe.cu`, or `moe.cu: moe_combine_recv_bf16` for a typed kernel's unit.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.typed {
            None => write!(f, "{}", self.source.file_name()),
            Some(t) => write!(f, "{}: {}", self.source.file_name(), self.kernel_name(t)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cache;

    fn typed(source: Source, kind: &'static str, dtype: DType) -> Unit {
        Unit {
            source,
            typed: Some(Typed { kind, dtype }),
        }
    }

    #[test]
    fn a_kernel_name_picks_its_unit() {
        let moe = |n: &str| Unit::of_kernel(Source::Moe, n);
        for (name, kind, dtype) in [
            (
                "moe_nvl_dispatch_fused_warp_native_bf16",
                "nvl_dispatch_fused_warp_native",
                DType::BF16,
            ),
            // A kind that is a prefix of another does not capture it, nor bf16 f16.
            (
                "moe_nvl_dispatch_fused_f16",
                "nvl_dispatch_fused",
                DType::F16,
            ),
            (
                "moe_nvl_combine_fused_onepass_f32",
                "nvl_combine_fused_onepass",
                DType::F32,
            ),
            ("moe_combine_recv_bf16", "combine_recv", DType::BF16),
        ] {
            assert_eq!(moe(name), typed(Source::Moe, kind, dtype), "{name}");
        }
        // Plain kernels, unknown kinds and non-float types go to the base unit.
        for n in [
            "moe_zero_padding",
            "moe_nvl_weights_send",
            "moe_no_such_kind_bf16",
            "moe_combine_recv_i32",
            "moe_combine_recv_",
            "combine_recv_bf16",
        ] {
            assert_eq!(moe(n), Unit::base(Source::Moe), "{n}");
        }
        // Sources without typed kernels have one unit.
        assert_eq!(
            Unit::of_kernel(Source::Elementwise, "binary_add_bf16"),
            Unit::base(Source::Elementwise)
        );
        assert_eq!(Unit::all_of(Source::Rows), vec![Unit::base(Source::Rows)]);
        assert_eq!(
            moe("moe_combine_recv_bf16").file_stem(),
            "moe_combine_recv_bf16"
        );
        assert_eq!(Unit::base(Source::Moe).file_stem(), "moe");
        assert_eq!(
            moe("moe_combine_recv_bf16").to_string(),
            "moe.cu: moe_combine_recv_bf16"
        );
    }

    /// Every kernel the host launches is in exactly one unit, the one its name picks.
    #[test]
    fn units_partition_the_kernels_of_each_source() {
        for source in Source::ALL {
            let units = Unit::all_of(source);
            let mut from_units: Vec<String> = units
                .iter()
                .flat_map(|u| {
                    let fs = u.functions();
                    assert!(!fs.is_empty(), "{u} defines no kernel");
                    for f in &fs {
                        assert_eq!(Unit::of_kernel(source, f), *u, "{f}");
                    }
                    fs
                })
                .collect();
            let mut all = source.functions();
            from_units.sort();
            all.sort();
            assert_eq!(from_units, all, "{}", source.file_name());
        }
        assert_eq!(
            Unit::all_of(Source::Moe).len(),
            1 + Source::Moe.typed_kinds().len() * FLOATS.len()
        );
    }

    /// A typed unit is the source plus one instantiation; the base unit instantiates none.
    #[test]
    fn unit_texts_instantiate_one_typed_kernel() {
        let base = Unit::base(Source::Moe).text();
        assert!(!base.contains("\nMF_KERNEL_"));
        let u = Unit::of_kernel(Source::Moe, "moe_nvl_combine_fused_bf16");
        let text = u.text();
        assert!(text.starts_with(&base));
        assert_eq!(
            &text[base.len()..],
            "\n#line 1 \"moe_nvl_combine_fused_bf16\"\nMF_KERNEL_moe_nvl_combine_fused(bf16)\n"
        );
        assert_eq!(text.matches("\nMF_KERNEL_").count(), 1);
    }

    /// Each registered kind has its macro in the source, and every `MF_KERNEL_` macro the source
    /// defines is registered (the check script finds the units from these macros).
    #[test]
    fn typed_kinds_match_the_macros_of_the_source() {
        for source in Source::ALL {
            let text = source.text();
            let mut defined: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("#define MF_KERNEL_"))
                .filter_map(|l| l.split_once("(T)").map(|(stem, _)| stem))
                .collect();
            let mut registered: Vec<String> = source
                .typed_kinds()
                .iter()
                .map(|k| format!("{}_{k}", source.typed_prefix()))
                .collect();
            defined.sort_unstable();
            registered.sort();
            assert_eq!(defined, registered, "{}", source.file_name());
            for stem in &registered {
                assert!(
                    text.contains(&format!(" {stem}_##T(")),
                    "MF_KERNEL_{stem} must define {stem}_##T"
                );
            }
            // A source with typed kernels instantiates nothing itself: what it did would land in
            // every one of its units.
            if !source.typed_kinds().is_empty() {
                for line in text.lines() {
                    let call = line.trim_end();
                    let inst = FLOATS.iter().any(|d| {
                        call.strip_suffix(&format!("({})", d.name()))
                            .is_some_and(|m| {
                                !m.is_empty()
                                    && m.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                            })
                    });
                    assert!(!inst, "{}: {line}", source.file_name());
                }
            }
        }
    }

    /// The disk cache key covers the unit's text: units of one source differ in their keys, and
    /// a unit's key is stable.
    #[test]
    fn cache_keys_differ_between_units() {
        let opts = ["--gpu-architecture=sm_90".to_owned()];
        let key = |u: &Unit| cache::key(&u.text(), &opts, (12, 9));
        let units = Unit::all_of(Source::Moe);
        let mut keys: Vec<u64> = units.iter().map(key).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), units.len());
        let u = Unit::of_kernel(Source::Moe, "moe_dispatch_recv_f16");
        assert_eq!(key(&u), key(&u));
        assert_ne!(key(&u), cache::key(&u.text(), &opts, (12, 8)));
        assert_ne!(
            key(&u),
            cache::key(&u.text(), &["--gpu-architecture=sm_80".to_owned()], (12, 9))
        );
        // A base unit hashes exactly as the whole source did before units existed, so the
        // cached images of the other sources stay valid.
        let e = Unit::base(Source::Elementwise);
        assert_eq!(
            e.text(),
            format!(
                "{COMMON}\n#line 1 \"elementwise.cu\"\n{}",
                Source::Elementwise.text()
            )
        );
    }
}
