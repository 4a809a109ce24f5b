"""benchmarks/ncu_summary.py reads Nsight Compute's details page and per-instruction CSV as ncu 2025
prints them (the layout of benchmarks/results/device-logs/device-check-2026-12-06-h100-s11/)."""

import csv
import io

import pytest

from tests.benchmark_support import load_benchmark

DETAILS = """[3006] python3.12@127.0.0.1
  void attention_fwd_tma<__nv_bfloat16, 64, 1>(TmaMap, TmaMap, T1 *, float *, int) (132, 1, 1)x(384, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Throughput                   %        42.82
    Duration                         us       124.58
    ----------------------- ----------- ------------
    Section: Memory Workload Analysis
    Memory Throughput                          Tbyte/s         1.44
    L2 Hit Rate                                      %        38.93
    Registers Per Thread             register/thread             168
    Achieved Occupancy                        %        13.96
    Issue Slots Busy               %        43.97
    Waves Per SM                                                   1
  cupy_copy__bfloat16_bfloat16 (98304, 1, 1)x(128, 1, 1), Context 1, Stream 13, Device 0, CC 9.0
    Duration                         us        62.14
    Memory Throughput                          Gbyte/s       573.67
    DRAM Throughput                   %        17.12
"""


def _sass_csv():
    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_wait", "stall_long_sb",
            "stall_wait (Not Issued)"]
    rows = [["Kernel Name", "void attention_fwd_tma<__nv_bfloat16, (int)64, (bool)1>(TmaMap, int)"], head,
            ["0x10", "  BRA 0x20", "30", "20", "10", "99"], ["0x20", "  FMNMX R1, R2, R3", "10", "10", "0", "99"],
            ["Kernel Name", "void attention_fwd_tma<__nv_bfloat16, (int)64, (bool)1>(TmaMap, int)"], head,
            ["0x10", "  BRA 0x20", "1000", "1000", "0", "0"]]  # ncu's repeated block: ignored
    f = io.StringIO()
    csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    return list(csv.reader(io.StringIO(f.getvalue())))


def test_details_give_each_launch_and_the_dram_bytes_it_implies():
    ncu = load_benchmark("ncu_summary")
    fwd, copy = ncu.parse_details(DETAILS)
    assert fwd["name"] == "attention_fwd_tma<__nv_bfloat16, 64, 1>" and fwd["grid"] == (132, 1, 1)
    assert fwd["block"] == (384, 1, 1) and fwd["Duration"] == pytest.approx(124.58)
    assert fwd["DRAM MB"] == pytest.approx(1.44e12 * 124.58e-6 / 1e6)
    assert fwd["Registers Per Thread"] == 168 and fwd["Issue Slots Busy"] == pytest.approx(43.97)
    assert copy["name"] == "cupy_copy__bfloat16_bfloat16" and copy["DRAM MB"] == pytest.approx(573.67e9 * 62.14e-6 / 1e6)
    assert "L2 Hit Rate" not in copy


def test_sass_stalls_by_reason_and_instruction_from_the_first_block():
    ncu = load_benchmark("ncu_summary")
    k = ncu.parse_sass(_sass_csv())["attention_fwd_tma<__nv_bfloat16, (int)64, (bool)1>"]
    assert k["reasons"] == {"wait": 30, "long_sb": 10}
    text = ncu.render(ncu.parse_details(DETAILS), {"fwd": k}, top=1)
    assert "| 0 | `attention_fwd_tma<__nv_bfloat16, 64, 1>` | 132x1x1 x 384x1x1 | 124.6 | 42.8 | 179.4 |" in text
    assert "40 stall samples" in text and "wait 75.0%, long_sb 25.0%" in text
    assert "| 30 | 75.0 | `BRA 0x20` |" in text and "FMNMX" not in text  # top=1


def test_a_file_without_launches_is_an_error(tmp_path, capsys):
    ncu = load_benchmark("ncu_summary")
    p = tmp_path / "details.log"
    p.write_text("==PROF== nothing profiled\n")
    assert ncu.main([str(p)]) == 1 and "no kernel launch" in capsys.readouterr().err
