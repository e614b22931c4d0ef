"""Gradient hooks that do not keep their strategy alive.

`Tensor.register_post_accumulate_grad_hook` stores the hook in the parameter's C++
autograd metadata, which Python's garbage collector cannot see into. A hook that holds
its strategy (a bound method, a closure over `self`) thus closes a cycle parameter ->
hook -> strategy -> model -> parameter that no `gc.collect()` breaks: the model, its
gradient buffers and the strategy's process groups outlive the run in any process that
runs another (a notebook, the tests' job server), and each gloo group's thread keeps
waking every 10 ms. The hook here holds the strategy weakly and nothing else (not the
parameter, not a unit holding it: either closes the same cycle); the strategy's owner
(the trainer) keeps it alive while it trains.
"""

import weakref


def on_grad_accumulated(param, method):
    """Call `method(param)` (a bound method of a strategy) each time backward has
    accumulated `param`'s gradient, without the hook keeping the method's object alive.
    Returns the hook's handle."""
    owner, func = weakref.ref(method.__self__), method.__func__

    def hook(accumulated):  # the parameter, passed in by autograd: never held here
        strategy = owner()
        if strategy is not None:
            func(strategy, accumulated)
    return param.register_post_accumulate_grad_hook(hook)
