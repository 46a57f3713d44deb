"""PyTorch helpers for :meth:`trainhealth.Monitor.log_step`: the global gradient norm as a float.

``import trainhealth.collectors.integrations.torch`` imports torch; ``import collectors`` does not.

When to read the value: ``.item()`` (and so both functions here, on a CUDA tensor) waits
until the GPU has finished all queued work. Read it **after** ``optimizer.step()``, once per
step, together with ``loss.item()``: the CPU then stalls only at the end of the step instead
of between backward and the optimizer, where it would stop queueing kernels ahead of the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["global_grad_norm", "grad_norm_value"]


def global_grad_norm(parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0) -> float:
    """Global norm of the parameters' gradients, as ``torch.nn.utils.clip_grad_norm_`` computes it, without clipping.

    The norm of the vector of per-parameter gradient norms (the same as the norm of all
    gradients concatenated into one vector); ``norm_type=inf`` gives the largest absolute
    gradient entry. Parameters without a gradient are skipped. The source is torch's own
    ``torch.nn.utils.get_total_norm`` (what ``clip_grad_norm_`` itself calls, where torch
    has it), else the same computation written out (per-tensor ``torch.linalg.vector_norm``, moved
    to the first gradient's device, then the norm of those norms).

    Call it after ``backward()``. With DDP the gradients are already all-reduced then, so
    every rank gets the same, global value. With sharded gradients (FSDP, ZeRO) each rank
    holds only its shard: use the value the framework's clip function returns instead.
    Reading the result synchronises with the GPU (see the module docstring).

    Parameters
    ----------
    parameters : iterable of torch.Tensor, or torch.Tensor
        Typically ``model.parameters()``; a generator is consumed.
    norm_type : float
        Order of the p-norm (``2.0``; ``float("inf")`` for the max-norm).

    Returns
    -------
    float
        The total norm (``0.0`` when no parameter has a gradient; NaN/Inf kept, as the
        NaN/Inf detector needs them).

    Examples
    --------
    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> global_grad_norm([w]), global_grad_norm([w], float("inf"))
    (5.0, 4.0)
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    with torch.no_grad():
        total = total_norm(grads, norm_type) if total_norm is not None else _total_norm(grads, norm_type)
    return float(total.item())


def _total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    # Older torch without get_total_norm: clip_grad_norm_'s computation without foreach kernels.
    norm_type = float(norm_type)
    first = grads[0].device
    norms = [torch.linalg.vector_norm(g, norm_type).to(first) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def grad_norm_value(x: Any) -> float | None:
    """The total norm ``clip_grad_norm_`` returned (a 0-d tensor), or a number, as a Python float.

    ``None`` stays ``None`` (no norm this step). A CUDA tensor is copied to the host, which
    waits for the GPU: call it after ``optimizer.step()`` (see the module docstring).

    Raises
    ------
    TypeError
        When ``x`` is neither a number, a one-element tensor nor None.
    ValueError
        When ``x`` is a tensor with more than one element.

    Examples
    --------
    >>> grad_norm_value(torch.tensor(2.5)), grad_norm_value(3), grad_norm_value(None)
    (2.5, 3.0, None)
    """
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"grad norm tensor has {x.numel()} elements (shape {tuple(x.shape)}); expected one")
        return float(x.detach().item())
    if isinstance(x, bool) or not hasattr(x, "__float__"):  # numbers, numpy scalars
        raise TypeError(f"grad norm {x!r} of type {type(x).__name__} is not a number or a tensor")
    return float(x)
