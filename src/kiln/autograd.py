"""The reverse-mode engine: graph nodes, saved tensors, grad mode, and `backward`.

An op is a `Function`: `forward(ctx, *args)` computes backend arrays from Tensors, `backward(ctx,
*grads)` returns one gradient array (or None) per Tensor argument. `apply` wraps the outputs in
Tensors whose `grad_fn` is the node; the node keeps edges to its inputs' nodes (never the input
Tensors themselves) and the arrays it saved, each with the version it was saved at.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading

from kiln.backend import array_backend
from kiln.errors import AutogradError

_state = threading.local()
_sequence = itertools.count()


def is_grad_enabled() -> bool:
    return getattr(_state, "grad_enabled", True)


class _GradMode:
    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        self.prev = is_grad_enabled()
        _state.grad_enabled = self.enabled

    def __exit__(self, *exc):
        _state.grad_enabled = self.prev

    def __call__(self, fn):
        def wrapped(*args, **kwargs):
            with _GradMode(self.enabled):
                return fn(*args, **kwargs)
        wrapped.__name__ = fn.__name__
        wrapped.__doc__ = fn.__doc__
        return wrapped


def graph_retained() -> bool:
    """True inside a backward(retain_graph=True): a Function whose backward hands on buffers it made
    in its forward (the fused LM head's gradients) must hand on copies, to give them again next time."""
    return getattr(_state, "retaining", False)


def no_grad() -> _GradMode:
    """Context manager (or decorator): ops inside record no graph."""
    return _GradMode(False)


def enable_grad() -> _GradMode:
    return _GradMode(True)


class AccumulateGrad:
    """The sink of a leaf tensor's gradient: adds into `leaf.grad`, then fires its hooks."""

    __slots__ = ("__weakref__", "leaf", "seq")

    def __init__(self, leaf):
        self.leaf = leaf
        # A leaf's gradient is accumulated (and its hooks fire) as soon as it is complete, before
        # any other ready node: DDP/ZeRO launch a bucket's collective and FSDP frees a unit's
        # gathered parameters while backward goes on, not after it.
        self.seq = math.inf

    def accumulate(self, grad, owned: bool = False) -> None:
        """owned: grad is a new array nothing else holds (a sum, a cast, the output of a Function with
        fresh_grads), so it becomes leaf.grad as it is; otherwise leaf.grad is a copy."""
        leaf = self.leaf
        backend = leaf.backend
        if grad.dtype != leaf.dtype.np:
            grad, owned = backend.cast(grad, leaf.dtype.np), True
        if grad.shape != leaf.shape:
            raise AutogradError(f"gradient of shape {grad.shape} for a leaf of shape {leaf.shape}")
        if leaf.grad is None:
            from kiln.tensor import Tensor
            leaf.grad = Tensor._wrap(grad if owned and grad.flags.c_contiguous else grad.copy(), leaf.device)
        else:
            backend.add(leaf.grad.data, grad, out=leaf.grad.data)
        for hook in leaf._post_accumulate_hooks:
            hook(leaf)


class DeferredGrad:
    """A gradient a Function's backward may return for an input in place of an array, when adding itself
    into an array is cheaper than being made whole (Embedding's scatter: no zeroed [V, C] array and no
    [V, C] add where GPT-2's LM head has already written the tied weight's gradient). `make(into)` adds it
    into the array `into` and returns that, or, with None, returns it as a new array. The engine adds it
    into the input's pending gradient when that is an array nothing else holds of its shape and dtype,
    else makes it whole (as fresh: nothing else holds it either)."""

    __slots__ = ("shape", "dtype", "make")

    def __init__(self, shape, dtype, make):
        self.shape, self.dtype, self.make = tuple(shape), dtype, make


class Fresh:
    """An array an op just computed, saved for backward (ctx.save_for_backward(Fresh(out))): nothing
    else holds it to change it, and the engine gives it the output tensor's version counter."""

    __slots__ = ("data", "_version")

    def __init__(self, data):
        self.data = data
        self._version = [0]


class Function:
    """Base of every differentiable op; a subclass instance is one node of the graph."""

    __slots__ = ("__dict__", "_saved", "freed", "needs_input_grad", "next_edges", "num_outputs", "seq")
    is_view = False  # True for ops whose outputs alias their first input (they share its version)
    # True when backward returns new arrays only, none aliasing another or g; or a tuple, that per input
    fresh_grads: bool | tuple = False
    # False: an output of a multi-output op that no gradient reached comes to backward as None
    # (as PyTorch's ctx.set_materialize_grads(False)); True: as zeros of the output's shape.
    materialize_grads = True

    @staticmethod
    def forward(ctx, *args, **kwargs):  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def apply(cls, *args, **kwargs):
        from kiln.tensor import Tensor
        tensors = [a for a in args if isinstance(a, Tensor)]
        _check_same_device(cls.__name__, tensors)
        record = is_grad_enabled() and any(t.requires_grad for t in tensors)
        ctx = cls.__new__(cls)
        ctx._saved = ()
        ctx.freed = False
        ctx.needs_input_grad = tuple(t.requires_grad for t in tensors) if record else (False,) * len(tensors)
        out = cls.forward(ctx, *args, **kwargs)
        device = ctx.__dict__.get("out_device") or (tensors[0].device if tensors else None)
        version = tensors[0]._version if cls.is_view else None
        # An output saved for backward (a Fresh) shares its version with the output tensor, so
        # an in-place change of the output is caught too.
        saved_boxes = {id(item[0]): item[1] for item in ctx._saved if item is not None}
        multi = isinstance(out, tuple)
        outs = out if multi else (out,)
        if not record:
            wrapped = tuple(Tensor._wrap(o, device, version=saved_boxes.get(id(o), version)) for o in outs)
        else:
            ctx.next_edges = tuple(_edge(t) for t in tensors)
            ctx.seq = next(_sequence)
            ctx.num_outputs = len(outs)
            if multi:
                ctx.output_meta = [(o.shape, o.dtype) for o in outs]
                ctx.output_backend = device.backend
            wrapped = tuple(Tensor._wrap(o, device, requires_grad=True, grad_fn=ctx, output_nr=i,
                                         version=saved_boxes.get(id(o), version))
                            for i, o in enumerate(outs))
        return wrapped if multi else wrapped[0]

    def save_for_backward(self, *tensors) -> None:
        """Keep these Tensors' arrays (None allowed) with their versions, checked in backward.
        Inside saved_tensors_hooks(pack, unpack), pack(tensor) is kept instead of the array."""
        hooks = getattr(_state, "saved_hooks", None)
        if hooks is not None:
            self.__dict__["unpack"] = hooks[1]
        self._saved = tuple(None if t is None else
                            (t.data if hooks is None else hooks[0](t), t._version, t._version[0])
                            for t in tensors)

    @property
    def saved(self):
        if self.freed:
            raise AutogradError(
                f"backward through {type(self).__name__} a second time: its saved tensors were freed "
                "after the first backward; pass retain_graph=True to the first backward to keep them")
        out = []
        for item in self._saved:
            if item is None:
                out.append(None)
                continue
            data, box, version = item
            if box[0] != version:
                raise AutogradError(
                    f"a tensor saved for the backward of {type(self).__name__} was modified in place "
                    f"(it is at version {box[0]}, it was saved at version {version}); "
                    "clone it before changing it")
            out.append(data)
        unpack = self.__dict__.get("unpack")
        return out if unpack is None else [None if d is None else unpack(d) for d in out]

    def release(self) -> None:
        self._saved = ()
        self.freed = True


class saved_tensors_hooks:
    """Context manager: ops recorded inside it save pack(tensor) (anything) for backward instead of
    the tensor's array, and backward reads unpack(that) back (torch.autograd.graph's hooks of the
    same name). FSDP packs its gathered parameters as handles, so that freeing them after a
    unit's forward frees their memory, and unpacks them from the gather before the unit's backward."""

    def __init__(self, pack, unpack):
        self.hooks = (pack, unpack)

    def __enter__(self):
        self.prev = getattr(_state, "saved_hooks", None)
        _state.saved_hooks = self.hooks

    def __exit__(self, *exc):
        _state.saved_hooks = self.prev


def _edge(t):
    if not t.requires_grad:
        return None
    if t.grad_fn is not None:
        return (t.grad_fn, t._output_nr)
    if t._accumulator is None:
        t._accumulator = AccumulateGrad(t)
    return (t._accumulator, 0)


def _check_same_device(op: str, tensors) -> None:
    if len(tensors) > 1:
        dev = tensors[0].device
        for t in tensors[1:]:
            if t.device != dev:
                from kiln.errors import DeviceError
                raise DeviceError(f"{op}: tensors on different devices ({dev} and {t.device}); "
                                  "move them with .to(device) first")


def backward(root, grad, retain_graph: bool = False, unit: bool = False) -> None:
    """Run the graph below `root` in reverse topological order, from `grad` (an array). unit: grad is the
    implicit 1 of a scalar's backward (Tensor.backward() with no gradient), which is_unit_grad names to the
    op that receives it: an op whose backward only scales by its upstream gradient (the fused LM head's)
    skips the pass."""
    if root.grad_fn is None:
        if root.requires_grad:
            root._accumulator = root._accumulator or AccumulateGrad(root)
            root._accumulator.accumulate(grad)
            return
        raise AutogradError("backward on a tensor that does not require grad and has no grad_fn")
    prev, _state.unit_grad = getattr(_state, "unit_grad", None), (grad if unit else None)
    try:
        _backward_from(root.grad_fn, {root._output_nr: grad}, retain_graph)
    finally:
        _state.unit_grad = prev


def is_unit_grad(g) -> bool:
    """Whether g is the implicit gradient 1 the running backward started from (see backward's unit)."""
    return g is not None and g is getattr(_state, "unit_grad", None)


def backward_outputs(outputs, grads, retain_graph: bool = False) -> None:
    """backward from several outputs of one node at once (a multi-output op's, e.g. add_layer_norm's
    (sum, norm)), each with its gradient array; an output whose gradient is None gets none."""
    pairs = [(t, g) for t, g in zip(outputs, grads) if g is not None]
    if not pairs:
        return
    node = pairs[0][0].grad_fn
    if node is None or any(t.grad_fn is not node for t, _ in pairs):
        raise AutogradError("backward_outputs takes outputs of one node (made by one op), with a grad_fn")
    seeds: dict = {}
    for t, g in pairs:
        seeds[t._output_nr] = g if t._output_nr not in seeds else array_backend(g).add(seeds[t._output_nr], g)
    _backward_from(node, seeds, retain_graph)


def graph_nodes(t) -> list:
    """Every op node of the graph below tensor t (depth first, each once; AccumulateGrad leaves out):
    what a graph keeps for backward can be read from their saved arrays."""
    nodes, stack, seen = [], [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or isinstance(node, AccumulateGrad):
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(e[0] for e in node.next_edges if e is not None)
    return nodes


def _backward_from(root_node, seeds: dict, retain_graph: bool) -> None:
    """Run the graph below root_node in reverse topological order, from seeds {output number: gradient}."""
    # Count, for every node below the root, how many edges lead into it.
    deps: dict = {}
    stack = [root_node]
    seen = {id(root_node)}
    while stack:
        node = stack.pop()
        if isinstance(node, AccumulateGrad):
            continue
        for edge in node.next_edges:
            if edge is None:
                continue
            child = edge[0]
            deps[id(child)] = deps.get(id(child), 0) + 1
            if id(child) not in seen:
                seen.add(id(child))
                stack.append(child)

    pending: dict = {id(root_node): [None] * root_node.num_outputs}
    owned: set = set()  # ids of gradient arrays nothing else holds (AccumulateGrad keeps them uncopied)
    for nr, g in seeds.items():
        pending[id(root_node)][nr] = g
    # Later nodes first, as PyTorch does: parameters used last get their gradients first (DDP).
    ready = [(-root_node.seq, 0, root_node)]
    retaining, _state.retaining = graph_retained(), retain_graph
    try:
        _run_graph(ready, pending, deps, owned, retain_graph)
    finally:
        _state.retaining = retaining


def _run_graph(ready, pending, deps, owned, retain_graph) -> None:
    """Run the ready nodes, and the nodes they make ready, until none is left."""
    tie = itertools.count(1)
    with no_grad():
        while ready:
            _, _, node = heapq.heappop(ready)
            grads = pending.pop(id(node), None)
            if isinstance(node, AccumulateGrad):
                if grads is not None:
                    node.accumulate(grads[0], owned=id(grads[0]) in owned)
                    owned.discard(id(grads[0]))
                continue
            # A node that no gradient reached still releases its children's counts.
            if grads is not None:
                owned.difference_update(id(g) for g in grads)  # they die here: their ids may be reused
            in_grads = _run_node(node, grads) if grads is not None else (None,) * len(node.next_edges)
            fresh = type(node).fresh_grads
            if not retain_graph:
                node.release()
            for i, (edge, g) in enumerate(zip(node.next_edges, in_grads)):
                if edge is None:
                    continue
                child, nr = edge
                key = id(child)
                if isinstance(g, DeferredGrad):
                    held = pending.get(key, (None,) * (nr + 1))[nr]
                    if held is not None and id(held) in owned and held.shape == g.shape and held.dtype == g.dtype:
                        g.make(held)  # added into the pending array itself
                        g = None
                    else:
                        g = g.make(None)  # a new array: fresh, as the node's fresh_grads says
                if g is not None:
                    slot = pending.get(key)
                    if slot is None:
                        slot = pending[key] = [None] * (1 if isinstance(child, AccumulateGrad)
                                                        else child.num_outputs)
                    if slot[nr] is None:
                        slot[nr] = g
                        if fresh is True or (fresh is not False and fresh[i]):
                            owned.add(id(g))
                    elif id(slot[nr]) in owned and slot[nr].shape == g.shape and slot[nr].dtype == g.dtype:
                        array_backend(g).add(slot[nr], g, out=slot[nr])  # nothing else holds it: in place
                    else:
                        owned.discard(id(slot[nr]))
                        slot[nr] = array_backend(g).add(slot[nr], g)  # a new array
                        owned.add(id(slot[nr]))
                deps[key] -= 1
                if deps[key] == 0:
                    heapq.heappush(ready, (-child.seq, next(tie), child))


def _run_node(node, grads):
    if node.freed:
        raise AutogradError(
            f"backward through {type(node).__name__} a second time: the graph was freed by the "
            "first backward; pass retain_graph=True to the first backward to keep it")
    if type(node).materialize_grads and any(g is None for g in grads):
        return _run_with_missing(node, grads)
    out = node.backward(node, *grads)
    return out if isinstance(out, tuple) else (out,)


def _run_with_missing(node, grads):
    """Outputs of a multi-output node that received no gradient get zeros."""
    xp = node.output_backend.xp
    filled = [g if g is not None else xp.zeros(shape, dtype=dtype)
              for g, (shape, dtype) in zip(grads, node.output_meta)]
    out = node.backward(node, *filled)
    return out if isinstance(out, tuple) else (out,)
