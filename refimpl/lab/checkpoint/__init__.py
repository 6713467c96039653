"""Checkpoint formats beside refimpl's own: torch.distributed.checkpoint conversions."""
