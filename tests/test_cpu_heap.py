"""The CPU backend's end of warm-up: glibc's heap keeps what a step frees (kiln.backend.cpu.heap)."""

from __future__ import annotations

from kiln.backend import cpu
from kiln.backend.cpu import heap


def test_end_warmup_raises_the_mmap_and_trim_thresholds(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda param, value: calls.append((param, value)) or 1)
    cpu.end_warmup()
    assert calls == [(heap.M_MMAP_THRESHOLD, 32 << 20), (heap.M_TRIM_THRESHOLD, 1 << 30)]


def test_this_c_library_takes_the_thresholds_and_a_missing_or_refusing_one_is_said(monkeypatch):
    if heap._mallopt() is not None:  # glibc (CI's): both values within its bounds
        assert heap.keep_freed_memory() is True
    monkeypatch.setattr(heap, "_mallopt", lambda: None)
    assert heap.keep_freed_memory() is False
    monkeypatch.setattr(heap, "_mallopt", lambda: lambda param, value: 0)
    assert heap.keep_freed_memory() is False
