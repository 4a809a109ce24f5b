#!/usr/bin/env bash
# One device call that checks a session's work on a GPU machine: the CUDA tests, then whichever
# benchmark parts are named (each under its own time limit, its log in one archive under $OUT).
#
#   KILN_COMMIT=<this checkout's HEAD> OUT=/tmp/out bash benchmarks/device_check.sh tests gpt2 ddp tp cp tptrace precision profile launch
#
# KILN_COMMIT is required: the device machine gets a copy of the working tree whose `git rev-parse HEAD` answers
# an older commit (the session's first, 2026-12-07), so the result files' commit must come from here.
#
# Parts: tests (SUITE_K=expr: a pytest -k expression, e.g. 'not tma and not fused' to leave out kernels that have
# never run, whose own parts try them alone; pytest -m "cuda and not slow" through benchmarks/cuda_suite.py: every kernel family compiled at once
# into the kernel cache, then the tests in 4 shards side by side on the GPU, a log each; the serial suite took ~550 s),
# gpt2 (gpt2_step bf16: kiln vs eager vs compile), branch-cast (issue 14: the add+LayerNorm backward writing the bf16
# branch gradient against the old separate cast, one call, ~100 s), strict (gpt2_step tf32 and fp32: kiln, eager,
# compile, and kiln-recompute: issue 14's tf32 and fp32 rows), long (issue 14's long context: B2 T16384, bf16 and fp32,
# kiln and kiln-recompute vs eager),
# ddp / tp / cp (the parallel benchmarks at world size 1), tptrace (the async-TP schedule, N = 1 and 4,
# in a CUPTI trace at world size 1), precision (kiln compare on the GPU in
# bf16 and fp32), profile (the graph-replayed bf16 step's kernels against the ceilings), the paper's Figure 3
# in three parts, one run (2000 steps of B4 T1024 from the same weights on the same random windows of 2000
# Python source files): fidelity-fp32 (kiln and eager, ~400 s: a call of its own), fidelity-fp32-compile
# (~250 s: the fp32 band) and fidelity-bf16 (kiln, eager, compile, ~250 s), the last two one call; then on
# any machine: python benchmarks/fidelity.py --merge benchmarks/results/fidelity/fidelity-<date>-2000steps-*.json
# bf16res (issues 14/17: the LayerNorm kernels over an fp32 residual, their tests and the precision logger's,
# and kiln's bf16 step with the old bf16 residual, to set beside gpt2's default fp32 residual, ~200 s)
# launch (kiln launch --nproc 1 with an injected kill and an injected NaN, recovered), launch-tests
# (issue 16's CUDA tests: recovery bit for bit, NCCL abort through the store, NVML and NUMA pinning),
# overlap (a DDP step's bucket collectives against backward, traced), ceilings (GEMM and copy, measured afresh),
# capture76 (issue 14: the 76-layer fp32 step captured as one graph, every allocation logged to
# capture76-trace.json and replayed through the allocator on the CPU at the device's free bytes),
# attention-bwd (issue 14: the fused backward, KILN_ATTENTION_BWD=fused-bulk: the backwards' ptxas report, a 2-minute
# smoke test, benchmarks/attention.py --bwd split,fused-bulk against SDPA, then the fused backward's tests (the smoke
# test and the benchmark first: a call cut off at its limit keeps them), ~5 minutes), attention-bwd-gpt2 (kiln's bf16
# GPT-2 step alone under split and fused-bulk, at B16 T1024 and at the long context B2 T16384, ~3 min),
# largest (the largest fp32 AdamW model: PyTorch at 76 layers vs kiln's AdamW in backward at 76 and 92, clip off,
# on and host (the clip through host memory), ~300-450 s: a call of its own), largest-h100 (the same on an 80 GB H100, scaled: PyTorch at 42 and 44
# layers, where 16 bytes a parameter stop it, kiln at 53 layers, 1.2x 44's parameters), largest-tests (the in-backward step against the ordinary one, bit for bit),
# attention (issue 14: the fused backward's masking and graph-replay tests, then benchmarks/attention.py with every
# forward and backward against SDPA, all graph-timed, ~5 min), attention-tma (issue 14: the forward with flash-attention 3's structure, KILN_ATTENTION_FWD=tma and tma-pingpong:
# the forwards' ptxas report, a 2-minute smoke test, then benchmarks/attention.py with the three forwards against
# SDPA and its tests, bf16, ~10 minutes at most: a call of its own),
# attention-tiles (issue 14: the split dK/dV kernel under KILN_ATTENTION_DKDV_TILES, the default and two tilings:
# the backward tests, benchmarks/attention.py --bwd split and kiln's bf16 GPT-2 step under each, ~4 min),
# gemm-tune (issue 14: cuBLASLt algorithm tuning: its CUDA tests and the GEMM probe under tuning, the bf16 step with
# the heuristic's GEMM algorithms (kiln) beside the tuned ones (kiln-tuned, which tunes in its step 0 on this
# fresh machine), and every GEMM of the bf16, tf32 and fp32 steps heuristic vs tuned, ~500 s),
# attention-ncu (issue 14: Nsight Compute's full set on one call of each attention kernel, kiln's forward, split-tma, split and
# fused-bulk backwards and SDPA's, at the GPT-2 shape: benchmarks/attention_ncu.py; the report, its details page,
# its per-SASS-instruction page and their digest by benchmarks/ncu_summary.py, ~1 min),
# tf32-attention (issue 14's tf32 row: the *_tf32 attention kernels' tests, benchmarks/attention.py tf32 and fp32 against
# SDPA, the tf32 step with eager and compile and its kernel tables, ~5 min; s16's call 2 ran these three commands),
# compiler (the device's NVRTC version, and tests/test_kernel_compile.py under it, one line a test: CI compiles with
# the nvidia-cuda-nvrtc wheel pyproject.toml pins, 13.0.88, the device image's release since 2026-12-07, when 13.5's
# ptxas passed a spill test the device's failed; run this part when the image changes, ~2 min).
set -u
OUT=${OUT:?set OUT to a folder for the logs}
LOGS=$(mktemp -d)/device-check; mkdir -p "$LOGS"; touch "$LOGS/.start"
KILN_COMMIT=${KILN_COMMIT:?set KILN_COMMIT to the commit measured: the git HEAD of the checkout that sent the call}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KILN_COMMIT
archive() {  # what the benchmarks wrote under benchmarks/results/ in this call, and the logs: one archive back,
    # remade after every part, so a call cut off at its limit still returns the parts before
    find benchmarks/results -newer "$LOGS/.start" -type f |
        tar -czf "$OUT/device-check.tgz.tmp" -T - -C "$(dirname "$LOGS")" device-check &&
        mv "$OUT/device-check.tgz.tmp" "$OUT/device-check.tgz"
    cp "$LOGS/summary.txt" "$OUT/"
}
part() {  # part NAME SECONDS COMMAND...: run COMMAND with a time limit, its output into NAME.log
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS rc
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s" | tee -a "$LOGS/summary.txt"
    tail -n 4 "$LOGS/$name.log"
    archive
    return $rc
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOGS/summary.txt"
for p in "$@"; do
    case $p in
        tests) part pytest-cuda 580 python3 benchmarks/cuda_suite.py --shards 4 --logs "$LOGS" ${SUITE_K:+-k "$SUITE_K"} ;;
        gpt2) part gpt2_step 190 python3 benchmarks/gpt2_step.py --modes bf16 --steps 40 --warmup 10 ;;
        bf16res) part ln-tests 150 python3 -m pytest -q -m "cuda and not slow" -p no:cacheprovider \
                     tests/test_op_layer_norm.py tests/test_precision.py tests/test_cuda_model.py
                 part gpt2_step-bf16-residual-bf16 100 python3 benchmarks/gpt2_step.py --modes bf16 --steps 40 \
                     --warmup 10 --frameworks kiln --bf16-residual bf16 --out "$LOGS/gpt2-bf16-residual-bf16" ;;
        branch-cast) part gpt2_step-branch-cast 150 python3 benchmarks/gpt2_step.py --modes bf16 --steps 40 \
                         --warmup 10 --frameworks kiln,kiln-branch-cast --out "$LOGS/gpt2-branch-cast" ;;
        strict) part gpt2_step-tf32-fp32 480 python3 benchmarks/gpt2_step.py --modes tf32,fp32 --steps 30 --warmup 5 \
                    --frameworks kiln,kiln-recompute,eager,compile --out "$LOGS/gpt2-tf32-fp32" ;;
        long) part gpt2_step-long 420 python3 benchmarks/gpt2_step.py --modes bf16,fp32 --frameworks kiln,kiln-recompute,eager \
                  --batch-size 2 --seq-len 16384 --steps 10 --warmup 3 --out "$LOGS/gpt2-long" ;;
        ddp) part ddp 100 python3 benchmarks/ddp.py --steps 20 --warmup 5 ;;
        tp) part tp 120 python3 benchmarks/tp.py ;;
        cp) part cp 50 python3 benchmarks/cp.py --seq-lens 16384 ;;
        tptrace) part async_tp_trace 120 python3 benchmarks/async_tp_trace.py ;;
        precision) part precision-bf16 45 python3 -m kiln.cli compare --config gpt2-124m --device cuda \
                       --precision bf16 --batch-size 4 --seq-len 1024 --out "$LOGS/compare-bf16"
                   part precision-fp32 45 python3 -m kiln.cli compare --config gpt2-124m --device cuda \
                       --precision fp32 --batch-size 4 --seq-len 1024 --out "$LOGS/compare-fp32" ;;
        profile) part step_profile 120 python3 benchmarks/step_profile.py --mode bf16 ;;
        fidelity-fp32) part fidelity-fp32 560 python3 benchmarks/fidelity.py --modes fp32 --frameworks kiln,eager \
                           --site-packages --max-files 2000 ;;
        fidelity-fp32-compile) part fidelity-fp32-compile 330 python3 benchmarks/fidelity.py --modes fp32 \
                                   --frameworks compile --site-packages --max-files 2000 ;;
        fidelity-bf16) part fidelity-bf16 330 python3 benchmarks/fidelity.py --modes bf16 --site-packages \
                           --max-files 2000 ;;
        overlap) part ddp_overlap 90 python3 benchmarks/ddp_overlap.py ;;
        ceilings) part ceilings 30 python3 -c "import kiln; from kiln.profiler.ceilings import measure; \
                      print(measure(kiln.device('cuda')))" ;;
        launch) part launch 80 python3 benchmarks/recovery.py --device cuda --faults kill,nan ;;
        launch-tests) part launch-tests 300 python3 -m pytest -q -m cuda -p no:cacheprovider \
                          tests/test_launch_recovery_cuda.py tests/test_launch.py tests/test_launch_health.py ;;
        capture76) part graph_capture_size-76 400 python3 benchmarks/graph_capture_size.py --n-layer 76 \
                       --batch-size 2 --seq-len 1024 --save-trace "$LOGS/capture76-trace.json"
                   free=$(grep -o 'capacity [0-9]*' "$LOGS/graph_capture_size-76.log" | head -1 | cut -d' ' -f2)
                   part allocator-replay-76 120 python3 benchmarks/allocator_trace.py \
                       --replay "$LOGS/capture76-trace.json" --capacity "${free:-150.7e9}" ;;
        largest) part largest_model 570 python3 benchmarks/largest_model.py ;;
        largest-h100) part largest_model-h100 570 python3 benchmarks/largest_model.py --torch-layers 42,44 \
                          --kiln-layers 53 --name "largest_model-$(date +%F)-h100" ;;
        largest-tests) part largest-tests 200 python3 -m pytest -q -m cuda -p no:cacheprovider \
                           tests/test_adamw_in_backward.py ;;
        attention-tma) part attention-tma-ptxas 60 python3 -c "from kiln.backend.cuda import attention, compiler; \
                           r = compiler.compile_family('attention.cu', 'sm_90a', verbose_ptxas=True); \
                           rep = compiler.ptxas_report(r.log); \
                           [print(e, rep[m]) for e, m in r.lowered.items() if 'fwd' in e]; \
                           print(*(l for l in r.log.splitlines() if 'C75' in l), sep='\n')"
                       # a hang or a fault shows here, in 2 minutes, before the long parts run
                       part attention-tma-smoke 120 python3 -m pytest -x -q -m cuda -p no:cacheprovider \
                           tests/test_op_attention.py -k "tma_reads_packed or (tma_matches_the_cpu_reference and shape3)" &&
                       part attention-tma-bench 240 python3 benchmarks/attention.py --fwd wgmma,tma,tma-pingpong &&
                       part attention-tma-tests 220 python3 -m pytest -q -m cuda -p no:cacheprovider \
                           tests/test_op_attention.py -k "tma" ;;
        attention-bwd) part attention-bwd-ptxas 60 python3 -c "from kiln.backend.cuda import attention, compiler; \
                           r = compiler.compile_family('attention.cu', 'sm_90a', verbose_ptxas=True); \
                           rep = compiler.ptxas_report(r.log); \
                           [print(e, rep[m]) for e, m in r.lowered.items() if 'bwd' in e]; \
                           print(*(l for l in r.log.splitlines() if 'C75' in l), sep='\n')"
                       # a hang (a turn never given) or a fault shows here, in 2 minutes, before the long parts run
                       part attention-bwd-smoke 120 python3 -m pytest -x -q -m cuda -p no:cacheprovider \
                           tests/test_op_attention.py -k "bwd_variant_equals_split and (shape0 or shape1)" &&
                       part attention-bwd-bench 200 python3 benchmarks/attention.py --bwd split,split-tma,fused-bulk &&
                       part attention-bwd-tests 200 python3 -m pytest -q -m "cuda and not slow" -p no:cacheprovider \
                           tests/test_op_attention.py -k "fused or split-tma or variant_equals or tma_is" ;;
        attention) part attention-fused-tests 150 python3 -m pytest -q -m cuda -p no:cacheprovider \
                       tests/test_op_attention.py -k "bwd_fused_masks or bwd_fused_replays"
                   part attention-bench 330 python3 benchmarks/attention.py --fwd wgmma,tma,tma-pingpong \
                       --bwd split,split-tma,fused-bulk ;;
        attention-tiles) for spec in "" "64:32x3,128:16x1" "64:32x2"; do  # each in its own processes: read at import
                             tag=${spec:-default}; tag=${tag//[:,]/-}
                             export KILN_ATTENTION_DKDV_TILES=$spec
                             [ -z "$spec" ] || part "attention-tiles-tests-$tag" 120 python3 -m pytest -q -m cuda \
                                 -p no:cacheprovider tests/test_op_attention.py -k "split and not fused"
                             part "attention-tiles-bench-$tag" 120 python3 benchmarks/attention.py --bwd split \
                                 --out "$LOGS/attention-tiles-$tag.json"
                             part "attention-tiles-gpt2-$tag" 90 python3 benchmarks/gpt2_step.py --modes bf16 \
                                 --frameworks kiln --steps 40 --warmup 10 --out "$LOGS/gpt2-tiles-$tag"
                         done
                         unset KILN_ATTENTION_DKDV_TILES ;;
        attention-bwd-gpt2) for variant in split fused-bulk; do
                                KILN_ATTENTION_BWD=$variant part "gpt2_step-$variant" 120 python3 benchmarks/gpt2_step.py \
                                    --modes bf16 --frameworks kiln --steps 40 --warmup 10 --out "$LOGS/gpt2-$variant"
                                KILN_ATTENTION_BWD=$variant part "gpt2_step-long-$variant" 150 python3 \
                                    benchmarks/gpt2_step.py --modes bf16 --frameworks kiln --batch-size 2 --seq-len 16384 \
                                    --steps 10 --warmup 3 --out "$LOGS/gpt2-long-$variant"
                            done ;;
        attention-ncu) part attention-ncu 300 ncu --clock-control none --profile-from-start off --set full \
                           --import-source no -o "$LOGS/attention-ncu" python3 benchmarks/attention_ncu.py &&
                       part attention-ncu-details 120 ncu --import "$LOGS/attention-ncu.ncu-rep" --page details &&
                       part attention-ncu-sass 120 ncu --import "$LOGS/attention-ncu.ncu-rep" --page source --csv \
                           --print-source sass &&
                       part attention-ncu-summary 60 python3 benchmarks/ncu_summary.py "$LOGS/attention-ncu-details.log" \
                           "$LOGS/attention-ncu-sass.log" --out "$LOGS/attention-ncu-summary.md" ;;
        compiler) part nvrtc-version 30 python3 -c "from kiln.backend.cuda import compiler; \
                      print('NVRTC', compiler._nvrtc_version())" &&
                  part kernel-compile-tests 300 python3 -m pytest -v -p no:cacheprovider tests/test_kernel_compile.py ;;
        tf32-attention) part tf32-attention-tests 200 python3 -m pytest -v -p no:cacheprovider -m cuda \
                            tests/test_op_attention.py -k "tf32 or test_attention_is_bitwise or test_context_parallel"
                        part attention-tf32 150 python3 benchmarks/attention.py --dtypes tf32,fp32 --bwd split \
                            --shapes 16x12x1024x64,8x16x1024x64,4x32x2048x128,2x12x16384x64 --out "$LOGS/attention-tf32.json"
                        part gpt2_step-tf32 240 python3 benchmarks/gpt2_step.py --modes tf32 --frameworks kiln,eager,compile \
                            --steps 50 --warmup 10 --out "$LOGS/gpt2-tf32" --kernel-profile "$LOGS/prof-tf32" ;;
        gemm-tune) part gemm-tune-tests 240 python3 benchmarks/cuda_suite.py --shards 2 --logs "$LOGS/gemm-tune" \
                       --paths tests/test_gemm_autotune.py tests/test_cuda_gemm.py
                   part gpt2_step-gemm-tune 150 python3 benchmarks/gpt2_step.py --modes bf16 --steps 40 --warmup 10 \
                       --frameworks kiln,kiln-tuned --out "$LOGS/gpt2-gemm-tune"
                   part gemm_autotune 200 python3 benchmarks/gemm_autotune.py --modes bf16,tf32,fp32 ;;
        *) echo "unknown part $p" ;;
    esac
done
