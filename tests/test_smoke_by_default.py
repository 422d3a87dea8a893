"""A bare `pytest` runs the notebooks at smoke sizes; COURSE_SMOKE set by hand wins. Before the
plugin, a bare `pytest` ran every notebook at default sizes: hours, and a cell close to
nbmake's limit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("given, seen", [(None, "1"), ("0", "0"), ("1", "1")])
def test_pytest_defaults_to_smoke_sizes(tmp_path, given, seen):
    probe = tmp_path / "test_probe.py"
    probe.write_text("import os\n\ndef test_probe():\n"
                     "    print('COURSE_SMOKE=' + os.environ['COURSE_SMOKE'])\n")
    env = {k: v for k, v in os.environ.items() if k != "COURSE_SMOKE"}
    if given is not None:
        env["COURSE_SMOKE"] = given
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-c",
                           str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), str(probe)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"COURSE_SMOKE={seen}" in done.stdout
