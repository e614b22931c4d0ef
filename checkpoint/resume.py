"""Where a run's snapshots live, and whether a snapshot may be resumed by this run:
the data order it was trained in must be the one this run reads, and its optimizer this
run's."""

import os

from data.sampling import LEGACY_ORDER, SAMPLERS, data_order, describe_data
from errors import UserError


def snapshot_location(t) -> str:
    """t: the trainer section."""
    return t.snapshot_path or os.path.join(t.run_dir, "snapshot")


def check_resumable(path, meta, cfg, data):
    """Refuse a snapshot whose data order differs from this run's; return notes on
    settings that legitimately change on resume (the LR schedule, when extending).
    data: char_dataset.data_identity of this run's train split."""
    saved_t, saved_d = meta["config"]["trainer"], meta["config"]["data"]
    text = not cfg.data.tokens_path  # prepared tokens are known by their fingerprint, not path
    for section, key, saved in (("trainer", "batch_size", saved_t), ("trainer", "seed", saved_t),
                                ("data", "path", saved_d), ("data", "val_fraction", saved_d)):
        now, was = getattr(getattr(cfg, section), key), saved.get(key, "")
        if was != now and (text or section == "trainer"):
            raise UserError(
                f"snapshot {path} was trained with {section}.{key}={was!r}, this run asks "
                f"for {now!r}: resuming would change the data order. Use the snapshot's value "
                "or a new trainer.snapshot_path")
    was, now = saved_t.get("optimizer", "adamw"), cfg.trainer.optimizer
    if was != now:
        raise UserError(
            f"snapshot {path} was trained with trainer.optimizer={was}, this run asks for {now}: "
            "its optimizer state does not carry over to another optimizer. Use "
            f"trainer.optimizer={was}, or a new trainer.snapshot_path")
    was, now = meta.get("data_order", LEGACY_ORDER), data_order(cfg.data)
    if was != now:
        known = SAMPLERS.get(was["sampler"]) == was["version"] and was["sampler"] != now["sampler"]
        hint = (f"Add data.sampler={was['sampler']} to finish it in the order it started with"
                if known else "This version cannot reproduce that order")
        raise UserError(
            f"snapshot {path} was trained in data order {was['sampler']} v{was['version']}, this "
            f"run reads in order {now['sampler']} v{now['version']}: resuming would silently change "
            f"the data it trains on. {hint}, or use a new trainer.snapshot_path")
    if meta.get("data", data) != data:
        raise UserError(
            f"snapshot {path} was trained on {describe_data(meta['data'])}, this run reads "
            f"{describe_data(data)}: resuming would change the data it trains on. Use the data it "
            "was trained on, or a new trainer.snapshot_path")
    return [f"note: trainer.{k} is {getattr(cfg.trainer, k)} now, {saved_t[k]} when the snapshot "
            f"was written: the LR schedule changes from here on"
            for k in ("max_steps", "warmup_steps", "lr", "min_lr") if saved_t[k] != getattr(cfg.trainer, k)]
