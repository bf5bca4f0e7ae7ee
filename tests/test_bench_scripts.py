"""Every benchmark script starts as RESULTS.md runs it (`python bench/NAME.py`).

Run so, a script's own folder leads the import path: bench/engine.py shadowed
the engine package, and bench/replay.py failed on its first import, --help
included, for as long as nothing ran it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(path.name for path in BENCH.glob("*.py") if "__main__" in path.read_text())


def test_the_scripts_are_found():
    assert {"replay.py", "gateway.py", "engine.py", "tenant_fair.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("pythonpath", [False, True])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_starts(script, pythonpath, tmp_path):
    """Also with the repository on PYTHONPATH: a script that put it first only when
    it was missing left bench/ ahead, and bench/gateway.py shadowed the package."""
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)} if pythonpath else None
    done = subprocess.run([sys.executable, str(BENCH / script), "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ")
