"""The plain run (ft.enabled off) as a replica group: alone, it computes the whole batch
(the one share of one), sums across no one and commits every step. The trainer calls it
as it calls a ReplicaGroup (replica_group.py): one loop, with or without fault tolerance."""


class OneGroup:
    replicas = 1  # the shares a step's global batch is cut into

    def begin_step(self, step):
        return step, [0]  # no quorum: the trainer's step, the whole batch

    def next_shares(self):
        return [0]  # known before the next step starts: its batch is read ahead

    def sum_across(self, loss, grads):
        return loss

    def commit(self):
        return True

    def stepped(self, more):
        pass  # no quorum to start

    def figures(self):
        return {}, False  # no field for the record, nothing that makes it written

    def writes_snapshots(self):
        return True

    def close(self):
        pass
