"""The instruction mix of kiln's compiled kernels, basic block by basic block, from their SASS (no GPU needed).

    python benchmarks/sass_mix.py FAMILY.cu "kernel<args>" [...] [--nvdisasm PATH] [--min-size 16] [--out FILE.md]

Compiles the named instantiations of a kernel family with NVRTC for sm_90a (as the CUDA backend does),
disassembles the cubin with `nvdisasm` (pip's nvidia-cuda-nvdisasm, or --nvdisasm), splits the code into basic
blocks (a label starts one, a branch or exit ends one) and prints, per kernel, its registers and spills, its
instruction count and, for each block of at least --min-size instructions (and each that issues tensor-core
products, HGMMA), in address order, the block's size and its mix of the instructions that matter in an attention
kernel (exponentials, the mask's compares, predicates and selects). What a loop iteration issues is the sum of the
blocks it runs through: an issue-bound kernel is as fast as that sum.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIX = ("HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "FSEL", "ISETP", "PLOP3", "P2R", "LOP3", "R2UR")
_INS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")


def opcode(text: str) -> str:
    """An instruction's opcode without its predicate and modifiers: '@!P0 BRA.U `(.L_x_3)' -> 'BRA'."""
    return _PRED.sub("", text.strip()).split()[0].split(".")[0]


def basic_blocks(sass: str) -> list[tuple[str, list[str]]]:
    """(name, instructions) of each basic block of one kernel's disassembly, in address order: a label starts a
    block, a branch or an exit ends one (the block after a branch is named after the last label with '+')."""
    blocks, cur, name = [], [], "entry"
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            if cur:
                blocks.append((name, cur))
            cur, name = [], m.group(1)
            continue
        m = _INS.match(line)
        if not m:
            continue
        cur.append(m.group(2))
        if opcode(m.group(2)) in ("BRA", "EXIT"):
            blocks.append((name, cur))
            cur, name = [], name + "+"
    if cur:
        blocks.append((name, cur))
    return blocks


def mix(instructions: list[str]) -> collections.Counter:
    return collections.Counter(opcode(t) for t in instructions)


def report(name: str, sass: str, ptxas: dict | None, min_size: int) -> list[str]:
    blocks = basic_blocks(sass)
    total = sum(len(b) for _, b in blocks)
    regs = "" if ptxas is None else (f", {ptxas['registers']} registers, {ptxas['spill_stores']} bytes spilled, "
                                     f"{ptxas['stack']} bytes of stack")
    lines = [f"### `{name}`", "", f"{total} instructions{regs}", "",
             "| block | instructions | " + " | ".join(MIX) + " |", "|---|---|" + "---|" * len(MIX)]
    for label, ins in blocks:
        c = mix(ins)
        if c["HGMMA"] or len(ins) >= min_size:
            lines.append(f"| {label} | {len(ins)} | " + " | ".join(str(c[k]) for k in MIX) + " |")
    return lines + [""]


def find_nvdisasm(given: str | None) -> str:
    if given:
        return given
    on_path = shutil.which("nvdisasm")
    if on_path:
        return on_path
    try:
        import nvidia
        for base in nvidia.__path__:
            for cand in Path(base).glob("*/bin/nvdisasm"):
                return str(cand)
    except ImportError:
        pass
    raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or pass --nvdisasm PATH")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", help="a kernel family's file, e.g. attention.cu")
    p.add_argument("kernels", nargs="+", help="its instantiations, e.g. 'attention_fwd_tma<__nv_bfloat16, 64, true>'")
    p.add_argument("--nvdisasm", default=None)
    p.add_argument("--min-size", type=int, default=16, help="the fewest instructions of a block shown (default 16)")
    p.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    import tempfile

    from kiln.backend.cuda import compiler
    nvdisasm = find_nvdisasm(args.nvdisasm)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    from cuda.bindings import nvrtc
    version = "%d.%d" % tuple(nvrtc.nvrtcVersion()[1:])
    lines = [f"# SASS instruction mix of {args.family} at {commit}{' (src modified)' if dirty else ''}, sm_90a, "
             f"NVRTC {version}", "",
             "`python benchmarks/sass_mix.py " + " ".join(repr(a) if " " in a else a for a in sys.argv[1:]) + "`", ""]
    for name in args.kernels:
        compiled = compiler.compile_family(args.family, name_expressions=[name], verbose_ptxas=True)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.cubin)
            f.flush()
            sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
        ptxas = compiler.ptxas_report(compiled.log).get(compiled.lowered[name])
        lines += report(name, sass, ptxas, args.min_size)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
