"""PipeDream's asynchronous pipeline, and why it must stash weights (seed 001: PipeDream).

Our 1F1B is PipeDream-*Flush* (Narayanan et al. 2021): every micro-batch of a step sees the same
weights, and the step ends with a flush (the bubble, (p-1)/(m+p-1) of it). PipeDream proper
(Narayanan et al. 2019, "PipeDream: Generalized Pipeline Parallelism for DNN Training", sec. 3.3)
never flushes: a stage updates its weights after every backward and keeps forwarding new inputs.
In the steady state of the 1F1B order, stage s has d = p - s inputs in flight, so between the
forward of input i and its backward the stage applies d - 1 updates (the backwards of the inputs
ahead of it). Without care, the backward of i would use weights its forward never saw:

  no stashing    backward with the *current* weights and the activations saved by the forward:
                 the gradient of no function at all (the Jacobians belong to another version);
  stashing       the stage keeps the version each in-flight forward used and runs that input's
                 backward with it: the exact gradient of the version that computed the forward,
                 at the price of d weight versions on stage s (p of them on the first stage).
                 PipeDream-2BW (Narayanan et al. 2021) caps that at two, updating less often.

`updates_between` reads d - 1 from a schedule row (how many backwards run between an input's F
and its B); `stash_versions` is the row's most inputs in flight (refimpl.lab.pipeline.simulate).
`stale_gradient_error` runs one stage (a tanh MLP, backward written out by hand so that the
weights it uses can be chosen) through those updates and compares both backwards with autograd's
gradient at the forward's version.
"""
from __future__ import annotations

import torch

from refimpl.lab.pipeline.simulate import flat, in_flight
from refimpl.parallel.pp.schedules import Action


def updates_between(row: list[str]) -> dict[int, int]:
    """Micro-batch -> the backwards this stage runs between its F and its B (each one an update
    under PipeDream's per-input updates)."""
    done_b, at_f = 0, {}
    result = {}
    for a in map(Action.parse, flat(row)):
        if a.kind == "F":
            at_f[a.micro_batch] = done_b
        elif a.kind == "B":
            result[a.micro_batch] = done_b - at_f[a.micro_batch]
            done_b += 1
    return result


def stash_versions(row: list[str]) -> int:
    """Weight versions a stage must keep: one per input in flight (forward done, backward not)."""
    return max(in_flight(row))


def _forward(A, B, x):
    h = torch.tanh(x @ A.T)
    return h, h @ B.T


def _backward(A, B, x, h, dy):
    """The stage's gradients by hand, with the weights given (not necessarily the forward's)."""
    dB = dy.T @ h
    dpre = (dy @ B) * (1 - h * h)
    return dpre.T @ x, dB


def stale_gradient_error(updates: int, *, width: int = 16, rows: int = 8, lr: float = 0.05,
                         seed: int = 0) -> dict[str, float]:
    """Relative error of input 0's weight gradient, with and without stashing, when `updates`
    SGD steps (on the gradients of the inputs behind it) happen between its forward and backward."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(width, width, generator=g, dtype=torch.float64) / width ** 0.5
    B = torch.randn(width, width, generator=g, dtype=torch.float64) / width ** 0.5
    inputs = [torch.randn(rows, width, generator=g, dtype=torch.float64) for _ in range(updates + 1)]
    targets = [torch.randn(rows, width, generator=g, dtype=torch.float64) for _ in range(updates + 1)]

    def dy_of(y, t):                       # d(mean squared error)/dy
        return 2 * (y - t) / y.numel()

    stash = (A.clone(), B.clone())
    h0, y0 = _forward(A, B, inputs[0])
    saved = (inputs[0], h0, dy_of(y0, targets[0]))
    for i in range(1, updates + 1):        # the stage's weights move `updates` times meanwhile
        h, y = _forward(A, B, inputs[i])
        dA, dB = _backward(A, B, inputs[i], h, dy_of(y, targets[i]))
        A, B = A - lr * dA, B - lr * dB

    a0, b0 = (w.clone().requires_grad_() for w in stash)
    _, y = _forward(a0, b0, inputs[0])
    ((y - targets[0]) ** 2).mean().backward()          # the true gradient at the forward's version
    truth = torch.cat([a0.grad.flatten(), b0.grad.flatten()])

    def error(weights) -> float:
        got = torch.cat([t.flatten() for t in _backward(*weights, *saved)])
        return float((got - truth).norm() / truth.norm())

    return {"stashed": error(stash), "current weights": error((A, B))}
