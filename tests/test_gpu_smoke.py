"""scripts/gpu_smoke.sh, the first command to run on a GPU node, runs here with --cpu:
the same matrix of layouts through main.py on gloo at tiny sizes, each against
`single`; it must print its table with every layout passing and exit 0 (and it
exits 1 on any difference, crash or hang: seen by breaking a strategy on purpose,
tests/README.md)."""

import os
import re

from harness import REPO, job_env, run_tree

MATRIX = ["single", "ddp_bucket", "ddp_bucket-ring", "fsdp3-prefetch", "tp2-sp", "pp2-gpipe",
          "pp2-1f1b", "pp2-interleaved-v2", "pp2-zb1p", "pp2-zbv", "ddp_bucket-bf16", "cp2"]
# one layout per dimension and the tolerance for bf16 (each layout of the matrix is at
# parity in its own tests; here the script, its table and its exit status are under test)
LAYOUTS = ["single", "ddp_bucket-ring", "fsdp3-prefetch", "tp2-sp", "pp2-zbv", "ddp_bucket-bf16", "cp2"]


def test_the_matrix_names_every_layout():
    """The script's matrix is the one listed here (a renamed or dropped row shows)."""
    with open(os.path.join(REPO, "scripts", "gpu_smoke.sh")) as f:
        rows = re.findall(r'^  "([^|"]+)\|', f.read(), re.M)
    assert rows == MATRIX


def test_gpu_smoke_passes_on_cpu(tmp_path):
    script = os.path.join(REPO, "scripts", "gpu_smoke.sh")
    env = dict(job_env(), TMPDIR=str(tmp_path),  # the jobs' directories go under tmp_path
               SMOKE_LAYOUTS=" ".join(LAYOUTS))
    result = run_tree(["bash", script, "--cpu"], 600, "gpu_smoke.sh --cpu", cwd=tmp_path, env=env)
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr[-3000:]}"
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines()
            if line.split() and line.split()[0] in LAYOUTS}
    assert rows == {name: "pass" for name in LAYOUTS}, out
    assert f"{len(LAYOUTS)} of {len(LAYOUTS)} layouts pass" in out, out
