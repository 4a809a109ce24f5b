"""Kiln's side of a precision comparison: every op's outputs and their gradients, by module.

While a `Capture` is open, `Function.apply` and the model's module forwards are wrapped: each op
output is recorded under (module path, op, output index), named with the unfused reference op it
stands for (`reference_name`), and passed through an identity node that keeps its gradient. On
exit the originals are put back, so a model that is not being compared runs exactly the code it
ran before (no flag is checked anywhere on the hot path). Paper §2.3, the precision logger.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.autograd import Function


def reference_name(path: str, op: str, k: int, n_layer: int):
    """(name of the unfused reference op, gradient comparable) for output k of kiln op `op` run in
    module `path`; None for ops the reference has no value for (casts, views).

    The fused ops map so: AddLayerNorm in `h.i.ln_2` gives (h.i.attn.residual, h.i.ln_2); in
    `h.j.ln_1` (h.{j-1}.mlp.residual, h.j.ln_1); in `ln_f` (h.{L-1}.mlp.residual, ln_f). LinearGELU
    in `h.i.mlp` is the reference's gelu(c_fc(.)): c_fc's own output is inside the fused op. The
    packed attention reads c_attn's QKV as it is: the reference's split, SDPA and head merge are
    `h.i.attn.sdpa`. The residual sum's gradient inside the fused add is not exposed (the op adds
    it to the LayerNorm's before it leaves), so only its forward value is compared."""
    if op == "Embedding":
        return path, True
    if op == "Add" and path == "":
        return "embed", True
    if op == "LayerNorm":
        return path, True
    if op == "AddLayerNorm":
        if k == 1:
            return path, True
        if path.endswith(".ln_2"):
            return path[: -len("ln_2")] + "attn.residual", False
        layer = int(path.split(".")[1]) - 1 if path.startswith("h.") else n_layer - 1
        return f"h.{layer}.mlp.residual", False
    if op == "Linear":
        return ("lm_head" if path in ("", "lm_head") else path), True
    if op in ("LinearGELU", "GELU"):
        return path.rsplit(".c_fc", 1)[0] + ".gelu", True
    if op == "PackedCausalAttention":
        return path + ".sdpa", True
    if op == "CrossEntropy":
        return "loss", True
    return None


@dataclass
class Record:
    """One op output: where it ran, what it is called in the reference, its value and gradient."""
    name: str
    path: str
    op: str
    output: int
    value: object              # the backend array
    compare_grad: bool
    grad: object = None        # the backend array of d loss / d value, once backward reached it
    grad_order: int = -1       # the order in which backward reached it
    extra: dict = field(default_factory=dict)


class _Tap(Function):
    """Identity; its backward keeps a copy of the gradient that passes through it."""
    is_view = True  # the output is the input's array: they share a version

    @staticmethod
    def forward(ctx, x, record, order):
        ctx.record, ctx.order = record, order
        return x.data

    @staticmethod
    def backward(ctx, g):
        ctx.record.grad = g.copy()
        ctx.record.grad_order = next(ctx.order)
        return g


class Capture:
    """Records the ops of `model` (kiln's GPT, or any module with the same names) while open.

    names: keep only records whose reference name matches one of these fnmatch patterns (all
    when None). unmapped lists the (path, op) pairs that have no reference counterpart. The LM
    head's logits are compared, so while open the model makes them whole (its fused_lm_head, when
    it has one, is off until exit)."""

    def __init__(self, model, names=None):
        self.model = model
        self.n_layer = model.config.n_layer
        self.names = names
        self.records: list[Record] = []
        self.unmapped: set = set()
        self._stack = [""]
        self._wrapped = []
        self._fused_lm_head = None
        self._fused: list = []

    def __enter__(self):
        import fnmatch
        import itertools
        original = Function.__dict__["apply"]
        self._original = original
        apply = original.__func__
        order = itertools.count()
        seen = {}

        def recording_apply(cls, *args, **kwargs):
            out = apply(cls, *args, **kwargs)
            if cls is _Tap:
                return out
            path = self._stack[-1]
            outs = out if isinstance(out, tuple) else (out,)
            tapped = []
            for k, o in enumerate(outs):
                mapped = reference_name(path, cls.__name__, k, self.n_layer)
                if mapped is None:
                    self.unmapped.add((path, cls.__name__))
                    tapped.append(o)
                    continue
                name, grad_ok = mapped
                n = seen.get(name, 0)
                seen[name] = n + 1
                if n:
                    name = f"{name}#{n + 1}"
                if self.names is not None and not any(fnmatch.fnmatchcase(name, p) for p in self.names):
                    tapped.append(o)
                    continue
                rec = Record(name, path, cls.__name__, k, o.data, grad_ok)
                self.records.append(rec)
                tapped.append(apply(_Tap, o, rec, order) if o.requires_grad else o)
            return tuple(tapped) if isinstance(out, tuple) else tapped[0]

        Function.apply = classmethod(recording_apply)
        if getattr(self.model, "fused_lm_head", False):
            self._fused_lm_head, self.model.fused_lm_head = True, False
        # a fused MLP (F.linear_gelu_linear) runs as its layers' ops while open: the GELU's output is compared
        self._fused = [m for _, m in self.model.named_modules() if getattr(m, "fused", None) is True]
        for module in self._fused:
            module.fused = False
        for path, module in self.model.named_modules():
            for attr in [a for a in dir(type(module)) if a.endswith("forward")]:
                bound = getattr(module, attr)
                object.__setattr__(module, attr, self._in_module(path, bound))
                self._wrapped.append((module, attr))
        return self

    def _in_module(self, path, fn):
        stack = self._stack

        def run(*args, **kwargs):
            stack.append(path)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
        return run

    def __exit__(self, *exc):
        Function.apply = self._original
        if self._fused_lm_head:
            self.model.fused_lm_head, self._fused_lm_head = True, None
        for module in self._fused:
            module.fused = True
        self._fused = []
        for module, attr in self._wrapped:
            del module.__dict__[attr]
        self._wrapped.clear()
