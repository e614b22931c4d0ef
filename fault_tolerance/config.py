"""The `ft:` section: fault-tolerant replica groups, and the values its keys may take (what
ft.enabled cannot run with is in parallel/rules.py, FT)."""

import importlib.util
from dataclasses import dataclass

from errors import UserError, missing_package


@dataclass
class FTConfig:
    """The `ft:` section of gpt2_train_cfg.yaml."""
    enabled: bool = False       # this launch is one fault-tolerant replica group of ft.replicas (torchft):
                                # groups agree on who is alive before every step through the lighthouse
    lighthouse: str = "localhost:29510"  # HOST:PORT of the lighthouse (mode=lighthouse runs it there)
    replica_id: int = 0         # this group's index, 0..ft.replicas-1 (one launch per index)
    replicas: int = 1           # R: the replica groups of the run; each step's global batch is cut into
                                # R shares, dealt to the live groups (survivors take a lost group's)
    min_replicas: int = 1       # fewest live groups a step may commit with (mode=lighthouse: its quorum)
    timeout_s: float = 60.0     # how long to wait for the lighthouse, a quorum, a collective across
                                # groups or a state transfer before giving up


def check(cfg):
    """One clear error for an impossible ft: section (every mode)."""
    f = cfg.ft
    if f.replicas < 1:
        raise UserError(f"ft.replicas must be >= 1, got {f.replicas}")
    if not 0 <= f.replica_id < f.replicas:
        raise UserError(f"ft.replica_id must be in 0..{f.replicas - 1} (ft.replicas={f.replicas}), "
                        f"got {f.replica_id}")
    if f.min_replicas < 1:
        raise UserError(f"ft.min_replicas must be >= 1, got {f.min_replicas}")
    # the lighthouse serves whatever groups come (it never reads ft.replicas)
    if cfg.mode != "lighthouse" and f.min_replicas > f.replicas:
        raise UserError(f"ft.min_replicas must be in 1..ft.replicas={f.replicas}, got "
                        f"{f.min_replicas}: a quorum cannot need more groups than the run has")
    if f.timeout_s <= 0:
        raise UserError(f"ft.timeout_s must be > 0, got {f.timeout_s}")
    host_port(f.lighthouse)
    if (cfg.mode == "train" and f.enabled) or cfg.mode == "lighthouse":
        # found, not imported: importing torchft starts its Rust logger, which reads RUST_LOG
        # once (replica_group.py sets it to warn before the import)
        if not _installed("torchft"):  # an optional package: requirements-dev.txt
            asked = "mode=lighthouse" if cfg.mode == "lighthouse" else "ft.enabled=true"
            raise missing_package(asked, "torchft", "torchft==0.2.0")


def _installed(package):
    try:
        return importlib.util.find_spec(package) is not None
    except ImportError:  # a finder that refuses it
        return False


def host_port(address):
    """(host, port) of a HOST:PORT address, or a UserError."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"ft.lighthouse must be HOST:PORT (e.g. localhost:29510), got {address!r}")
    return host.strip("[]"), int(port)

