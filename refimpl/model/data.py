"""The data: a deterministic, learnable synthetic stream, the same global batch on every rank; a
data-parallel rank takes its rows with `Batch.shard`, and cuts them with `micro_batches`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from refimpl.model.gpt import GPTConfig


@dataclass(frozen=True)
class Batch:
    """One global batch of token ids: `inputs[b, t]` predicts `targets[b, t]` (= inputs shifted)."""
    inputs: torch.Tensor
    targets: torch.Tensor

    def shard(self, index: int, count: int) -> "Batch":
        """Rows [index*B/count, (index+1)*B/count): this data-parallel rank's view."""
        rows = self.inputs.shape[0]
        if rows % count:
            raise ValueError(f"global batch {rows} is not divisible by {count}")
        per = rows // count
        return Batch(self.inputs[index * per:(index + 1) * per],
                     self.targets[index * per:(index + 1) * per])

    def micro_batches(self, count: int) -> list["Batch"]:
        """Split into `count` equal micro-batches (gradient accumulation, pipeline schedules)."""
        return [self.shard(i, count) for i in range(count)]

    def to(self, device) -> "Batch":
        return Batch(self.inputs.to(device), self.targets.to(device))


def synthetic_batch(cfg: GPTConfig, global_batch: int, seq_len: int, seed: int, step: int) -> Batch:
    """A deterministic, learnable global batch for `step`, identical on every rank."""
    if seq_len > cfg.seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the model's position table ({cfg.seq_len})")
    perm = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    tokens = torch.empty(global_batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab_size, (global_batch,), generator=g)
    for t in range(seq_len):
        tokens[:, t + 1] = perm[tokens[:, t]]
    noise = torch.rand(global_batch, seq_len + 1, generator=g) < 0.1
    tokens[noise] = torch.randint(cfg.vocab_size, (int(noise.sum()),), generator=g)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
