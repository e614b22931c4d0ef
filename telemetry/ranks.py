"""`<run_dir>/ranks.json`, written once at the end of training: what metrics.jsonl (rank 0's
figures) cannot say about the other ranks.

- per rank: its place in the grid, its device and the device's model name, and its peak
  memory over the run (peak_mem_mb; on CUDA also peak_mem_reserved_mb);
- replicas: every rank digests each canonical box of the parameters it holds
  (Region.canonical_parts: the same box under the same name on two ranks must hold the
  same values: data-parallel replicas, a tensor tensor parallelism does not split, the
  tied embedding's two pipeline copies); `replicas_equal` says whether every box held by
  more than one rank has one digest, `replicas_checked` how many such boxes there were,
  `replicas_differ` the first that do not;
- `weights_digest`: one digest of every rank's boxes, so two runs of the same layout can
  be compared bitwise (scripts/gpu_smoke.sh's determinism column).

One object gather over the host group (gloo, host memory) at the end of the run; the
digests read every parameter to the host once, as the end-of-run state_dict does.
PyTorch's references that hold DTensors have no boxes here (their parameters are
torch's), so they report memory only.
"""

import hashlib
import json
import os
import platform

import torch
import torch.distributed as dist

from telemetry.metrics import peak_memory


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.machine() or 'host'})"


def box_digests(regions):
    """{"name[box]": digest} of the canonical boxes this rank holds (values as stored)."""
    from torch.distributed.tensor import DTensor
    out = {}
    for r in regions:
        if isinstance(r.opt_param, DTensor):
            continue
        values = r.values().detach()
        for box, idx in r.canonical_parts():
            data = values[idx].contiguous().cpu()
            key = f"{r.placement.name}{list(map(list, box))}"
            out[key] = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(),
                                       digest_size=8).hexdigest()
    return out


def this_rank(grid, strategy):
    return {"rank": grid.rank, "coords": dict(grid.coords), "device": str(grid.device),
            "device_name": device_name(grid.device), **peak_memory(grid.device),
            "digests": box_digests(strategy.regions())}


def replicas(everyone):
    """(boxes held by more than one rank, [keys whose copies differ])."""
    seen = {}
    for r in everyone:
        for key, digest in r["digests"].items():
            seen.setdefault(key, set()).add(digest)
    shared = [k for k in seen if sum(k in r["digests"] for r in everyone) > 1]
    return len(shared), sorted(k for k in shared if len(seen[k]) > 1)


def write_ranks(grid, strategy, run_dir):
    """Collective (every rank, the end of training): gather every rank's summary to the
    main rank, which writes ranks.json and says so if replicas differ."""
    mine = this_rank(grid, strategy)
    everyone = [mine]
    if grid.world_size > 1:  # in host memory (gloo), never staged on the GPU
        everyone = [None] * grid.world_size if grid.is_main else None
        dist.gather_object(mine, everyone, dst=0, group=grid.host_group)
    if not grid.is_main:
        return None
    checked, differ = replicas(everyone)
    weights = hashlib.blake2b(digest_size=8)
    for key, digest in sorted({k: d for r in everyone for k, d in r["digests"].items()}.items()):
        weights.update(f"{key}={digest};".encode())
    summary = {"ranks": [{k: v for k, v in r.items() if k != "digests"} for r in everyone],
               "replicas_checked": checked, "replicas_equal": not differ,
               "replicas_differ": differ[:10], "weights_digest": weights.hexdigest()}
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "ranks.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if differ:
        print(f"warning: {len(differ)} parameter boxes differ between the ranks that should hold "
              f"the same copy, e.g. {differ[0]} (ranks.json)", flush=True)
    return summary
