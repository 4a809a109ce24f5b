"""Every collective of a ProcessGroup on real MPI ranks, against NumPy on all ranks' inputs.

Each rank draws its inputs from (seed, rank), so every rank can also draw everyone's and compute
the expected result; the result file holds the largest error of each check."""

import numpy as np
from rank_output import write_result

import kiln
import kiln.distributed as dist


def inputs(rank, shape, dtype):
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-1000, 1000, shape).astype(dtype)


def main():
    world = dist.init_process_group("mpi", timeout=30)
    W, r = world.size, world.rank
    errors = {}

    def check(name, got, want):
        errors[name] = float(np.max(np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64))))

    for dtype in ("float64", "float32", "int64"):
        all_in = [inputs(q, (6, 5), dtype) for q in range(W)]
        for op in ("sum", "max") + (("avg",) if dtype != "int64" else ()):
            t = kiln.tensor(all_in[r])
            world.all_reduce(t, op)
            want = {"sum": np.sum(all_in, axis=0, dtype=np.float64), "max": np.max(all_in, axis=0),
                    "avg": np.mean(np.asarray(all_in, dtype=np.float64), axis=0)}[op]
            check(f"all_reduce_{op}_{dtype}", t.numpy(), want)
        big = [inputs(q, (W * 3, 4), dtype) for q in range(W)]
        out = kiln.zeros(3, 4, dtype=dtype)
        world.reduce_scatter(out, kiln.tensor(big[r]), "sum")
        check(f"reduce_scatter_sum_{dtype}", out.numpy(), np.sum(big, axis=0, dtype=np.float64)[3 * r:3 * r + 3])
        gathered = kiln.zeros(W * 6, 5, dtype=dtype)
        world.all_gather(gathered, kiln.tensor(all_in[r]))
        check(f"all_gather_{dtype}", gathered.numpy(), np.concatenate(all_in))
        t = kiln.tensor(all_in[r])
        world.broadcast(t, src=W - 1)
        check(f"broadcast_{dtype}", t.numpy(), all_in[W - 1])

    # bfloat16 moves as bytes (broadcast, all_gather), exactly
    b = kiln.tensor(inputs(r, (7,), "float32")).to("bfloat16")
    world.broadcast(b, src=0)
    check("broadcast_bfloat16", b.numpy().astype(np.float32),
          kiln.tensor(inputs(0, (7,), "float32")).to("bfloat16").numpy().astype(np.float32))

    # reduce_scatter avg, float32
    big = [inputs(q, (W * 2,), "float32") for q in range(W)]
    out = kiln.zeros(2, dtype="float32")
    world.reduce_scatter(out, kiln.tensor(big[r]), "avg")
    check("reduce_scatter_avg_float32", out.numpy(), np.mean(np.asarray(big, np.float64), axis=0)[2 * r:2 * r + 2])

    # reduce_scatter_all_gather: the all-reduce (avg) whose every element has the bits of a reduce_scatter
    # of the same layout; several in flight at once, waited in reverse order
    for dtype in ("float64", "float32"):
        big = [[inputs(q + 10 * i, (W * (5 + i),), dtype) for q in range(W)] for i in range(3)]
        ts = [kiln.tensor(b[r]) for b in big]
        works = [world.reduce_scatter_all_gather(t, "avg", async_op=True) for t in ts]
        for w in reversed(works):
            w.wait()
        for i, t in enumerate(ts):
            check(f"reduce_scatter_all_gather_{dtype}_{i}", t.numpy(), np.mean(np.asarray(big[i], np.float64), axis=0))
            shard = kiln.zeros(5 + i, dtype=dtype)
            world.reduce_scatter(shard, kiln.tensor(big[i][r]), "avg")
            errors[f"reduce_scatter_all_gather_bits_{dtype}_{i}"] = int(np.count_nonzero(
                t.numpy()[r * (5 + i):(r + 1) * (5 + i)] != shard.numpy()))

    # send/recv around a ring, both async
    mine = kiln.tensor(inputs(r, (4, 3), "float64"))
    got = kiln.zeros(4, 3, dtype="float64")
    works = [world.recv(got, (r - 1) % W, async_op=True), world.send(mine, (r + 1) % W, async_op=True)]
    for w in works:
        w.wait()
    check("send_recv_ring", got.numpy(), inputs((r - 1) % W, (4, 3), "float64"))

    # several async all-reduces in flight at once, waited in reverse order
    ts = [kiln.tensor(inputs(r, (50 + i,), "float64") * (i + 1)) for i in range(3)]
    works = [world.all_reduce(t, "avg", async_op=True) for t in ts]
    assert all(isinstance(w, dist.Work) for w in works)
    for w in reversed(works):
        w.wait()
    for i, t in enumerate(ts):
        check(f"async_all_reduce_{i}", t.numpy(),
              np.mean([inputs(q, (50 + i,), "float64") * (i + 1) for q in range(W)], axis=0))
    world.barrier()

    # sub-groups: the even ranks, and a split by parity
    evens = list(range(0, W, 2))
    g = world.new_group(evens)
    assert (g is None) == (r % 2 == 1)
    if g is not None:
        t = kiln.tensor(inputs(r, (5,), "float64"))
        g.all_reduce(t, "sum")
        check("new_group_evens", t.numpy(), np.sum([inputs(q, (5,), "float64") for q in evens], axis=0))
        assert g.ranks == evens and g.rank == evens.index(r)
    half = world.split(r % 2)
    t = kiln.tensor(inputs(r, (5,), "float64"))
    half.all_reduce(t, "sum")
    check("split_parity", t.numpy(), np.sum([inputs(q, (5,), "float64") for q in range(r % 2, W, 2)], axis=0))

    # a DeviceMesh dp x tp: each dimension's group reduces over the right ranks
    if W % 2 == 0:
        mesh = dist.DeviceMesh({"dp": -1, "tp": 2})
        tp_ranks = [r - r % 2, r - r % 2 + 1]
        dp_ranks = list(range(r % 2, W, 2))
        assert mesh["tp"].ranks == tp_ranks and mesh["dp"].ranks == dp_ranks, (mesh["tp"].ranks, mesh["dp"].ranks)
        for name, ranks in (("tp", tp_ranks), ("dp", dp_ranks)):
            t = kiln.tensor(inputs(r, (3,), "float64"))
            mesh[name].all_reduce(t, "sum")
            check(f"mesh_{name}", t.numpy(), np.sum([inputs(q, (3,), "float64") for q in ranks], axis=0))
    write_result(r, {"world_size": W, "errors": errors})


if __name__ == "__main__":
    main()
