"""Which steps went wrong, kept on the device: a step's loss and gradient norm are read only
at the steps the trainer logs or saves (one host read for all the values), not after every
step, where on a GPU the read would wait for the step.

- A step whose pre-clip gradient norm is not finite was skipped by the strategy on every
  rank (parallel/finite.py): counted here (`skipped_steps`, `step_skipped`), with the run of
  consecutive skips; `trainer.max_skipped_steps` of them in a row stop the run at the next
  read, with one line naming where the run began. (fp16: the loss scaler skips and counts
  its overflows itself, parallel/precision.py; they are not counted here.)
- A step whose loss is not finite while its gradients were (so it was not skipped) stops
  the run too: the weights took that step.
"""

import torch

from errors import UserError


class LossWatch:
    def __init__(self, device, max_skipped=5, count_skips=True):
        zero = lambda: torch.zeros((), dtype=torch.int64, device=device)  # noqa: E731
        self.first_bad, self.bad_loss = zero(), torch.zeros((), device=device)  # 0: none yet
        self.skipped, self.in_a_row, self.run_from, self.last_skipped = zero(), zero(), zero(), zero()
        self.max_skipped, self.count_skips = max_skipped, count_skips
        self.reported = 0  # skipped steps already said on the console

    def watch(self, loss, grad_norm, step):
        skipped = ~torch.isfinite(grad_norm) if self.count_skips \
            else torch.zeros((), dtype=torch.bool, device=self.skipped.device)
        new = ~torch.isfinite(loss) & ~skipped & (self.first_bad == 0)
        self.first_bad = torch.where(new, step, self.first_bad)
        self.bad_loss = torch.where(new, loss.detach().float(), self.bad_loss)
        self.skipped = self.skipped + skipped
        self.run_from = torch.where(skipped & (self.in_a_row == 0), step, self.run_from)
        self.in_a_row = torch.where(skipped, self.in_a_row + 1, 0)
        self.last_skipped = torch.where(skipped, step, self.last_skipped)

    def read(self, loss, grad_norm, step):
        """(loss, grad_norm, {the skip figures for the record}), in one read with the
        watch; raises if a loss was not finite in a step that was not skipped, or if
        max_skipped steps in a row were skipped."""
        values = torch.stack([loss.detach().double(), grad_norm.detach().double(),
                              self.first_bad.double(), self.bad_loss.double(),
                              self.skipped.double(), self.in_a_row.double(),
                              self.run_from.double(), self.last_skipped.double()]).tolist()
        loss, grad_norm, first_bad, bad_loss, skipped, in_a_row, run_from, last = values
        if first_bad:
            raise UserError(f"training loss became {bad_loss} at step {int(first_bad)}: "
                            "lower trainer.lr or raise trainer.warmup_steps")
        if in_a_row >= self.max_skipped:
            raise UserError(
                f"the gradients were not finite (inf or NaN) in {int(in_a_row)} steps in a row, "
                f"from step {int(run_from)}: every rank skipped them and the weights are those "
                f"of step {int(run_from) - 1}; stopping (trainer.max_skipped_steps="
                f"{self.max_skipped}). Lower trainer.lr or raise trainer.warmup_steps")
        figures = {}
        if skipped:  # fields of runs that skipped a step, only
            figures = {"skipped_steps": int(skipped), "step_skipped": int(last == step)}
            if skipped > self.reported:
                figures["skipped_note"] = (f"{int(skipped - self.reported)} step(s) skipped "
                                           f"(gradients not finite), the last at step {int(last)}")
                self.reported = int(skipped)
        return loss, grad_norm, figures
