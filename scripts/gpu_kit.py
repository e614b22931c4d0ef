"""The device kit: what a call to a lent GPU machine carries beside the checkout, prepared here.

    python scripts/gpu_kit.py                  # build peers/ (git-ignored), print its size
    python scripts/gpu_kit.py --commit         # (there) the commit the copy is, checked
    python scripts/gpu_kit.py --check          # (there) interpreter, torch, GPU, imports, APIs

The GPU machine (docs/benchmarks-gpu.md) has no network and no .git in its copy of the
checkout; its image has its own CUDA build of torch (2.11, Python 3.12, `python3`) but not
omegaconf, wandb or torchft. So, built here into peers/ (ignored by .gitignore, carried with
`carry: ["peers"]`):

  peers/wheels/        the wheels the image lacks, for its Python 3.12 (pip download; or,
                       offline, repacked from this Python's installed pure-Python
                       distribution: --wheels-from installed), and modules.txt: "module
                       wheel" lines, which scripts/gpu_session.sh installs only where the
                       module does not import. omegaconf alone: its one requirement, PyYAML,
                       is in the image; wandb is not carried (wandb.mode=disabled, which
                       every device command passes, never imports it), nor torchft
                       (ft.enabled only).
  peers/nanoGPT/       karpathy/nanoGPT's tree at the fetched mirror's HEAD (a depth-1
                       clone, without .git), its commit in peers/nanoGPT/.commit
  peers/tinyshakespeare.txt   the text of ../shared/data (the call does not carry ../shared)
  peers/kit.json       this checkout's commit (git describe) and what the kit holds
  peers/tree.sha256    every tracked file's hash as it is here: --commit there says whether
                       the copy is still that commit (else "-changed-since-kit")

Stdlib only: --commit runs before anything is installed there.
"""

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = "peers"
MIRROR = "/work/.mirror/karpathy+nanoGPT/repo"  # what the session's fetch tool brings
TEXT = os.path.join(os.path.dirname(REPO), "shared", "data", "tinyshakespeare.txt")
# module -> distribution: what our code imports that the GPU image lacks
CARRIED = {"omegaconf": "omegaconf"}
# what the carried wheels may require: distributions the image has (KINDS.md's list)
IMAGE_HAS = {"pyyaml", "typing-extensions", "packaging", "numpy", "torch", "fsspec", "tiktoken",
             "safetensors", "requests", "matplotlib", "pytest", "pytest-timeout"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
CALL_LIMIT_MIB = 64  # what one device call carries at most: tree, untracked files, carry


def git(*args, cwd=REPO):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


# ---------------------------------------------------------------------------- wheels

def download_wheel(dist, version, dest):
    """The distribution's wheel for the image's Python 3.12 from the package index; its path."""
    before = set(os.listdir(dest))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp",
           *[a for p in PLATFORMS for a in ("--platform", p)], "-d", dest, f"{dist}=={version}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    new = sorted(set(os.listdir(dest)) - before)
    if len(new) != 1 or not new[0].endswith(".whl"):
        raise RuntimeError(f"pip download {dist}=={version} gave {new}")
    return os.path.join(dest, new[0])


def repack_installed(dist, dest):
    """A wheel of the installed distribution `dist`, from its recorded files (a pure-Python
    one only: its WHEEL says py3-none-any), for a machine without the package index."""
    d = importlib.metadata.distribution(dist)
    wheel_meta = d.read_text("WHEEL") or ""
    if "Root-Is-Purelib: true" not in wheel_meta or "py3-none-any" not in wheel_meta:
        raise RuntimeError(f"{dist} is not a pure-Python py3-none-any wheel: cannot repack it")
    name, version = d.metadata["Name"].replace("-", "_"), d.version
    info = f"{name}-{version}.dist-info"
    path = os.path.join(dest, f"{name}-{version}-py3-none-any.whl")
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for f in sorted(d.files, key=str):
            rel = str(f)
            if "__pycache__" in rel or rel.endswith((".pyc", "RECORD", "INSTALLER", "REQUESTED",
                                                     "direct_url.json")) or rel.startswith(".."):
                continue
            data = f.locate().read_bytes()
            arc = rel if not rel.split("/")[0].endswith(".dist-info") else f"{info}/{rel.split('/', 1)[1]}"
            whl.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append((arc, f"sha256={digest}", str(len(data))))
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(record + [(f"{info}/RECORD", "", "")])
        whl.writestr(f"{info}/RECORD", out.getvalue())
    return path


def requirements(wheel):
    """The distributions a wheel requires (no extras), lower-cased."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    needs = []
    for line in lines:
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            name = re.match(r"\s*([A-Za-z0-9._-]+)", line.split(":", 1)[1]).group(1)
            needs.append(name.lower().replace("_", "-"))
    return needs


def build_wheels(kit, source):
    dest = os.path.join(kit, "wheels")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    lines = []
    for module, dist in CARRIED.items():
        version = importlib.metadata.version(dist)  # the one the CPU results ran with
        if source == "pypi":
            wheel = download_wheel(dist, version, dest)
        elif source == "installed":
            wheel = repack_installed(dist, dest)
        else:  # auto: the index, else (offline) the installed copy
            try:
                wheel = download_wheel(dist, version, dest)
            except (subprocess.SubprocessError, RuntimeError, OSError) as e:
                print(f"gpu_kit: pip download {dist}=={version} failed ({str(e).splitlines()[0]}); "
                      "repacking the installed copy", file=sys.stderr)
                wheel = repack_installed(dist, dest)
        missing = [n for n in requirements(wheel) if n not in IMAGE_HAS and n not in CARRIED.values()]
        if missing:
            raise SystemExit(f"gpu_kit: {os.path.basename(wheel)} requires {missing}, which the GPU "
                             "image lacks: add them to CARRIED")
        lines.append(f"{module} {os.path.basename(wheel)}")
    with open(os.path.join(dest, "modules.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


# ---------------------------------------------------------------------------- nanoGPT, text

def copy_nanogpt(kit, mirror=None, checkout=None):
    """nanoGPT's tree into kit/nanoGPT without .git, its commit in .commit: a depth-1 clone
    of the fetched mirror's HEAD, or a copy of a checkout given (the tests' stand-in)."""
    dest = os.path.join(kit, "nanoGPT")
    shutil.rmtree(dest, ignore_errors=True)
    if checkout:
        shutil.copytree(checkout, dest, ignore=shutil.ignore_patterns(".git"))
        try:
            commit = git("rev-parse", "HEAD", cwd=checkout).strip()
        except (subprocess.CalledProcessError, OSError):
            commit = "unknown"
    else:
        subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{os.path.abspath(mirror)}",
                        dest], check=True, capture_output=True, text=True)
        commit = git("rev-parse", "HEAD", cwd=dest).strip()
        shutil.rmtree(os.path.join(dest, ".git"))
    with open(os.path.join(dest, ".commit"), "w") as f:  # bench/nanogpt_runner.COMMIT_FILE
        f.write(commit + "\n")
    return commit


def tree_hashes(kit):
    """kit/tree.sha256: `sha256sum -c` lines of every tracked file as it is here."""
    names = [n for n in git("ls-files", "-z").split("\0") if n and os.path.isfile(os.path.join(REPO, n))]
    with open(os.path.join(kit, "tree.sha256"), "w") as out:
        for name in names:
            with open(os.path.join(REPO, name), "rb") as f:
                out.write(f"{hashlib.sha256(f.read()).hexdigest()}  {name}\n")
    return len(names)


def size_of(paths):
    total = 0
    for p in paths:
        if os.path.isfile(p):
            total += os.path.getsize(p)
        for root, _, files in os.walk(p):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def travelling_bytes():
    """What a call sends besides the kit: tracked files and untracked ones not ignored."""
    names = [n for n in git("ls-files", "-z", "-co", "--exclude-standard").split("\0") if n]
    return size_of(os.path.join(REPO, n) for n in names)


def build(args):
    kit = os.path.join(REPO, args.kit)
    probe = os.path.join(args.kit, "wheels", "x.whl")
    if subprocess.run(["git", "check-ignore", "-q", probe], cwd=REPO).returncode != 0:
        raise SystemExit(f"gpu_kit: {args.kit}/ is not git-ignored here: the kit must never be committed")
    os.makedirs(kit, exist_ok=True)
    started = time.monotonic()
    wheels = build_wheels(kit, args.wheels_from)
    if args.nanogpt:
        nano = copy_nanogpt(kit, checkout=args.nanogpt)
    elif os.path.isdir(args.mirror):
        nano = copy_nanogpt(kit, mirror=args.mirror)
    else:
        raise SystemExit(f"gpu_kit: no nanoGPT mirror at {args.mirror}: fetch github:karpathy/nanoGPT "
                         "(or pass --nanogpt CHECKOUT)")
    if not os.path.isfile(args.text):
        raise SystemExit(f"gpu_kit: no text at {args.text} (--text PATH)")
    shutil.copyfile(args.text, os.path.join(kit, "tinyshakespeare.txt"))
    tracked = tree_hashes(kit)
    describe = git("describe", "--always", "--dirty").strip()
    manifest = {"commit": describe, "head": git("rev-parse", "HEAD").strip(),
                "built": time.strftime("%Y-%m-%d %H:%M"), "wheels": wheels, "nanogpt_commit": nano,
                "text": {"from": os.path.abspath(args.text), "bytes": os.path.getsize(args.text)},
                "tracked_files": tracked}
    with open(os.path.join(kit, "kit.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    kit_bytes, tree = size_of([kit]), travelling_bytes()
    mib = 2**20
    print(f"gpu_kit: {args.kit}/ built in {time.monotonic() - started:.1f} s for commit {describe}: "
          f"{kit_bytes / mib:.2f} MiB ({', '.join(w.split()[1] for w in wheels)}; nanoGPT {nano[:12]}; "
          f"tinyshakespeare.txt); the call carries {(kit_bytes + tree) / mib:.1f} MiB with the tree's "
          f"{tree / mib:.1f} MiB, of {CALL_LIMIT_MIB} MiB")
    if kit_bytes + tree > (CALL_LIMIT_MIB - 4) * mib:
        raise SystemExit(f"gpu_kit: {(kit_bytes + tree) / mib:.1f} MiB is too close to a call's "
                         f"{CALL_LIMIT_MIB} MiB")
    return 0


# ---------------------------------------------------------------------------- there

def commit(args):
    """The commit the kit recorded, with "-changed-since-kit" where the copy's files differ
    from those it hashed (or "?" without a kit)."""
    kit = os.path.join(REPO, args.kit)
    try:
        with open(os.path.join(kit, "kit.json")) as f:
            recorded = json.load(f)["commit"]
        with open(os.path.join(kit, "tree.sha256")) as f:
            lines = [line.rstrip("\n").split("  ", 1) for line in f if line.strip()]
    except (OSError, ValueError, KeyError):
        print("?")
        return 0
    changed = []
    for digest, name in lines:
        try:
            with open(os.path.join(REPO, name), "rb") as f:
                same = hashlib.sha256(f.read()).hexdigest() == digest
        except OSError:
            same = False
        if not same:
            changed.append(name)
    if changed:
        print(f"gpu_kit: {len(changed)} file(s) differ from the kit's commit {recorded}: "
              f"{', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}", file=sys.stderr)
    print(recorded + ("-changed-since-kit" if changed else ""))
    return 0


# torch APIs our code calls that a torch older than the pin (the image's 2.11) may lack:
# each with what happens without it
APIS = [
    ("torch.distributed", "all_gather_single", "all_gather_into_tensor is used (parallel/comm.py)"),
    ("torch.distributed", "reduce_scatter_single", "reduce_scatter_tensor is used (parallel/comm.py)"),
    ("torch.distributed", "all_gather_into_tensor", "NEEDED: ZeRO and tp+sp gathers"),
    ("torch.distributed", "split_group", "one new_group per line instead (parallel/grid.py)"),
    ("torch", "_grouped_mm", "experts: one product per expert (moe/experts.py)"),
    ("torch.accelerator", "synchronize", "NEEDED by ft.enabled's state transfer"),
    ("torch.accelerator", "set_device_index", "NEEDED by ft.enabled"),
    ("torch.utils.checkpoint", "create_selective_checkpoint_contexts", "NEEDED: selective recompute"),
    ("torch.distributed.fsdp", "fully_shard", "NEEDED: parallel.dp=torch_fsdp"),
    ("torch.distributed.fsdp", "CPUOffloadPolicy", "NEEDED: torch_fsdp with offload"),
    ("torch._dynamo.callback", "CallbackTrigger", "NEEDED: trainer.compile's compile_ms"),
    ("torch.compiler", "is_compiling", "NEEDED: experts under compile"),
    ("torch", "get_autocast_dtype", "NEEDED: experts under autocast"),
    ("torch.distributed", "DistError", "NEEDED: collective failures' one line"),
]
# every module of ours a device command imports
MODULES = ["config", "main", "trainer", "bench.gpu_vs_nanogpt", "bench.shakespeare_curve",
           "bench.run_engine.jobs", "parallel.parallelize", "parallel.compile", "moe.experts",
           "telemetry.step_record", "launch.hang_report", "scripts.smoke_table"]


def check(_args):
    """What the device command finds there: one line each; exit 1 if something NEEDED is
    missing (the parts still run: their failures are then read in their logs)."""
    import importlib
    import platform
    print(f"python {platform.python_version()} at {sys.executable}")
    sys.path.insert(0, REPO)
    bad = []
    try:
        import torch
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {gpu}, "
              f"NCCL {torch.cuda.nccl.version() if torch.cuda.is_available() else '-'}")
    except Exception as e:  # noqa: BLE001 -- said, then the rest is checked
        print(f"torch: FAILED {type(e).__name__}: {e}")
        return 1
    for module, name, without in APIS:
        try:
            ok = hasattr(importlib.import_module(module), name)
        except ImportError:
            ok = False
        if not ok:
            print(f"missing {module}.{name}: {without}")
            bad += [f"{module}.{name}"] if without.startswith("NEEDED") else []
    for module in MODULES + list(CARRIED):
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001
            print(f"import {module}: FAILED {type(e).__name__}: {str(e).splitlines()[0]}")
            bad.append(module)
    for optional in ("wandb", "torchft"):
        try:
            importlib.import_module(optional)
            print(f"{optional}: installed")
        except ImportError:
            print(f"{optional}: absent (not needed: wandb.mode=disabled, ft.enabled=false)")
    print("check: " + ("FAILED: " + ", ".join(bad) if bad else "ok"))
    return 1 if bad else 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python scripts/gpu_kit.py", description=__doc__.split("\n")[0])
    p.add_argument("--commit", action="store_true", help="(there) print the copy's commit, checked")
    p.add_argument("--check", action="store_true", help="(there) interpreter, torch, imports, APIs")
    p.add_argument("--kit", default=KIT, help="the kit's folder, git-ignored (%(default)s)")
    p.add_argument("--mirror", default=MIRROR, help="the fetched nanoGPT mirror (%(default)s)")
    p.add_argument("--nanogpt", default="", help="a nanoGPT checkout to copy instead of the mirror")
    p.add_argument("--text", default=TEXT, help="tinyshakespeare.txt (%(default)s)")
    p.add_argument("--wheels-from", choices=("auto", "pypi", "installed"), default="auto",
                   help="auto: the package index, else this Python's installed copy (%(default)s)")
    args = p.parse_args(argv)
    if args.commit:
        return commit(args)
    if args.check:
        return check(args)
    return build(args)


if __name__ == "__main__":
    sys.exit(main())
