"""DeviceMesh: the world's ranks as a grid of named dimensions (dp, tp, cp), a group per dimension.

The ranks fill the grid in row-major order, the last dimension fastest: with {"dp": 2, "tp": 4}
ranks 0-3 are one tensor-parallel group (neighbours, the fastest links, as Megatron places
them) and ranks {0, 4}, {1, 5}, ... the data-parallel ones. `mesh["tp"]` is this rank's group
along tp; the model code asks the mesh for its group and does not change with the strategy
(DESIGN.md, DTMS).
"""

from __future__ import annotations

import math

from kiln.errors import ConfigError

DIMENSIONS = ("dp", "tp", "cp")


class DeviceMesh:
    def __init__(self, dims: dict, group=None):
        """dims: {name: size} in mesh order (names from dp, tp, cp; one size may be -1: the rest);
        group: the ranks it covers (default the world). Collective over the group."""
        from kiln.distributed.process_group import get_world
        group = group or get_world()
        dims = dict(dims)
        bad = [n for n in dims if n not in DIMENSIONS]
        if bad or not dims:
            raise ConfigError(f"unknown mesh dimensions {bad or dims}; allowed: {', '.join(DIMENSIONS)}")
        free = [n for n, s in dims.items() if s == -1]
        fixed = math.prod(s for s in dims.values() if s != -1)
        if len(free) > 1 or any((not isinstance(s, int) or s < 1) and s != -1 for s in dims.values()):
            raise ConfigError(f"mesh sizes must be positive integers (one may be -1), got {dims}")
        if free:
            if group.size % fixed:
                raise ConfigError(f"mesh {dims}: {group.size} ranks do not divide by {fixed}")
            dims[free[0]] = group.size // fixed
        if math.prod(dims.values()) != group.size:
            raise ConfigError(f"mesh {dims} has {math.prod(dims.values())} places for {group.size} ranks")
        self.group, self.names, self.shape = group, tuple(dims), tuple(dims.values())
        self.coordinate = dict(zip(self.names, _unravel(group.rank, self.shape)))
        self._groups = {}
        for i, name in enumerate(self.names):
            others = [self.coordinate[n] for j, n in enumerate(self.names) if j != i]
            sizes = [s for j, s in enumerate(self.shape) if j != i]
            color = _ravel(others, sizes)
            self._groups[name] = group.split(color, self.coordinate[name])

    def __getitem__(self, name: str):
        """This rank's process group along dimension name."""
        if name not in self._groups:
            raise ConfigError(f"this mesh has dimensions {', '.join(self.names)}, not {name!r}")
        return self._groups[name]

    def size(self, name: str) -> int:
        return self[name].size

    def __repr__(self) -> str:
        return f"DeviceMesh({dict(zip(self.names, self.shape))}, at {self.coordinate})"


def _unravel(index: int, shape) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return out[::-1]


def _ravel(coords, shape) -> int:
    index = 0
    for c, s in zip(coords, shape):
        index = index * s + c
    return index
