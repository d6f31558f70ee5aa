"""The README's Python example runs (15 lines) and its run matches the reference."""

import contextlib
import io
import re

from conftest import REPO


def test_readme_example_runs():
    text = (REPO / "README.md").read_text()
    section = text[text.index("## From Python") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert len(code.strip().splitlines()) <= 15
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    printed = out.getvalue()
    assert printed.startswith("host column_parallel_linear_ring {")
    assert printed.rstrip().splitlines()[-1].startswith("ok ")
