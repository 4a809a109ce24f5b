"""Device health and telemetry for the supervisor: NVML, NUMA pinning, Prometheus (paper §4.4).

Each is optional and says so once when it is not there (no GPU, no `nvidia-ml-py`, no
`prometheus-client`, no NUMA information), never failing the run:

- NVML (`pip install nvidia-ml-py`): per GPU temperature, ECC error counts (volatile, single and
  double bit), clock-throttle reasons, XID events (as far as NVML's event set delivers them) and
  memory, sampled at each attempt and every HEALTH_EVERY_S into <run>/health.jsonl. A GPU with
  a double-bit ECC error or an XID since the run began is unhealthy; when there are more GPUs
  than ranks it is left out of the next attempt (CUDA_VISIBLE_DEVICES).
- NUMA: each rank is pinned to the CPU cores of its GPU's NUMA node (sysfs local_cpulist of
  the GPU's PCI device); a rank without a GPU (CPU ranks) to NUMA node local_rank mod the
  node count (sysfs /sys/devices/system/node). Always within the cores the supervisor may use.
- Prometheus (`pip install prometheus-client`, --prometheus-port P): step, loss, grad norm and
  heartbeat age per rank, restarts, incidents per class, GPU temperature and ECC counts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

HEALTH_EVERY_S = 10.0


def _nvml():
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml, None
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    except Exception as e:  # NVMLError: no driver, no GPU
        return None, f"NVML did not start ({e})"


def read_gpus(nvml, events=None) -> tuple[list[dict], list[dict]]:
    """(a row per GPU, the pending XID events of the NVML event set `events`) read from NVML: what
    Health.record judges."""
    rows = [_read_gpu(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]
    uuids = {row.get("uuid"): row["gpu"] for row in rows}
    xids = []
    while events is not None:
        try:
            e = nvml.nvmlEventSetWait(events, 0)
        except Exception:  # NVML_ERROR_TIMEOUT: no event pending
            break
        uuid = str(nvml.nvmlDeviceGetUUID(e.device))
        xids.append({"xid": int(e.eventData), "gpu": uuids.get(uuid), "gpu_uuid": uuid})
    return rows, xids


def _read_gpu(n, i: int) -> dict:
    h = n.nvmlDeviceGetHandleByIndex(i)
    row = {"gpu": i}
    for name, read in (
            ("uuid", lambda: str(n.nvmlDeviceGetUUID(h))),
            ("pci_bus_id", lambda: _text(n.nvmlDeviceGetPciInfo(h).busId)),
            ("temperature_c", lambda: int(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))),
            ("ecc_sbe", lambda: int(n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                                                  n.NVML_VOLATILE_ECC))),
            ("ecc_dbe", lambda: int(n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                                  n.NVML_VOLATILE_ECC))),
            ("throttle_reasons", lambda: int(n.nvmlDeviceGetCurrentClocksEventReasons(h))),
            ("memory_used_bytes", lambda: int(n.nvmlDeviceGetMemoryInfo(h).used)),
            ("memory_total_bytes", lambda: int(n.nvmlDeviceGetMemoryInfo(h).total))):
        try:
            row[name] = read()
        except Exception:  # a counter this GPU does not have (ECC off): left out of the row
            pass
    return row


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> list[list[int]]:
    """The CPU cores of each NUMA node with cores, in node order ([] where Linux shows none)."""
    nodes = sorted((int(d.name[4:]), d) for d in root.glob("node[0-9]*") if (d / "cpulist").is_file())
    return [cpus for _, d in nodes if (cpus := _cpulist((d / "cpulist").read_text()))]


def rank_cpus(nodes: list[list[int]], local_rank: int, nproc: int) -> list[int]:
    """A CPU rank's cores: NUMA node local_rank mod the node count, or with fewer ranks than nodes
    every node i with i mod nproc = local_rank (so one rank alone keeps every core)."""
    if not nodes:
        return []
    mine = nodes[local_rank::nproc] if nproc < len(nodes) else [nodes[local_rank % len(nodes)]]
    return [c for node in mine for c in node]


def gpu_cpus(pci_bus_id: str) -> list[int]:
    """The CPU cores local to a PCI device (NVML's bus id 00000000:17:00.0 or sysfs's 0000:17:00.0)."""
    return _cpulist(Path(f"/sys/bus/pci/devices/{pci_bus_id.lower()[-12:]}/local_cpulist").read_text())


def _cpulist(text: str) -> list[int]:
    cpus = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


class Health:
    def __init__(self, path: Path, prometheus_port: int | None, say):
        self.path, self.say = Path(path), say
        self.nvml, why = _nvml()
        self.gpus: dict[int, dict] = {}  # the last row of each GPU, with its double-bit ECC count at the start
        self.unhealthy: set[int] = set()
        self._events = None  # NVML's XID event set
        self._last = 0.0
        if self.nvml is None:
            say(f"GPU health: not available ({why})")
        else:
            self._watch_xids()
        self.prom = self._prometheus(prometheus_port) if prometheus_port else None

    # ------------------------------------------------------------------ NVML
    def _watch_xids(self) -> None:
        n = self.nvml
        try:
            self._events = n.nvmlEventSetCreate()
            for i in range(n.nvmlDeviceGetCount()):
                n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(i), n.nvmlEventTypeXidCriticalError,
                                           self._events)
        except Exception as e:
            self._events = None
            self.say(f"GPU XID events: not available ({e})")

    def sample(self, attempt: int) -> None:
        """Read every GPU and the pending XID events from NVML (where it is) and record them."""
        self._last = time.monotonic()
        if self.nvml is not None:
            self.record(*read_gpus(self.nvml, self._events), attempt)

    def record(self, rows: list[dict], xids: list[dict], attempt: int) -> None:
        """One sample of the GPUs (read_gpus' rows and XID events) into health.jsonl and Prometheus;
        a GPU whose double-bit ECC count rose since its first sample, or with an XID event, is
        unhealthy from then on."""
        for row in rows:
            known = self.gpus.setdefault(row["gpu"], {"ecc_dbe_at_start": row.get("ecc_dbe", 0)})
            if row.get("ecc_dbe", 0) > known["ecc_dbe_at_start"]:
                self.unhealthy.add(row["gpu"])
            known.update(row)
        self.unhealthy |= {x["gpu"] for x in xids if x.get("gpu") is not None}
        with open(self.path, "a") as f:
            f.write(json.dumps({"time": time.time(), "attempt": attempt, "gpus": rows, "xid_events": xids,
                                "unhealthy": sorted(self.unhealthy)}) + "\n")
        if self.prom is not None:
            for row in rows:
                for name in ("temperature_c", "ecc_sbe", "ecc_dbe", "memory_used_bytes"):
                    if name in row:
                        self.prom["gpu"].labels(gpu=str(row["gpu"]), metric=name).set(row[name])

    def usable_gpus(self, nproc: int) -> list[int] | None:
        """The GPUs for the next attempt (None: no GPU sampled, leave CUDA_VISIBLE_DEVICES alone):
        the healthy ones first; an unhealthy one only if there are not enough spares."""
        if not self.gpus:
            return None
        healthy = [i for i in sorted(self.gpus) if i not in self.unhealthy]
        if len(healthy) < nproc:
            self.say(f"only {len(healthy)} healthy GPU(s) for {nproc} rank(s): using unhealthy "
                     f"GPU(s) {sorted(self.unhealthy)} too")
            return sorted(self.gpus)
        return healthy

    def cpus_for(self, local_rank: int, nproc: int, gpu: int | None) -> list[int] | None:
        """The CPU cores to pin a rank to: those of its GPU's NUMA node, or for a rank without a GPU
        rank_cpus'. Only cores this process may use. None: leave the rank unpinned (the topology
        is not visible, or none of those cores is allowed)."""
        try:
            if gpu is not None:
                bus = self.gpus.get(gpu, {}).get("pci_bus_id")
                cpus = gpu_cpus(bus) if bus else []
            else:
                cpus = rank_cpus(numa_nodes(), local_rank, nproc)
        except (OSError, ValueError):
            return None
        allowed = os.sched_getaffinity(0)
        return [c for c in cpus if c in allowed] or None

    # ------------------------------------------------------------------ the run's telemetry
    def update(self, beats: dict[int, dict], attempt: int) -> None:
        if time.monotonic() - self._last > HEALTH_EVERY_S:
            self.sample(attempt)
        if self.prom is None:
            return
        now = time.time()
        for rank, hb in beats.items():
            r = str(rank)
            self.prom["step"].labels(rank=r).set(hb["step"])
            self.prom["heartbeat_age"].labels(rank=r).set(now - hb["time"])
            for name in ("loss", "grad_norm"):
                if hb.get(name) is not None:
                    self.prom[name].labels(rank=r).set(hb[name])
        self.prom["attempt"].set(attempt)

    def incident(self, inc) -> None:
        if self.prom is not None:
            self.prom["incidents"].labels(**{"class": inc.cls}).inc()

    def _prometheus(self, port: int):
        try:
            import prometheus_client as p
        except ImportError:
            self.say("Prometheus export: not available (pip install prometheus-client); continuing without it")
            return None
        registry = p.CollectorRegistry()
        metrics = {
            "step": p.Gauge("kiln_rank_step", "last step a rank reported", ["rank"], registry=registry),
            "loss": p.Gauge("kiln_rank_loss", "training loss of the last step", ["rank"], registry=registry),
            "grad_norm": p.Gauge("kiln_rank_grad_norm", "gradient norm of the last step", ["rank"],
                                 registry=registry),
            "heartbeat_age": p.Gauge("kiln_rank_heartbeat_age_seconds", "seconds since the rank's last "
                                     "heartbeat", ["rank"], registry=registry),
            "attempt": p.Gauge("kiln_attempt", "restarts so far", registry=registry),
            "incidents": p.Counter("kiln_incidents", "incidents by class", ["class"], registry=registry),
            "gpu": p.Gauge("kiln_gpu", "GPU health counters", ["gpu", "metric"], registry=registry),
        }
        self._prom_server, _ = p.start_http_server(port, registry=registry)
        self.say(f"Prometheus metrics on :{port}/metrics")
        return metrics

    def close(self) -> None:
        """Stop the metrics server (its port is free again) and NVML."""
        if self.prom is not None:
            self._prom_server.shutdown()
            self._prom_server.server_close()
            self.prom = None
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
