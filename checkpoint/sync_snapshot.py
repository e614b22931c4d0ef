"""trainer.snapshot_async=false: every rank writes its part of a save now and waits for its
commit (snapshot_writer.save_sharded). AsyncSnapshots' interface (async_snapshot.py), so
the trainer calls either alike: here nothing is ever in flight."""

from checkpoint.snapshot_writer import save_sharded


class SyncSnapshots:
    def __init__(self, path, grid, keep):
        self.path, self.grid, self.keep = path, grid, keep

    def save_step(self, step, pieces, meta, final):
        """Collective; returns the record's figures beyond snapshot_ms: none."""
        save_sharded(self.path, self.grid, step, pieces, keep=self.keep, meta=meta)
        return {}

    def flags(self):
        return ()  # nothing for the end-of-step all-reduce to carry

    def advance(self, agreed):
        pass

    def drain(self):
        pass

    def close(self):
        return None
