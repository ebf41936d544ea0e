"""README.md's Python blocks run as written (CPU: the ops pick their torch implementations or the interpreter)."""
from __future__ import annotations

import re
from pathlib import Path

BLOCKS = re.findall(r"```python\n(.*?)```", (Path(__file__).resolve().parents[1] / "README.md").read_text(), re.S)


def test_readme_has_a_python_tour():
    assert BLOCKS


def test_readme_python_blocks_run(capsys):
    for i, block in enumerate(BLOCKS):
        exec(compile(block, f"README.md python block {i + 1}", "exec"), {"__name__": f"readme_{i}"})
    out = capsys.readouterr().out
    assert "{'rms_norm': 9, 'swiglu': 2}" in out and "'qwen3'" in out
