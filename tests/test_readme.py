"""Every Python example in the README runs as written (issue 8, item 19)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_the_readme_has_python_examples():
    assert EXAMPLES, "README.md lost its Python examples"


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index, tmp_path):
    if "RemoteConfig" in EXAMPLES[index]:  # the remote tier's example needs the `remote` extra (CI has it)
        pytest.importorskip("mooncake.store", reason="the README's remote-tier example needs pip install -e '.[remote]'")
    if "from transformers" in EXAMPLES[index]:  # the drop-in cache's example needs the `hf` extra (CI has it)
        pytest.importorskip("transformers", reason="the README's transformers example needs pip install -e '.[hf]'")
    done = subprocess.run([sys.executable, "-c", EXAMPLES[index]], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, f"README example {index} failed:\n{EXAMPLES[index]}\n{done.stderr[-2000:]}"
