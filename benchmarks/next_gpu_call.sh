#!/usr/bin/env bash
# What the next GPU calls run first (2 GPUs, repository root, .whl/ and .peers/ carried), each
# well under the 600 s per command:
#   bash benchmarks/next_gpu_call.sh tests [K]  -- the GPU tests (those pytest -k K selects), each
#       in its own pytest run with its log under $OUT, stopping before BUDGET (540) seconds; the
#       whole file takes about 20 minutes (each training run starts in ~40 s on the GPU machine),
#       so split it over calls, e.g. K="cuda or adamw or varlen or entropy or fp32 or tensor or graphed" then
#       K="pipeline or curve" then K="zero"
# The next 2-GPU session's calls (sessions 23 to 27 were lent one GPU only: the one-GPU tests and
# the pairs' streams and graphs on one GPU passed; session 22 ran s22B: bf16 gradient buffers do
# not lift dp=2, BENCHMARKS.md). 30 device minutes; kind
# nvidia-h200-x2 (or -h100-x2); send the next call at once: the machine is given back 30 s after
# a call ends:
#   1. s23A -- micro-batch pairs with parallel.tp_pairs_backward=in_turn (PAIRS_SETTINGS=turn, the
#      default): one thread issues both backwards in one order on every rank (CPU-tested to the
#      bit; never run on a GPU). Runs of 30 timed steps until BUDGET (540 s): count hangs (the
#      two-thread backwards hung in 5 of 25 runs of 4-10 steps, sessions 19-20) and ms/step
#      (the two-thread version: 353-363 ms on 2x H100)
#   2. s23A with PAIRS_SETTINGS=0 EXTRA_ENV="CUDA_DEVICE_MAX_CONNECTIONS=32": the two-thread
#      backwards with 32 hardware queues instead of 8 (CUDA gives two streams no promise of
#      independent progress: streams sharing a queue can make a kernel wait behind another
#      stream's spinning NCCL kernel; one queue stopped the hangs and the gain in session 20)
#      If 1 hung too: s23A with EXTRA_ENV="NCCL_LAUNCH_ORDER_IMPLICIT=1" (NCCL >= 2.26 orders the
#      communicators' operations by host launch order, which the in-turn backward makes the same
#      on every rank; the two-thread backwards do not, session 20)
#   3. where 1 (or 2) ran clean: the issue-6 rows with the pairs, e.g. COMPARE_BUDGET=585 python3
#      benchmarks/compare.py gpt-1.3b 1gpu tp2 \
#        tp2+parallel.tp_microbatch_pairs=true+parallel.tp_pairs_backward=in_turn
#      (Llama-1B next); many clean runs would justify pairs on by default
#   4. the 2-GPU tests (tests K="nccl or pairs or graphed_layers_without or overlapped or rng_tracker",
#      rng_tracker new in session 23, nccl_checkpoint_loads_into_other_layouts new in session 26: a
#      tp=2 + SP checkpoint trained on at dp=2 under zero 1 and FSDP, never run yet; and K="nonfinite":
#      its gpt2-zero3-2 case, new in session 27, FSDP's fused AdamW skipping a nan step at dp=2):
#      the others last ran in sessions 18-20
# Session 20's calls (done; BENCHMARKS.md session 20): s20A (pairs with one hardware queue: 0
# of 6 hung, no gain; default 1 of 6 hung), s18B / s18C (the issue-6 rows with both peers),
# s20C (gc_probe: 0.2 ms per collection between bare steps), s20D (the trainer's collections:
# ~250 ms of the collector's own scan, not the GPU), the GPU test of bf16 at dp=2 (passed).
# Its plan, as written before the calls:
# Session 20's calls (30 device minutes; kind nvidia-h100-x2; send the next call at once):
#   1. s20A -- can micro-batch pairs be made safe? (off by default since session 19: 4 of 19
#      pairs_ab runs hung in their first 10 steps, side adds off; NCCL says two communicators in
#      flight at once may deadlock). pairs_ab runs (each step printed, stacks dumped where a step
#      runs 25 s) with CUDA_DEVICE_MAX_CONNECTIONS=1 (kernels start in the order they were issued;
#      the forwards are issued by one thread in the same order on both ranks, the two backwards
#      from two threads, so a clean result speaks for the forwards first), alternating with the
#      control (default connections); speed of both (~540 s). Only a clean run count far above
#      19 would justify turning pairs back on.
#   2. the issue-6 rows with both peers and the default tp=2 (no pairs): s18B / s18C
#      (compare.py, GPT then Llama, ~580 s each)
#   3. s20C -- where a gc_interval collection's ~270 ms goes (session 19: the refreeze did not
#      help; on a CPU training makes no garbage cycles at all): benchmarks/gc_probe.py times a
#      collection with the host ahead of the GPU and one after a sync (~70 s)
# Session 19's calls (done; BENCHMARKS.md session 19): s19A (side-adds GPU test failed: the
# tied embedding), a probe (used_more_than_once's id-keyed count), the fix's GPU test (passed),
# pairs_ab runs (side adds +2.0-2.5 %; 4 of 19 runs hung), s18E (gc_interval:
# still ~270 ms per collection after the refreeze).
# Session 18's calls (done; BENCHMARKS.md session 18): s18D (the tp=2 profile: pairs ran one
# after the other), s18E (gc_interval: ~250 ms per collection), s18A (GPU tests), s18F (pairs
# interleaved and concurrent: +13.7 %), s18G (curve test, Llama +8.3 %), s18H (pairs_ab: side
# adds +2.3 %, forward lag nothing; the pairs GPU test ran out of its time with side adds on).
# Its plan, as written before the calls:
# Session 18's calls, in order (30 device minutes; kind nvidia-h100-x2; send the next call at once):
#   1. s18A -- the GPU tests that session 17's changes touch and that did not run after them:
#      graphed layers' gradients on the step's stream (every layer's nodes now held on the capture
#      stream; a review found the last layer's left on the warm-up stream), the pairs against the
#      plain tp=2 run (pairs now auto), graphed tp=2 against eager and graphed tp=2 without SP
#      (both now with auto pairs) (~420 s)
#   1b. s18A2 -- the graphed group of the 200-step curve test (the step stream) and the graphed
#      overlapped TP paths (pairs auto with tp_comm_overlap) (~350 s)
#   2. s18B -- GPT-1.3B one GPU (twice), tp=2 (pairs auto) and dp=2 with both peers
#      (benchmarks/compare.py; torch DDP left out), the issue-6 rows on one card (~580 s)
#   3. s18C -- the same for Llama-1B (~580 s)
#   4. s18D -- where tp=2 + SP's step goes with pairs (auto) and without: kernel_table.py per
#      rank (session 13: ~95 ms of a 384 ms step in unoverlapped SP collectives; the pairs hid
#      only ~4 %: do the two streams' NCCL and GEMMs overlap, or does one wait?) (~250 s)
#   5. (if time is left) s18E -- GPT-1.3B dp=2 with train.gc_interval=5: each collection's host
#      time (gc_ms, "GC host ms" line) against the ~0.3 s dips of session 17 (a frozen collection
#      takes ~0.1 ms on a CPU) (~70 s)
# Session 17's calls (done; BENCHMARKS.md session 17):
#   1. s17A -- the GPU test of the micro-batch pairs (parallel.tp_microbatch_pairs against the
#      plain tp=2 + SP run, graphed and eager, fp32; session 16's ran out of its 170 s), then
#      GPT-1.3B tp=2 + SP with and without pairs (the version with two backward calls, forwards
#      side by side, set B captured on its own stream; session 16's first version +1.0 %), one GPU
#      in the same call. The plain tp=2 figure also checks DataParallel's hook now moving graphed
#      layers' gradient adds onto the step's stream (session 16: 41,421-41,629) (~480 s)
#   2. s17B -- Llama-1B: one GPU (auto now: compiled layers with fused weight gradients), dp=2
#      zero=1 (issue 4's 0.97), tp=2 + SP with and without pairs; the GPU test of graphed layers at
#      dp=2 under the overlapped gather (DataParallel's hook moved their adds onto the step's
#      stream); the peer (~520 s)
# Session 16's modes (s16A-D) are kept below for their commands.
# Session 15's modes (s15A-E) are kept below for their commands.
# Session 14's modes (s14A-E) are kept below for their commands.
# The benchmark modes log the GPUs' clocks, power and throttle reasons (smi_*.csv under $OUT).
# Session 13's modes (s13d, s13e, s13f) are kept below for their commands.
# Session 12's modes (probe, s12a, pin) are kept below for their commands.
# Session 11's modes (s11a-d) are kept below for their commands.
#   bash benchmarks/next_gpu_call.sh tp2    -- GPT-1.3B tp=2 + SP: eager, CUDA-graphed layers
#       (train.cuda_graphs), compiled layers (now with opaque collectives), megatron-core tp=2
#   bash benchmarks/next_gpu_call.sh ab     -- first A/Bs: the FLOPs-balanced pipeline split
#       against the even one (pp=2), and the ring (p2p) async TP against plain SP (tp=2)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1; nvidia-smi topo -m | head -3; nproc
# a timed-out pytest leaves its training runs behind (holding the GPUs and torchrun's port, so
# every later run fails): kill them (the pattern is anchored, so it never matches this shell)
reap() { pgrep -f "^\S*python3? (-u )?-m (tessera|torch.distributed.run)" | xargs -r kill -9; sleep 1; }
# the GPUs' clocks, power and throttle reasons twice a second into $OUT (the one-GPU baseline had
# slow stretches in session 12: were the clocks down then?)
smi_log() { nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
              --format=csv,noheader -lms 500 > "${OUT:-/tmp}/smi_$1.csv" 2>&1 &
            trap "kill $! 2>/dev/null" EXIT; }  # stopped with this script (else the call would wait for it)
q() { NPROC=2 timeout ${QT:-100} python3 benchmarks/quick_train.py gpt-1.3b "$@" 2>&1 | grep -E "RESULT|Error" | tail -2; }
case "${1:-tests}" in
  tests)  # each GPU test in its own pytest run, its log kept at once: a timeout loses one test's message only
    shift; deadline=$((SECONDS + ${BUDGET:-540}))
    for node in $(python3 -m pytest -q --collect-only tests/test_gpu.py ${1:+-k "$1"} | grep "::"); do
      left=$((deadline - SECONDS)); [ "$left" -lt 30 ] && { echo "SKIPPED (no time left): $node"; continue; }
      log="${OUT:-/tmp}/gpu_$(echo "$node" | tr -c 'A-Za-z0-9_\n-' _).log"
      timeout "$left" python3 -m pytest -q -rsx "$node" > "$log" 2>&1; echo "rc=$? $node: $(tail -1 "$log")"
      reap
    done ;;
  diag) timeout 270 python3 benchmarks/gpu_tp_diag.py 2>&1 | tee "${OUT:-/tmp}/diag.log" ;;
  ab)
    for v in false p2p; do q parallel.tp=2 parallel.sequence_parallel=true "parallel.tp_async=$v" train.cuda_graphs=false; done
    for layout in "" balanced; do q parallel.pp=2 parallel.schedule=zb-h1 "parallel.pp_layout=$layout"; done ;;
  session5)  # compiled numerics at one GPU vs tp=2; tp=2 weight-gradient fusion on/off; short GPU tests
    timeout 160 python3 benchmarks/gpu_tp_diag.py one-compiled tp2-compiled 2>&1 | tee "${OUT:-/tmp}/diag.log"
    for s in "train.grad_accum_fusion=false" "train.grad_accum_fusion=true" "train.compile=true"; do
      q parallel.tp=2 parallel.sequence_parallel=true train.cuda_graphs=false "$s"; done
    timeout 90 python3 -m pytest -q -rs tests/test_gpu.py -k "adamw or varlen or cross_entropy or exact_to_fp32" 2>&1 | tail -5 ;;
  tp2)  # next session's tp=2 call: the new opt-in paths against plain SP, the peer in the same call
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
    sp="parallel.tp=2 parallel.sequence_parallel=true train.grad_accum_fusion=false"
    q $sp train.compile=false train.cuda_graphs=false
    q $sp train.compile=false train.cuda_graphs=true
    q $sp train.compile=true
    PYTHONPATH=/tmp/site:$PYTHONPATH timeout 100 torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py --tp 2 2>&1 \
      | grep -E "^RESULT|Error" | tail -2 ;;
  session6)  # why train.cuda_graphs made no result at tp=2 (output kept, Python stacks dumped on a hang);
    # where tp=2 + SP spends its step, eager and compiled (kernel time vs wall, NCCL, launches)
    export PYTHONFAULTHANDLER=1 NCCL_DEBUG=WARN
    g() { log="${OUT:-/tmp}/$1.log"; shift; (sleep 85; pkill -ABRT -f "m tessera train") & k=$!
          timeout 110 python3 benchmarks/quick_train.py gpt-1.3b "$@" > "$log" 2>&1; kill $k 2>/dev/null
          grep -E "RESULT|Error|error" "$log" | tail -3; }
    NPROC=1 g graphs1 train.cuda_graphs=true train.compile=false train.grad_accum_fusion=false
    NPROC=2 g graphs2 parallel.tp=2 parallel.sequence_parallel=true train.cuda_graphs=true train.compile=false train.grad_accum_fusion=false
    for c in false true; do
      timeout 120 torchrun --nproc-per-node 2 benchmarks/kernel_table.py parallel.tp=2 parallel.sequence_parallel=true \
        train.grad_accum_fusion=false train.compile=$c > "${OUT:-/tmp}/kernels_tp2_compile_$c.log" 2>&1
      grep SUMMARY "${OUT:-/tmp}/kernels_tp2_compile_$c.log"; done ;;
  graphs)  # the CUDA-graph GPU test, then GPT-1.3B: one GPU (auto), tp=2 + SP eager and graphed, megatron-core tp=2
    BUDGET=230 bash "$0" tests graphed | grep "rc="
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
    NPROC=1 timeout 100 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    q $sp train.cuda_graphs=false; q $sp train.cuda_graphs=true
    PYTHONPATH=/tmp/site:$PYTHONPATH timeout 100 torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py --tp 2 2>&1 \
      | grep -E "^RESULT|Error" | tail -2 ;;
  llama)  # Llama-1B at tp=2 + SP with the auto choice (graphed layers) and eager, one GPU, megatron-core tp=2
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
    l() { NPROC=$1 timeout $2 python3 benchmarks/quick_train.py llama-1b "${@:3}" 2>&1 | grep -E "RESULT|Error|tessera: llama" | tail -3; }
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    l 2 80 $sp
    PYTHONPATH=/tmp/site:$PYTHONPATH timeout 70 torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py --tp 2 \
      --llama 1 --kv-heads 8 --ffn 8192 --heads 32 --layers 16 --vocab 128256 2>&1 | grep -E "^RESULT|Error" | tail -2
    l 1 90; l 2 75 $sp train.cuda_graphs=false ;;
  overlap)  # GPT-1.3B tp=2 + SP graphed layers: plain SP (the auto), with the p2p ring, with the
    # backward comm overlap; one GPU and megatron-core tp=2 in the same call (run `tests graphed` first)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
    NPROC=1 timeout 100 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    q $sp; q $sp train.cuda_graphs=true parallel.tp_async=p2p; q $sp train.cuda_graphs=true parallel.tp_comm_overlap=true
    PYTHONPATH=/tmp/site:$PYTHONPATH timeout 100 torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py --tp 2 2>&1 \
      | grep -E "^RESULT|Error" | tail -2 ;;
  dp2)  # issue 4's target in one call: one GPU, dp=2 zero=1 (the default layout), torch DDP and megatron-core dp=2
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
    NPROC=1 timeout 100 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    q parallel.zero=1
    timeout 120 torchrun --nproc-per-node 2 .peers/torch_gpt_bench.py --mbs 2 --gbs 16 2>&1 | grep -E "^RESULT|Error" | tail -2
    PYTHONPATH=/tmp/site:$PYTHONPATH timeout 100 torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py 2>&1 \
      | grep -E "^RESULT|Error" | tail -2 ;;
  nccl)  # tp=2 + SP graphed layers under NCCL settings: the in-step collectives ran RING_LL (session 6);
    # the TP collectives are not overlapped, so more CTAs for them cost no compute (a win here
    # would become a per-group ProcessGroupNCCL config in Topology)
    env | grep ^NCCL; sp="parallel.tp=2 parallel.sequence_parallel=true"
    q $sp; NCCL_PROTO=Simple q $sp; NCCL_MIN_CTAS=32 q $sp; NCCL_MIN_CTAS=32 NCCL_PROTO=Simple q $sp ;;
  profile)  # per rank: GPU busy / NCCL / wall per step, for pp=2 (which stage idles), dp=2 and graphed tp=2
    for l in "parallel.pp=2 parallel.schedule=zb-h1" "parallel.zero=1" "parallel.tp=2 parallel.sequence_parallel=true"; do
      timeout 120 torchrun --nproc-per-node 2 benchmarks/kernel_table.py $l > "${OUT:-/tmp}/kernels_$(echo $l | tr -c 'a-z0-9\n' _).log" 2>&1
      grep -h SUMMARY "${OUT:-/tmp}"/kernels_$(echo $l | tr -c 'a-z0-9\n' _).log; done ;;
  pp2)  # issue 6's pp=2 target: one GPU, pp=2 (auto: ZB-H1 with W's deferred behind the I's, session 6), the
    # session-5 layout A/B, megatron-core pp=2 in the same call
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
    NPROC=1 timeout 100 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    q parallel.pp=2; q parallel.pp=2 parallel.pp_layout=balanced
    PYTHONPATH=/tmp/site:$PYTHONPATH timeout 100 torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py --pp 2 2>&1 \
      | grep -E "^RESULT|Error" | tail -2 ;;
  session7)  # the step-read test (first launch warmed), then where pp=2 (even and balanced) and dp=2 spend the step, per rank
    BUDGET=60 bash "$0" tests step_result | grep "rc="
    for l in "parallel.pp=2" "parallel.pp=2 parallel.pp_layout=balanced" "parallel.zero=1"; do
      log="${OUT:-/tmp}/kernels_$(echo $l | tr -c 'a-z0-9\n' _).log"
      timeout 130 torchrun --nproc-per-node 2 benchmarks/kernel_table.py $l > "$log" 2>&1; grep -h SUMMARY "$log"; done ;;
  timeline)  # the step-read test, then pp=2 step timelines per rank (even and balanced layouts), no profiler
    BUDGET=60 bash "$0" tests step_result | grep "rc="
    for l in "parallel.pp=2" "parallel.pp=2 parallel.pp_layout=balanced"; do
      log="${OUT:-/tmp}/timeline_$(echo $l | tr -c 'a-z0-9\n' _).log"
      timeout 120 torchrun --nproc-per-node 2 benchmarks/pipeline_timeline.py $l > "$log" 2>&1; grep -h SUMMARY "$log"; done ;;
  zbh2)  # pp=2: ZB-H1 (auto) against ZB-H2's warm-up (parallel.schedule=zb-h2), one GPU in the same call;
    # then each with one NCCL channel for point-to-point: session 7's timeline saw rank 0's F slow from
    # 10.2 to 13 ms while its early-posted gradient receive spun, waiting for the slower rank 1
    NPROC=1 timeout 80 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    QT=100 q parallel.pp=2; QT=100 q parallel.pp=2 parallel.schedule=zb-h2
    export NCCL_MAX_P2P_NCHANNELS=1; QT=100 q parallel.pp=2; QT=100 q parallel.pp=2 parallel.schedule=zb-h2 ;;
  collectives)  # the tp=2 SP collectives alone: NCCL eager / graphed against symmetric-memory copies;
    # then whether two half micro-batches on two streams (two TP communicators) overlap comm and GEMMs
    timeout 150 torchrun --nproc-per-node 2 benchmarks/tp_collectives.py 8 > "${OUT:-/tmp}/collectives.log" 2>&1
    grep -E "RESULT|Error" "${OUT:-/tmp}/collectives.log"
    timeout 150 torchrun --nproc-per-node 2 benchmarks/tp_two_stream_probe.py 4 > "${OUT:-/tmp}/probe.log" 2>&1
    grep -E "^RESULT|Error" "${OUT:-/tmp}/probe.log" ;;
  contention)  # dp=2: how much the overlapped gradient reduce-scatter slows the GEMMs, per way of running it
    for ctas in "" 8; do log="${OUT:-/tmp}/contention${ctas}.log"
      env ${ctas:+NCCL_MAX_CTAS=$ctas} timeout 120 torchrun --nproc-per-node 2 benchmarks/dp_overlap_contention.py > "$log" 2>&1
      grep -E "RESULT|Error" "$log"; done ;;
  symm)  # tp=2 + SP graphed layers with torch's fused symmetric-memory all-gather+GEMM / GEMM+reduce-scatter
    # (parallel.tp_async=true; graphed, the ops beat NCCL-then-GEMM by 29 % / 16 % in session 8's
    # collectives call) against the auto; one GPU and megatron-core tp=2 in the same call
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
    NPROC=1 timeout 90 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    g() { log="${OUT:-/tmp}/symm_$1.log"; shift; NPROC=2 timeout 110 python3 benchmarks/quick_train.py gpt-1.3b "$@" > "$log" 2>&1
          grep -E "RESULT|Error|error" "$log" | tail -3; }
    g auto $sp; g graphs_true $sp train.cuda_graphs=true parallel.tp_async=true; g eager_true $sp train.cuda_graphs=false parallel.tp_async=true
    PYTHONPATH=/tmp/site:$PYTHONPATH timeout 100 torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py --tp 2 2>&1 \
      | grep -E "^RESULT|Error" | tail -2 ;;
  pp2v)  # pp=2: one GPU, ZB-H1 (auto), interleaved vpp=2 / vpp=3 (1F1B-interleaved: bubble / vpp),
    # interleaved-zb vpp=2 / 3 (its backward split, W's deferred), megatron-core pp=2, in one call
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
    NPROC=1 timeout 90 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    QT=100 q parallel.pp=2
    for v in 2 3; do QT=90 q parallel.pp=2 parallel.schedule=interleaved parallel.vpp=$v; done
    for v in 2 3; do QT=90 q parallel.pp=2 parallel.schedule=interleaved-zb parallel.vpp=$v; done
    # point-to-point by the copy engines (no SMs taken from the forwards, session 7's rank-0 slowdown)
    echo "with NCCL_P2P_USE_CUDA_MEMCPY=1:"; NCCL_P2P_USE_CUDA_MEMCPY=1 QT=90 q parallel.pp=2
    PYTHONPATH=/tmp/site:$PYTHONPATH timeout 100 torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py --pp 2 2>&1 \
      | grep -E "^RESULT|Error" | tail -2 ;;
  tpprof)  # tp=2 + SP graphed layers: a step's kernels (rank 0) and GPU busy / NCCL per rank, plain
    # SP collectives against torch's fused symmetric-memory ops (parallel.tp_async=true)
    for a in false true; do log="${OUT:-/tmp}/kernels_tp2_async_$a.log"
      timeout 150 torchrun --nproc-per-node 2 benchmarks/kernel_table.py parallel.tp=2 parallel.sequence_parallel=true \
        train.cuda_graphs=true parallel.tp_async=$a > "$log" 2>&1; grep -h -E "SUMMARY|Error" "$log" | tail -4; done ;;
  dp2b)  # dp=2 zero=1 beside one GPU: gradient bucket size (never tuned on GPU) and fewer NCCL blocks
    NPROC=1 timeout 90 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    for bs in 40000000 20000000 80000000; do q parallel.zero=1 parallel.bucket_size=$bs; done
    echo "with NCCL_MAX_CTAS=8:"; NCCL_MAX_CTAS=8 q parallel.zero=1 ;;
  s11a)  # session 11, first call: see the plan at the top
    for l in "" "parallel.zero=1" "parallel.pp=2 parallel.vpp=2"; do n=$([ -z "$l" ] && echo 1 || echo 2)
      log="${OUT:-/tmp}/timeline_$(echo "n$n $l" | tr -c 'a-z0-9\n' _).log"
      timeout ${T1:-110} torchrun --nproc-per-node $n benchmarks/pipeline_timeline.py $l > "$log" 2>&1
      grep -h -E "SUMMARY|Error" "$log" | tail -4; grep -h -A8 "^TAIL" "$log"; grep -h -A10 "^HOST" "$log"; done
    log="${OUT:-/tmp}/sync_dp2.log"
    timeout ${T2:-90} torchrun --nproc-per-node 2 benchmarks/sync_probe.py parallel.zero=1 > "$log" 2>&1
    grep -h -E "^SYNC|Error" "$log"; grep -c -i "synchroniz" "$log" ;;
  s11d)  # NCCL streams at high priority against the default, per layout (see the plan at the top)
    NPROC=1 timeout 90 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    for l in "parallel.zero=1" "parallel.pp=2 parallel.vpp=2" "parallel.tp=2 parallel.sequence_parallel=true"; do
      QT=80 q $l; echo "  with TORCH_NCCL_HIGH_PRIORITY=1:"; TORCH_NCCL_HIGH_PRIORITY=1 QT=80 q $l; done
    echo "tp=2 + SP, graphed layers with the fused weight-gradient GEMMs captured:"
    QT=80 q parallel.tp=2 parallel.sequence_parallel=true train.grad_accum_fusion=true ;;
  s14A)  # session 14, first call: see the plan at the top
    smi_log s14A
    COMPARE_BUDGET=580 python3 benchmarks/compare.py gpt-1.3b 1gpu dp2 1gpu+train.grad_dtype=bf16 \
      dp2+train.grad_dtype=bf16 --skip mcore@1gpu,torch@1gpu 2>&1 | tee "${OUT:-/tmp}/compare_dp.log" \
      | grep -v "^WARNING" | tail -20 ;;
  s14B)  # session 14, second call: see the plan at the top
    smi_log s14B
    COMPARE_BUDGET=580 python3 benchmarks/compare.py llama-1b 1gpu pp2v dp2 --skip mcore@1gpu,torch@dp2 2>&1 \
      | tee "${OUT:-/tmp}/compare_llama.log" | grep -v "^WARNING" | tail -20 ;;
  s14C)  # session 14, third call: see the plan at the top
    smi_log s14C; date +"runs from %T"
    run() { NPROC=$1 timeout 85 python3 benchmarks/quick_train.py gpt-1.3b ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    run 1; for i in 1 2; do run 2 $sp; run 2 $sp parallel.tp_comm_overlap=true; done  # alternated, twice
    run 2 parallel.zero=1 parallel.grad_reduce_dtype=bf16
    CUDA_VISIBLE_DEVICES=1 run 1
    BUDGET=120 bash "$0" tests "uneven_default_layout" | grep -E "rc=|SKIPPED" ;;
  s15A)  # session 15, first call: see the plan at the top
    BUDGET=560 bash "$0" tests "compiled_elementwise or fast_paths_follow or under_the_split_backward" \
      | grep -E "rc=|SKIPPED" ;;
  s15B)  # session 15, second call: see the plan at the top
    smi_log s15B; date +"runs from %T"
    run() { NPROC=$1 timeout ${T:-80} python3 benchmarks/quick_train.py llama-1b ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    pp="parallel.pp=2 parallel.vpp=2"; sp="parallel.tp=2 parallel.sequence_parallel=true"
    run 1; run 2 $pp; run 2 $pp train.fused_elementwise=true; T=120 run 2 $pp train.compile=true
    run 2 $pp parallel.schedule=interleaved; run 2 $sp; run 2 $sp train.fused_elementwise=true
    CUDA_VISIBLE_DEVICES=1 run 1 ;;
  s15C)  # session 15, third call: see the plan at the top
    smi_log s15C; date +"runs from %T"
    run() { NPROC=$2 timeout 95 python3 benchmarks/quick_train.py $1 ${@:3} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    run llama-1b 2 $sp train.fused_elementwise=true; run llama-1b 2 $sp  # the tp=2 pair again, reversed
    run gpt-1.3b 1 train.steps=40; run gpt-1.3b 2 parallel.zero=1 train.steps=40
    # per step and rank: idle (host behind), forward+backward, reduction wait, tail, host lead
    for n in 2 1; do log="${OUT:-/tmp}/jitter_n$n.log"
      STEPS=40 timeout 150 torchrun --nproc-per-node $n benchmarks/step_jitter.py $([ $n = 2 ] && echo parallel.zero=1) \
        > "$log" 2>&1; grep -E "SUMMARY|Error" "$log" | tail -3; reap; done ;;
  s18A)  # session 18, first call: see the plan at the top
    smi_log s18A; date +"runs from %T"
    BUDGET=540 bash "$0" tests "steps_stream or microbatch_pairs or graphed_layers_follow_eager or without_sp" \
      | grep -E "rc=|SKIPPED" ;;
  s18A2)  # session 18, second call: see the plan at the top
    smi_log s18A2; date +"runs from %T"
    BUDGET=540 bash "$0" tests "(curve and graphed) or overlapped_tp_paths" | grep -E "rc=|SKIPPED" ;;
  s18B)  # session 18, second call: see the plan at the top
    smi_log s18B; date +"runs from %T"
    COMPARE_BUDGET=585 python3 benchmarks/compare.py gpt-1.3b 1gpu tp2 dp2 --skip torch@dp2 2>&1 \
      | tee "${OUT:-/tmp}/compare_gpt.log" | grep -E "^\||RESULT|Error" | tail -14 ;;
  s18C)  # session 18, third call: see the plan at the top
    smi_log s18C; date +"runs from %T"
    COMPARE_BUDGET=585 python3 benchmarks/compare.py llama-1b 1gpu tp2 dp2 --skip torch@dp2 2>&1 \
      | tee "${OUT:-/tmp}/compare_llama.log" | grep -E "^\||RESULT|Error" | tail -14 ;;
  s18D)  # session 18, fourth call: see the plan at the top
    for v in true false; do export KT_TAG=tp2_pairs_$v; log="${OUT:-/tmp}/kernels_tp2_pairs_$v.log"
      timeout 150 torchrun --nproc-per-node 2 benchmarks/kernel_table.py parallel.tp=2 parallel.sequence_parallel=true \
        parallel.tp_microbatch_pairs=$v > "$log" 2>&1; grep -h -E "SUMMARY|STREAM|Error" "$log" | tail -12; done ;;
  s18F)  # session 18, after s18D's profile: the pairs' forwards issued layer by layer in turn and the two
    # backwards concurrent (a worker thread); GPU test, GPT-1.3B tp=2 + SP pairs / plain / 1 GPU, the profile (~430 s)
    smi_log s18F; date +"runs from %T"
    BUDGET=150 bash "$0" tests "microbatch_pairs" | grep -E "rc=|SKIPPED"
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    for v in true false; do NPROC=2 timeout 100 python3 benchmarks/quick_train.py gpt-1.3b $sp parallel.tp_microbatch_pairs=$v 2>&1 \
      | grep -E "LOSSES|RESULT|Error" | tail -2; reap; done
    NPROC=1 timeout 90 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -1; reap
    export KT_TAG=tp2_pairs_interleaved; timeout 120 torchrun --nproc-per-node 2 benchmarks/kernel_table.py $sp \
      parallel.tp_microbatch_pairs=true > "${OUT:-/tmp}/kernels_tp2_pairs_interleaved.log" 2>&1
    grep -h -E "SUMMARY|Error" "${OUT:-/tmp}/kernels_tp2_pairs_interleaved.log" | tail -3 ;;
  s18G)  # session 18, last call: the 200-step curve test's graphed group under the concurrent pairs (auto);
    # Llama-1B tp=2 + SP pairs / plain and one GPU (~500 s)
    smi_log s18G; date +"runs from %T"
    BUDGET=200 bash "$0" tests "curve and graphed" | grep -E "rc=|SKIPPED"
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    for v in true false; do NPROC=2 timeout 100 python3 benchmarks/quick_train.py llama-1b $sp parallel.tp_microbatch_pairs=$v 2>&1 \
      | grep -E "LOSSES|RESULT|Error" | tail -2; reap; done
    NPROC=1 timeout 95 python3 benchmarks/quick_train.py llama-1b 2>&1 | grep -E "RESULT|Error" | tail -1 ;;
  s20A)  # session 20, first call: see the plan at the top
    # the two settings alternate run by run, until BUDGET seconds are used (a hang costs its run's 75 s)
    smi_log s20A; date +"runs from %T"; deadline=$((SECONDS + ${BUDGET:-540}))
    for i in 1 2 3 4 5 6 7 8; do for conn in 1 default; do
      [ $((deadline - SECONDS)) -lt 80 ] && { echo "no time left for run $i conn=$conn"; continue; }
      log="${OUT:-/tmp}/pairs_ab_conn${conn}_$i.log"
      ( [ "$conn" = 1 ] && export CUDA_DEVICE_MAX_CONNECTIONS=1
        EACH_STEP=1 DUMP_AFTER=25 SETTINGS="0 1" STEPS=4 ROUNDS=1 timeout -k 5 75 torchrun --nproc-per-node 2 \
          benchmarks/pairs_ab.py parallel.tp=2 parallel.sequence_parallel=true parallel.tp_microbatch_pairs=true > "$log" 2>&1
        echo "conn=$conn run $i rc=$? last: $(grep -E '^step' "$log" | tail -1) $(grep -E 'PAIRS' "$log" | tr '\n' ' ')" )
      pkill -9 -f "benchmarks/pairs_ab[.]py"; sleep 1  # (a killed torchrun's workers)
    done; done ;;
  s21A)  # session 21: do the two backwards of a pair issue their graphs in a different order on each rank?
    # pairs_ab runs with ORDER_LOG=1 (each pair's backward replays, by capture index, per rank),
    # until BUDGET seconds are used; per run: hung or not, and how many pair backwards differ.
    # EXTRA_ENV="NCCL_LAUNCH_ORDER_IMPLICIT=1" (say) is set for the runs; PAIRS_SETTINGS (pairs_ab's
    # SETTINGS, default 0: the two-thread backwards; "turn": backward_in_turn; "turn 0": an A/B)
    smi_log s21A; date +"runs from %T"; deadline=$((SECONDS + ${BUDGET:-540}))
    for i in $(seq 1 12); do
      [ $((deadline - SECONDS)) -lt 80 ] && { echo "no time left for run $i"; continue; }
      dir="${OUT:-/tmp}/order_$i"; mkdir -p "$dir"
      OUT="$dir" ORDER_LOG=1 EACH_STEP=1 DUMP_AFTER=25 SETTINGS="${PAIRS_SETTINGS:-0}" STEPS=6 ROUNDS=1 env $EXTRA_ENV timeout -k 5 75 torchrun \
        --nproc-per-node 2 benchmarks/pairs_ab.py parallel.tp=2 parallel.sequence_parallel=true \
        parallel.tp_microbatch_pairs=true > "$dir/log" 2>&1
      rc=$?; pkill -9 -f "benchmarks/pairs_ab[.]py"; sleep 1
      python3 - "$dir" "$rc" <<'PY'
import sys
d, rc = sys.argv[1], sys.argv[2]
a, b = (open(f"{d}/replays_rank{r}.txt").read().splitlines() for r in (0, 1))
pairs = [(x, y) for x, y in zip(a, b) if not x.startswith("step")]
differ = [k for k, (x, y) in enumerate(pairs) if x != y]
steps = sum(x.startswith("step") for x in a)
first = differ[0] if differ else None
where = ""
if first is not None:
    x, y = pairs[first][0].split(), pairs[first][1].split()
    at = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    where = f"; first at pair backward {first}, replay {at} of {len(x)}: rank0 {x[max(0, at - 2):at + 4]} rank1 {y[max(0, at - 2):at + 4]}"
speed = " ".join(line.split(":", 1)[1].split(",")[0].strip() for line in open(f"{d}/log") if line.startswith("PAIRS"))
print(f"{d.rsplit('/', 1)[-1]}: rc={rc}, steps begun {steps}, pair backwards {len(pairs)} (rank1 {len(b) - steps}), "
      f"orders differ in {len(differ)}{where}; {speed}")
PY
    done ;;
  s23A)  # session 23: micro-batch pairs' hang count under PAIRS_SETTINGS (default "turn": backward_in_turn,
    # one thread issuing both backwards in one order; "0": the two-thread backwards) and EXTRA_ENV
    # (e.g. "CUDA_DEVICE_MAX_CONNECTIONS=32": more hardware queues, fewer streams sharing one);
    # runs of STEPS (default 30) timed steps after 4 warm-up steps, until BUDGET seconds are used;
    # per run: finished or hung (stacks dumped where a step runs 25 s), steps begun, ms/step
    smi_log s23A; date +"runs from %T"; deadline=$((SECONDS + ${BUDGET:-540}))
    for i in $(seq 1 12); do
      [ $((deadline - SECONDS)) -lt 95 ] && { echo "no time left for run $i"; continue; }
      log="${OUT:-/tmp}/pairs_hangs_$i.log"
      EACH_STEP=1 DUMP_AFTER=25 SETTINGS="${PAIRS_SETTINGS:-turn}" STEPS=${STEPS:-30} ROUNDS=1 env $EXTRA_ENV \
        timeout -k 5 90 torchrun --nproc-per-node 2 benchmarks/pairs_ab.py parallel.tp=2 \
        parallel.sequence_parallel=true parallel.tp_microbatch_pairs=true > "$log" 2>&1
      rc=$?; pkill -9 -f "benchmarks/pairs_ab[.]py"; sleep 1
      echo "run $i (${PAIRS_SETTINGS:-turn}; ${EXTRA_ENV:-default env}): rc=$rc, $(grep -cE '^step' "$log") steps begun; $(grep -E '^PAIRS' "$log" | tr '\n' ' ')"
    done ;;
  s22B)  # session 22: dp=2 with bf16 gradient buffers now that they travel as bf16 (session 20's fix; 0.929
    # in session 14 when they were widened to fp32 on the wire, 0.983 in session 2's code), and the fp32 default
    smi_log s22B; date +"runs from %T"
    COMPARE_BUDGET=585 python3 benchmarks/compare.py ${MODEL:-gpt-1.3b} 1gpu 1gpu+train.grad_dtype=bf16 \
      dp2+train.grad_dtype=bf16 dp2 --skip mcore@1gpu,torch@1gpu 2>&1 \
      | tee "${OUT:-/tmp}/compare_bf16_grads.log" | grep -E "^\||RESULT|Error" | tail -14 ;;
  s20D)  # session 20: what a gc_interval collection inside the trainer finds, and whether it waits for the GPU
    sets="model.family=gpt2 model.layers=24 model.hidden=2048 model.heads=16 model.seq_len=2048 model.vocab_size=50304
          model.tie_embeddings=true train.micro_batch=2 train.global_batch=16 train.steps=17 train.dtype=bf16
          data.source=synthetic train.log_every=4 train.out_dir=/tmp/gcp parallel.zero=1 train.gc_interval=4"
    timeout 150 torchrun --nproc-per-node 2 benchmarks/gc_trainer_probe.py $(for s in $sets; do echo --set $s; done) \
      > "${OUT:-/tmp}/gc_trainer_probe.log" 2>&1
    grep -E "^GCPROBE|Error" "${OUT:-/tmp}/gc_trainer_probe.log" | cut -c1-500 | tail -12 ;;
  s20C)  # session 20: see the plan at the top
    timeout 150 torchrun --nproc-per-node 2 benchmarks/gc_probe.py parallel.zero=1 > "${OUT:-/tmp}/gc_probe.log" 2>&1
    grep -E "^GC rank 0|Error" "${OUT:-/tmp}/gc_probe.log" | tail -8 ;;
  s19A)  # session 19, first call: see the plan at the top
    smi_log s19A; date +"runs from %T"
    BUDGET=200 bash "$0" tests "side_stream" | grep -E "rc=|SKIPPED"
    SETTINGS="0 1" STEPS=6 ROUNDS=3 timeout 130 torchrun --nproc-per-node 2 benchmarks/pairs_ab.py parallel.tp=2 \
      parallel.sequence_parallel=true parallel.tp_microbatch_pairs=true > "${OUT:-/tmp}/pairs_ab.log" 2>&1
    grep -h -E "PAIRS|Error" "${OUT:-/tmp}/pairs_ab.log" | tail -3 ;;
  s18H)  # session 18, fifth call: the pairs' settings A/B'd in one process (side-stream forward lag,
    # the second backward's adds on the side stream), the pairs GPU test (side adds on), GPT-1.3B
    # tp=2 + SP pairs and one GPU (~420 s; pairs were auto then, opted in now)
    smi_log s18H; date +"runs from %T"
    sp="parallel.tp=2 parallel.sequence_parallel=true parallel.tp_microbatch_pairs=true"
    SETTINGS="0:0 0:1 60:1 120:1 60:0" STEPS=6 ROUNDS=3 timeout 130 torchrun --nproc-per-node 2 benchmarks/pairs_ab.py $sp \
      > "${OUT:-/tmp}/pairs_ab.log" 2>&1; grep -h -E "PAIRS|Error" "${OUT:-/tmp}/pairs_ab.log" | tail -7; reap
    BUDGET=135 bash "$0" tests "microbatch_pairs" | grep -E "rc=|SKIPPED"
    NPROC=2 timeout 100 python3 benchmarks/quick_train.py gpt-1.3b $sp 2>&1 | grep -E "LOSSES|RESULT|Error" | tail -2; reap
    NPROC=1 timeout 85 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -1 ;;
  s18E)  # session 18, optional: see the plan at the top
    NPROC=2 timeout 100 python3 benchmarks/quick_train.py gpt-1.3b parallel.zero=1 train.gc_interval=5 2>&1 \
      | grep -E "STEPS|GC host|RESULT|Error" | tail -3 ;;
  s17D)  # session 17, last call: s17C's graphed tp=2 runs failed (DataParallel held AccumulateGrad
    # nodes made on the legacy default stream; a capture cannot make that stream wait). Now the
    # trainer captures and trains graphed layers on a stream of its own (cuda_graphs.step_stream):
    # the captured nodes live on the step's stream. GPU test of that; GPT-1.3B and Llama-1B tp=2 +
    # SP plain / pairs and one GPU; the graphed-vs-eager tp=2 GPU test (~430 s)
    smi_log s17D; date +"runs from %T"
    BUDGET=50 bash "$0" tests "steps_stream" | grep -E "rc=|SKIPPED"
    run() { NPROC=$2 timeout 85 python3 benchmarks/quick_train.py $1 ${@:3} 2>&1 | grep -E "STEPS|LOSSES|RESULT|Error" | tail -3; reap; }
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    for m in gpt-1.3b llama-1b; do run $m 2 $sp; run $m 2 $sp parallel.tp_microbatch_pairs=true; run $m 1; done
    BUDGET=90 bash "$0" tests "graphed_layers_follow_eager" | grep -E "rc=|SKIPPED" ;;
  s17C)  # session 17, third call: s17A's plain tp=2 fell to 37,412 (41,421-41,629 in session 16):
    # DataParallel's per-gradient stream handover for graphed layers. Now DataParallel holds each
    # parameter's AccumulateGrad node (made on the step's stream): no handover. GPU test of that,
    # then GPT-1.3B one GPU, tp=2 + SP plain / pairs, dp=2 zero=1 with automatic GC / gc_interval=5
    # (frozen heap), Llama-1B tp=2 + SP plain / pairs, one GPU (~430 s)
    smi_log s17C; date +"runs from %T"
    BUDGET=60 bash "$0" tests "steps_stream" | grep -E "rc=|SKIPPED"
    run() { NPROC=$2 timeout 85 python3 benchmarks/quick_train.py $1 ${@:3} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; reap; }
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    run gpt-1.3b 1; run gpt-1.3b 2 $sp; run gpt-1.3b 2 $sp parallel.tp_microbatch_pairs=true
    run llama-1b 2 $sp; run llama-1b 2 $sp parallel.tp_microbatch_pairs=true; run llama-1b 1
    run gpt-1.3b 2 parallel.zero=1; run gpt-1.3b 2 parallel.zero=1 train.gc_interval=5 ;;
  s17A)  # session 17, first call: see the plan at the top
    smi_log s17A; date +"runs from %T"
    BUDGET=260 bash "$0" tests "microbatch_pairs" | grep -E "rc=|SKIPPED"
    # (LOSSES: pairs and plain train the same bf16 curve at full size, where cuBLAS may split K)
    run() { NPROC=$1 timeout 100 python3 benchmarks/quick_train.py gpt-1.3b ${@:2} 2>&1 | grep -E "STEPS|LOSSES|RESULT|Error" | tail -3; reap; }
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    run 2 $sp parallel.tp_microbatch_pairs=true; run 2 $sp; run 1 ;;
  s17B)  # session 17, second call: see the plan at the top
    smi_log s17B; date +"runs from %T"
    run() { NPROC=$1 timeout 100 python3 benchmarks/quick_train.py llama-1b ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; reap; }
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    run 1; run 2 parallel.zero=1; run 2 $sp parallel.tp_microbatch_pairs=true; run 2 $sp
    # the graphed layers at dp=2: their gradients' adds, and the reductions they launch, now on the step's stream
    BUDGET=170 bash "$0" tests "under_the_overlapped_gather" | grep -E "rc=|SKIPPED"
    timeout 120 python3 .peers/torch_gpt_bench.py --mbs 2 --gbs 16 --llama 1 --kv-heads 8 --ffn 8192 --heads 32 --layers 16 \
      --vocab 128256 2>&1 | grep -E "^RESULT|Error" | tail -2 ;;
  s16D)  # session 16, last call: micro-batch pairs on two streams (parallel.tp_microbatch_pairs,
    # built this session after s16C's probe: two whole micro-batches on two streams 0.832 of
    # their time one after the other) at GPT-1.3B tp=2 + SP (graphed layers) against plain, one
    # GPU in the same call; then the GPU test of the pairs against one GPU (fp32)
    smi_log s16D; date +"runs from %T"
    run() { NPROC=$1 timeout 100 python3 benchmarks/quick_train.py gpt-1.3b ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; reap; }
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    run 2 $sp parallel.tp_microbatch_pairs=true; run 2 $sp; run 1
    BUDGET=170 bash "$0" tests "microbatch_pairs" | grep -E "rc=|SKIPPED" ;;
  s16A)  # session 16, first call: see the plan at the top
    BUDGET=540 bash "$0" tests "fast_paths_follow" | grep -E "rc=|SKIPPED" ;;
  s16B)  # session 16, second call: see the plan at the top
    smi_log s16B; date +"runs from %T"
    BUDGET=60 bash "$0" tests "sm_carveout" | grep -E "rc=|SKIPPED"
    for c in "" 16; do log="${OUT:-/tmp}/contention${c:-_default}.log"
      env ${c:+NCCL_MAX_CTAS=$c} timeout 90 torchrun --nproc-per-node 2 benchmarks/dp_overlap_contention.py > "$log" 2>&1
      grep -E "RESULT|Error" "$log"; reap; done
    run() { NPROC=$1 timeout 80 python3 benchmarks/quick_train.py gpt-1.3b ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    run 1; run 2 parallel.zero=1; TORCH_BLAS_PREFER_CUBLASLT=1 run 2 parallel.zero=1
    run 2 parallel.zero=1 parallel.dp_sm_carveout=16; NCCL_MAX_CTAS=16 run 2 parallel.zero=1 parallel.dp_sm_carveout=16
    sp="parallel.tp=2 parallel.sequence_parallel=true"  # graphed layers, the backward comm overlap on
    run 2 $sp; run 2 $sp parallel.tp_sm_carveout=16; CUDA_VISIBLE_DEVICES=1 run 1 ;;
  s16C)  # session 16, third call: see the plan at the top
    smi_log s16C; date +"runs from %T"
    # tp=2: do two whole micro-batches on two streams hide each other's SP collectives?
    timeout 100 torchrun --nproc-per-node 2 benchmarks/tp_two_stream_probe.py 8 > "${OUT:-/tmp}/probe.log" 2>&1
    grep -E "^RESULT|Error" "${OUT:-/tmp}/probe.log"; reap
    run() { NPROC=$1 timeout 90 python3 benchmarks/quick_train.py llama-1b ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    # Llama-1B one GPU: compiled layers (auto) / compiled layers + fused weight gradients (one graph
    # per layer now) / eager layers + fused weight gradients + the compiled elementwise functions
    run 1; run 1 train.compile=true train.grad_accum_fusion=true; run 1 train.compile=false
    timeout 120 python3 .peers/torch_gpt_bench.py --mbs 2 --gbs 16 --llama 1 --kv-heads 8 --ffn 8192 --heads 32 --layers 16 \
      --vocab 128256 2>&1 | grep -E "^RESULT|Error" | tail -2
    CUDA_VISIBLE_DEVICES=1 run 1
    # dp=2's rare slow steps (a rank's host behind its GPU): Python's collector at fixed steps
    for gci in 0 10; do log="${OUT:-/tmp}/jitter_gc$gci.log"
      STEPS=40 timeout 120 torchrun --nproc-per-node 2 benchmarks/step_jitter.py parallel.zero=1 train.gc_interval=$gci \
        > "$log" 2>&1; grep -E "SUMMARY|Error" "$log" | tail -3; reap; done ;;
  s15E)  # session 15, last call: Llama-1B tp=2 + SP (graphed layers) with and without the compiled
    # elementwise functions (auto leaves them out of graphed layers until this pair), then the GPU tests
    # after the fixes (the fp32 tolerance; the CUDA-graph search that tripped on a dead weakref proxy)
    run() { NPROC=2 timeout 80 python3 benchmarks/quick_train.py llama-1b ${@:1} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    sp="parallel.tp=2 parallel.sequence_parallel=true"
    run $sp train.fused_elementwise=true; reap; run $sp train.fused_elementwise=false; reap
    BUDGET=350 bash "$0" tests "(compiled_elementwise and dtype0) or fast_paths_follow" | grep -E "rc=|SKIPPED" ;;
  s15D)  # session 15, if time is left: compiled layers with fused weight gradients at one GPU, now
    # without graph breaks (each alone measured faster than the pair with breaks: 55.2k vs 44.8k)
    run() { NPROC=1 timeout 100 python3 benchmarks/quick_train.py $1 ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    both="train.compile=true train.grad_accum_fusion=true"
    run llama-1b; run llama-1b $both; run gpt-1.3b $both; run gpt-1.3b ;;
  s14D)  # session 14, last call: Llama-1B's pp=2 vpp=2 measured 0.811 of one GPU in s14B (GPT's: 0.917)
    # with the auto (balanced) layout 5,5,5,1 (the untied 128k-vocabulary head weighs 4.0 layers):
    # its step timeline per rank, then the layouts: even 4,4,4,4; vpp=1 even 8,8 and balanced 10,6
    smi_log s14D; date +"runs from %T"
    llama="model.family=llama model.layers=16 model.heads=32 model.kv_heads=8 model.ffn_hidden=8192 model.vocab_size=128256 model.tie_embeddings=false"
    log="${OUT:-/tmp}/timeline_llama_pp2v.log"
    timeout 120 torchrun --nproc-per-node 2 benchmarks/pipeline_timeline.py $llama parallel.pp=2 parallel.vpp=2 > "$log" 2>&1
    grep -h -E "SUMMARY|Error" "$log" | tail -4; reap
    run() { NPROC=$1 timeout 85 python3 benchmarks/quick_train.py llama-1b ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    run 1; run 2 parallel.pp=2 parallel.vpp=2 parallel.pp_layout=even; run 2 parallel.pp=2
    run 2 parallel.pp=2 parallel.pp_layout=balanced; CUDA_VISIBLE_DEVICES=1 run 1 ;;
  s14E)  # session 14: s14D's timeline put rank 0 (10 layers) at 38.4 ms per micro-batch against rank 1's
    # 33.1 (6 layers + the head, which runs in 2.5 layers' time, not its FLOPs' 4.0): 9 / 7 layers
    run() { NPROC=$1 timeout 80 python3 benchmarks/quick_train.py llama-1b ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    run 1; run 2 parallel.pp=2 parallel.vpp=2 parallel.pp_layout=5,4,4,3; run 2 parallel.pp=2 parallel.vpp=2 parallel.pp_layout=4,5,5,2 ;;
  s14a)  # session 14, first call: see the plan at the top
    smi_log s14a
    COMPARE_BUDGET=585 python3 benchmarks/compare.py gpt-1.3b 1gpu dp2 2>&1 | tee "${OUT:-/tmp}/compare_dp.log" \
      | grep -v "^WARNING" | tail -20 ;;
  s14b)  # session 14, second call: see the plan at the top
    smi_log s14b
    COMPARE_BUDGET=500 python3 benchmarks/compare.py gpt-1.3b 1gpu pp2v tp2 2>&1 | tee "${OUT:-/tmp}/compare_pp_tp.log" \
      | grep -v "^WARNING" | tail -22
    # the backward's TP comm overlap inside the graphs: +2.6 % in its one A/B (session 5), never repeated
    NPROC=2 timeout 85 python3 benchmarks/quick_train.py gpt-1.3b parallel.tp=2 parallel.sequence_parallel=true \
      parallel.tp_comm_overlap=true 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2 ;;
  s14c)  # session 14, third call: see the plan at the top
    BUDGET=500 bash "$0" tests "pipeline_schedules" | grep -E "rc=|SKIPPED" ;;
  s14d)  # session 14, if device time is left: see the plan at the top
    smi_log s14d
    for layout in even balanced; do
      NPROC=2 timeout 85 python3 benchmarks/quick_train.py gpt-1.3b parallel.pp=2 "parallel.pp_layout=$layout" 2>&1 \
        | grep -E "STEPS|RESULT|Error|peak memory per rank" | tail -3; done
    # rank 0's memory with the balanced layout at vpp=2 (it holds 13 layers and the most micro-batches in flight)
    NPROC=2 timeout 85 python3 benchmarks/quick_train.py gpt-1.3b parallel.pp=2 parallel.vpp=2 2>&1 \
      | grep -E "RESULT|Error|peak memory per rank" | tail -2 ;;
  s14e)  # session 14: see the plan at the top
    smi_log s14e
    COMPARE_BUDGET=585 python3 benchmarks/compare.py llama-1b 1gpu pp2v dp2 2>&1 | tee "${OUT:-/tmp}/compare_llama.log" \
      | grep -v "^WARNING" | tail -22 ;;
  s13e)  # session 13, last call: the GPUs run power-capped (s13b's clock log: ~690 W, SM clocks
    # 1650-1800 of 1980 MHz), so SMs that NCCL kernels hold spinning cost twice. pp=2 vpp=2 with
    # fewer point-to-point channels (a 16 MB activation over 4-8 channels is still ~50-100 us;
    # session 8's one channel was too slow), one GPU first and last
    smi_log s13e; date +"runs from %T"
    run() { NPROC=$1 timeout 85 python3 benchmarks/quick_train.py gpt-1.3b ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    ev=parallel.pp_layout=even  # the default then (auto has been balanced at vpp > 1 since)
    run 1; run 2 parallel.pp=2 parallel.vpp=2 $ev
    for ch in 8 4; do echo "NCCL_MAX_P2P_NCHANNELS=$ch"; NCCL_MAX_P2P_NCHANNELS=$ch run 2 parallel.pp=2 parallel.vpp=2 $ev; done
    run 2 parallel.zero=1; run 1 ;;
  s13f)  # session 13, after s13e: at pp=2 vpp=2 GPU 1 (the head's stage) ran power-capped at
    # ~1715 MHz while GPU 0 ran below the cap at ~1940: move a layer to rank 0 (balanced: 7,6,6,5)
    smi_log s13f; date +"runs from %T"
    run() { NPROC=$1 timeout 80 python3 benchmarks/quick_train.py gpt-1.3b ${@:2} 2>&1 | grep -E "STEPS|RESULT|Error" | tail -2; }
    run 1; run 2 parallel.pp=2 parallel.vpp=2 parallel.pp_layout=even; run 2 parallel.pp=2 parallel.vpp=2 parallel.pp_layout=balanced
    run 2 parallel.pp=2 parallel.vpp=2 parallel.pp_layout=6,6,7,5 ;;
  s13d)  # session 13 (tp=2 graphed kernel tables with and without fused weight gradients)
    for f in false true; do log="${OUT:-/tmp}/kernels_tp2_graphs_fusion_$f.log"
      timeout 150 torchrun --nproc-per-node 2 benchmarks/kernel_table.py parallel.tp=2 parallel.sequence_parallel=true \
        train.cuda_graphs=true train.grad_accum_fusion=$f > "$log" 2>&1; grep -h -E "SUMMARY|Error" "$log" | tail -4; done ;;
  s12a)  # session 12, second call (the PROBE and NCCL lines ran in the first): one GPU, dp=2 zero=1,
    # and NCCL >= 2.27's CTA policies: 1 = efficiency (fewest CTAs for decent speed: for overlap
    # with compute), 2 = zero-CTA where it can (copy engines); the overlapped reduce-scatter slowed
    # the GEMMs beside it by up to 13.5 % (session 9), and early-posted pipeline receives hold SMs
    NPROC=1 timeout 90 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    QT=85 q parallel.zero=1
    for pol in 1 2; do echo "NCCL_CTA_POLICY=$pol:"; NCCL_CTA_POLICY=$pol QT=85 q parallel.zero=1; done
    QT=85 q parallel.pp=2 parallel.vpp=2; echo "NCCL_CTA_POLICY=1:"; NCCL_CTA_POLICY=1 QT=85 q parallel.pp=2 parallel.vpp=2 ;;
  probe)  # whether this torch has the fp32-accumulating bf16 GEMM (graphed tp=2 with fused weight
    # gradients gained only 0.4 %: if accumulate is False the graphs replay GEMM + add_ anyway); NCCL's version
    python3 -c "import torch; from tessera.tensor_parallel.wgrad import _dtype_out_gemm as g; d=torch.device('cuda')
print('PROBE mm out_dtype', g(d, torch.float32, torch.bfloat16, False), 'addmm accumulate', g(d, torch.float32, torch.bfloat16, True))"
    python3 -c "import torch; print('NCCL', torch.cuda.nccl.version())" ;;
  pin)  # dp=2 step timeline with each rank pinned to its own cores: is rank 1's host still ~1.5x slower
    log="${OUT:-/tmp}/timeline_dp2_pinned.log"
    PIN=1 PYTHONPATH=$PWD/benchmarks/site_diag:$PYTHONPATH timeout 110 torchrun --nproc-per-node 2 \
      benchmarks/pipeline_timeline.py parallel.zero=1 > "$log" 2>&1
    grep -h -E "PIN|SUMMARY|Error" "$log"; grep -h -E "^\s+F[0-9]" "$log" ;;
  s11b)  # issue 4's and 6's dp=2 target with the peers in one call (one GPU: tessera, megatron-core, compiled PyTorch)
    COMPARE_BUDGET=585 python3 benchmarks/compare.py gpt-1.3b 1gpu dp2 2>&1 | tee "${OUT:-/tmp}/compare_dp2.log" | tail -12 ;;
  s11c)  # pp=2 (vpp=2, tessera's recommended) and tp=2 against one GPU (run first and last) and
    # megatron-core, same call (8 runs, ~500 s)
    COMPARE_BUDGET=570 python3 benchmarks/compare.py gpt-1.3b 1gpu pp2v tp2 2>&1 | tee "${OUT:-/tmp}/compare_pp_tp.log" \
      | grep -v "^WARNING" | tail -22 ;;
  s9a)  # session 9, second half (same warm machine as s9b): one GPU, pp=2 interleaved-zb vpp=2 again,
    # its step timeline, the tp=2 kernel tables (tpprof), dp=2 at an 80M bucket
    NPROC=1 timeout 90 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error" | tail -2
    QT=90 q parallel.pp=2 parallel.schedule=interleaved-zb parallel.vpp=2
    log="${OUT:-/tmp}/timeline_ilzb_vpp2.log"
    timeout 100 torchrun --nproc-per-node 2 benchmarks/pipeline_timeline.py parallel.pp=2 parallel.schedule=interleaved-zb \
      parallel.vpp=2 > "$log" 2>&1; grep -h -E "SUMMARY|Error" "$log" | tail -4
    bash "$0" tpprof
    QT=90 q parallel.zero=1 parallel.bucket_size=80000000 ;;
  s9b)  # dp=2 zero=1 at the default 40M bucket, 20M, and with NCCL_MAX_CTAS=8 (one GPU: s9a, same machine)
    for bs in 40000000 20000000; do QT=90 q parallel.zero=1 parallel.bucket_size=$bs; done
    echo "with NCCL_MAX_CTAS=8:"; NCCL_MAX_CTAS=8 QT=90 q parallel.zero=1 ;;
  diag-ab) bash "$0" diag; bash "$0" ab ;;
  *) echo "usage: $0 tests [K]|s13a|s13b|s13c|s13d|probe|pin|s12a|s11a|s11b|s11c|s11d|s9a|s9b|pp2v|tpprof|dp2b|symm|zbh2|collectives|contention|overlap|pp2|dp2|nccl|profile|timeline|session7|graphs|llama|tp2|ab|diag|session5|session6|diag-ab" >&2; exit 2 ;;
esac
