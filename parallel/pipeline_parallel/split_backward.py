"""A chunk's backward in two parts, for the zero-bubble schedules (Qi et al., 2023):

- B, `backward_input`: the gradient of the chunk's input only, which the previous
  stage waits for (the critical path);
- W, `backward_weight`, later: the gradients of the chunk's parameters, which
  nothing downstream waits for, so a schedule can put them into its bubbles.

Both run autograd on the graph the chunk's forward built; nothing about the
model changes. B asks autograd for the input's gradient only (retaining the
graph), so each matmul computes its input gradient and skips its weight
gradient. Where a parameter's gradient branches off the input's path (the
"intermediate" nodes: a linear's matmul, a LayerNorm, the embedding sum), a
hook keeps the gradient flowing into that node. W then restarts autograd at
exactly those nodes with the kept gradients, once per group of parameters
sharing them, and follows only the edges to the parameters: no input gradient
is computed twice, and parameters and their gradients are exactly those of the
unsplit backward (the same kernels on the same operands; only when each runs
changes).

W accumulates through autograd (`torch.autograd.backward(..., inputs=params)`),
so `.grad` is accumulated in place and post-accumulate-grad hooks fire as in a
plain backward: the data-parallel strategies' gradient sync keys on those, and
so starts after a parameter's last W, not after its last B.

Between B and W a chunk keeps what its weight gradients need (the inputs of
its matmuls and the gradients kept at the intermediates); W frees them.
PyTorch's `torch.distributed.pipelining` does the same split
(`_backward.stage_backward_input/weight`); this is our own, smaller version.
"""

import collections

import torch
from torch.autograd.graph import GradientEdge


def _node(t):
    """The autograd node producing t's gradient: its grad_fn, or a leaf's AccumulateGrad."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's accumulator, made on demand


def _consumers(roots):
    """{node: [nodes that feed it a gradient]} over the graph below `roots` (edges reversed)."""
    users, queue, seen = collections.defaultdict(list), collections.deque(roots), set(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            users[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return users


def _reach(starts, users, stop=frozenset()):
    """Nodes reached from `starts` towards the outputs, and the `stop` nodes met on the way
    (not crossed)."""
    reached, met, queue = set(starts), set(), collections.deque(starts)
    while queue:
        for user in users[queue.popleft()]:
            if user in stop:
                met.add(user)
            elif user not in reached:
                reached.add(user)
                queue.append(user)
    return reached, met


def _weight_groups(output, inp, params):
    """[(params, intermediate nodes)]: each parameter with the nodes of the input's
    gradient path where its own gradient branches off; parameters sharing one are grouped
    (a W restarts autograd once per group, so no node runs twice)."""
    users = _consumers([output.grad_fn])
    on_input_path, _ = _reach([_node(inp)], users)
    groups = []  # [[parameter positions, intermediate nodes]]
    for k, p in enumerate(params):
        _, met = _reach([_node(p)], users, stop=on_input_path)
        if not met:
            continue  # not used by this chunk
        group = [{k}, set(met)]
        for other in [g for g in groups if g[1] & met]:
            group[0] |= other[0]
            group[1] |= other[1]
            groups.remove(other)
        groups.append(group)
    return [([params[k] for k in sorted(ks)], list(nodes)) for ks, nodes in groups]


class DeferredWeightGrad:
    """What B leaves for W: the kept gradients at each group's intermediates, and
    `then`: (tensor, its gradient) to backward last (the embedding below a first
    chunk's blocks: pipeline.py), or None."""

    def __init__(self, groups, kept):
        self.groups, self.kept, self.then = groups, kept, None


def backward_input(output, grad, inp, params):
    """B: returns (the gradient of `inp`, a DeferredWeightGrad for backward_weight).
    output: the chunk's output (or its scaled loss, with grad None); inp: the leaf the
    chunk's layers start from, requiring grad; params: the chunk's parameters."""
    groups = _weight_groups(output, inp, params)
    kept = {}
    handles = [node.register_prehook(lambda grads, node=node: kept.__setitem__(node, grads))
               for _, nodes in groups for node in nodes]
    try:
        (inp_grad,) = torch.autograd.grad(output, inp, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return inp_grad, DeferredWeightGrad(groups, kept)


def backward_weight(deferred, quiet=()):
    """W: accumulate the parameters' gradients into .grad (their hooks fire), then free
    the graph. quiet: parameters whose gradient is added without firing their hooks
    (zbv's tied weight in the LM head's W: pipeline.py); each must be alone in its group."""
    quiet = {id(p) for p in quiet}
    for params, nodes in deferred.groups:
        edges, grads = [], []
        for node in nodes:
            for i, g in enumerate(deferred.kept.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue  # no gradient reached this group (e.g. a masked-out branch)
        # several intermediates in one group: a node below another would receive the
        # gradient twice (kept, and again from the upper one); keep each at what B saw
        pins = [node.register_prehook(lambda grads, kept=deferred.kept[node]: kept)
                for node in nodes if node in deferred.kept] if len(nodes) > 1 else []
        try:
            if any(id(p) in quiet for p in params):
                assert all(id(p) in quiet for p in params), "a quiet parameter shares its group"
                for p, g in zip(params, torch.autograd.grad(edges, params, grads)):
                    p.grad = g if p.grad is None else p.grad.add_(g)
            else:
                torch.autograd.backward(edges, grads, inputs=params)
        finally:
            for h in pins:
                h.remove()
    if deferred.then is not None:
        tensor, grad = deferred.then
        tensor.backward(grad)
    deferred.groups = deferred.kept = deferred.then = None
