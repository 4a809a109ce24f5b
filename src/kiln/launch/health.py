"""Device health and telemetry for the supervisor: NVML, NUMA pinning, Prometheus (paper §4.4).

Each is optional and says so once when it is not there (no GPU, no `nvidia-ml-py`, no
`prometheus-client`, no NUMA information), never failing the run:

- NVML (`pip install nvidia-ml-py`): per GPU temperature, ECC error counts (volatile, single and
  double bit), clock-throttle reasons, XID events (as far as NVML's event set delivers them) and
  memory, sampled at each attempt and every HEALTH_EVERY_S into <run>/health.jsonl. A GPU with
  a double-bit ECC error or an XID since the run began is unhealthy; when there are more GPUs
  than ranks it is left out of the next attempt (CUDA_VISIBLE_DEVICES).
- NUMA: each rank is pinned to the CPU cores of its GPU's NUMA node (sysfs local_cpulist of
  the GPU's PCI device).
- Prometheus (`pip install prometheus-client`, --prometheus-port P): step, loss, grad norm and
  heartbeat age per rank, restarts, incidents per class, GPU temperature and ECC counts.
"""

from __future__ import annotations

import json
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
        self.gpus: dict[int, dict] = {}
        self.unhealthy: set[int] = set()
        self._events = None
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

    def _read_gpu(self, i: int) -> dict:
        n = self.nvml
        h = n.nvmlDeviceGetHandleByIndex(i)
        row = {"gpu": i}
        for name, read in (
                ("temperature_c", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
                ("ecc_sbe", lambda: n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                                                  n.NVML_VOLATILE_ECC)),
                ("ecc_dbe", lambda: n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                                  n.NVML_VOLATILE_ECC)),
                ("throttle_reasons", lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
                ("memory_used_bytes", lambda: n.nvmlDeviceGetMemoryInfo(h).used),
                ("memory_total_bytes", lambda: n.nvmlDeviceGetMemoryInfo(h).total)):
            try:
                row[name] = int(read())
            except Exception:  # a counter this GPU does not have (ECC off): left out of the row
                pass
        return row

    def sample(self, attempt: int) -> None:
        """Read every GPU (and pending XID events) into health.jsonl; flag unhealthy GPUs."""
        self._last = time.monotonic()
        if self.nvml is None:
            return
        n = self.nvml
        rows = [self._read_gpu(i) for i in range(n.nvmlDeviceGetCount())]
        xids = []
        while self._events is not None:
            try:
                e = n.nvmlEventSetWait(self._events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: no event pending
                break
            xids.append({"xid": int(e.eventData), "gpu_uuid": str(n.nvmlDeviceGetUUID(e.device))})
        for row in rows:
            known = self.gpus.setdefault(row["gpu"], {"ecc_dbe_at_start": row.get("ecc_dbe", 0)})
            if row.get("ecc_dbe", 0) > known["ecc_dbe_at_start"]:
                self.unhealthy.add(row["gpu"])
            known.update(row)
        if xids:
            uuids = {str(n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i))): i for i in range(len(rows))}
            self.unhealthy |= {uuids[x["gpu_uuid"]] for x in xids if x["gpu_uuid"] in uuids}
        with open(self.path, "a") as f:
            f.write(json.dumps({"time": time.time(), "attempt": attempt, "gpus": rows, "xid_events": xids,
                                "unhealthy": sorted(self.unhealthy)}) + "\n")
        if self.prom is not None:
            for row in rows:
                for name in ("temperature_c", "ecc_sbe", "ecc_dbe"):
                    if name in row:
                        self.prom["gpu"].labels(gpu=str(row["gpu"]), metric=name).set(row[name])

    def usable_gpus(self, nproc: int) -> list[int] | None:
        """The GPUs for the next attempt (None: no NVML, leave CUDA_VISIBLE_DEVICES alone): the
        healthy ones first; an unhealthy one only if there are not enough spares."""
        if self.nvml is None:
            return None
        count = self.nvml.nvmlDeviceGetCount()
        healthy = [i for i in range(count) if i not in self.unhealthy]
        if len(healthy) < nproc:
            self.say(f"only {len(healthy)} healthy GPU(s) for {nproc} rank(s): using unhealthy "
                     f"GPU(s) {sorted(self.unhealthy)} too")
            return list(range(count))
        return healthy

    def cpus_for(self, gpu: int | None) -> list[int] | None:
        """The CPU cores of this GPU's NUMA node (None when the topology is not visible)."""
        if gpu is None or self.nvml is None:
            return None
        try:
            bus = self.nvml.nvmlDeviceGetPciInfo(self.nvml.nvmlDeviceGetHandleByIndex(gpu)).busId
            bus = (bus.decode() if isinstance(bus, bytes) else bus).lower()
            text = Path(f"/sys/bus/pci/devices/{bus[-12:]}/local_cpulist").read_text()
            return _cpulist(text) or None
        except Exception:
            return None

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
        self._prom_server = p.start_http_server(port, registry=registry)
        self.say(f"Prometheus metrics on :{port}/metrics")
        return metrics

    def close(self) -> None:
        server = getattr(self, "_prom_server", None)
        if server is not None and isinstance(server, tuple):
            server[0].shutdown()
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
