"""The supervisor's health paths with their packages (issue 16): NVML (nvidia-ml-py) reading the
GPUs and judging them, each rank pinned to its NUMA node's cores, and the Prometheus exporter
scraped over loopback while a gang runs."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kiln.launch.health import Health, numa_nodes, rank_cpus
from tests.launch_support import incidents, launch, processes_of, start_launch

STEPS = [sys.executable, str(Path(__file__).parent / "ranks" / "launch_steps.py")]
WRITE_CPUS = ("import json, os; open(os.path.join(os.environ['KILN_RUN_DIR'], 'cpus-' + os.environ['RANK']), 'w')"
              ".write(json.dumps({'cpus': sorted(os.sched_getaffinity(0)), "
              "'visible': os.environ.get('CUDA_VISIBLE_DEVICES')}))")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nvml_starts() -> bool:
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def _scrape(port: int) -> dict:
    """{(name, labels as sorted tuples): value} of everything the exporter serves."""
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _sysfs_cpulist(path: Path) -> list[int]:
    cpus = []
    for part in path.read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


# ---------------------------------------------------------------------- NVML
def test_without_a_driver_nvml_says_so_and_the_gpus_are_left_alone(tmp_path):
    if _nvml_starts():
        pytest.skip("NVML starts here: test_nvml_reads_and_judges_the_gpus (cuda) covers this machine")
    said = []
    health = Health(tmp_path / "health.jsonl", None, said.append)
    assert health.nvml is None and said[0].startswith("GPU health: not available (NVML did not start (")
    health.sample(0)
    assert health.usable_gpus(2) is None and health.cpus_for(0, 2, gpu=0) is None
    assert not (tmp_path / "health.jsonl").exists()
    health.close()


def test_a_gpu_with_new_double_bit_ecc_errors_or_an_xid_is_left_out_while_spares_exist(tmp_path):
    """Health.record judges NVML's readings (read_gpus' rows and XID events) the same wherever they
    come from; here four GPUs on this machine's real PCI devices, so that each GPU's cores are its
    device's local_cpulist in sysfs."""
    devices = sorted(d for d in Path("/sys/bus/pci/devices").glob("*") if (d / "local_cpulist").is_file()) \
        if Path("/sys/bus/pci/devices").is_dir() else []
    if not devices:
        pytest.skip("Linux shows no PCI devices with local_cpulist here")
    said = []
    health = Health(tmp_path / "health.jsonl", None, said.append)
    rows = [{"gpu": i, "pci_bus_id": "0000" + devices[i % len(devices)].name, "temperature_c": 40 + i,
             "ecc_dbe": 7 if i == 2 else 0, "memory_used_bytes": 1 << 30} for i in range(4)]
    health.record(rows, [], attempt=0)
    assert health.unhealthy == set() and health.usable_gpus(4) == [0, 1, 2, 3]
    rows[2]["ecc_dbe"] = 8  # a double-bit ECC error since the run began; 7 were there before
    health.record(rows, [{"xid": 79, "gpu": 1, "gpu_uuid": "GPU-1"}], attempt=1)
    assert health.unhealthy == {1, 2}
    assert health.usable_gpus(2) == [0, 3]
    assert health.usable_gpus(3) == [0, 1, 2, 3] and "using unhealthy GPU(s) [1, 2] too" in said[-1]
    lines = [json.loads(line) for line in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["unhealthy"], r["xid_events"]) for r in lines] == [
        (0, [], []), (1, [1, 2], [{"xid": 79, "gpu": 1, "gpu_uuid": "GPU-1"}])]
    allowed = os.sched_getaffinity(0)
    for i in range(4):
        local = _sysfs_cpulist(devices[i % len(devices)] / "local_cpulist")
        assert health.cpus_for(i, 4, gpu=i) == ([c for c in local if c in allowed] or None)
    health.close()


@pytest.mark.cuda
def test_nvml_reads_and_judges_the_gpus(tmp_path):
    """On a GPU machine: every GPU read from NVML (temperature, memory, its PCI device's cores),
    healthy at the start, and a launched rank pinned to its GPU's NUMA node's cores."""
    pytest.importorskip("pynvml")
    if not _nvml_starts():
        pytest.skip("NVML does not start here")
    said = []
    health = Health(tmp_path / "health.jsonl", None, said.append)
    health.sample(0)
    [line] = [json.loads(x) for x in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert line["gpus"] and line["unhealthy"] == []
    for row in line["gpus"]:
        assert 5 <= row["temperature_c"] <= 110 and 0 < row["memory_used_bytes"] < row["memory_total_bytes"]
        assert row["uuid"].startswith("GPU-") and "throttle_reasons" in row
    assert health.usable_gpus(1) == [r["gpu"] for r in line["gpus"]]
    local = _sysfs_cpulist(Path(f"/sys/bus/pci/devices/{line['gpus'][0]['pci_bus_id'].lower()[-12:]}/local_cpulist"))
    allowed = os.sched_getaffinity(0)
    want = [c for c in local if c in allowed]  # none: this process may not use the GPU's node's cores
    assert health.cpus_for(0, 1, gpu=0) == (want or None)
    health.close()
    run = tmp_path / "run"
    proc = launch(run, [sys.executable, "-c", WRITE_CPUS], "--nproc", 1)
    assert proc.returncode == 0, proc.stderr
    got = json.loads((run / "cpus-0").read_text())
    assert got == {"cpus": want or sorted(allowed), "visible": ",".join(str(r["gpu"]) for r in line["gpus"])}
    assert json.loads((run / "health.jsonl").read_text().splitlines()[0])["gpus"][0]["gpu"] == 0


# ---------------------------------------------------------------------- NUMA
def test_cpu_ranks_spread_over_numa_nodes():
    two = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [rank_cpus(two, r, 4) for r in range(4)] == [two[0], two[1], two[0], two[1]]
    assert rank_cpus(two, 0, 1) == two[0] + two[1]  # a rank alone keeps every core
    four = [[0], [1], [2], [3]]
    assert [rank_cpus(four, r, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert rank_cpus([], 0, 2) == []


def test_launched_cpu_ranks_are_pinned_to_their_numa_node(tmp_path):
    """For real, on this machine's nodes (one node: every rank on that node's cores)."""
    root = Path("/sys/devices/system/node")
    nodes = [_sysfs_cpulist(d / "cpulist") for d in sorted(root.glob("node[0-9]*"), key=lambda d: int(d.name[4:]))
             if (d / "cpulist").read_text().strip()] if root.is_dir() else []
    if not nodes:
        pytest.skip("Linux shows no NUMA nodes here")
    assert numa_nodes() == nodes
    run = tmp_path / "run"
    proc = launch(run, [sys.executable, "-c", WRITE_CPUS], "--nproc", 3)
    assert proc.returncode == 0, proc.stderr
    allowed = os.sched_getaffinity(0)
    for r in range(3):
        want = [c for c in (nodes[r % len(nodes)] if len(nodes) <= 3 else rank_cpus(nodes, r, 3)) if c in allowed]
        assert json.loads((run / f"cpus-{r}").read_text()) == {"cpus": want or sorted(allowed), "visible": None}


# ---------------------------------------------------------------------- Prometheus
def test_prometheus_serves_the_gangs_metrics_over_loopback(tmp_path):
    """`kiln launch --prometheus-port P`: scraped while two ranks train, each rank's step, loss and
    grad norm are those of one of its heartbeats, and the restart after a killed rank is counted."""
    port = _free_port()
    run = tmp_path / "run"
    launcher = start_launch(run, [*STEPS, 400, 0.05], "--nproc", 2, "--max-restarts", 1, "--prometheus-port", port,
                            fault="kill@step=3,rank=1")
    try:
        deadline, seen = time.monotonic() + 90, {}
        while time.monotonic() < deadline:
            try:
                seen = _scrape(port)
            except OSError:  # not serving yet
                seen = {}
            if seen.get(("kiln_attempt", ())) == 1 and seen.get(("kiln_rank_step", (("rank", "1"),)), 0) >= 5:
                break
            time.sleep(0.2)
        assert seen.get(("kiln_attempt", ())) == 1, seen
        assert seen[("kiln_incidents_total", (("class", "dead_rank"),))] == 1
        for rank in ("0", "1"):
            step = seen[("kiln_rank_step", (("rank", rank),))]
            assert step >= 1 and seen[("kiln_rank_loss", (("rank", rank),))] == 1.0 + 1.0 / step
            assert seen[("kiln_rank_grad_norm", (("rank", rank),))] == 1.0
            assert 0 <= seen[("kiln_rank_heartbeat_age_seconds", (("rank", rank),))] < 30
    finally:
        launcher.terminate()
        _, err = launcher.communicate(timeout=60)
    assert f"Prometheus metrics on :{port}/metrics" in err
    assert [i["class"] for i in incidents(run)] == ["dead_rank"]
    assert processes_of(run) == []
    with pytest.raises(OSError):  # the exporter went with the launcher
        _scrape(port)


def test_the_exporter_stops_with_health(tmp_path):
    port = _free_port()
    health = Health(tmp_path / "health.jsonl", port, lambda msg: None)
    health.update({0: {"step": 3, "time": time.time(), "loss": 2.5, "grad_norm": None}}, attempt=0)
    seen = _scrape(port)
    assert seen[("kiln_rank_step", (("rank", "0"),))] == 3 and seen[("kiln_rank_loss", (("rank", "0"),))] == 2.5
    assert ("kiln_rank_grad_norm", (("rank", "0"),)) not in seen  # no norm reported: no sample
    health.close()
    with pytest.raises(OSError):
        _scrape(port)
    with socket.socket() as s:  # and nothing listens on its port (a closed connection may linger in TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", port))
