"""`trainer.compile`: torch.compile each transformer block, after the model is parallelized.

Why per block (torchtitan's way) rather than the whole model in one call (nanoGPT's):
our strategies work *between* blocks. fsdp stage 3 all-gathers a block's parameters
in a forward pre-hook and frees them after its forward; ddp_bucket and fsdp launch
their collectives from gradient hooks; a pipeline stage is a run of blocks driven by
its own schedule. So what is compiled is each block's `forward` (the instance
attribute, as activation checkpointing replaces it): module hooks keep running
outside the compiled code, and the parameters' gradient hooks fire from autograd as
before. A compiled block's backward is one autograd node, so its parameters'
gradients become ready together when it ends (buckets still launch during backward,
block by block). Every block runs the same code on parameters of the same shapes,
and dynamo lifts parameters to graph inputs: all blocks share one compiled graph,
so start-up pays for one block, not for n_layer of them.

Inside a block, tensor parallelism's f / g and sequence gather / scatter, context
parallelism's attention and TP's switches of random stream are marked
`eager_under_compile` where they are defined (torch.compiler.disable, applied when
compilation starts): dynamo cannot trace a generator's
state, and a collective traced into a graph would be counted by parallel/comm.py
once at trace time, never per step. The block then compiles into the pieces between
them, and those run eagerly through the counted comm, in the same order on every rank.

`trainer.compile_scope=model` compiles the GPT's whole forward in one graph
(nanoGPT's `torch.compile(model)`), for `single` on one process only: it is the
benchmark's bound for what per-block compilation can reach.

A piece recompiles when what its guards check changes: the input's shape (the
evaluation batch, a pipeline's micro-batch), grad mode and the training flag
(evaluation). CompileEvents counts compilations per code object (metrics.jsonl:
`compile_recompiles`, ...); dynamo's recompile limit raises instead of silently
running that code eagerly (`fail_on_recompile_limit_hit`).
"""

import re
import time
from collections import Counter

import torch

from parallel import model_plan as plan

_EAGER = []  # (module, qualified name) of every function marked eager_under_compile


def eager_under_compile(fn):
    """Mark `fn` (a module's function or a class's method) to run eagerly between compiled
    pieces: compile_model replaces it by torch.compiler.disable(fn) before compiling.

    Not at import: torch.compiler.disable imports dynamo, about 1.5 s of CPU in every
    process (half a small job's start-up), which a run without trainer.compile never
    needs. So callers reach `fn` through its module or class at call time
    (`ops.copy_to_tp(...)`, `self.random.enter_own()`, a global of its own module), never
    through a name imported before compilation started."""
    _EAGER.append((fn.__module__, fn.__qualname__))
    return fn


def _disable_marked():
    """torch.compiler.disable every function marked so far, where it is defined."""
    import importlib
    for module, qualname in _EAGER:
        *path, name = qualname.split(".")
        owner = importlib.import_module(module)
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, name)
        if not getattr(fn, "_torchdynamo_disable", False):
            setattr(owner, name, torch.compiler.disable(fn))


def compile_model(gpt, backend, scope="block"):
    """Compile every block of `gpt` this rank holds (a pipeline stage's too), or, with
    scope "model", its whole forward. Idempotent. Returns the process's CompileEvents."""
    _disable_marked()
    events = compile_events()
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # a storm fails, never runs eager
    targets = [gpt] if scope == "model" else [block for _, block in plan.blocks(gpt)]
    for module in gpt.modules():  # what must run eagerly once before tracing (moe/experts.py)
        if hasattr(module, "before_compile"):
            module.before_compile()
    for module in targets:
        if not getattr(module, "compiled", False):
            module.forward = torch.compile(module.forward, backend=backend, dynamic=False)
            module.compiled = True
    return events


class CompileEvents:
    """Time dynamo spends compiling and how often it compiles each code object, from its
    compile callbacks (the whole process: one per rank)."""

    def __init__(self):
        from torch._dynamo.callback import CallbackTrigger
        self.trigger = CallbackTrigger.DYNAMO  # a new frame (not a deferred backward)
        self.per_code = Counter()  # dynamo's frame id -> compilations
        self.seconds, self.depth, self.started = 0.0, 0, 0.0
        self.listen()

    def listen(self):
        """(Re-)register with dynamo: torch._dynamo.reset() drops every callback."""
        from torch._dynamo.callback import callback_handler
        if self._start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)
            self.per_code.clear()  # after a reset dynamo numbers code objects from 0 again
            self.depth = 0

    def _start(self, args):
        if self.depth == 0:
            self.started = time.perf_counter()
        self.depth += 1
        found = re.search(r"(\d+)/\d+", args.compile_id or "")
        if args.callback_trigger == self.trigger and found:
            self.per_code[found.group(1)] += 1

    def _end(self, args):
        self.depth -= 1
        if self.depth == 0:
            self.seconds += time.perf_counter() - self.started

    def pop_ms(self) -> float:
        """Milliseconds spent compiling since the last call."""
        ms, self.seconds = 1000 * self.seconds, 0.0
        return ms

    def counts(self) -> dict:
        """Since start: code objects compiled, compilations beyond each one's first, and
        the most compilations of one code object."""
        return {"compile_frames": len(self.per_code),
                "compile_recompiles": sum(n - 1 for n in self.per_code.values()),
                "compile_max_per_frame": max(self.per_code.values(), default=0)}


_events = None


def compile_events() -> CompileEvents:
    """The process's one CompileEvents (dynamo's callbacks are global)."""
    global _events
    if _events is None:
        _events = CompileEvents()
    _events.listen()
    return _events
