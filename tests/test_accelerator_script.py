"""benchmarks/accelerator.py --dry-run: every section of the GPU report runs on tiny shapes on
the CPU, so the script that a session with a GPU runs once cannot rot in between."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import accelerator  # noqa: E402


def test_dry_run_writes_every_section(tmp_path):
  pytest.importorskip("tokamax")  # section 5 runs tokamax's XLA op on the CPU
  out = tmp_path / "report.md"
  assert accelerator.main(["--dry-run", "--out", str(out)]) == 0
  text = out.read_text()
  for title in ("## 1. Newton–Schulz", "## 2. The Gram iteration", "## 2b. The update's band", "## 3. Whole updates",
                "## 4. An expert stack",
                "## 5. Attention", "## 6. Compile time"):
    assert title in text
  assert "failed" not in text.lower() and "Failed sections" not in text
  # every table row has a number in its timing column (median (min-max))
  rows = [line for line in text.splitlines() if line.startswith("| ") and "(" in line]
  assert len(rows) >= 20


def test_full_run_needs_an_accelerator(capsys):
  with pytest.raises(SystemExit):
    accelerator.main([])
  assert "needs a GPU" in capsys.readouterr().err
