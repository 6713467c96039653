"""What communication and compute cost: measured sweeps (`bench`), the alpha-beta model and its fit
(`alpha_beta`), the GPU datasheet presets (`hardware`), the seed's per-strategy table
(`strategy_cost`), volumes counted from traces (`volume`), and
the CUDA caching allocator's rounding (`allocator`) and fragmentation replayed (`caching_allocator`)."""
