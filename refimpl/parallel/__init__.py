"""One folder per parallelism: the mechanism and its strategies (PyTorch's twins: refimpl/lab/twins/)."""
