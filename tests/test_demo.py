"""The demo (examples/train_mla_lm.py) end to end at a tiny size, and its bad-input handling."""

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import train_mla_lm  # noqa: E402


def test_demo_runs_end_to_end_on_a_2x4_mesh(tmp_path, capsys):
  out = tmp_path / "run"
  rc = train_mla_lm.main(["--steps", "3", "--batch", "4", "--seq", "32", "--eval-every", "2",
                          "--mesh", "2,4", "--tau", "5", "--out", str(out)])
  assert rc == 0
  captured = capsys.readouterr()
  printed = captured.out
  assert "\r" not in captured.err and "adamw     3/3 loss" in captured.err  # plain progress lines in a log
  for name in ("adamw", "muon", "muonclip"):
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    recs = [json.loads(line) for line in lines]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["max_logit"]) for r in recs)
    assert "val_loss" in recs[1] and "val_loss" in recs[2]
    assert len(recs[0]["max_logit_per_layer"]["layers/attn"]) == 2  # one per scanned layer
    row = next(line for line in printed.splitlines() if line.startswith(name + " "))
    numbers = [float(v.strip().rstrip("%")) for v in row.split("|")[1:]]
    assert len(numbers) == 6 and all(math.isfinite(v) for v in numbers)
  assert (out / "report.png").stat().st_size > 10_000
  assert (out / "summary.txt").read_text().splitlines()[1].startswith("optimizer")


def test_progress_redraws_on_a_terminal_and_prints_lines_in_a_log():
  import io

  class Tty(io.StringIO):
    def isatty(self):
      return True

  rec = {"loss": 2.0, "max_logit": 3.0}
  log, tty = io.StringIO(), Tty()
  for step in range(1, 21):
    train_mla_lm.progress("muon", step, 20, rec, stream=log)
    train_mla_lm.progress("muon", step, 20, rec, stream=tty)
  lines = log.getvalue().splitlines()
  assert len(lines) == 10 and lines[-1].startswith("muon      20/20 loss 2.000") and "\r" not in log.getvalue()
  assert tty.getvalue().count("\r") == 20 and tty.getvalue().endswith("\n") and tty.getvalue().count("\n") == 1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--optimizers", "adamw,sgd"], "--optimizers: unknown optimizer(s) ['sgd']"),
        (["--tau", "0"], "--tau must be > 0, got 0.0"),
        (["--tau", "-3"], "--tau must be > 0, got -3.0"),
        (["--mesh", "3,1"], "--mesh 3,1 needs 3 devices, but JAX sees 8"),
        (["--mesh", "two,4"], "--mesh must be DATA,MODEL (two integers)"),
    ],
)
def test_bad_input_gives_one_line_and_exit_status_2(argv, message, capsys, tmp_path):
  rc = train_mla_lm.main(argv + ["--out", str(tmp_path)])
  err = capsys.readouterr().err
  assert rc == 2
  assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_an_out_path_that_cannot_be_created_gives_one_line_and_exit_status_2(capsys, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("a regular file, not a directory")
  for out in (blocker, blocker / "sub"):
    rc = train_mla_lm.main(["--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("train_mla_lm.py: error: --out ") and "Traceback" not in err
    assert "cannot create or write the directory" in err


def test_steps_1_runs(tmp_path, capsys):
  # --steps 1 used to crash in optax (the schedule's cosine decay had 0 steps).
  out = tmp_path / "run"
  rc = train_mla_lm.main(["--steps", "1", "--batch", "4", "--seq", "32", "--optimizers", "adamw", "--out", str(out)])
  assert rc == 0
  recs = [json.loads(line) for line in (out / "adamw" / "metrics.jsonl").read_text().splitlines()]
  assert len(recs) == 1 and math.isfinite(recs[0]["loss"]) and math.isfinite(recs[0]["val_loss"])
  for peak in (train_mla_lm.LR_ADAMW, train_mla_lm.LR_MUON):
    lr = train_mla_lm.lr_schedule(peak, 1)
    assert all(math.isfinite(float(lr(t))) for t in range(3))
