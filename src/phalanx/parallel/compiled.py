"""``px.DataParallel`` under ``torch.compile``: graph breaks where buckets begin, so that the
reduction still overlaps backward.

A compiled region's backward is one autograd node that hands over all of its gradients when it
ends, so a model compiled as one graph would launch every bucket after the whole backward (no
overlap, and nothing says so). Breaking the forward before the module that holds each bucket's
first parameter gives a region per bucket, as Dynamo's DDPOptimizer does for DDP: the last
region's backward ends, its bucket is sent, and the earlier regions' backward runs meanwhile.
Parameters are assumed to be registered in the order forward uses them (DDP assumes the same).
In eager mode the hooks do nothing.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

T = TypeVar("T")


def eager(function: Callable[..., T]) -> Callable[..., T]:
    """``function``, run eagerly even where a compiled region calls it (Dynamo does not trace it).

    ``torch.compiler.disable`` is applied at the call, and only while compiling: applying it at
    import would import Dynamo, a second of start-up for every process that never compiles.
    """
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> T:
        if torch.compiler.is_compiling():
            return torch.compiler.disable(function)(*args, **kwargs)
        return function(*args, **kwargs)
    return call


@eager
def _graph_break() -> None:
    """Nothing; run outside the graph, a call ends the compiled graph where it is made."""


def _break_before(module: nn.Module, args: Any) -> None:
    _graph_break()


def break_at_buckets(module: nn.Module, params: Sequence[nn.Parameter],
                     buckets: Sequence[Sequence[int]]) -> list[RemovableHandle]:
    """Forward pre-hooks that break a compiled graph before each bucket's first parameter's module
    (``buckets``: indices into ``params``); remove them when the buckets change."""
    owner = {id(param): child for child in module.modules() for param in child.parameters(recurse=False)}
    firsts = sorted({min(bucket) for bucket in buckets if bucket} - {0})
    starts = {id(owner[id(params[index])]): owner[id(params[index])] for index in firsts}
    return [child.register_forward_pre_hook(_break_before) for child in starts.values()
            if not isinstance(child, torch.jit.ScriptModule)]  # TorchScript takes no hooks (nor compiles)
