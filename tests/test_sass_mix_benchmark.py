"""benchmarks/sass_mix.py: SASS split into basic blocks and each block's instruction mix (no GPU, no nvdisasm)."""

from tests.benchmark_support import load_benchmark

SASS = """
        .text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P1 BRA `(.L_x_1) ;
        /*0020*/                   FSEL R2, R2, -INF , !P0 ;
        /*0030*/                   ISETP.GT.OR P0, PT, R3, R4, P2 ;
.L_x_1:
        /*0040*/                   MUFU.EX2 R5, R5 ;
        /*0050*/                   FFMA R5, R5, R6, -R7 ;
        /*0060*/              @!P0 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
"""


def test_blocks_end_at_branches_and_start_at_labels_and_their_mix_drops_predicates_and_modifiers():
    sm = load_benchmark("sass_mix")
    assert sm.opcode("@!P0 BRA.U `(.L_x_3)") == "BRA" and sm.opcode("HGMMA.64x128x16.F32.BF16 R24, R132") == "HGMMA"
    blocks = sm.basic_blocks(SASS)
    assert [(name, len(ins)) for name, ins in blocks] == [("entry", 2), ("entry+", 2), (".L_x_1", 3), (".L_x_1+", 1)]
    assert sm.mix(blocks[1][1]) == {"FSEL": 1, "ISETP": 1}
    lines = sm.report("k", SASS, {"registers": 40, "spill_stores": 0, "stack": 0}, min_size=3)
    assert "8 instructions, 40 registers, 0 bytes spilled, 0 bytes of stack" in lines
    rows = [line for line in lines if line.startswith("| .L_x") or line.startswith("| entry")]
    assert rows == ["| .L_x_1 | 3 | 0 | 1 | 1 | " + " | ".join(["0"] * 10) + " |"]
