"""The only place zeroinf registers hooks on the user's modules and parameters.

Hook actions are idempotent where they can be re-entered (a parameter reused twice in one forward
still reports its gradient once: autograd sums into the leaf before AccumulateGrad runs).

Every hook runs eagerly under `torch.compile` (`eager`): the compiler breaks its graph at each
hook and compiles the modules' own code between them. Traced instead, the hooks would put the
engine's state (which shard is where, locks, I/O handles) into the compiler's guards: a recompile per
unit until torch's recompile limit sends the whole forward back to eager, with collectives and NVMe
reads inside traced code on the way. docs/design.md, "torch.compile".
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn
from torch._C._dynamo.eval_frame import set_eval_frame  # torch._dynamo's own import costs ~1.2 s
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.hooks import RemovableHandle

from zeroinf.runtime import interrupts

UNPICKLABLE = (
    "a model sharded by zeroinf cannot be pickled or deep-copied (torch.save(model), copy.deepcopy): "
    "its parameters are shards on their tiers, owned by this process. Save the weights with "
    "model.state_dict() on every rank (or zeroinf.save for training state); for a second copy (EMA, "
    "a reference model) build the model again, freeze it (requires_grad_(False)), shard it, and load the "
    "state dict into it; zeroinf.ema_update(ema, model, decay) then averages into it"
)


# [Note: the engine outside inference mode]
# Under `torch.inference_mode()` (Hugging Face pipelines run their forward in it) every tensor made,
# views of existing storage included, is an inference tensor, which may never be updated in place
# outside inference mode, and inference mode is per thread. The engine's hooks gather parameters
# into views of flat buffers, land NVMe reads through the I/O threads into views of pool buffers and
# cache slots, and keep some of those views for later steps: made in the user's inference mode, the
# I/O threads' writes into them failed ("Inplace update to inference tensor outside InferenceMode")
# and a later training step could not save them for backward. So each hook runs with inference mode
# off; what the user's code computes from the gathered parameters stays inference tensors. The
# engine's entry points that are not hooks (`zeroinf.gathered`) do the same.
def outside_inference_mode() -> contextlib.AbstractContextManager[Any]:
    """Inference mode switched off for the block if it is on: [Note: the engine outside inference mode]."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


class eager:  # noqa: N801 - used like a function: hooks.eager(fn)
    """`fn`, run as plain Python even where `torch.compile` traces its caller.

    What `torch.compiler.disable(fn)` does, without importing torch._dynamo (about 1.2 s, which
    `import zeroinf` and the planner's pass must not pay): the compiler, finding `_torchdynamo_disable`
    on `__call__`, breaks its graph there instead of tracing in; the call then switches the compiler's
    frame hook off until `fn` returns, so nothing below it is compiled either. An object rather than
    a closure, so that pickling a module carrying one of these hooks stops with the reason
    (`UNPICKLABLE`), not with pickle's "Can't pickle local object".
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        prior = set_eval_frame(None)
        try:
            with interrupts.held():  # runtime/interrupts.py [Note: Ctrl-C inside the engine]
                if torch.is_inference_mode_enabled():  # a branch, not a context, on the hot path
                    with torch.inference_mode(False):
                        return self.fn(*args, **kwargs)
                return self.fn(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    __call__._torchdynamo_disable = True  # type: ignore[attr-defined]

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(UNPICKLABLE)


try:  # and `__call__` itself is never compiled as a frame (else the compiler warns that it cannot
    # trace set_eval_frame, then runs it anyway); older torch lacks the switch and only warns
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
except ImportError:
    pass
else:
    set_code_exec_strategy(eager.__call__.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


# [Note: hooks that hold the engine weakly]
# A model is a cycle: the module holds its engine (`_zeroinf_engine`), the engine holds the module,
# its units and their parameters. Python's collector frees such a cycle once nothing outside holds
# it, but only through references it can see, and torch does not show it a parameter's
# post-accumulate-grad hooks (torch 2.13: a plain module whose parameter carries such a hook bound to
# an object that holds the module is never freed). With the engine's method in those hooks, a
# deleted model and optimizer were never freed: each build of a sweep (Optuna trials, a notebook
# re-run) kept its shards, host states, I/O threads, open files and NVMe swap files until the process
# ended (a small model on NVMe: 16 threads, 8 descriptors and 4 swap files more per build). So the
# hooks hold the engine through a weak reference, and `del model, opt` (with `gc.collect()`, or the
# collector's own next pass) releases everything, the swap files included
# (tests/runtime/test_lifetime.py). The optimizer's calls into the engine are held the same way.
def weak_callable(fn: Callable[..., None]) -> Callable[..., None]:
    """`fn`, holding its bound object (a method, or a `functools.partial` of one) weakly: a call
    once that object is gone does nothing. [Note: hooks that hold the engine weakly]"""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    if not inspect.ismethod(inner):
        return fn
    owner, function = weakref.ref(inner.__self__), inner.__func__
    bound_args = fn.args if isinstance(fn, functools.partial) else ()
    bound_kwargs = fn.keywords if isinstance(fn, functools.partial) else {}

    def call(*args: Any) -> None:
        target = owner()
        if target is not None:
            function(target, *bound_args, *args, **bound_kwargs)

    return call


def register_grad_ready_hooks(
    params: list[nn.Parameter], on_ready: Callable[[int], None]
) -> list[RemovableHandle]:
    """Call `on_ready(i)` after autograd has accumulated params[i].grad in a backward pass."""
    handles = []
    call = weak_callable(on_ready)
    for index, param in enumerate(params):

        def hook(_: torch.Tensor, index: int = index) -> None:
            call(index)

        handles.append(param.register_post_accumulate_grad_hook(eager(hook)))
    return handles


def _gets_gradient() -> Callable[[nn.Parameter], bool] | None:
    """From inside a backward pass: whether it delivers a gradient to a parameter. Exact: the
    autograd engine has already computed the set of nodes reachable from the pass's roots (the
    user's loss, not the model's output), and a parameter gets a gradient iff its AccumulateGrad node
    is among them. A parameter whose forward ran inside a reentrant checkpoint is not reachable yet
    (its backward is nested). ~4 us a parameter. None: torch lacks the query."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        return None
    edge = torch.autograd.graph.get_gradient_edge
    return lambda p: p.requires_grad and bool(will_execute(edge(p).node))


def reached_in_this_backward(params: list[nn.Parameter]) -> list[bool]:
    """From inside a backward pass: whether it delivers a gradient to each of `params` (without the
    query: every one)."""
    gets = _gets_gradient()
    return [True] * len(params) if gets is None else [gets(p) for p in params]


def reaches_any(params: list[nn.Parameter]) -> bool:
    """From inside a backward pass: whether it delivers a gradient to any of `params` (False for
    `torch.autograd.grad(loss, inputs)` that asks for the inputs' gradients only). Stops at the
    first reached parameter: a training backward costs one query."""
    gets = _gets_gradient()
    return gets is None or any(gets(p) for p in params)


def behind_reentrant_checkpoint() -> bool:
    """From a hook inside a backward pass: whether the graph below the node running it holds a
    reentrant checkpoint (`use_reentrant=True`), whose parameters are reached only by the backward it
    runs of its own, later. A walk of the graph, made only for a backward that reaches no parameter."""
    seen: set[int] = set()
    stack: list[Any] = [torch._C._current_autograd_node()]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` once the current autograd backward pass has finished (call from inside a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def register_forward_hooks(
    module: nn.Module,
    pre: Callable[[nn.Module], None],
    post: Callable[[nn.Module, Any], None],
    *,
    traceable: bool = False,
) -> list[RemovableHandle]:
    """`pre(module)` before and `post(module, output)` after every call of `module`.

    The pre-hook is prepended so that it runs before any user hook that might read the weights.
    `traceable`: `torch.compile` traces the hooks instead of breaking its graph at them; for hooks
    on every submodule whose usual path only reads a flag and leaves the real work to an `eager`
    function (a break per Linear would leave the compiler nothing to fuse).
    """
    wrap = (lambda fn: fn) if traceable else eager
    return [
        module.register_forward_pre_hook(wrap(lambda m, args: pre(m)), prepend=True),
        module.register_forward_hook(wrap(lambda m, args, out: post(m, out))),
    ]


def register_pre_backward(output: Any, callback: Callable[[], None]) -> None:
    """Call `callback()` in backward as soon as the gradient of any tensor in `output` is computed.

    `output` may be any nesting of tuples, lists, dicts and pytree-registered classes (e.g. Hugging
    Face ModelOutput). Outputs that need no gradient register nothing.
    """
    tensors = tuple(
        t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
    )
    if tensors:
        torch.autograd.graph.register_multi_grad_hook(tensors, eager(lambda grads: callback()), mode="any")


def register_input_hook(module: nn.Module, fn: Callable[[Any], None]) -> RemovableHandle:
    """`fn((args, kwargs))` with the inputs of every call of `module`, before it runs."""
    return register_input_rewrite(module, lambda args, kwargs: fn((args, kwargs)))


def register_input_rewrite(
    module: nn.Module, fn: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any] | None]
) -> RemovableHandle:
    """Every call of `module` gets the keyword arguments `fn(args, kwargs)` returns (None: unchanged)."""

    def rewrite(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
        new = fn(args, kwargs)
        return None if new is None else (args, new)

    return module.register_forward_pre_hook(eager(rewrite), with_kwargs=True)


def register_input_cast(module: nn.Module, dtype: torch.dtype) -> RemovableHandle:
    """Every call of `module` gets its floating-point tensor inputs (any nesting of tuples, lists and
    dicts, positional or keyword) in `dtype`; other values pass unchanged. The cast is differentiable,
    so an input that requires grad gets its gradient back in its own dtype."""

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    def rewrite(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return tree_map(cast, args), tree_map(cast, kwargs)

    return module.register_forward_pre_hook(eager(rewrite), with_kwargs=True)


def register_output_hook(module: nn.Module, fn: Callable[[Any], None]) -> RemovableHandle:
    """`fn(output)` with the output of every call of `module`, after it ran."""
    return module.register_forward_hook(eager(lambda m, args, out: fn(out)))


def register_state_dict_hook(module: nn.Module, fn: Callable[[nn.Module, Any, str, Any], None]) -> RemovableHandle:
    """`fn(module, state_dict, prefix, local_metadata)` after `module` wrote its entries into a `state_dict()`."""
    return module._register_state_dict_hook(fn)


def register_load_hooks(
    module: nn.Module, before: Callable[..., None], after: Callable[[nn.Module, Any], None] | None
) -> list[RemovableHandle]:
    """Around `module`'s part of a `load_state_dict`: `before(module, state_dict, prefix,
    local_metadata, ...)` as its own values are about to be copied, `after(module, incompatible_keys)`
    once its whole subtree is loaded."""
    handles = [module.register_load_state_dict_pre_hook(before)]
    if after is not None:
        handles.append(module.register_load_state_dict_post_hook(after))
    return handles
