# Lower bounds for the fp32 kernels at B16 H12 T1024 D64 on an H200 (132 SMs, 4 SMSPs, 1 warp-instr/cycle
# per SMSP; shared pipe 128 B/cycle/SM, LDS.128 = 4 cycles, STS.128 = 4, STS.128 2-way = 8, SHFL = 1).
BH, T = 192, 1024
SM = 132
def per_head_tiles_fwd():
    act = inact = 0
    for b in range(T // 64):
        q0 = b * 64; nt = (q0 + 63) // 32 + 1
        for w in range(2):
            for t in range(nt):
                if t * 32 <= q0 + 32 * w + 31: act += 1
                else: inact += 1
    return act, inact
def per_head_tiles_dkdv():
    return sum(T // 32 - kb for kb in range(T // 32)) * 2, 0
def per_head_tiles_dq():
    return sum(qb + 1 for qb in range(T // 32)) * 2, 0
# (instructions per active warp-tile, per inactive one, shared-pipe cycles per active warp-tile)
kern = {
  # S loop 8 x 287, P.V 4 x 552, outer 805; LDS.128: 8*24 + 4*32 = 320 -> 1280; P store 8 STS.128 (2-way) 64;
  # cp.async K+V 16 x 16 B per thread -> 64 per warp; 24 SHFL + 8 at the end
  "fwd":  (8 * 287 + 4 * 552 + 805, 250, 1280 + 64 + 64 + 24, per_head_tiles_fwd()),
  # S loop 8 x 287, dV/dK 4 x 552, outer ~973; 1280 + P/dS (warp 0: 64, warp 1: 32 + 64 -> mean 80) + Q, dO 64 + L, D 16
  "dkdv": (8 * 287 + 4 * 552 + 973, 0, 1280 + 80 + 64 + 16, per_head_tiles_dkdv()),
  # S loop 8 x 287, dQ 2 x 552, outer ~813; LDS.128 8*24 + 2*32 = 256 -> 1024; P/dS 80; K, V 64
  "dq":   (8 * 287 + 2 * 552 + 813, 0, 1024 + 80 + 64, per_head_tiles_dq()),
}
tot = {}
for name, (ins, ins_in, shc, (act, inact)) in kern.items():
    wi = (act * ins + inact * ins_in) * BH
    issue_cycles = wi / SM / 4
    shared_cycles = act * BH * shc / SM
    for ghz in (1.98, 1.75):
        i_ms, s_ms = issue_cycles / ghz / 1e6, shared_cycles / ghz / 1e6
        print(f"{name:5s} {ghz} GHz: active warp-tiles/head {act}, issue bound {i_ms:.3f} ms, shared bound {s_ms:.3f} ms")
    tot[name] = (issue_cycles, shared_cycles)
for ghz in (1.98, 1.75):
    lb = sum(max(a, b) for a, b in tot.values()) / ghz / 1e6
    print(f"sum of max bounds at {ghz} GHz: {lb:.2f} ms; at 80% of that bound: {lb / 0.8:.2f} ms")
