//! The on-disk cache of compiled images: `$XDG_CACHE_HOME/meshflow/kernels` (else
//! `~/.cache/meshflow/kernels`; `MESHFLOW_KERNEL_CACHE=off` disables it), one file per unit and
//! target, `<stem>-<key>.cubin` or `<stem>-<key>.ptx`: the unit's file stem ([`Unit::file_stem`])
//! and a hash of its full text, the NVRTC options and the NVRTC version ([`key`]). Writers write
//! `<stem>-<key>.tmp<pid>` and rename it into place, so readers never see a partial image.
//!
//! Every image the running build can read is known from its name alone: the stem and key of
//! every unit for every target this NVRTC can compile for. Once per process, [`sweep_once`]
//! removes the images outside that set (images of an older text, such as the whole-`moe.cu`
//! images from before typed units, of another NVRTC version, or of a unit that no longer exists)
//! that are older than [`STALE_IMAGE_AGE`], and temp files a writer left behind (older than
//! [`ORPHAN_TEMP_AGE`]). Nothing else in the directory is touched, and a failure is logged,
//! never an error. The age keeps the images of another build that shares the directory and is
//! still in use: such a build loses an image at most once a day and writes it again.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use super::compile::{nvrtc_options, Image};
use super::sources::Source;
use super::units::Unit;

/// How long an image the running build cannot read is kept after it was last written.
pub(crate) const STALE_IMAGE_AGE: Duration = Duration::from_secs(24 * 60 * 60);

/// How long a writer's temp file is kept: a writer writes it and renames it at once, so one
/// this old belongs to a writer that died.
pub(crate) const ORPHAN_TEMP_AGE: Duration = Duration::from_secs(60 * 60);

/// The disk cache key of a compile: the full text (source, prelude and the unit's instantiation),
/// the NVRTC options and the NVRTC version.
pub(crate) fn key(text: &str, options: &[String], version: (i32, i32)) -> u64 {
    key_after_text(fnv1a(text.as_bytes()), options, version)
}

/// [`key`] from the hash of the text alone (one hash of a text serves every target).
fn key_after_text(text_hash: u64, options: &[String], version: (i32, i32)) -> u64 {
    fnv1a_extend(text_hash, format!("\0{options:?}\0{version:?}").as_bytes())
}

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// 64-bit FNV-1a: a stable hash for cache keys (std's hasher may change between Rust versions).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_extend(FNV_OFFSET_BASIS, bytes)
}

/// Continues an FNV-1a hash: `fnv1a_extend(fnv1a(a), b) == fnv1a(a ++ b)`.
fn fnv1a_extend(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The cache directory, or `None` when disabled or no home is known.
pub(crate) fn dir_from(
    setting: Option<&str>,
    xdg_cache_home: Option<&str>,
    home: Option<&str>,
) -> Option<PathBuf> {
    if matches!(setting, Some("0" | "off" | "false" | "no")) {
        return None;
    }
    let base = match (xdg_cache_home, home) {
        (Some(x), _) if !x.is_empty() => PathBuf::from(x),
        (_, Some(h)) if !h.is_empty() => PathBuf::from(h).join(".cache"),
        _ => return None,
    };
    Some(base.join("meshflow").join("kernels"))
}

/// The cache directory of this process's environment.
fn dir() -> Option<PathBuf> {
    let env = |k: &str| std::env::var(k).ok();
    dir_from(
        env("MESHFLOW_KERNEL_CACHE").as_deref(),
        env("XDG_CACHE_HOME").as_deref(),
        env("HOME").as_deref(),
    )
}

/// The file name of an image: `<stem>-<key>.cubin` or `<stem>-<key>.ptx`.
fn file_name(stem: &str, key: u64, cubin: bool) -> String {
    let ext = if cubin { "cubin" } else { "ptx" };
    format!("{stem}-{key:016x}.{ext}")
}

/// Where the image of `unit` with `key` lives, or `None` when the cache is off.
pub(crate) fn path(unit: &Unit, key: u64, cubin: bool) -> Option<PathBuf> {
    Some(dir()?.join(file_name(&unit.file_stem(), key, cubin)))
}

pub(crate) fn read(path: &Path, cubin: bool) -> Option<Image> {
    let bytes = std::fs::read(path).ok()?;
    if bytes.is_empty() {
        return None;
    }
    Some(if cubin {
        Image::Cubin(bytes)
    } else {
        Image::Ptx(bytes)
    })
}

/// Best effort: a cache that cannot be written is logged, not an error.
pub(crate) fn write(path: &Path, image: &Image) {
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, image.bytes())?;
        std::fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        tracing::debug!(path = %path.display(), "kernel cache not written: {e}");
    }
}

/// What a file of the cache directory is, judged by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// `<stem>-<key>.cubin` or `<stem>-<key>.ptx`.
    Image,
    /// `<stem>-<key>.tmp<pid>`: a writer's temp file.
    Temp,
}

/// The entry a file name stands for, or `None` for a name this cache never writes: a stem of
/// lowercase letters, digits and `_`, `-`, 16 lowercase hex digits, and an extension.
fn classify(name: &str) -> Option<Entry> {
    let (base, ext) = name.rsplit_once('.')?;
    let (stem, key) = base.rsplit_once('-')?;
    let stem_ok = !stem.is_empty()
        && stem
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    let key_ok = key.len() == 16
        && key
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if !stem_ok || !key_ok {
        return None;
    }
    match ext {
        "cubin" | "ptx" => Some(Entry::Image),
        _ => {
            let pid = ext.strip_prefix("tmp")?;
            (!pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit())).then_some(Entry::Temp)
        }
    }
}

/// The file names of every image this build can read with NVRTC `version`: each unit of each
/// source, compiled for `sm_<a>` (CUBIN) or `compute_<a>` (PTX), `a` among `archs` (the
/// architectures this NVRTC supports, among which every target is picked).
fn readable_names(archs: &[u32], version: (i32, i32)) -> HashSet<String> {
    let mut names = HashSet::new();
    for unit in Source::ALL.into_iter().flat_map(Unit::all_of) {
        let (stem, text_hash) = (unit.file_stem(), fnv1a(unit.text().as_bytes()));
        for a in archs {
            for (arch, cubin) in [(format!("sm_{a}"), true), (format!("compute_{a}"), false)] {
                let key = key_after_text(text_hash, &nvrtc_options(&arch), version);
                names.insert(file_name(&stem, key, cubin));
            }
        }
    }
    names
}

/// Removes, at most once per process, the images this build can never read and the temp files
/// of dead writers from the cache directory (see the module docs).
pub(crate) fn sweep_once(archs: &[u32], version: (i32, i32)) {
    static SWEPT: AtomicBool = AtomicBool::new(false);
    if SWEPT.swap(true, Ordering::Relaxed) {
        return;
    }
    if let Some(dir) = dir() {
        let removed = sweep(&dir, &readable_names(archs, version), SystemTime::now());
        if !removed.is_empty() {
            tracing::debug!(dir = %dir.display(), removed = removed.len(), "kernel cache swept");
        }
    }
}

/// Removes from `dir` the regular files that [`classify`] names an image not in `readable`
/// and older than [`STALE_IMAGE_AGE`], or a temp file older than [`ORPHAN_TEMP_AGE`], as of
/// `now`. Returns the names removed. Every failure is logged and skipped.
fn sweep(dir: &Path, readable: &HashSet<String>, now: SystemTime) -> Vec<String> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) => {
            tracing::debug!(dir = %dir.display(), "kernel cache not swept: {e}");
            return Vec::new();
        }
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let min_age = match classify(&name) {
            Some(Entry::Image) if !readable.contains(&name) => STALE_IMAGE_AGE,
            Some(Entry::Temp) => ORPHAN_TEMP_AGE,
            Some(Entry::Image) | None => continue,
        };
        // Not following links: a link or a directory of a matching name stays.
        let Ok(meta) = entry.metadata() else { continue };
        let age = meta
            .modified()
            .ok()
            .and_then(|m| now.duration_since(m).ok());
        if !meta.is_file() || age.is_none_or(|a| a < min_age) {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) => removed.push(name),
            Err(e) => tracing::debug!(file = %name, "stale kernel cache file not removed: {e}"),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_is_stable() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_extend(fnv1a(b"ab"), b"cd"), fnv1a(b"abcd"));
    }

    /// The key is the hash it always was, so the images already on disk keep their names.
    #[test]
    fn key_hashes_text_options_and_version_together() {
        let opts = nvrtc_options("sm_90");
        assert_eq!(
            key("text", &opts, (12, 9)),
            fnv1a(format!("text\0{opts:?}\0{:?}", (12, 9)).as_bytes())
        );
    }

    #[test]
    fn dir_rules() {
        assert_eq!(
            dir_from(None, Some("/x"), Some("/h")),
            Some(PathBuf::from("/x/meshflow/kernels"))
        );
        assert_eq!(
            dir_from(None, None, Some("/h")),
            Some(PathBuf::from("/h/.cache/meshflow/kernels"))
        );
        assert_eq!(dir_from(Some("off"), Some("/x"), None), None);
        assert_eq!(dir_from(None, None, None), None);
    }

    #[test]
    fn names_are_classified_by_the_patterns_the_cache_writes() {
        let k = "0123456789abcdef";
        for (name, want) in [
            (format!("moe-{k}.cubin"), Some(Entry::Image)),
            (format!("moe_combine_recv_bf16-{k}.ptx"), Some(Entry::Image)),
            (format!("rows-{k}.tmp4242"), Some(Entry::Temp)),
            (format!("moe-{k}.tmp"), None),
            (format!("moe-{k}.tmpx1"), None),
            (format!("moe-{k}.o"), None),
            (format!("moe-{k}"), None),
            (format!("Moe-{k}.cubin"), None),
            (format!("-{k}.cubin"), None),
            (format!("my-moe-{k}.cubin"), None),
            ("moe-0123456789ABCDEF.cubin".to_owned(), None),
            ("moe-0123456789abcde.cubin".to_owned(), None),
            ("notes.txt".to_owned(), None),
        ] {
            assert_eq!(classify(&name), want, "{name}");
        }
    }

    /// Every image the compile path would read is in the set the sweep keeps.
    #[test]
    fn readable_names_cover_every_unit_and_target() {
        let (archs, version) = ([80, 90], (12, 9));
        let names = readable_names(&archs, version);
        let units: Vec<Unit> = Source::ALL.into_iter().flat_map(Unit::all_of).collect();
        assert_eq!(names.len(), units.len() * archs.len() * 2);
        for unit in &units {
            for (arch, cubin) in [("sm_90", true), ("compute_80", false)] {
                let k = key(&unit.text(), &nvrtc_options(arch), version);
                let name = file_name(&unit.file_stem(), k, cubin);
                assert_eq!(classify(&name), Some(Entry::Image), "{name}");
                assert!(names.contains(&name), "{unit} for {arch}: {name}");
            }
        }
        // Another NVRTC version reads other images.
        let unit = Unit::base(Source::Moe);
        let k = key(&unit.text(), &nvrtc_options("sm_90"), (12, 8));
        assert!(!names.contains(&file_name("moe", k, true)));
    }

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(test: &str) -> TempDir {
            let dir = std::env::temp_dir().join(format!(
                "meshflow-kernel-cache-{test}-{}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        /// Creates file `name`, last modified `age` before `now`.
        fn file(&self, name: &str, now: SystemTime, age: Duration) {
            let path = self.0.join(name);
            std::fs::write(&path, b"image").unwrap();
            let f = std::fs::File::options().write(true).open(&path).unwrap();
            f.set_modified(now - age).unwrap();
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn sweep_removes_only_old_unreadable_images_and_orphaned_temp_files() {
        let dir = TempDir::new("sweep");
        let now = SystemTime::now();
        let (old, young) = (
            Duration::from_secs(2 * 24 * 60 * 60),
            Duration::from_secs(10),
        );
        let (k1, k2) = ("00000000000000aa", "00000000000000bb");
        let readable: HashSet<String> = [format!("moe-{k1}.cubin")].into_iter().collect();
        let cases = [
            // An image this build reads stays, however old.
            (format!("moe-{k1}.cubin"), old, false),
            // An image of an older text (the whole `moe.cu` of old) goes once it is old.
            (format!("moe-{k2}.cubin"), old, true),
            (format!("moe-{k2}.ptx"), young, false),
            // So does an image of a unit that no longer exists.
            (format!("moe_gone_bf16-{k1}.ptx"), old, true),
            // A writer's temp file goes once it is surely orphaned.
            (format!("moe-{k1}.tmp123"), old, true),
            (format!("moe-{k2}.tmp123"), young, false),
            // Names the cache never writes stay.
            ("notes.txt".to_owned(), old, false),
            (format!("moe-{k2}.cubin.bak"), old, false),
            (format!("MOE-{k2}.cubin"), old, false),
        ];
        for (name, age, _) in &cases {
            dir.file(name, now, *age);
        }
        // A directory with an image's name stays.
        std::fs::create_dir(dir.0.join(format!("rows-{k2}.cubin"))).unwrap();
        let mut removed = sweep(&dir.0, &readable, now);
        removed.sort();
        let mut want: Vec<String> = cases.iter().filter(|c| c.2).map(|c| c.0.clone()).collect();
        want.sort();
        assert_eq!(removed, want);
        for (name, _, gone) in &cases {
            assert_eq!(!dir.0.join(name).exists(), *gone, "{name}");
        }
        assert!(dir.0.join(format!("rows-{k2}.cubin")).is_dir());
        // A missing directory is no error.
        assert!(sweep(&dir.0.join("missing"), &readable, now).is_empty());
    }
}
