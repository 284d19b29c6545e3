"""``meshd demo`` (what ``make run`` calls): a local mesh on 127.0.0.1, one completion, status."""

from __future__ import annotations

import re
import subprocess
import sys


def test_demo_runs_a_local_mesh_and_answers(tiny_model_dir, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "meshd.tools.cli", "demo", "--peers", "3", "--model", str(tiny_model_dir),
         "--max-tokens", "6", "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=240,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
    assert "mesh ready in" in out
    assert "POST http://127.0.0.1:" in out and re.search(r"\(\d+ tokens in [\d.]+ s", out), out
    table = out[out.index("$ meshctl status"):]
    assert "supernode" in table and "serving" in table, table
    assert sum(line.startswith(("0", "1", "2", "3", "4", "5", "6", "7", "8", "9", "a", "b", "c", "d", "e", "f"))
               and " ready " in line for line in table.splitlines()) == 3, table
