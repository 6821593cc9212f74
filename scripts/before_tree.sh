#!/usr/bin/env bash
# The code of an earlier commit for the device, so that a hot-path change is measured
# before and after in the same device call (README: the H200 runbook):
#   bash scripts/before_tree.sh REV
# writes .before/ (ignored by git): the package, kernels and benchmarks at REV, without
# the shipped drafter's weights and benchmarks/results (about 1.5 MiB). Carry it:
# [".gpu/bin", ".before"]; `bash scripts/gpu_jobs.sh round-cost-before ARGS` installs and
# measures it there.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: before_tree.sh REV}
rm -rf .before
mkdir .before
git archive "$rev" pyproject.toml README.md vllm_dominotree kernels benchmarks | tar -x -C .before
# Neither the shipped drafter's weights nor the recorded results are needed to measure.
rm -f .before/vllm_dominotree/drafters/*/model-*.safetensors
rm -rf .before/benchmarks/results
echo "$(git rev-parse --short "$rev")" > .before/REVISION
echo ".before/ holds $(cat .before/REVISION) ($(du -sh .before | cut -f1)); carry it with .gpu/bin"
