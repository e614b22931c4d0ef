"""`python -m bench.snapshot_checksum`: what the snapshot checksums cost (issue 54).

    python -m bench.snapshot_checksum                  # GPT-2 small: 124M parameters, 1.49 GB
    python -m bench.snapshot_checksum --rounds 5 --out docs/bench/snapshot_checksum

One process writes the snapshot of a 124M-parameter model (weights and AdamW's two
moments, fp32: 12 bytes a parameter, one part) through the writer's own code
(`snapshot_writer.write_part` + `commit`), with checksums and without, and reads every
tensor back (`SnapshotReader.read_full`: what mode=sample, mode=export and a one-rank
resume do), checked and unchecked; each round does the four in a rotated order, the
files deleted in between. Reports the median write and read time of each, wall-clock
and CPU (the process's user + system time: on shared cores the wall clock mostly
measures the neighbours, CPU time what the work costs), the checksums' share of it,
and, for the choice of algorithm, the throughput of CRC-32C (`crc32c`), zlib.crc32 and
xxHash's XXH3 (when installed) over 256 MiB on one core. The files go to a temporary
directory on local disk (--dir), into the page cache: the fastest storage a snapshot
meets, so the largest share the checksums can take.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import report  # noqa: E402


def pieces_of(layers, width, vocab, block):
    """(key, shape, box, tensor) of a GPT's weights and AdamW moments, whole tensors."""
    import torch
    from model import GPT, GPTConfig, shapes_only
    with shapes_only():
        shapes = GPT(GPTConfig(n_layer=layers, n_head=max(1, width // 64), n_embd=width,
                               vocab_size=vocab, block_size=block)).canonical_shapes()
    gen = torch.Generator().manual_seed(0)
    pieces = []
    for name, shape in shapes.items():
        for key in (f"model/{name}", f"optim/{name}/exp_avg", f"optim/{name}/exp_avg_sq"):
            t = torch.empty(shape).uniform_(-1, 1, generator=gen)
            pieces.append((key, shape, tuple((0, n) for n in shape), t))
    return pieces


def write(path, pieces, checksums):
    """(wall s, CPU s) of one snapshot's write."""
    from checkpoint.snapshot_writer import commit, prepare_step_dir, write_part
    started, cpu = time.perf_counter(), time.process_time()
    prepare_step_dir(path, 1)
    index = write_part(path, 1, 0, "bench", pieces, checksums=checksums)
    commit(path, 1, "bench", {}, [index])
    return time.perf_counter() - started, time.process_time() - cpu


def read(path, verify):
    """(wall s, CPU s) of reading every tensor back."""
    from checkpoint.snapshot_reader import SnapshotReader
    started, cpu = time.perf_counter(), time.process_time()
    snap = SnapshotReader(path, verify=verify)
    for key in snap.keys():
        snap.read_full(key)
    return time.perf_counter() - started, time.process_time() - cpu


def throughput(mib=256):
    """GB/s of each candidate checksum over `mib` MiB on one core (best of 3)."""
    import zlib
    import crc32c
    data = memoryview(os.urandom(mib << 20))
    candidates = {"crc32c (crc32c package)": crc32c.crc32c, "zlib.crc32": zlib.crc32}
    try:
        import xxhash
        candidates["xxh3_64 (xxhash package)"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    out = {}
    for name, fn in candidates.items():
        best = min(_timed(fn, data) for _ in range(3))
        out[name] = round(len(data) / best / 1e9, 2)
    return out


def _timed(fn, data):
    started = time.perf_counter()
    fn(data)
    return time.perf_counter() - started


def measure(args):
    """{case: [(wall s, CPU s) per round]} for the write and the read, with and without."""
    import torch
    torch.set_num_threads(1)
    pieces = pieces_of(args.layers, args.width, args.vocab, args.block)
    nbytes = sum(t.numel() * t.element_size() for *_, t in pieces)
    params = sum(t.numel() for key, *_, t in pieces if key.startswith("model/"))
    times = {case: [] for case in ("write", "write checked", "read", "read checked")}
    root = tempfile.mkdtemp(prefix="bench-snapshot-checksum-", dir=args.dir)
    try:
        cases = list(times)
        for i in range(args.rounds):
            for j in range(len(cases)):  # rotated, so no case always follows the same one
                case = cases[(i + j) % len(cases)]
                path = os.path.join(root, "checked" if case.endswith("checked") else "plain")
                if case.startswith("write"):
                    shutil.rmtree(path, ignore_errors=True)
                    times[case].append(write(path, pieces, case.endswith("checked")))
                else:
                    if not os.path.exists(path):  # the first round's read before its write
                        write(path, pieces, True)
                    times[case].append(read(path, case.endswith("checked")))
            print(f"round {i}: " + ", ".join(f"{c} {t[-1][0]:.2f} s (CPU {t[-1][1]:.2f})"
                                             for c, t in times.items()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return times, nbytes, params


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.snapshot_checksum", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--block", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mib", type=int, default=256, help="MiB each checksum's throughput is measured on")
    p.add_argument("--dir", default=None, help="where the snapshots go (default: the temporary directory)")
    p.add_argument("--out", default=None, help="a folder for results.json and results.md")
    args = p.parse_args(argv)
    command, load_before = report.command_line("-m bench.snapshot_checksum", argv), os.getloadavg()
    speeds = throughput(args.mib)
    times, nbytes, params = measure(args)
    share, rows = {}, []
    for what in ("write", "read"):
        for clock, k in (("wall", 0), ("CPU", 1)):
            plain = statistics.median(t[k] for t in times[what])
            checked = statistics.median(t[k] for t in times[what + " checked"])
            share[f"{what} {clock}"] = (checked - plain) / plain
            rows.append([f"{what}, {clock}", f"{plain:.2f}", f"{checked:.2f}",
                         f"{100 * share[f'{what} {clock}']:+.1f}%",
                         " / ".join(f"{t[k]:.2f}" for t in times[what]),
                         " / ".join(f"{t[k]:.2f}" for t in times[what + " checked"])])
    env = report.environment(load_before)
    text = "\n".join(report.header("Snapshot checksums: their cost on save and load", command, [
        f"{params / 1e6:.1f}M parameters, {nbytes / 1e9:.2f} GB in one part (weights + AdamW "
        f"moments, fp32), one process, 1 thread, {args.rounds} rounds; local disk (page cache)"], env)
        + ["", *report.table(["", "unchecked s", "checked s", "checksums' share",
                              "unchecked, each round", "checked, each round"], rows, "lrrrll"),
           "", f"One core, {args.mib} MiB, best of 3:", "",
           *report.table(["checksum", "GB/s"], [[k, v] for k, v in speeds.items()], "lr"), ""])
    if args.out:
        report.write_results(args.out, {"command": command, "environment": env, "settings": vars(args),
                                        "bytes": nbytes, "parameters": params, "seconds": times,
                                        "share": share, "checksum_gb_s": speeds}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
