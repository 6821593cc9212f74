#!/usr/bin/env bash
# The drafter recipe for SmolLM2-135M-Instruct (README: "Training a drafter"); any small
# Hugging Face target works the same way with its own folder in place of step 1.
#   bash scripts/train_smollm2.sh WORK_DIR MINUTES [GGUF_FILE]
# 1. WORK_DIR/target: the GGUF converted into a plain Hugging Face folder (once);
# 2. WORK_DIR/data.jsonl: self-distilled data, the target's greedy answers through vLLM
#    to PROMPTS (default 12000) prompts, SELF_WRITTEN (default 0.75) of them written by
#    the target itself and the rest from templates, none sharing an 8-gram with any
#    evaluation set, in DTYPE (default auto; bfloat16 on a GPU is faster), SEED (default 0)
#    choosing the prompts (once);
# 3. WORK_DIR/run: one training chunk of MINUTES, resumed from WORK_DIR/run if it holds
#    one (copy a chunk's run/ back there after a machine restart). Every file <= 16 MiB.
#    Without one, INIT_FROM=DRAFTER_DIR starts the run from a released drafter (the
#    shipped one: vllm_dominotree/drafters/smollm2-135m-instruct-domino) instead of anew;
#    DRAFT_LAYERS=N (more than its layers) deepens it, the new layers starting as no-ops.
#    EXPORT=DIR also writes the drafter there in bfloat16, as it ships, with its draft
#    vocabulary's ranking counted over WORK_DIR/data.jsonl (training/draft_vocab.py) and,
#    given HELDOUT=ANSWERS.jsonl[.xz] (answers it did not train on), its score
#    temperatures fitted there (training/calibrate.py).
set -euo pipefail
work=$1
minutes=$2
gguf=${3:-}
python=${PYTHON:-python3}
"$python" -m vllm_dominotree.training.smollm2 "$work/target" ${gguf:+--gguf "$gguf"}
[ -f "$work/data.jsonl" ] || "$python" -m vllm_dominotree.training.distill --target "$work/target" \
  --out "$work/data.jsonl" --prompts "${PROMPTS:-12000}" --self-written "${SELF_WRITTEN:-0.75}" \
  --max-tokens 512 --seed "${SEED:-0}" \
  --max-num-seqs "${MAX_NUM_SEQS:-256}" --dtype "${DTYPE:-auto}"
"$python" -m vllm_dominotree.training --target "$work/target" --data "$work/data.jsonl" \
  --out "$work/run" --minutes "$minutes" ${INIT_FROM:+--init-from "$INIT_FROM"} \
  ${DRAFT_LAYERS:+--draft-layers "$DRAFT_LAYERS"} ${EXPORT:+--export "$EXPORT"}
[ -z "${EXPORT:-}" ] || "$python" -m vllm_dominotree.training.draft_vocab --data "$work/data.jsonl" \
  --drafter "$EXPORT" --target "$work/target"
[ -z "${EXPORT:-}" ] || [ -z "${HELDOUT:-}" ] || "$python" -m vllm_dominotree.training.calibrate \
  --target "$work/target" --drafter "$EXPORT" --data "$HELDOUT" --write
