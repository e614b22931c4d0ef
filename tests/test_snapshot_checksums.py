"""Checksums (issue 54): a snapshot damaged without changing its size -- flipped bits in a
part, in the manifest, in an exported folder -- is refused in one line naming the file and
the tensor, and the older kept snapshot to go back to, on every read path: resume (a real
2-rank job), mode=sample, mode=export, model.init_from. Ranged reads check the chunks
they touch; snapshots of the formats before checksums still load; the kept snapshot
named by the refusal resumes exactly. (The healing state of a replica group:
tests/test_replica_group_step.py.)

One 2-rank run writes the snapshots every test damages a copy of: steps 2 (in the
background, trainer.snapshot_async) and 4 (the end: synchronous), both kept."""

import json
import shutil

import pytest
import torch

from checkpoint import hf_gpt2
from checkpoint.checksums import CHUNK_BYTES, MANIFEST_KEY
from checkpoint.snapshot_reader import open_snapshot
from checkpoint.snapshot_writer import save_sharded
from config import load_config
from errors import UserError
from harness import REPO, our_frames, read_metrics, run_job

RUN = ["trainer.max_steps=4", "trainer.save_every=2", "trainer.keep_snapshots=2",
       "trainer.snapshot_async=true"]
TENSOR = "model/transformer.h.0.attn.c_attn.weight"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(snapshot directory, metrics records) of a 2-rank run of 4 steps."""
    workdir = tmp_path_factory.mktemp("written")
    result = run_job(workdir, 2, RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir / "runs" / "default" / "snapshot", read_metrics(workdir / "runs" / "default")


def copy_of(written, tmp_path):
    snap = tmp_path / "snap"
    shutil.copytree(written[0], snap)
    return snap


def tree_bytes(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def flip_bit(path, at, bit):
    """Flip one bit of the file in place: its size unchanged."""
    data = bytearray(path.read_bytes())
    data[at] ^= 1 << bit
    path.write_bytes(bytes(data))
    assert len(path.read_bytes()) == len(data)


def damage_tensor(snap, key=TENSOR, step=4):
    """Flip the high exponent bit of the first element of `key`'s first piece in step
    `step`'s part (0.02 becomes about 1e37: the issue's NaNs). Returns the part."""
    step_dir = snap / f"step-{step:08d}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    entry = next(e for e in manifest["parts"] if e["key"] == key)
    flip_bit(step_dir / entry["file"], entry["offset"] + 3, 6)  # float32 little-endian: bit 30
    return step_dir / entry["file"]


def error_lines(result, ranks):
    """The error line of each rank (`error on rank N:`; one process: `error:`), each the
    only one, and no traceback of ours."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert not our_frames(result.stderr), result.stderr[-3000:]
    marks = [f"error on rank {r}:" for r in range(ranks)] if ranks > 1 else ["error:"]
    lines = []
    for mark in marks:
        found = [ln for ln in result.stderr.splitlines() if ln.startswith(mark)]
        assert len(found) == 1, f"{mark} printed {len(found)} lines:\n{result.stderr[-3000:]}"
        lines += found
    return lines


def test_flipped_bits_in_a_part_are_refused_on_resume_and_the_older_snapshot_resumes_exactly(
        written, tmp_path):
    """One flipped bit in a tensor of step 4's part, the file's size unchanged: the resume,
    under pp=2 (only rank 0, stage 0, reads layer 0), stops both ranks with one line
    naming the part, the tensor and trainer.resume_step=2 (rank 1 prints rank 0's line),
    nothing written; then that command resumes step 2 (written in the background, its
    checksums checked) and trains steps 3-4 with the losses of the uninterrupted run. Red
    without the check: the job trains on, every step skipped (gradients not finite);
    with the damage raised at the read instead of agreed after the load: rank 1 says only
    that another rank failed."""
    snap = copy_of(written, tmp_path)
    part = damage_tensor(snap)
    before = tree_bytes(snap)
    result = run_job(tmp_path / "job", 2, RUN + [f"trainer.snapshot_path={snap}", "trainer.max_steps=6",
                                                 "parallel.pp=2", "parallel.microbatches=2"])
    for line in error_lines(result, 2):
        assert str(part) in line and repr(TENSOR) in line and "trainer.resume_step=2" in line, line
    assert tree_bytes(snap) == before
    back = run_job(tmp_path / "back", 2, RUN + [f"trainer.snapshot_path={snap}", "trainer.resume_step=2"])
    assert back.returncode == 0, back.stderr[-3000:]
    resumed = read_metrics(tmp_path / "back" / "runs" / "default")
    reference = {r["step"]: r for r in written[1]}
    assert [r["step"] for r in resumed] == [3, 4]
    for got in resumed:
        want = reference[got["step"]]
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), (got, want)


@pytest.mark.parametrize("mode", ["sample", "export"])
def test_flipped_bits_are_refused_by_sample_and_export(written, tmp_path, mode):
    """mode=sample and mode=export read a damaged snapshot: one line naming the part and
    the tensor and trainer.resume_step=2, status 2, no traceback, nothing exported. Red
    without the check: sample prints text from a model with a weight of 1e37 (or dies in
    `probability tensor contains either inf, nan`), export writes the damage out."""
    snap = copy_of(written, tmp_path)
    part = damage_tensor(snap)
    out = tmp_path / "hf"
    args = [f"trainer.snapshot_path={snap}", f"mode={mode}"] + (
        ["sample.length=20"] if mode == "sample" else [f"export.path={out}"])
    result = run_job(tmp_path / "job", 1, args)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    [line] = error_lines(result, 1)
    assert str(part) in line and repr(TENSOR) in line and "trainer.resume_step=2" in line, line
    assert not out.exists() or not any(out.iterdir())


def test_a_damaged_manifest_is_refused_in_one_line(written, tmp_path):
    """One flipped bit in step 4's manifest that leaves it valid JSON and the parts' sizes
    right (the first piece's offset 256 becomes 257: every value of it read one byte off):
    the resume stops both ranks with one line naming the manifest and trainer.resume_step=2.
    Red without the manifest's own checksum: the line blames part-00000.bin (its chunk
    read one byte off); without any check, the job trains on from shifted weights."""
    snap = copy_of(written, tmp_path)
    manifest = snap / "step-00000004" / "manifest.json"
    text = manifest.read_bytes()
    at = text.index(b'"offset": 256') + len(b'"offset": 25')
    flip_bit(manifest, at, 0)  # "6" -> "7"
    assert json.loads(manifest.read_text())  # still JSON
    result = run_job(tmp_path / "job", 2, RUN + [f"trainer.snapshot_path={snap}", "trainer.max_steps=6"])
    for line in error_lines(result, 2):
        assert f"manifest {manifest} is damaged" in line and "trainer.resume_step=2" in line, line


def test_the_background_write_checksums_every_piece_and_its_manifest(written):
    """Step 2 was written by trainer.snapshot_async's writer thread: every index entry
    carries its chunks' checksums, the manifest its own, and every tensor reads back
    checked. Red when the background write leaves them out (write_part(checksums=False)
    in async_snapshot.write_own_part)."""
    snap = open_snapshot(str(written[0]), 2)
    assert snap.meta["config"]["trainer"]["snapshot_async"] and snap.meta["step"] == 2
    assert MANIFEST_KEY in snap.meta
    assert all(isinstance(e.get("crc32c"), list) and e["crc32c"] for e in snap.meta["parts"])
    for key in snap.keys():
        snap.read_full(key)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_ranged_read_checks_the_chunks_it_touches(tmp_path, one_rank_grid, where):
    """A piece of 3 MiB + 4 bytes has 4 checksums; a bit flipped in its third MiB: reads of
    the first two MiB (a box across the chunk boundary included) give the written values,
    a read touching the third is refused naming the tensor and the bytes. On a local disk
    (read into the buffer a chunk at a time) and through another fsspec filesystem
    (memory://, as an object store: one ranged read)."""
    import fsspec
    n = 3 * CHUNK_BYTES // 4 + 1
    w = torch.arange(n, dtype=torch.float32)
    path = str(tmp_path / "s") if where == "local" else f"memory://{tmp_path.name}/s"
    save_sharded(path, one_rank_grid, 1, [("model/w", (n,), 0, w)], {"gpt_config": {}})
    part = f"{path}/step-00000001/part-00000.bin"
    assert len(open_snapshot(path).meta["parts"][0]["crc32c"]) == 4
    data = bytearray(fsspec.open(part, "rb").open().read())
    data[256 + 2 * CHUNK_BYTES + 100] ^= 1
    with fsspec.open(part, "wb") as f:
        f.write(bytes(data))
    snap = open_snapshot(path)
    edge = CHUNK_BYTES // 4
    assert torch.equal(snap.read_box("model/w", [(edge - 3, edge + 5)]), w[edge - 3:edge + 5])
    assert torch.equal(snap.read_box("model/w", [(0, 2 * edge)]), w[:2 * edge])
    with pytest.raises(UserError) as refused:
        snap.read_box("model/w", [(2 * edge - 1, 2 * edge + 1)])
    assert f"part {snap.dir}/part-00000.bin is damaged: tensor 'model/w' (bytes " \
           f"{256 + 2 * CHUNK_BYTES}-{256 + 3 * CHUNK_BYTES} of the part)" in str(refused.value)
    assert "no older snapshot is kept" in str(refused.value)
    assert torch.equal(snap.read_box("model/w", [(3 * edge, n)]), w[3 * edge:])


@pytest.mark.parametrize("version", [2, 3])
def test_snapshots_of_the_formats_before_checksums_still_load(version):
    """tests/data's snapshots of formats 2 and 3 have no checksums: they open and every
    tensor reads (unchecked)."""
    snap = open_snapshot(f"{REPO}/tests/data/snapshot-v{version}")
    assert snap.meta["format_version"] == version and MANIFEST_KEY not in snap.meta
    assert all(snap.read_full(key).numel() for key in snap.keys())


def test_a_damaged_exported_folder_is_refused_by_init_from(written, tmp_path):
    """model.init_from reads what mode=export wrote: one flipped bit in a tensor of its
    model.safetensors (the file still readable) is one line naming the file and the
    tensor. Red without the check: the folder loads."""
    from checkpoint.export import export
    out = tmp_path / "hf"
    export(load_config(["mode=export", f"export.path={out}", f"trainer.snapshot_path={written[0]}"], 1))
    hf_gpt2.read_folder(str(out))  # intact: loads
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    size = int.from_bytes(data[:8], "little")
    name = "transformer.h.0.attn.c_attn.weight"
    flip_bit(weights, 8 + size + json.loads(data[8:8 + size])[name]["data_offsets"][0] + 3, 6)
    with pytest.raises(UserError) as refused:
        hf_gpt2.read_folder(str(out))
    assert f"{weights} is damaged: tensor {name!r}" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_benchmark_command_runs_at_a_tiny_size(capsys):
    """`python -m bench.snapshot_checksum` (docs/checkpointing.md's numbers) at a tiny size:
    its table has the write and the read, wall and CPU."""
    from bench import snapshot_checksum
    assert snapshot_checksum.main(["--layers", "1", "--width", "64", "--vocab", "100", "--block",
                                   "32", "--rounds", "1", "--mib", "4"]) == 0
    table = capsys.readouterr().out
    assert all(f"| {row} |" in table for row in ("write, wall", "write, CPU", "read, wall", "read, CPU"))
