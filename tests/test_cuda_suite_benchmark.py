"""benchmarks/cuda_suite.py: the sharded CUDA suite collects what pytest selects and deals every id to one shard."""

from tests.benchmark_support import load_benchmark

cuda_suite = load_benchmark("cuda_suite")


def test_collect_returns_the_selected_node_ids():
    ids = cuda_suite.collect("not slow", ["tests/test_cuda_suite_benchmark.py"])
    assert ids == ["tests/test_cuda_suite_benchmark.py::test_collect_returns_the_selected_node_ids",
                   "tests/test_cuda_suite_benchmark.py::test_deal_gives_every_id_to_exactly_one_shard",
                   "tests/test_cuda_suite_benchmark.py::test_collect_narrows_by_keyword"]


def test_deal_gives_every_id_to_exactly_one_shard():
    ids = [f"t::{i}" for i in range(11)]
    shards = cuda_suite.deal(ids, 4)
    assert [len(s) for s in shards] == [3, 3, 3, 2]
    assert sorted(sum(shards, []), key=lambda s: int(s[3:])) == ids
    assert shards[1] == ["t::1", "t::5", "t::9"]


def test_collect_narrows_by_keyword():
    ids = cuda_suite.collect("not slow", ["tests/test_cuda_suite_benchmark.py"], "deal")
    assert ids == ["tests/test_cuda_suite_benchmark.py::test_deal_gives_every_id_to_exactly_one_shard"]
