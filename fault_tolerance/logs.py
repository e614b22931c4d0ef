"""torchft's own log lines (a quorum and a commit line per step, reconfigurations, errors)
go to <run_dir>/torchft-rank<R>.log, not the console: the console shows one line per
membership change (replica_group.py)."""

import logging
import os

LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")


def to_file(run_dir, rank):
    """Send torchft's Python loggers to the file; returns the handler (close_file)."""
    os.makedirs(run_dir, exist_ok=True)
    handler = logging.FileHandler(os.path.join(run_dir, f"torchft-rank{rank}.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s "
                                           "%(extra_fields)s", defaults={"extra_fields": ""}))
    handler.addFilter(_with_extras)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return handler


def close_file(handler):
    for name in LOGGERS:
        logging.getLogger(name).removeHandler(handler)
    handler.close()


STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def _with_extras(record):
    """torchft's quorum/commit loggers put their fields in `extra=` with an empty message."""
    extras = {k: v for k, v in vars(record).items() if k not in STANDARD and k != "extra_fields"}
    record.extra_fields = " ".join(f"{k}={v}" for k, v in extras.items())
    return True
