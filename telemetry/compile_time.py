"""trainer.compile in the metrics record, from parallel/compile.py's CompileEvents (given):
compile_ms (of step_ms: a step that compiled is always written), val_compile_ms
(evaluation compiles for its own mode and shape), compilations per code object."""


class CompileTime:
    def __init__(self, events):
        """events: the process's CompileEvents; None without trainer.compile (no fields)."""
        self.events = events
        if events is not None:
            events.pop_ms()  # this process's earlier compiles are not this run's

    def figures(self):
        """(fields for the step's record, whether it compiled: then it is written)."""
        if self.events is None:
            return {}, False
        ms = self.events.pop_ms()
        return {"compile_ms": ms, **self.events.counts()}, bool(ms)

    def after_eval(self):
        """Fields for the record of a step that evaluated."""
        if self.events is None:
            return {}
        return {"val_compile_ms": self.events.pop_ms(), **self.events.counts()}
