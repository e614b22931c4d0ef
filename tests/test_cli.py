"""What a user sees at the command line: `--help`, a finished run run again, the console of
a default run (the program's lines, not a library's), and the hints of common mistakes."""

import os
import subprocess
import sys

import config
from harness import MAIN, REPO, job_env, run_tree


def test_help_lists_the_modes_and_every_key_with_its_default_and_exits_0():
    for flag in ("--help", "-h"):
        result = run_tree([sys.executable, MAIN, flag, "trainer.max_steps=bad"], 120, flag,
                          cwd=REPO, env=job_env())
        assert result.returncode == 0 and not result.stderr, result.stderr[-3000:]
        out = result.stdout
        assert out.startswith("usage: python main.py") and "gpt2_train_cfg.yaml" in out
        assert all(f"  {mode} " in out for mode in config.MODES)
        missing = [k.name for k in config.describe_keys()
                   if f"    {k.name}={config._typed(k.default)} " not in out]
        assert not missing, missing
        assert "docs/configuration.md" in out
