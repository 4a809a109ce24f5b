#!/usr/bin/env bash
# s18 call 4: what bounds fused-tma: 064f78d against s18-nochain (the same kernel with no order chain: no counter
# waits, every tile reduce-added into a zeroed accumulator; an experiment, not for main)
set -u
O=$OUT/r; mkdir -p $O
export PYTHONUNBUFFERED=1
pack() { (cd $OUT && tar czf r.tgz.tmp r && mv r.tgz.tmp r.tgz); }
t0=$SECONDS; timeout -s KILL 200 python3 benchmarks/ab.py run --arms ab-arms/nochain --repeat 1 --logs $O/ab-nochain --timeout 95 -- python3 benchmarks/attention.py --ops bwd --bwd fused-tma --shapes 16x12x1024x64,8x12x2048x64,2x12x16384x64 > $O/ab-nochain.log 2>&1; echo "ab-nochain rc $? $((SECONDS-t0)) s" >> $O/summary.txt
python3 benchmarks/ab.py table $O/ab-nochain > $O/ab-nochain-table.txt 2>&1; cat $O/ab-nochain-table.txt >> $O/summary.txt
pack
