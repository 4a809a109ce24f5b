"""kiln.launch: `kiln launch`, the supervisor of a rank gang (paper §4.4, Distributed Orchestration).

supervisor.py starts, watches and restarts the gang; rank.py is the ranks' side (heartbeats,
bad-step checks, failure reports); anomaly.py the NaN and z-score spike detector; incidents.py
the classes and incidents.jsonl; faults.py the KILN_FAULT injection hook for recovery tests;
health.py NVML, NUMA pinning and Prometheus, each optional.
"""

from kiln.launch.anomaly import BadStep, BadStepDetector
from kiln.launch.faults import FaultPlan
from kiln.launch.incidents import Incident, IncidentLog
from kiln.launch.rank import BadStepError, RankAgent
from kiln.launch.supervisor import LaunchConfig, Supervisor

__all__ = ["BadStep", "BadStepDetector", "BadStepError", "FaultPlan", "Incident", "IncidentLog", "LaunchConfig",
           "RankAgent", "Supervisor"]
