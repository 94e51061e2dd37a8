"""Every ```python block of README.md runs, as written, in a fresh interpreter.

Each block must define its own data and print what it fitted; the README shows the expected output next
to it. Blocks run in a temporary folder (anything they write stays there). Together they take about two
minutes of CPU time.

The "Scale out" block runs in ``tests/test_multihost.py``, as written, in a fresh interpreter: once on one
process (the run this file would make, checked there to print the fit) and as 2 processes x 2 devices
(checked to give the same fit). Running it here too would fit the same model a third time.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)
# run by tests/test_multihost.py (on one process and on two): the first block of the section
SCALE_OUT = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8").split("## Scale out", 1)[1],
                       re.S | re.M)[0]


def _block_id(code: str) -> str:
    head = README.read_text(encoding="utf-8").split(code)[0]
    headings = re.findall(r"^#+ (.+)$", head, re.M)
    return re.sub(r"\W+", "-", headings[-1] if headings else "top").strip("-").lower()


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3
    assert BLOCKS.count(SCALE_OUT) == 1  # the one block test_multihost.py runs is a block of this list


@pytest.mark.parametrize("code", [b for b in BLOCKS if b != SCALE_OUT],
                         ids=[f"{i}-{_block_id(b)}" for i, b in enumerate(BLOCKS) if b != SCALE_OUT])
def test_readme_block_runs(code, tmp_path):
    ast.parse(code)  # a syntax error reports the block, not a subprocess traceback
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"README block failed:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip(), "a README block should print what it computed"
    fitted = re.search(r"posterior median of w: \[([^\]]*)\]", proc.stdout)
    if fitted:  # the DP-VI example: the coefficients must come out close to the truth [1, -1, 0.5]
        w = [float(v) for v in fitted.group(1).split(",")]
        assert all(abs(a - b) < 0.3 for a, b in zip(w, [1.0, -1.0, 0.5])), proc.stdout
