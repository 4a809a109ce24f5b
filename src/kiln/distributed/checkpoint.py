"""Sharded checkpoints: every rank writes its own shard in parallel, one manifest names them, and a
run saved with W ranks and one strategy resumes with W' ranks and another (DDP, ZeRO-1/2, FSDP).

    ckpt-00000200.kiln                        the manifest: a kiln checkpoint file (checksummed)
    ckpt-00000200.shard-00001-of-00004.kiln   rank 1's pieces: each a kiln checkpoint file

What a rank writes is what it owns, as element ranges of each parameter's flattened values: its
FlatShards' segments under ZeRO and FSDP (values and AdamW moments), a 1/W slice of every
parameter under DDP (whose ranks hold the same state). The manifest (written by rank 0 after
every shard is on disk, so a crash leaves the previous checkpoint the newest good one) holds the
optimizer's hyperparameters, the caller's state, and per shard file its checksum and the ranges
it holds. Loading, each rank reads the shard files that overlap what it owns under the new
layout; a missing shard, or one whose checksum is not the manifest's, is a CheckpointError, and a
corrupt one fails its own checksums, as for single files (kiln.checkpoint.format).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.autograd import no_grad
from kiln.checkpoint.format import CheckpointError, load, save
from kiln.checkpoint.sharded import load_shard, read_full_state, shard_path

KINDS = ("param", "exp_avg", "exp_avg_sq")


class _Layout:
    """Where this rank's part of each parameter (and its moments) lives under a strategy: a list
    of (name, parameter, lo, hi, {kind: array view of hi - lo elements or None})."""

    def __init__(self, model, optimizer, wrapper, group):
        from kiln.distributed.fsdp import FullyShardedDataParallel
        from kiln.distributed.zero import ZeroDataParallel
        self.model, self.wrapper, self.group = model, wrapper, group
        names = {id(p): n for n, p in model.named_parameters()}
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.pieces = []
        if isinstance(wrapper, (ZeroDataParallel, FullyShardedDataParallel)):
            self.adamw = wrapper.optimizer.optimizer
            for s in wrapper.optimizer.shards:
                for p, a, b, off in s.segments:
                    views = {"param": s.param[a:b], "exp_avg": None if s.exp_avg is None else s.exp_avg[a:b],
                             "exp_avg_sq": None if s.exp_avg_sq is None else s.exp_avg_sq[a:b]}
                    self.pieces.append((names[id(p)], p, off, off + b - a, views, s))
            self.sharded = True
        else:  # DDP or one process: full replicas, each rank writes 1/W of every parameter
            self.adamw, self.sharded = optimizer, False
            moments = optimizer._moments
            index = {id(p): i for i, p in enumerate(optimizer.params)}
            for n, p in self.params.items():
                i = index[id(p)]
                views = {"param": p.data.reshape(-1),
                         "exp_avg": None if moments is None else moments[0][i].reshape(-1),
                         "exp_avg_sq": None if moments is None else moments[1][i].reshape(-1)}
                self.pieces.append((n, p, 0, p.numel(), views, None))

    def own(self, rank: int, world: int):
        """The pieces this rank writes: all of its shards', or its 1/W slice of each replica."""
        if self.sharded:
            yield from self.pieces
            return
        for n, p, lo, hi, views, s in self.pieces:
            a, b = lo + (hi - lo) * rank // world, lo + (hi - lo) * (rank + 1) // world
            if a < b:
                yield n, p, a, b, {k: None if v is None else v[a - lo:b - lo] for k, v in views.items()}, s


def save_sharded(path, model, optimizer, wrapper=None, group=None, state: dict | None = None,
                 on_saved=None) -> dict:
    """Collective over group: every rank writes its shard of model's parameters and optimizer's
    moments (wrapper: the ZeRO/FSDP/DDP wrapper, or None for one process), rank 0 the manifest
    naming them with `state` (JSON values and arrays). Returns rank 0's {"path", "bytes", "checksum"}.
    on_saved(that) runs on rank 0 before any rank returns (a CheckpointFolder's commit: a rank that
    dies right after the checkpoint leaves it committed as the newest)."""
    from kiln.distributed.process_group import get_world
    group = group or get_world()
    layout = _Layout(model, optimizer, wrapper, group)
    tensors, ranges = {}, {}
    for n, _, lo, hi, views, _ in layout.own(group.rank, group.size):
        ranges[n] = [lo, hi]
        for kind, v in views.items():
            if v is not None:
                tensors[f"{kind}/{n}"] = np.asarray(_host(v))
    mine = shard_path(path, group.rank, group.size)
    result = save(mine, {"tensors": tensors})
    everyone = group.engine.exchange({"file": mine.name, "checksum": result["checksum"], "ranges": ranges,
                                      "bytes": result["bytes"]})
    adamw = layout.adamw
    manifest = {"sharded": {"world_size": group.size, "files": everyone,
                            "moments": any(v["exp_avg"] is not None for *_, v, _ in layout.pieces),
                            "shapes": {n: list(p.shape) for n, p in layout.params.items()}},
                "optimizer": {"step": adamw.step_count, "betas": list(adamw.betas), "eps": adamw.eps,
                              "groups": [{"lr": g["lr"], "weight_decay": g["weight_decay"]}
                                         for g in adamw.param_groups]},
                "state": state or {}}
    out = save(path, manifest) if group.rank == 0 else None
    if out is not None and on_saved is not None:
        on_saved(out)
    group.barrier()  # the manifest is on disk (and committed) before anyone goes on
    return out


def _host(array):
    return array.get() if hasattr(array, "get") else array


def load_sharded(path, model, optimizer, wrapper=None, group=None) -> dict:
    """Collective over group: put the checkpoint at path (a manifest) into model, optimizer and
    wrapper, whatever world size and strategy saved it; returns the `state` saved with it."""
    from kiln.distributed.process_group import get_world
    group = group or (get_world() if wrapper is not None else None)  # one process needs no group
    path = Path(path)
    manifest = load(path)
    if "sharded" not in manifest:
        raise CheckpointError(f"{path} is not a sharded checkpoint manifest")
    info, cache = manifest["sharded"], {}

    def read(entry):
        if entry["file"] not in cache:
            cache[entry["file"]] = load_shard(path, entry)
        return cache[entry["file"]]

    _fill(str(path), _Layout(model, optimizer, wrapper, group), manifest["optimizer"], info["moments"],
          info["shapes"], info["files"], read)
    return manifest["state"]


def load_replicated(params: dict, optimizer_state: dict, model, optimizer, wrapper=None, group=None) -> None:
    """Put a single-file checkpoint's state (a one-process or DDP run's: every parameter's full value
    by name, and kiln.optim.AdamW's state_dict with the parameters' names under "params") into model,
    optimizer and wrapper: under ZeRO or FSDP each rank keeps the pieces it owns, as load_sharded."""
    from kiln.distributed.process_group import get_world
    group = group or (get_world() if wrapper is not None else None)
    moments = optimizer_state["exp_avg"] is not None
    tensors = {f"param/{n}": np.asarray(_host(a)).reshape(-1) for n, a in params.items()}
    if moments:
        for kind in ("exp_avg", "exp_avg_sq"):
            tensors.update((f"{kind}/{n}", np.asarray(_host(m)).reshape(-1))
                           for n, m in zip(optimizer_state["params"], optimizer_state[kind]))
    whole = {"ranges": {n: [0, int(np.size(a))] for n, a in params.items()}}
    shapes = {n: list(np.shape(a)) for n, a in params.items()}
    _fill("the single-file checkpoint", _Layout(model, optimizer, wrapper, group), optimizer_state, moments,
          shapes, [whole], lambda entry: tensors)


def read_replicated(path, optimizer, names: dict) -> tuple[dict, dict]:
    """A sharded checkpoint (its manifest at path) as a single-file one holds it: (every parameter's
    full value by name, kiln.optim.AdamW's state_dict with the names under "params", in optimizer's
    parameter order; names: {id(parameter): name}). Every rank reads every shard: for a layout whose
    pieces are not element ranges of the flattened parameters (a tensor-parallel one)."""
    manifest = load(path)
    info, opt = manifest["sharded"], manifest["optimizer"]
    if len(opt["groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{path} has {len(opt['groups'])} optimizer param groups, this optimizer "
                              f"{len(optimizer.param_groups)}")
    full = read_full_state(path, KINDS if info["moments"] else ("param",))
    order = [names[id(p)] for p in optimizer.params]
    state = {"step": opt["step"], "betas": opt["betas"], "eps": opt["eps"], "params": order,
             "groups": [{**g, "size": len(mine["params"])} for g, mine in zip(opt["groups"], optimizer.param_groups)]}
    for kind in ("exp_avg", "exp_avg_sq"):
        state[kind] = [full[kind][n] for n in order] if info["moments"] else None
    return full["param"], state


def _fill(source: str, layout, opt: dict, moments: bool, shapes: dict, files: list, read) -> None:
    """Every piece of layout from the files that hold it (each {"ranges": {name: [lo, hi]}}, its
    tensors read(file) by "kind/name"), and the optimizer's step and hyperparameters from opt."""
    mine = {n: list(p.shape) for n, p in layout.params.items()}
    if mine != shapes:
        bad = sorted(n for n in set(mine) | set(shapes) if mine.get(n) != shapes.get(n))
        raise CheckpointError(f"{source} holds another model: parameters {bad[:5]} differ in name or shape")
    adamw = layout.adamw
    if len(opt["groups"]) != len(adamw.param_groups):
        raise CheckpointError(f"{source} has {len(opt['groups'])} optimizer param groups, this optimizer "
                              f"{len(adamw.param_groups)}")
    adamw.step_count, adamw.betas, adamw.eps = int(opt["step"]), tuple(opt["betas"]), float(opt["eps"])
    for g, s in zip(adamw.param_groups, opt["groups"]):
        g["lr"], g["weight_decay"] = s["lr"], s["weight_decay"]
    if moments and not layout.sharded and adamw._moments is None:
        adamw._allocate()
        layout = _Layout(layout.model, adamw, layout.wrapper, layout.group)
    kinds = KINDS if moments else ("param",)
    with no_grad():
        for n, p, lo, hi, views, s in layout.pieces:
            if moments and s is not None and s.exp_avg is None:
                xp = p.backend.xp
                s.exp_avg, s.exp_avg_sq = xp.zeros_like(s.param), xp.zeros_like(s.param)
            for kind in kinds:
                target = _target(views, kind, s, lo, hi, p)
                for entry in files:
                    a, b = entry["ranges"].get(n, (0, 0))
                    x, y = max(a, lo), min(b, hi)
                    if x < y:
                        piece = read(entry)[f"{kind}/{n}"][x - a:y - a]
                        target[x - lo:y - lo] = p.backend.asarray(piece)
    _after_load(layout)


def _target(views, kind, s, lo, hi, p):
    """The array (hi - lo elements) the loaded values of kind go to."""
    if views[kind] is not None:
        return views[kind]
    # moments created just now for a shard: find this piece's place in it
    for q, a, b, off in s.segments:
        if q is p and off == lo:
            return (s.exp_avg if kind == "exp_avg" else s.exp_avg_sq)[a:b]
    raise CheckpointError(f"no place for {kind} of a parameter piece [{lo}, {hi})")


def _after_load(layout) -> None:
    """ZeRO-1/2: every rank's parameters from the loaded shards; versions bumped."""
    from kiln.distributed.zero import ZeroDataParallel
    if isinstance(layout.wrapper, ZeroDataParallel):
        layout.wrapper._gather_parameters()
    for p in layout.params.values():
        p._version[0] += 1

