"""Which device this rank trains on: its GPU from what its launcher says (torchrun's
LOCAL_RANK, Slurm's, Open MPI's), or the CPU; a node with fewer GPUs than ranks is refused
in one line on every rank."""

import os

import torch

from errors import UserError
from parallel.grid import uses_cuda

LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")


def local_rank_from_env(environ=os.environ):
    """This process's rank on its node, as its launcher says it: torchrun's LOCAL_RANK,
    else Slurm's SLURM_LOCALID (srun starting every rank), else Open MPI's; None if no
    launcher said."""
    for name in LOCAL_RANK_VARIABLES:
        if environ.get(name, "") != "":
            return int(environ[name])
    return None


def pick_device(choice, local_rank, world_size=1):
    if uses_cuda(choice):
        if not torch.cuda.is_available():
            raise UserError("trainer.device=cuda but no CUDA device is available")
        index = cuda_index(local_rank, torch.cuda.device_count(),
                           int(os.environ.get("LOCAL_WORLD_SIZE", "1")), world_size)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def precision_for(device_choice):
    """trainer.precision=auto on this machine: bf16 where the device computes it natively
    (a CUDA GPU of compute capability 8.0 or newer, A100, H100, ...; ROCm GPUs), else fp32
    (a CPU, or an older GPU, where bf16 is emulated and slower than fp32). Reads the first
    visible GPU's properties (no tensor, no context made on it): a node's GPUs are alike."""
    if not uses_cuda(device_choice):
        return "fp32"
    if torch.version.hip or torch.cuda.get_device_properties(0).major >= 8:
        return "bf16"
    return "fp32"


def cuda_index(local_rank, visible, local_world=1, world_size=1):
    """This rank's GPU: LOCAL_RANK when the node's ranks share its GPUs (torchrun), 0 when
    the launcher shows each task just one (srun --gpus-per-task=1: every task sees its
    own GPU as device 0). Two ranks on one GPU would fail inside NCCL: refused here.
    local_world: the ranks this task's launcher started on the node (torchrun's
    LOCAL_WORLD_SIZE), which all see the same devices: more of them than GPUs is
    refused on every one of them (torchrun --nproc_per_node=2 on a 1-GPU box).
    local_rank None (no launcher said, local_rank_from_env): GPU 0 for a one-rank job
    or a task that sees one GPU; otherwise refused, since every rank would take GPU 0."""
    if local_rank is None:
        if visible == 1 or world_size == 1:
            return 0
        raise UserError(f"no {' / '.join(LOCAL_RANK_VARIABLES)} for this rank of {world_size}, "
                        f"which sees {visible} CUDA devices: every rank would take GPU 0; launch "
                        "with torchrun (it sets LOCAL_RANK), set LOCAL_RANK yourself, or give "
                        "each task one GPU (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES)")
    if local_world > visible:
        raise UserError(f"LOCAL_WORLD_SIZE={local_world} ranks on this node but each sees "
                        f"{visible} CUDA device{'s' if visible != 1 else ''}: two ranks would "
                        f"share a GPU; start at most {visible} ranks per node "
                        "(--nproc_per_node), or give each task its own GPU")
    if visible == 1:
        return 0
    if local_rank >= visible:
        raise UserError(f"LOCAL_RANK={local_rank} but this task sees {visible} CUDA devices: start "
                        f"at most {visible} ranks per node, or give each task one GPU "
                        "(CUDA_VISIBLE_DEVICES)")
    return local_rank
