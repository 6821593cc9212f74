"""The model runner: vLLM's V1 runner with tree verification and tree acceptance.

Per step, on top of vLLM's DFlash flow:
1. `_prepare_inputs`: after vLLM laid out the rows (each verification row in its own
   KV slot), give tree rows their tree positions (root position + depth) and describe
   the step's trees (`TreeRows`).
2. `_model_forward`: run the target with the trees published to the attention backend
   (ancestor-only attention for tree rows, K/V of tree rows kept).
3. `_sample`: sample-and-match every request's tree with its own sampling params and
   generator; report the accepted path plus the bonus as the first tokens of vLLM's
   [R, max_spec_len + 1] output so the scheduler's prefix rollback stays right; rewrite
   the path's K/V into the first slots; put the root and path rows first (with linear
   positions) so the drafter's context update takes exactly the accepted rows.
4. The proposer (`DominoTreeProposer`) drafts the next trees, kept per request id.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
import vllm.v1.worker.gpu_model_runner as gpu_model_runner
from vllm.v1.outputs import SamplerOutput

from ..patches.worker_classes import swapped
from ..tree.acceptance import SamplingParams, draw_target_tokens
from ..tree.builder import DraftTree
from .profiling import StageClock
from .proposer import DominoTreeProposer
from .tree_context import TreeAttentionContext, published, rewrite_accepted_kv
from .verify import TreeRows, accept_rows, tree_rows


@dataclass
class DominoTreeStats:
    """Counters the tests and benchmarks read through collective_rpc."""

    steps: int = 0  # verification steps with at least one tree
    trees: int = 0  # trees verified
    accepted_tokens: int = 0  # drafted tokens accepted (bonus excluded)
    sibling_accepts: int = 0  # accepted nodes that were not their parent's first child
    kv_moves: int = 0  # accepted paths whose K/V had to move to the first slots
    tree_leaves: int = 0  # leaves of the trees verified (a chain has one)

    @property
    def mean_accept_length(self) -> float:
        return 1 + self.accepted_tokens / max(1, self.trees)

    @property
    def mean_leaves(self) -> float:
        return self.tree_leaves / max(1, self.trees)


class DominoTreeWorkerMixin:
    """Mixed into the DominoTree workers: the RPCs the tests and benchmarks call."""

    def dominotree_stats(self) -> dict:
        """Counters of the tree runner (read with LLM.collective_rpc), and the seconds
        per stage while profiling (profiling.py)."""
        stats = self.model_runner.dominotree_stats
        clock = self.model_runner.stage_clock
        return asdict(stats) | {"mean_accept_length": stats.mean_accept_length,
                                "mean_leaves": stats.mean_leaves,
                                "stage_seconds": dict(clock.seconds)}  # fmt: skip

    def dominotree_profile(self, enabled: bool) -> None:
        """Start (or stop) timing the stages; the stage totals start again from zero."""
        self.model_runner.stage_clock.reset(enabled)


class DominoTreeRunnerMixin:
    """Mixed into vLLM's V1 GPUModelRunner / CPUModelRunner (cpu_worker.py, gpu_worker.py)."""

    def __init__(self, vllm_config, device):
        with swapped(gpu_model_runner, "DFlashProposer", DominoTreeProposer):
            super().__init__(vllm_config, device)
        assert isinstance(self.drafter, DominoTreeProposer), "see patches/worker_classes.py"
        self.dominotree_stats = DominoTreeStats()
        self.stage_clock = self.drafter.clock = StageClock(self.device)
        self._trees: dict[str, DraftTree] = {}  # request id -> the tree proposed for it
        self._step_trees: TreeAttentionContext | None = None
        # This step's accepted paths that are not rows 1..k: their K/V moves to the first
        # slots, and their rows move first for the drafter.
        self._moved: list[tuple[TreeRows, list[int]]] = []

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        forward_context = self.compilation_config.static_forward_context
        self._target_layers = frozenset(
            name
            for name, layer in forward_context.items()
            if hasattr(layer, "impl") and name not in self.drafter._draft_attn_layer_names
        )

    def execute_model(self, *args, **kwargs):
        with self.stage_clock.stage("step"):
            return super().execute_model(*args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        with self.stage_clock.stage("step"):
            return super().sample_tokens(*args, **kwargs)

    # 1. positions and tree description -------------------------------------------------
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        trees: list[TreeRows] = []
        row = 0
        for i, req_id in enumerate(self.input_batch.req_ids[: self.input_batch.num_reqs]):
            drafts = spec_tokens.get(req_id)
            if drafts:
                start = int(self.input_batch.num_computed_tokens_cpu[i])
                trees.append(tree_rows(i, row, start, list(drafts), self._trees.get(req_id)))
            row += int(num_scheduled_tokens[i])
        if trees:
            # Every tree row's position in one host-to-device copy: [sum of rows].
            rows = torch.tensor([t.row_start + r for t in trees for r in range(t.num_rows)])
            depths = torch.tensor([t.start + d for t in trees for d in t.depths])
            device = self.positions.device
            self.positions[rows.to(device)] = depths.to(device, self.positions.dtype)
        self._step_trees = TreeAttentionContext(trees, self._target_layers) if trees else None
        # Consumed: if the drafter is skipped this step (input too long), the scheduler
        # gets zero drafts, which then verify as a plain chain.
        self._trees = {}
        return out

    # 2. the target forward with tree attention ----------------------------------------
    def _model_forward(self, *args, **kwargs):
        with published(self._step_trees), self.stage_clock.stage("verify"):
            return super()._model_forward(*args, **kwargs)

    # 3. acceptance ---------------------------------------------------------------------
    def _sample(self, logits, spec_decode_metadata) -> SamplerOutput:
        if spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        with self.stage_clock.stage("accept"):
            return self._accept(logits, spec_decode_metadata)

    def _accept(self, logits, spec_decode_metadata) -> SamplerOutput:
        batch = self.input_batch
        num_reqs = batch.num_reqs
        trees = {t.batch_index: t for t in (self._step_trees.trees if self._step_trees else [])}
        width = spec_decode_metadata.max_spec_len + 1
        sampled = torch.full((num_reqs, width), -1, dtype=torch.int32)
        self._moved = []
        # Greedy rows' tokens for the whole batch in one device-to-host copy.
        greedy = logits.argmax(dim=-1).tolist() if batch.greedy_reqs else None
        first_row = 0
        for i in range(num_reqs):
            num_rows = spec_decode_metadata.num_draft_tokens[i] + 1
            rows = slice(first_row, first_row + num_rows)
            first_row += num_rows
            if self.discard_request_mask.np[i]:  # a prefill chunk: vLLM drops the token
                sampled[i, 0] = 0
                continue
            params = self._sampling_params(i)
            tree = trees.get(i)
            if params.greedy:
                target = greedy[rows]
            else:
                generator = batch.sampling_metadata.generators.get(i)
                # Without a tree (a prefill's end) only the last row is drawn.
                drawn = logits[rows] if tree is not None else logits[rows][-1:]
                target = draw_target_tokens(drawn, params, generator).tolist()
            if tree is None:
                sampled[i, 0] = target[-1]
                continue
            result = accept_rows(tree, target)
            sampled[i, : len(result.tokens)] = torch.tensor(result.tokens, dtype=torch.int32)
            self._count(tree, result)
            if result.moved:
                self._moved.append((tree, result.path))
        if self._step_trees is not None:
            rewrite_accepted_kv(self.compilation_config.static_forward_context,
                                self._step_trees, self._moved)  # fmt: skip
            self.dominotree_stats.steps += 1
            self.dominotree_stats.kv_moves += len(self._moved)
        return SamplerOutput(sampled_token_ids=sampled.to(logits.device), logprobs_tensors=None)

    def _bookkeeping_sync(self, *args, **kwargs):
        # vLLM rewinds the generator of every request whose sampled token it discards
        # (a prefill chunk), assuming its sampler drew for it; ours did not draw, and a
        # CPU generator cannot be rewound at all (get_offset raises). Hide them.
        generators = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]
        hidden = {int(i): generators.pop(int(i)) for i in discarded if int(i) in generators}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(hidden)

    def _sampling_params(self, i: int) -> SamplingParams:
        batch = self.input_batch
        if batch.req_ids[i] in batch.greedy_reqs:
            return SamplingParams()
        top_k = int(batch.top_k_cpu[i])
        return SamplingParams(
            temperature=float(batch.temperature_cpu[i]),
            top_k=0 if top_k >= self.model_config.get_vocab_size() else top_k,
            top_p=float(batch.top_p_cpu[i]),
        )

    def _count(self, tree: TreeRows, result) -> None:
        stats = self.dominotree_stats
        stats.trees += 1
        stats.accepted_tokens += len(result.path)
        kids = tree.tree.children
        stats.sibling_accepts += sum(kids[tree.parents[n]][0] != n for n in result.path)
        stats.tree_leaves += sum(not node_kids for node_kids in kids)

    # 4. proposing ----------------------------------------------------------------------
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                *args):  # fmt: skip
        # The drafter takes each request's first 1 + k rows (k accepted) as its new
        # context, at linear positions: put the root and the path first (one gather per
        # tensor for all moved trees).
        if self._moved:
            dst, src, positions = [], [], []
            for tree, path in self._moved:
                keep = [0, *path]
                order = keep + [r for r in range(tree.num_rows) if r not in set(keep)]
                dst += range(tree.row_start, tree.row_start + tree.num_rows)
                src += [tree.row_start + r for r in order]
                positions += range(tree.start, tree.start + tree.num_rows)
            device = self.positions.device
            dst, src = torch.tensor(dst, device=device), torch.tensor(src, device=device)
            for rows in (self.input_ids.gpu, *(aux_hidden_states or [])):
                rows[dst] = rows[src]  # the gather copies before the scatter writes
            self.positions[dst] = torch.tensor(positions, device=device,
                                               dtype=self.positions.dtype)  # fmt: skip
        drafts = super().propose_draft_token_ids(
            scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
            sample_hidden_states, aux_hidden_states, *args,
        )  # fmt: skip
        req_ids = self.input_batch.req_ids[: self.input_batch.num_reqs]
        self._trees = dict(zip(req_ids, self.drafter.last_trees, strict=True))
        return drafts
