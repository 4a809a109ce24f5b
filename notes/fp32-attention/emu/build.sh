#!/bin/bash
# build.sh [attention.cu]: extracts the fp32 section of attention.cu (between the markers
# "// ---- float32 on the CUDA cores" and "// ---- Tensor-core path") and builds ./emu and the
# ThreadSanitizer build ./emu_tsan next to this script. Needs g++ >= 11 (C++20 <barrier>).
set -e
here=$(cd "$(dirname "$0")" && pwd)
src=${1:-$here/../../../src/kiln/backend/cuda/kernels/attention.cu}
python3 - "$src" "$here/f32_section.inc" <<'PY'
import sys
s = open(sys.argv[1]).read()
a = s.index("// ---- float32 on the CUDA cores")
b = s.index("// ---- Tensor-core path")
open(sys.argv[2], "w").write(s[a:b])
PY
cd "$here"
g++ -std=c++20 -O2 -pthread -Wall -Wno-unused-variable -Wno-unknown-pragmas -o emu main.cpp
g++ -std=c++20 -O1 -g -pthread -fsanitize=thread -Wno-unknown-pragmas -o emu_tsan main.cpp
echo built "$here/emu" "$here/emu_tsan" from "$src"
