"""Entry point: config, process groups, wiring; then train, sample, export or prepare.

    torchrun --standalone --nproc_per_node=2 main.py [key=value ...]
    python main.py [key=value ...]                 # world size 1
    python main.py mode=sample sample.prompt="KING:"
    python main.py mode=export export.path=DIR     # a Hugging Face GPT-2 folder (checkpoint/export.py)
    python main.py mode=prepare data.path=SRC data.tokens_path=DST   # token shards
    python main.py mode=plan plan.nodes=8 plan.gpus_per_node=8 plan.gpu=H100-80GB  # layouts
    python main.py mode=dryrun plan.nodes=8 plan.gpus_per_node=8 parallel.tp=4 ...   # try one
    python main.py mode=lighthouse ft.lighthouse=HOST:PORT ft.min_replicas=N  # fault tolerance
    python main.py mode=plot                       # pictures of the run in run_dir/plots/ (plots/)
    python main.py --help                          # the modes and every key with its default

Every failure a user can fix is a UserError: printed as one line on every
rank, exit status 2 (under torchrun also written into its error file, so that its
failure summary shows the line: launch/exit.py). SIGTERM or SIGUSR1 (a cluster
preempting the job) stops every rank after the same step, with a snapshot of it:
exit status 75; so does a first Ctrl-C, exit status 130, and a second stops at once
(launch/preemption.py; what each prints: docs/stopping.md). Checks that every rank can make on its own (config, data,
snapshot) run before the first collective that could leave a rank waiting;
the ranks then agree that all of them got through before going on.
"""

import datetime
import os
import sys
import traceback
from contextlib import contextmanager
from dataclasses import asdict

import torch
import torch.distributed as dist

from char_dataset import build_tokenizer, data_identity, open_data
from checkpoint import hf_gpt2
from checkpoint.canonical import check_state_names, load_named_parameters
from checkpoint.export import export
from checkpoint.resume import check_resumable, snapshot_location
from checkpoint.snapshot_reader import check_model_shape, open_snapshot, step_to_resume
from config import help_text, load_config, resolved_yaml, to_dict
from data.prepare import prepare
from errors import UserError
from fault_tolerance import lighthouse, replica_group
from generation import kv_cache
from launch import preemption
from launch.hang_report import hang_dir, nccl_flight_recorder
from launch.devices import cuda_index, local_rank_from_env, pick_device  # noqa: F401 (tests: main.cuda_index)
from launch.exit import flush_and_exit, tell_launcher
from model import GPT, GPTConfig, shapes_only
from parallel.comm import collective_failure
from parallel.parallelize import parallelize
from parallel.grid import ProcessGrid, nccl_timeout_s, together
from parallel.initial import GivenWeights, InitialWeights
from planner.dryrun import dryrun
from planner.report import plan
from telemetry.ranks import write_ranks
from trainer import Trainer


_groups_started = 0  # process groups this process has started (init_process_group)


@contextmanager
def determinism(enabled):
    """trainer.deterministic: deterministic kernels (torch.use_deterministic_algorithms,
    strict: an op without one stops the run naming it. Warn-only is not enough: CUDA's
    memory-efficient and cuDNN attention keep their atomics there and only warn, and an
    H100 rerun of fp32 `single` differed at step 7), cuDNN without autotuning, and
    cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG, read when its first handle is made:
    before any matmul of the run), so that a rerun on a GPU is bitwise the first run
    (scripts/gpu_smoke.sh's rerun column). Restored afterwards: a process may run more
    jobs (tests/job_server.py)."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[2:]


def init_process_group(device, timeout_s, rank, world_size, run_dir=None):
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and run_dir:  # a timed-out collective dumps NCCL's recent ones there
        os.makedirs(hang_dir(run_dir), exist_ok=True)
        for key, value in nccl_flight_recorder(run_dir).items():
            os.environ.setdefault(key, value)
    timeout = datetime.timedelta(seconds=timeout_s)
    # NCCL's collectives wait a margin longer: each rank's hang watchdog reports first
    waits = datetime.timedelta(seconds=nccl_timeout_s(timeout_s)) if backend == "nccl" else timeout
    # NCCL: bind the group to this rank's GPU now (communicators created eagerly; barriers
    # know the device instead of guessing it from the rank)
    bound = {"device_id": device} if device.type == "cuda" else {}
    if "MASTER_ADDR" in os.environ:  # launched by torchrun (or by hand with env://)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun keeps one key-value store across --max-restarts attempts: without a
        # per-attempt namespace a restarted rank can read a dead rank's old address
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # and one per group this process starts: a second run in the same process (a
        # notebook, the tests' job server) must not read the first one's addresses
        global _groups_started
        _groups_started += 1
        store = dist.PrefixStore(f"attempt-{attempt}/group-{_groups_started}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=waits, **bound)
    else:  # plain `python main.py`: a one-rank group, so the code path is the same
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=waits, **bound)


def read_inputs(cfg, is_main):
    """Everything each rank can check alone: snapshot, data, tokenizer, shapes,
    the prompt of the final sample; the main rank also creates the run directory."""
    path = snapshot_location(cfg.trainer)
    step, note = step_to_resume(path, cfg.trainer.resume_step)
    snapshot = open_snapshot(path, step)
    init = None
    if cfg.model.init_from and not snapshot:
        init = hf_gpt2.read_folder(cfg.model.init_from)
    saved_tokenizer = snapshot.meta["tokenizer"] if snapshot else None
    saved_by = f"the snapshot at {path}"
    if init is not None:  # the data must be read with the folder's tokenizer
        saved_tokenizer = init_tokenizer(cfg, *init)
        saved_by = f"model.init_from={cfg.model.init_from}"
    tokenizer, train_set, val_set = open_data(cfg.data, saved_tokenizer, saved_by, cfg.config)
    notes = ([note] if note else []) + (check_resumable(path, snapshot.meta, cfg,
                                                        data_identity(train_set))
                                        if snapshot else [])
    if cfg.model.init_from and snapshot:
        notes.append(f"note: model.init_from is ignored: resuming from the snapshot at {path}")
    shape = {k: v for k, v in asdict(cfg.model).items() if k != "init_from"}
    gpt_config = GPTConfig(**shape, vocab_size=tokenizer.vocab_size, block_size=cfg.data.block_size)
    if snapshot:
        check_model_shape(path, snapshot.meta["gpt_config"], asdict(gpt_config))
    init_state = None
    if init is not None:  # checked here, on every rank, before any collective
        hf, tensors, _ = init
        notes += hf_gpt2.check_config(hf, asdict(gpt_config), cfg.model.init_from)
        init_state = hf_gpt2.from_hf(tensors, asdict(gpt_config), cfg.model.init_from)
    if cfg.sample.length > 0:
        tokenizer.encode(cfg.sample.prompt)  # fail now, not after the whole run
    if is_main:
        os.makedirs(cfg.trainer.run_dir, exist_ok=True)
        stale = os.path.join(cfg.trainer.run_dir, preemption.MARKER)
        if os.path.exists(stale):  # the preempted run this one resumes
            os.remove(stale)
        with open(os.path.join(cfg.trainer.run_dir, "config.yaml"), "w") as f:
            f.write(resolved_yaml(cfg))
        for note in notes:
            print(note, flush=True)
    return snapshot, tokenizer, train_set, val_set, gpt_config, init_state


def init_tokenizer(cfg, hf, tensors, chars):
    """The tokenizer of a model.init_from folder, which the data must be read with."""
    saved = hf_gpt2.tokenizer_state(hf, chars, cfg.model.init_from)
    if saved["kind"] != cfg.data.tokenizer:
        raise UserError(f"model.init_from={cfg.model.init_from} was trained with the "
                        f"{saved['kind']} tokenizer: set data.tokenizer={saved['kind']}")
    return saved


def finished(cfg):
    """The lines to print when the snapshot this run would resume from is at or past
    trainer.max_steps (the command of a finished run, run again), else None."""
    t = cfg.trainer
    path = snapshot_location(t)
    step, note = step_to_resume(path, t.resume_step)
    snapshot = open_snapshot(path, step)
    if snapshot is None or snapshot.meta["step"] < t.max_steps:
        return None
    run, fresh = (f"snapshot {path}", "trainer.snapshot_path") if t.snapshot_path else \
        (f"run {t.run_dir}", "trainer.run_dir")
    return ([note] if note else []) + [
        f"{run} already finished at step {snapshot.meta['step']} (trainer.max_steps="
        f"{t.max_steps}): raise trainer.max_steps to continue, or set a new {fresh} for a "
        "fresh run"]


def train(cfg, grid):
    """Returns what the main rank needs to print a sample once the group is gone, or None
    when the run had finished already (nothing trained, nothing written)."""
    done = together(grid, "reading the snapshot", lambda: finished(cfg))
    if not grid.all_ok(done is None):
        if grid.is_main and done:
            print("\n".join(done), flush=True)
        return None
    snapshot, tokenizer, train_set, val_set, gpt_config, init_state = together(
        grid, "reading the config, data and snapshot", lambda: read_inputs(cfg, grid.is_main))
    with shapes_only():  # each rank materializes what it holds
        model = GPT(gpt_config)
    if init_state is not None:  # model.init_from: checked against the model, read by box
        check_state_names(model.canonical_shapes(), init_state,
                          f"model.init_from={cfg.model.init_from}")
        init = GivenWeights(init_state)
    else:  # the same values whatever the layout: each parameter from (seed, its name)
        init = InitialWeights(model, cfg.trainer.seed)
    if grid.is_main:
        print(f"{grid}; {model.num_params() / 1e6:.2f}M parameters, vocab {gpt_config.vocab_size}, "
              f"{len(train_set)} train windows", flush=True)
    strategy = parallelize(model, grid, cfg, init)  # ready: its optimizer built
    meta = {"config": to_dict(cfg), "gpt_config": asdict(gpt_config), "tokenizer": tokenizer.state()}
    trainer = Trainer(cfg, strategy, grid, train_set, val_set, meta)
    try:
        if snapshot:
            together(grid, "loading the snapshot", lambda: trainer.restore(snapshot))
        together(grid, "opening metrics.jsonl and wandb", trainer.open_metrics)
        # this launch's replica group (fault_tolerance/); ft.enabled: waits for the lighthouse
        group = together(grid, "joining the replica groups",
                         lambda: replica_group.start(cfg, grid, strategy, trainer.step))
        trainer.join_replicas(group)
        trainer.train()
    finally:
        trainer.close()  # the replica group's too
    write_ranks(grid, strategy, cfg.trainer.run_dir)  # collective: every rank's memory, replicas
    state = strategy.state_dict()  # collective: gathers shards where there are any
    return state, tokenizer, gpt_config


def sample(cfg):
    path = snapshot_location(cfg.trainer)
    snap = open_snapshot(path, cfg.trainer.resume_step)
    if snap is None:
        raise UserError(f"no snapshot at {path}: train first, or set trainer.snapshot_path")
    tokenizer = build_tokenizer(None, saved=snap.meta["tokenizer"], source=f"the snapshot at {path}")
    model = GPT(GPTConfig(**snap.meta["gpt_config"]))
    load_named_parameters(model, {n: snap.read_full(f"model/{n}") for n, _ in model.named_parameters()},
                          f"snapshot {path}")
    print(generate_text(model, tokenizer, cfg.sample), flush=True)


def plot(cfg):
    from plots.draw import write_plots
    page, pictures = write_plots(cfg.trainer.run_dir)
    print(f"{len(pictures)} pictures of {cfg.trainer.run_dir} in {os.path.dirname(page)} "
          f"({', '.join(pictures)}): open {page}", flush=True)


def generate_text(model, tokenizer, scfg):
    model.eval()
    prompt = tokenizer.encode(scfg.prompt) or [0]
    idx = torch.tensor([prompt], dtype=torch.long)
    gen = torch.Generator().manual_seed(scfg.seed)
    out = kv_cache.generate(model, idx, scfg.length, temperature=scfg.temperature,
                            top_k=scfg.top_k or None, generator=gen)
    return tokenizer.decode(out[0].tolist())


def main(argv, rank, world_size, local_rank):
    cfg = load_config(argv, world_size)  # before any collective: bad config exits everywhere
    if cfg.mode in ("sample", "prepare"):  # one process (prepare runs its own pool)
        if rank == 0:
            (sample if cfg.mode == "sample" else prepare)(cfg)
        return
    if cfg.mode == "plot":  # reads the run directory only: a finished, running or killed run
        if rank == 0:
            plot(cfg)
        return
    if cfg.mode == "plan":  # no process group, no device: predictions only (planner/)
        if rank == 0:
            plan(cfg)
        return
    if cfg.mode == "dryrun":  # a few ranks of plan.nodes x plan.gpus_per_node, here, one step each
        if rank == 0:
            dryrun(cfg)
        return
    if cfg.mode == "export":
        if rank == 0:
            print("\n".join(export(cfg)), flush=True)
        return
    if cfg.mode == "lighthouse":  # torchft's quorum service, until stopped (fault_tolerance/)
        if rank == 0:
            lighthouse.serve(cfg.ft)
        return
    preemption.install()  # SIGTERM/SIGUSR1 now stop after a step, with a snapshot
    device = pick_device(cfg.trainer.device, local_rank, world_size)
    init_process_group(device, cfg.parallel.timeout_s, rank, world_size, cfg.trainer.run_dir)
    try:
        grid = ProcessGrid(cfg.sizes, device, cfg.parallel.timeout_s, cfg.parallel.ep)  # config.validate's
        with determinism(cfg.trainer.deterministic):
            trained = train(cfg, grid)
        dist.barrier()  # nobody leaves while another rank may still need it
    except Exception as e:  # a collective that timed out or lost its peer: one line, not a traceback
        failure = collective_failure(e, cfg.parallel.timeout_s)
        if failure is None:
            raise
        raise failure from e
    dist.destroy_process_group()
    if trained is None:  # the run had finished: said so, nothing to sample
        return
    state, tokenizer, gpt_config = trained
    # alone now: a failure here blocks nobody; skipped when a stop signal came in the last step
    if grid.is_main and cfg.sample.length > 0 and not preemption.received():
        model = GPT(gpt_config)
        load_named_parameters(model, state)
        print("---- sample ----\n" + generate_text(model, tokenizer, cfg.sample), flush=True)


def run(argv, rank, world_size, local_rank, error_file=None) -> int:
    """main(), and the exit status for every way it can end. error_file: torchrun's
    TORCHELASTIC_ERROR_FILE for this rank, where the line (a crash's traceback) goes too,
    so that torchrun's failure summary shows it (launch/exit.py tell_launcher)."""
    try:
        main(argv, rank, world_size, local_rank)
    except UserError as e:
        where = f" on rank {rank}" if world_size > 1 else ""
        sys.stderr.flush()  # one write of the whole line, so ranks' lines never interleave
        os.write(2, f"error{where}: {e}\n".encode())
        tell_launcher(error_file, f"error{where}: {e}")
        return 2
    except preemption.Preempted as e:  # the snapshot of the last step done is written
        if rank == 0:
            print(str(e), flush=True)
        tell_launcher(error_file, str(e))
        return e.status  # 75 (a preemption) or 130 (Ctrl-C)
    except KeyboardInterrupt:
        return preemption.INTERRUPTED
    except BaseException as e:
        traceback.print_exc()
        tell_launcher(error_file, f"{type(e).__name__}: {e}", traceback.format_exc())
        return 1
    return 0


def run_and_exit():
    """run() with this process's arguments and launcher environment, then leave through
    launch/exit.py (never the interpreter's teardown)."""
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        sys.stdout.write(help_text())  # before any config, device or process group
        sys.stdout.flush()
        flush_and_exit(0)
    flush_and_exit(run(sys.argv[1:], int(os.environ.get("RANK", 0)),
                       int(os.environ.get("WORLD_SIZE", 1)), local_rank_from_env(),
                       os.environ.get("TORCHELASTIC_ERROR_FILE")))


if __name__ == "__main__":
    run_and_exit()
