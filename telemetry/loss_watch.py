"""Whether a training loss became inf or NaN, and at which step, kept on the device: a
step's loss is read only at the steps the trainer logs or saves (one host read for all
its values), not after every step, where on a GPU it would wait for the step."""

import torch

from errors import UserError


class LossWatch:
    def __init__(self, device):
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)  # 0: none yet
        self.bad_loss = torch.zeros((), device=device)

    def watch(self, loss, step):
        new = ~torch.isfinite(loss) & (self.first_bad == 0)
        self.first_bad = torch.where(new, step, self.first_bad)
        self.bad_loss = torch.where(new, loss.detach().float(), self.bad_loss)

    def read(self, loss, grad_norm):
        """(loss, grad_norm) as floats, in one read with the watch; raises if some step's
        loss since the start was not finite."""
        values = torch.stack([loss.detach().double(), grad_norm.detach().double(),
                              self.first_bad.double(), self.bad_loss.double()]).tolist()
        if values[2]:
            raise UserError(f"training loss became {values[3]} at step {int(values[2])}: "
                            "lower trainer.lr or raise trainer.warmup_steps")
        return values[0], values[1]
