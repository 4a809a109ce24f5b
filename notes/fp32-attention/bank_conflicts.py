# Bank-conflict check of the fp32 attention kernels' shared-memory access patterns (word addresses,
# lane layout mg/ng as in attention.cu). modelA: distinct words per bank over the warp (at least W
# cycles for a W-word access); modelB: the same within phases of 32/W lanes. python3 bank_conflicts.py
# Bank-conflict check of the fp32 kernels' shared-memory access patterns (addresses in words).
import itertools
def mg(l): return ((l >> 1) & 1) | ((l >> 3) & 2)
def ng(l): return (l & 1) | ((l >> 1) & 6)
def cost(addr_fn, W, warp=0):
    lanes = {l: [addr_fn(l, warp) + w for w in range(W)] for l in range(32)}
    # model A: distinct words per bank over the whole warp, at least W
    banks = {}
    for l, ws in lanes.items():
        for a in ws: banks.setdefault(a % 32, set()).add(a)
    a_cost = max(W, max(len(s) for s in banks.values()))
    # model B: phases of 32/W lanes (quarter warps for 128-bit), conflicts within a phase
    per = 32 // W; b_cost = 0
    for p in range(W):
        bk = {}
        for l in range(p * per, (p + 1) * per):
            for a in lanes[l]: bk.setdefault(a % 32, set()).add(a)
        b_cost += max(len(s) for s in bk.values())
    uniq = len({a for ws in lanes.values() for a in ws})
    return a_cost, b_cost, uniq
def report(name, fn, W, warps=(0, 1)):
    res = [cost(fn, W, w) for w in warps]
    a = max(r[0] for r in res); b = max(r[1] for r in res)
    flag = "" if a == W and b <= W else "   <-- conflict"
    print(f"  {name:58s} W={W} modelA={a} modelB={b} unique_words={res[0][2]}{flag}")
for D in (32, 64, 128):
    TM = 4 if D >= 128 else 8; WM = 4 * TM; BN = 64 if D <= 32 else (32 if D <= 64 else 16)
    TN = BN // 8; TE = D // 8
    print(f"D={D} TM={TM} WM={WM} BN={BN} TN={TN} TE={TE}")
    # forward
    BQ = 2 * WM; LDK = D + 4; LDP = BQ + 4
    for i4 in range(0, TM, 4):
        report(f"fwd  S: Qt[d][rl+{i4}] (d=0)", lambda l, w: 0 * BQ + w * WM + mg(l) * TM + i4, 4)
    for j in range(TN):
        report(f"fwd  S: Ks[ng+8*{j}][d..] (d=0)", lambda l, w: (ng(l) + 8 * j) * LDK + 0, 4)
    for j in range(TN):
        for i4 in range(0, TM, 4):
            report(f"fwd  P store: Pt[ng+8*{j}][rl+{i4}]", lambda l, w: (ng(l) + 8 * j) * LDP + w * WM + mg(l) * TM + i4, 4)
    for i4 in range(0, TM, 4):
        report(f"fwd  PV: Pt[k][rl+{i4}] (k=0)", lambda l, w: 0 * LDP + w * WM + mg(l) * TM + i4, 4)
    for cc in range(TE // 4):
        report(f"fwd  PV: Vs[k][4ng+32*{cc}] (k=0)", lambda l, w: 0 * D + ng(l) * 4 + 32 * cc, 4)
    CH = D // 4
    for LD, nm in ((LDK, "Ks"), (D, "Vs")):
        report(f"fwd  cp.async into {nm} (first 32 chunks of warp)", lambda l, w: ((w * 32 + l) // CH) * LD + ((w * 32 + l) % CH) * 4, 4)
    # dK/dV
    BK = WM; LDQ = D + 4; LDP = BK + 4
    for i4 in range(0, TM, 4):
        report(f"dkdv S: Kt[d][kl+{i4}]", lambda l, w: mg(l) * TM + i4, 4)
    for j in range(TN):
        report(f"dkdv S: Qs[ng+8*{j}][d..]", lambda l, w: (ng(l) + 8 * j) * LDQ, 4)
    for j in range(TN):
        for i4 in range(0, TM, 4):
            report(f"dkdv Ps/Ss[ng+8*{j}][kl+{i4}] store/load", lambda l, w: (ng(l) + 8 * j) * LDP + mg(l) * TM + i4, 4)
    for j in range(TN):
        report(f"dkdv Ls[ng+8*{j}]", lambda l, w: ng(l) + 8 * j, 1)
    for i4 in range(0, TM, 4):
        report(f"dkdv dV/dK: Ps[k][kl+{i4}]", lambda l, w: mg(l) * TM + i4, 4)
    for cc in range(TE // 4):
        report(f"dkdv dV/dK: Gs[k][4ng+32*{cc}]", lambda l, w: ng(l) * 4 + 32 * cc, 4)
    report(f"dkdv cp.async into Qs", lambda l, w: ((w * 32 + l) // CH) * LDQ + ((w * 32 + l) % CH) * 4, 4)
    # dQ
    BQ = WM; LDK = D + 4; LDP = BQ + 4; HN = BN // 2
    for i4 in range(0, TM, 4):
        report(f"dq   S: Qt[d][rl+{i4}]", lambda l, w: mg(l) * TM + i4, 4)
    for j in range(TN):
        report(f"dq   S: Ks[ng+8*{j}][d..]", lambda l, w: (ng(l) + 8 * j) * LDK, 4)
    for j in range(TN):
        for i4 in range(0, TM, 4):
            report(f"dq   Ps/Ss[ng+8*{j}][rl+{i4}]", lambda l, w: (ng(l) + 8 * j) * LDP + mg(l) * TM + i4, 4)
    for i4 in range(0, TM, 4):
        report(f"dq   dQ: Ss[w*HN+k][rl+{i4}]", lambda l, w: (w * HN) * LDP + mg(l) * TM + i4, 4)
    for cc in range(TE // 4):
        report(f"dq   dQ: Ks[w*HN+k][4ng+32*{cc}]", lambda l, w: (w * HN) * LDK + ng(l) * 4 + 32 * cc, 4)
    for i in (0,):
        for e4 in range(0, TE, 4):
            report(f"dq   partial dQ via Ks: [rl+{i}][4ng+8*{e4}]", lambda l, w: (mg(l) * TM + i) * D + ng(l) * 4 + 8 * e4, 4)
