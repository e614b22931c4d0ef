"""Mixture-of-experts blocks, single-device: a router and grouped experts that replace a
block's MLP when `model.moe_experts` > 0 (model.py builds them; parallel/expert_parallel/
splits the experts across ranks from the outside, as the other dimensions do)."""
