"""The layer map of DESIGN.md, enforced: a module imports only from its own layer or the ones below
(lazy imports inside functions included). The one allowed circle is tensor <-> ops (methods call
ops, ops return Tensors), with autograd and random, which live beside tensor."""

import ast
from pathlib import Path

import pytest

import kiln

LAYERS = [  # lowest first
    ("errors", "dtypes", "paths"),
    ("backend",),
    ("tensor", "autograd", "random"),
    ("ops",),
    ("profiler", "precision", "graph"),
    ("nn", "optim", "data", "checkpoint"),
    ("distributed",),
    ("launch",),
    ("train", "cli", "__init__", "__main__"),
]
ALLOWED_CIRCLE = {"tensor", "autograd", "random", "ops"}
ROOT = Path(kiln.__file__).parent


def layer_of(head: str) -> int | None:
    return next((i for i, names in enumerate(LAYERS) if head in names), None)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def head_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported(tree) -> list[tuple[int, str]]:
    """(line, kiln module) for every import of a kiln module in the tree; `import kiln` alone (for
    kiln.__version__) names no layer and is skipped, as DESIGN.md's hook does."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kiln":
                out += [(node.lineno, f"kiln.{a.name}") for a in node.names if layer_of(a.name) is not None]
            elif node.module.startswith("kiln."):
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("kiln.")]
    return out


def violations(module: str, source: str) -> list[str]:
    """The upward imports of one module's source, each as 'module:line -> imported (layer names)'."""
    me = head_of(module)
    mine = layer_of(me)
    bad = []
    for line, target in imported(ast.parse(source)):
        theirs = layer_of(head_of(target))
        if theirs is None:
            bad.append(f"{module}:{line} -> {target} (a package that is on no layer of the map)")
        elif theirs > mine and not {me, head_of(target)} <= ALLOWED_CIRCLE:
            bad.append(f"{module}:{line} -> {target} (layer {LAYERS[mine]} imports from {LAYERS[theirs]})")
    return bad


def test_every_package_is_on_a_layer():
    heads = {head_of(module_name(p)) for p in ROOT.rglob("*.py")}
    assert not {h for h in heads if layer_of(h) is None}, "add new packages to the layer map (DESIGN.md)"


def test_no_module_imports_from_a_layer_above_it():
    bad = [v for p in sorted(ROOT.rglob("*.py")) for v in violations(module_name(p), p.read_text())]
    assert not bad, "upward imports:\n" + "\n".join(bad)


@pytest.mark.parametrize("module,source,flagged", [
    ("kiln.ops.matmul", "from kiln.train import Trainer\n", True),
    ("kiln.backend.cpu.adamw", "def f():\n    import kiln.nn.gpt\n", True),     # lazy imports count
    ("kiln.nn.gpt", "from kiln import distributed\n", True),
    ("kiln.data.loader", "from kiln.checkpoint import save\n", False),        # the same layer
    ("kiln.tensor", "from kiln import ops as _ops\n", False),                # the allowed circle
    ("kiln.ops.shape", "from kiln.tensor import Tensor\n", False),
    ("kiln.distributed.ddp", "import kiln\nfrom kiln.nn import GPT\n", False),
])
def test_the_check_flags_a_planted_violation(module, source, flagged):
    assert bool(violations(module, source)) == flagged
