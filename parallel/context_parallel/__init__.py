"""The context-parallel dimension (`parallel.cp`): every sequence split over cp ranks.

    apply.py           the zigzag split of micro-batches, the true positions, the ring
                       installed as every block's attention; the layout rules
    ring_attention.py  causal ring attention over the zigzag chunks, forward and backward
                       as one autograd Function, merged by log-sum-exp in fp32
    allgather_attention.py  the reference (`parallel.cp_impl=allgather`): all-gather K and
                       V, attend on the true positions; reduce-scatter their gradients

May import: parallel/'s root files (model_plan, grid; comm through the context it is
given) and its own files; no other dimension, nothing outside parallel/.
"""
