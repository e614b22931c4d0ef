"""The tensor-parallel dimension (`parallel.tp`, `parallel.sequence_parallel`): Megatron's
column / row linears, vocabulary-parallel embedding and loss, sequence parallelism.

    apply.py   swaps the model plan's layers for TP ones; Placements; the layout rules
    layers.py  the TP layers and the two random streams (shared / own per TP rank)
    ops.py     f, g, sequence gather / scatter and the vocabulary-parallel cross-entropy

May import: parallel/'s root files (model_plan, placement, grid) only.
"""
