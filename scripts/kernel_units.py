"""The compile units of kernels/cuda/*.cu, assembled as kernels/src/kernels/units.rs does.

A source is a .cu file with the files appended to it (PARTS, as in kernels/src/kernels/sources.rs),
behind the common prelude. Its base unit is that text; each typed kernel `<stem>_<dtype>`, defined
by a macro `MF_KERNEL_<stem>(T)` that no file instantiates, is a unit of its own per float type:
the base text followed by `#line 1 "<stem>_<dtype>"` and `MF_KERNEL_<stem>(<dtype>)`. The library
lists the stems in Rust and a test there checks they are exactly the `MF_KERNEL_` macros of the
source, which is where this module finds them. Used by nvrtc-check.py and cuda-frontend-check.py.
"""
import os
import re
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = os.path.join(ROOT, "kernels", "cuda")

# The float types of the typed kernels (FLOATS in sources.rs, in its order).
FLOATS = ["f32", "bf16", "f16"]
# Sources appended to another before compiling (the concat! of Source::text in sources.rs).
PARTS = {
    "moe.cu": [
        "moe_dispatch.cu",
        "moe_combine.cu",
        "moe_fused.cu",
        "moe_fused_warp.cu",
        "moe_fused_warp_combine.cu",
    ],
}
APPENDED = {p for parts in PARTS.values() for p in parts}

TYPED_MACRO = re.compile(r"^#define MF_KERNEL_(\w+)\(T\)", re.M)


def _read(name):
    with open(os.path.join(CUDA, name)) as f:
        return f.read()


def sources():
    """The file names of every source (the appended parts excluded)."""
    names = sorted(os.path.basename(p) for p in os.listdir(CUDA) if p.endswith(".cu"))
    return [n for n in names if n not in APPENDED]


def source_text(name):
    """A source's text without the prelude: the file, then its parts, joined by newlines."""
    return "\n".join([_read(name)] + [_read(p) for p in PARTS.get(name, [])])


def base_text(name):
    """The full text of a source's base unit: the prelude, a #line, the source."""
    return f'{_read("common.cuh")}\n#line 1 "{name}"\n{source_text(name)}'


def typed_stems(name):
    """The stems of the source's typed kernels (`moe_combine_recv` for MF_KERNEL_moe_combine_recv)."""
    return TYPED_MACRO.findall(source_text(name))


def instantiation(stem, dtype):
    """What a typed unit appends to the base text."""
    return f'\n#line 1 "{stem}_{dtype}"\nMF_KERNEL_{stem}({dtype})\n'


@dataclass
class Unit:
    source: str  # file name of the source, e.g. "moe.cu"
    kernel: str  # "" for the base unit, else the typed kernel's name, e.g. "moe_combine_recv_bf16"
    text: str

    @property
    def name(self):
        """The unit's name: the source's stem (`moe`) or the typed kernel's name."""
        return self.kernel or self.source[: -len(".cu")]

    def __str__(self):
        return f"{self.source}: {self.kernel}" if self.kernel else self.source


def units(name, dtypes=FLOATS):
    """Every unit of source `name`: the base unit, then each typed kernel (in the order of the
    source) for each of `dtypes`: the units of the library's Unit::all_of."""
    base = base_text(name)
    out = [Unit(name, "", base)]
    for stem in typed_stems(name):
        for d in [d for d in FLOATS if d in dtypes]:
            out.append(Unit(name, f"{stem}_{d}", base + instantiation(stem, d)))
    return out


def check_text(name):
    """One text with the source and every typed kernel for every float type: for front-end checks
    that want every entry point expanded at once (not a unit the library compiles)."""
    return base_text(name) + "".join(
        instantiation(stem, d) for stem in typed_stems(name) for d in FLOATS)
