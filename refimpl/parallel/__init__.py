"""One folder per parallelism: its mechanism, its strategy and PyTorch's twin together."""
