"""Two torchrun agents on this machine act as two nodes (c10d rendezvous on loopback):
training completes, the snapshot is written once for the job (not once per node), and
the losses equal a single-node run of the same world size."""

import os
import socket
import subprocess

from harness import MAIN, TINY, job_env, kill_tree, python, read_metrics, run_metrics
from checkpoint.snapshot_reader import open_snapshot

ARGS = ["parallel.dp=torch_ddp", "trainer.max_steps=6", "trainer.save_every=3"]


def written_once(snapshot_dir):
    """The part files of a snapshot in which every element of every tensor comes from
    exactly one part (opening it checks that each tensor's pieces tile it once)."""
    return open_snapshot(str(snapshot_dir)).part_files()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_match_one_node(tmp_path):
    reference = [r["loss"] for r in run_metrics(tmp_path, 2, ARGS)]
    port = free_port()
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    shared = tmp_path / "shared" / "snapshot"  # snapshots live where every node sees them
    procs = []
    for node in nodes:  # each "node" runs in its own directory: relative run_dirs differ
        os.makedirs(node)
        procs.append(subprocess.Popen(
            [python(), "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=multinode",
             MAIN, *TINY, *ARGS, f"trainer.snapshot_path={shared}"],
            cwd=node, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:  # launchers and their workers (in sessions of their own)
            kill_tree(p.pid)
            p.wait()
        raise AssertionError("the two-node job hung") from None
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)

    # one part per rank, each tensor written once (not once per node); global rank 0
    # alone writes the manifest and metrics, so the other node's directory stays empty
    assert written_once(shared) == {"part-00000.bin", "part-00001.bin"}
    writers = [n for n in nodes if os.path.exists(n / "runs" / "default" / "metrics.jsonl")]
    assert len(writers) == 1, writers
    assert not os.path.exists(next(n for n in nodes if n not in writers) / "runs")
    losses = [r["loss"] for r in read_metrics(writers[0] / "runs" / "default")]
    assert len(losses) == len(reference)
    assert max(abs(a - b) / a for a, b in zip(reference, losses)) <= 1e-6
