"""A sharded checkpoint on disk, read in one process: the manifest ckpt-N.kiln and its shard files
ckpt-N.shard-RRRRR-of-WWWWW.kiln (written by kiln.distributed.checkpoint, one per rank), and every
parameter's full value assembled from them with no process group (`kiln export`, sampling)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.checkpoint.format import SUFFIX, CheckpointError, load, read_header


def shard_path(manifest, rank: int, world_size: int) -> Path:
    manifest = Path(manifest)
    stem = manifest.name.removesuffix(SUFFIX)
    return manifest.with_name(f"{stem}.shard-{rank:05d}-of-{world_size:05d}{SUFFIX}")


def load_shard(manifest, entry: dict) -> dict:
    """The tensors of one shard file that the manifest at path `manifest` names (entry: its record),
    CRCs verified; a missing file, or one whose checksum is not the manifest's, is a CheckpointError."""
    f = Path(manifest).with_name(entry["file"])
    if not f.is_file():
        raise CheckpointError(f"shard {f} named by {Path(manifest).name} is missing")
    if read_header(f)[1].get("kiln.checksum") != entry["checksum"]:
        raise CheckpointError(f"shard {f} is not the one {Path(manifest).name} names (checksum differs)")
    return load(f)["tensors"]


def verify_shards(path, manifest: dict) -> None:
    """Read every shard of the manifest (loaded from path) through its checksums: CheckpointError
    for a missing, foreign or corrupt one. So a run resumes from the newest checkpoint whose
    shards are all good, as from single files (CheckpointFolder.load_latest)."""
    for entry in manifest["sharded"]["files"]:
        load_shard(path, entry)


def read_full(path) -> dict:
    """Every parameter's full value (NumPy, by name) from a sharded checkpoint's manifest and all
    its shards, in one process and with no process group: what `kiln export` and sampling read."""
    return read_full_state(path, ("param",))["param"]


def read_full_state(path, kinds) -> dict:
    """{kind: {name: full array}} of kinds ("param", "exp_avg", "exp_avg_sq": the values and AdamW's
    moments) from a sharded checkpoint's manifest and all its shards, as read_full."""
    path = Path(path)
    manifest = load(path)
    if "sharded" not in manifest:
        raise CheckpointError(f"{path} is not a sharded checkpoint manifest")
    info, filled = manifest["sharded"], {}
    out = {kind: {} for kind in kinds}
    for entry in info["files"]:
        tensors = load_shard(path, entry)
        for n, (a, b) in entry["ranges"].items():
            for kind in kinds:
                piece = tensors[f"{kind}/{n}"]
                if n not in out[kind]:
                    out[kind][n] = np.empty(int(np.prod(info["shapes"][n])), dtype=piece.dtype)
                out[kind][n][a:b] = piece
            filled[n] = filled.get(n, 0) + b - a
    short = [n for n, shape in info["shapes"].items() if filled.get(n, 0) != int(np.prod(shape))]
    if short:
        raise CheckpointError(f"the shards of {path} do not cover parameters {short[:5]}")
    return {kind: {n: out[kind][n].reshape(info["shapes"][n]) for n in info["shapes"]} for kind in kinds}
