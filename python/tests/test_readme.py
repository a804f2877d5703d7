"""The README's Python usage runs as written: each ```python block, in a
fresh interpreter, must finish without an error (the values its comments
claim are the op tests' business). It had names that were never defined
(`b`, `gate_up`, `m`, `scores`, ...) and reused `h` and `s` for tensors
before using them as sizes."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"^```python\n(.*?)^```$", f.read(), flags=re.S | re.M)


def test_readme_has_python_usage():
    assert _blocks(), "README.md has no ```python block"


def test_readme_python_blocks_run():
    for i, code in enumerate(_blocks()):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"README python block {i} failed:\n{p.stderr}"
