"""DeepSeek-V3's auxiliary-loss-free balancing (`model.moe_bias_rate` > 0): each MoE block
has a per-expert bias added to the router's scores for the choice only (never to the
weights), and after every optimizer step each bias moves by the rate towards balance:

    bias_e += rate x sign(mean_e' count_e' - count_e)

with count_e the choices of expert e over the step's whole global batch. Every rank
holds the biases of every MoE block (E floats each, also of blocks on other pipeline
stages): the counts are summed over the world in one all-reduce of (blocks x E) per step,
and every rank applies the same update, so the biases agree everywhere and travel in the
snapshot's manifest (`state`), whatever the layout that reads it.
"""

import torch


class ChoiceBalancer:
    def __init__(self, layers, blocks, num_experts, rate, grid, comm):
        """layers: [(canonical block index, MoE layer)] this rank holds; blocks: every MoE
        block's canonical index, on every rank alike."""
        self.layers, self.blocks, self.rate = layers, blocks, rate
        self.grid, self.comm = grid, comm
        self.bias = torch.zeros(len(blocks), num_experts, device=grid.device)
        self._install()

    def _install(self):
        for i, moe in self.layers:
            moe.choice_bias = self.bias[self.blocks.index(i)]

    @torch.no_grad()
    def step(self, skipped=None):
        """After an optimizer step: the step's counts, summed over the world; the biases
        move (a collective, on every rank), unless `skipped` (a 0-d bool tensor: the step's
        gradients were not finite, parallel/finite.py)."""
        counts = torch.zeros(len(self.blocks), self.bias.size(1), dtype=torch.float64,
                             device=self.bias.device)
        for i, moe in self.layers:
            if moe.stats["forwards"]:
                counts[self.blocks.index(i)] = moe.stats["counts"].to(counts)
        if self.grid.world_size > 1:
            self.comm.all_reduce(counts)
        # on the device, nothing read: a step makes no host sync for it
        move = self.rate * torch.sign(counts.mean(1, keepdim=True) - counts).float()
        self.bias += move if skipped is None else torch.where(skipped, 0.0, move)

    def state(self) -> dict:
        """{canonical block index: [E floats]}: exact (float32 values in JSON's doubles).
        Read at snapshot steps only."""
        return {str(b): row.tolist() for b, row in zip(self.blocks, self.bias.cpu())}

    def load_state(self, state):
        if state:
            for b, row in state.items():
                self.bias[self.blocks.index(int(b))] = torch.tensor(row, device=self.bias.device)
