"""Compiled decoder layers (``train.compile``): each layer of the policy run through
``torch.compile`` in the passes that train and score, as torchtitan compiles its blocks.

What compiles is a layer's forward without a KV cache: a packed micro-batch
(``train.packing``), or a padded one whose prompt and responses run together. A forward that
continues from a cache (generation on the policy itself, a shared prompt's responses) runs
eagerly: a cache's Python bookkeeping would break the graph or specialise it per layer.

One compiled function serves every layer of a class (the layer is an argument, its parameters
graph inputs) and every length (``dynamic=True``). The packed attention runs between two
graphs (:func:`dapo.models.packing.packed_attention`): its layout is host data, handed over
in an object the graph does not look into, so a new layout does not compile again.

A layer is wrapped by a :func:`functools.partial` over the layer, not a closure, so a deep
copy of the model (the generation copy of ``train.async_staleness``) runs its own layers.
A compiler error before any compiled pass has run turns compiling off for the model with a
warning, and that call and the rest run eagerly; after one, it is an error (checkpointed
layers would recompute eagerly what they saved compiled).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.exc

from dapo.dist.fsdp import decoder_layers

BACKEND = "inductor"
"""``torch.compile``'s backend: Triton kernels on a GPU, C++ on a CPU."""

CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""The names a decoder layer's KV cache argument has had in transformers (``cache`` from
5.2x, ``past_key_values`` before, ``past_key_value`` before 4.56; GPT-2's ``layer_past``)."""

RECOMPILE_LIMIT = 64
"""Compiled versions dynamo keeps of the layers' one forward: grad or not, train or eval,
LoRA adapters on or off, a mask or none each make one (its default, 8, could be reached,
and past it calls run eagerly with no more than a log line)."""

LOWER_BACKWARD_NOW = (
    {"force_non_lazy_backward_lowering": True}
    if hasattr(torch._functorch.config, "force_non_lazy_backward_lowering")
    else {}
)
"""AOTAutograd compiles a graph's backward when its forward runs, so that a failure is raised
where :func:`layer_forward` falls back (where the option exists: torch 2.13 has it)."""

COMPILER_ERRORS = (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError)
"""What a failed ``torch.compile`` raises: dynamo's errors (a backend's failure included)
and inductor's."""


class CompiledForward:
    """A layer class's forward, eager and compiled, and whether compiling is still on.

    Shared, never copied: a deep copy of the model keeps calling through it."""

    def __init__(self, forward: Callable[..., Any], backend: str) -> None:
        self.eager = forward
        self.compiled = torch.compile(forward, dynamic=True, backend=backend)
        self.on = True
        self.ran = False
        """Whether a compiled call has run: after one, falling back mid-pass would leave a
        checkpointed layer recomputing eagerly what it saved compiled."""

    def __deepcopy__(self, memo: dict) -> CompiledForward:
        return self


def compile_layers(model: torch.nn.Module, backend: str = BACKEND) -> int:
    """Wraps each decoder layer of ``model`` (:func:`decoder_layers`) so that its forwards
    without a KV cache run compiled; returns how many layers. Layers already wrapped are left
    as they are. Call it before activation checkpointing wraps the layers, so that a
    recomputation runs the compiled layer too."""
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
    shared: dict[Any, CompiledForward] = {}
    layers = decoder_layers(model)
    for layer in layers:
        if is_compiled(layer):
            continue
        forward = type(layer).forward
        if forward not in shared:
            shared[forward] = CompiledForward(forward, backend)
        layer.forward = functools.partial(layer_forward, shared[forward], layer)
    return len(layers)


def is_compiled(layer: torch.nn.Module) -> bool:
    """Whether :func:`compile_layers` wrapped ``layer`` (under activation checkpointing's
    wrapper or not)."""
    wrappers, _ = unwrapped(layer.__dict__.get("forward"))
    return any(wrapper.func is layer_forward for wrapper in wrappers)


def unwrapped(forward: Any) -> tuple[list[functools.partial], Any]:
    """The :func:`functools.partial` wrappers around a layer's ``forward``, outermost first
    (each wrapping its first argument: activation checkpointing's ``recomputed`` wraps the
    forward, :func:`layer_forward` the compiled function), and what the innermost wraps."""
    wrappers = []
    while isinstance(forward, functools.partial):
        wrappers.append(forward)
        forward = forward.args[0] if forward.args else None
    return wrappers, forward


def layer_forward(fn: CompiledForward, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``layer``'s forward: compiled unless it reads or fills a KV cache, or compiling failed."""
    cached = any(kwargs.get(name) is not None for name in CACHE_ARGUMENTS)
    if not fn.on or cached or kwargs.get("use_cache"):
        return fn.eager(layer, *args, **kwargs)
    try:
        # The backward compiled now, inside this try, not lazily in loss.backward().
        with torch._functorch.config.patch(**LOWER_BACKWARD_NOW):
            out = fn.compiled(layer, *args, **kwargs)
    except COMPILER_ERRORS as err:
        # A backend's failure wraps the compiler's own error: that one says what is missing.
        cause = getattr(err, "inner_exception", None) or err
        what = f"torch.compile failed ({type(cause).__name__}: "
        what += (str(cause).strip().splitlines() or [""])[0] + ")"
        if fn.ran:
            raise RuntimeError(
                f"train.compile: {what} after compiled passes had run; set train.compile=false"
            ) from err
        warnings.warn(
            f"train.compile: {what}; the decoder layers run eagerly from now on "
            "(train.compile=false skips compiling)",
            stacklevel=2,
        )
        fn.on = False
        return fn.eager(layer, *args, **kwargs)
    fn.ran = True
    return out
