"""Training-speed machinery for the draft layer: shared matmul casts, weight gradients summed in place over TTT steps, recomputation, compilation on CUDA."""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run a matmul on x in (x's own dtype outside autocast)."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def recomputed(fn, *args):
    """fn(*args), keeping only args for backward and recomputing fn there when gradients are being recorded.

    For cheap elementwise stretches (norms, casts, SiLU): the backward then holds bf16 inputs instead of the fp32
    intermediates autograd would keep; the forward values and the gradients are bitwise those of fn itself.
    """
    if torch.is_grad_enabled() and any(a.requires_grad for a in args if isinstance(a, torch.Tensor)):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


class _SharedCast(torch.autograd.Function):
    """One consumer's view of a cast made once; its gradient returns in the source dtype, as autocast's own cast would."""

    @staticmethod
    def forward(ctx, source, cast):
        ctx.source_dtype = source.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.source_dtype), None


def matmul_inputs(x: torch.Tensor, consumers: int) -> list[torch.Tensor]:
    """x in the matmul dtype for each of `consumers` matmuls, from a single cast.

    Autocast would cast x once per matmul and keep each copy for backward; sharing one copy saves that memory,
    and each consumer's gradient is still summed in x's dtype (fp32), so the gradients are bitwise autocast's.
    """
    dtype = matmul_dtype(x)
    if dtype == x.dtype:
        return [x] * consumers
    cast = x.detach().to(dtype)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return [cast] * consumers
    return [_SharedCast.apply(x, cast) for _ in range(consumers)]


class SharedWeightGrad:
    """The gradient of one weight that every TTT step uses, summed by matmuls that add into one buffer (beta=1).

    Autograd would form each step's gradient on its own and add them in separate kernels: about 100 bf16 adds, 4.6 ms
    of a 150 ms step in an H200 profile. Here the first backward to run hands its buffer to autograd and the later
    ones add into it in place. That is safe because autograd reads the buffer only in the node that consumes the
    weight's gradient (its cast), which waits for every use's backward.
    """

    def __init__(self):
        self.grad: torch.Tensor | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
        """a @ b added to the weight's gradient; the buffer for autograd on the first call, None after."""
        if self.grad is None:
            self.grad = torch.matmul(a, b)
            return self.grad
        self.grad.addmm_(a, b)
        return None


class _SharedGradLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, shared):
        ctx.save_for_backward(x, weight)
        ctx.shared = shared
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = torch.matmul(grad, weight) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = ctx.shared.add(grad.reshape(-1, grad.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None


class StepWeights:
    """The draft layer's linear weights during one unrolled training forward: each cast to the matmul dtype once
    (autocast would do that too) and its gradient summed over the steps by SharedWeightGrad."""

    def __init__(self):
        self._weights: dict[nn.Module, tuple[torch.Tensor, SharedWeightGrad]] = {}

    def weight(self, module: nn.Module | tuple[nn.Module, ...], dtype: torch.dtype
               ) -> tuple[torch.Tensor, SharedWeightGrad]:
        """The module's weight in dtype; for a tuple of modules, their weights stacked along the outputs (one matmul
        for linears that read one input)."""
        if module not in self._weights:
            w = torch.cat([m.weight for m in module]) if isinstance(module, tuple) else module.weight
            self._weights[module] = (w.to(dtype), SharedWeightGrad())
        return self._weights[module]

    def linear(self, module: nn.Linear | tuple[nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
        """module(x) without bias, in the dtype autocast would pick; for a tuple of modules, their outputs
        concatenated along the last dimension, from one matmul."""
        weight, shared = self.weight(module, matmul_dtype(x))
        x = x.to(weight.dtype)
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
            return _SharedGradLinear.apply(x, weight, shared)
        return torch.matmul(x, weight.t())


def project(module: nn.Linear, x: torch.Tensor, steps: StepWeights | None) -> torch.Tensor:
    """module(x), through the training forward's StepWeights when there is one."""
    return module(x) if steps is None else steps.linear(module, x)


def project_each(modules: tuple[nn.Linear, ...], x: torch.Tensor, steps: StepWeights | None) -> list[torch.Tensor]:
    """[m(x) for m in modules]. In the training forward one matmul over the stacked weights, split into views: fewer
    kernels for the host to issue, and the narrow k and v projections run at the efficiency of a wide one."""
    if steps is None:  # one cast of x shared by all of them (matmul_inputs)
        return [m(to_m) for m, to_m in zip(modules, matmul_inputs(x, len(modules)))]
    return list(steps.linear(modules, x).split([m.out_features for m in modules], dim=-1))


COMPILE_DEVICES = ("cuda",)  # where compiled_on_device compiles; CPU runs (and CI) need no C compiler


def compiled_on_device(fn):
    """fn, run through torch.compile (inductor, dynamic shapes) when its first argument lives on a device in
    COMPILE_DEVICES, eagerly elsewhere. For elementwise stretches that eager PyTorch runs as one pass over memory per
    op (norms, SiLU, rotary, the loss over the draft vocabulary): compiled, each is a kernel or two. Dynamic shapes,
    because token counts differ per batch and per TTT step, and recompiling for each would hit dynamo's limit."""
    compiled = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled
        if args[0].device.type not in COMPILE_DEVICES:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args)

    return run
