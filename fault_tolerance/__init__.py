"""Fault-tolerant replica groups (ft.enabled): a lost group costs one step, not a restart.

A replica group is one ordinary launch of main.py (any layout inside); R of them train one
run. torchft (PyTorch's library for this) supplies what it is made for: the lighthouse
that agrees on the live groups before every step, the reconfigurable process group that
spans them, the commit vote that drops a step a group died in, and the live copy of the
training state to a group that (re)joins. The math stays ours: the global batch is dealt
to the live groups in shares, each group's own strategy reduces inside it, and the
groups' weighted gradients are summed across through torchft's group.

    config.py          the ft: keys and their rules
    lighthouse.py      mode=lighthouse (torchft's lighthouse in the foreground); waiting for it
    shares.py          which shares of a step's global batch a group computes, and reading them
    state_transfer.py  the training state a live group sends to a joining one
    logs.py            torchft's own log lines into a file of the run directory
    replica_group.py   the step's quorum, the sum across groups, the commit, membership lines
    buckets.py         the gradients cut into the buckets that the sum across groups sends
    one_group.py       the plain run's group (ft.enabled off): the whole batch, always committed

May import: errors, parallel/placement.py (the state a rank holds), and torchft (only
replica_group.py and lighthouse.py, lazily: a run without ft.enabled never imports it).
Wired in by main.py (the group, mode=lighthouse) and trainer.py (the step).
"""
