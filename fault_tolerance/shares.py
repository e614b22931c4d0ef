"""Which part of a step's global batch a replica group computes.

The global batch (trainer.batch_size) is cut into ft.replicas equal shares, share s being
the rows that data rank s of an R-way split would read. The live groups of a step's
quorum take them in turn: share s goes to the group of participant rank s mod live. With
every group alive each takes its own share; when one is gone the others take its share
on top of theirs (more micro-steps), so every share of every step is computed exactly
once and the run stays the one the user configured.
"""


def shares_of(replicas, participant_rank, live):
    """The shares (of 0..replicas-1) the group of `participant_rank` among `live` computes."""
    return [s for s in range(replicas) if s % live == participant_rank]


def share_micro_batches(batches, dataset, step, shares, replicas, data_rank, data_size, grad_accum):
    """This rank's micro-batches of `step`: for each of its group's shares, trainer.grad_accum
    micro-batches of this data rank's rows of it (GlobalBatches.local_micro_batches with
    the data split R times wider)."""
    micro = []
    for s in shares:
        micro += batches.local_micro_batches(dataset, step, s * data_size + data_rank,
                                             replicas * data_size, grad_accum)
    return micro
