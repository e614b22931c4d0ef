"""Text generation from a trained model: `kv_cache.generate`, the sampler mode=sample and
the sample after training use."""
