"""The DominoTree engine on vLLM's Model Runner V2 (option `model_runner: "v2"`).

vLLM's V2 runner keeps every request's state on the device and prepares a step with a
few Triton kernels, where the V1 runner that the tree runner (runner.py) extends
rebuilds a host-side batch each step: on the H200 that host work paced the plugin's
batch-1 round (docs/v2-runner-port.md). This mixin gives the V2 runner the plugin's
speculator (v2_speculator.py). The chain is verified by vLLM's own sampler (exact for a
chain). Trees take the tree runner's steps, at V2's hooks (on CUDA after vLLM's own
attention pass, FA3 path requests or the fix-up kernel recompute the branched rows,
recorded in its FULL graphs: tree_attention_setup.py):
1. prepare (`prepare_attn`, after vLLM's slot mappings from linear positions): the
   step's trees described (tree_step.py; the tables by request-state slot) and the tree
   rows' positions moved to root + depth;
2. verify: the target's forward, the attention backends reading the description;
3. accept (`rejection_sampler`, v2_sampler.py): the target's token drawn at every row,
   the longest accepted path per tree, its K/V moved to rows 1..k; vLLM's V2 bookkeeping
   then keeps 1 + k rows per request, as for a chain;
4. commit (the speculator's `commit`, before it drafts): the drafter's context rows
   reordered, root and path first (commit.py);
5. propose: the speculator's trees, filed by request-state slot.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from ..config import accept_kernel
from ..metrics import engine_block
from ..patches.worker_classes import v2_runner_builds_speculator
from ..stage_clock import StageClock
from ..tree.scorers import corrected_candidates, draft_vocab_size
from . import tree_attention_setup
from .accept_graphs import AcceptGraphs, accept_and_move
from .acceptance import Accepted, draw_targets
from .commit import drafter_rows_first, target_kv
from .step_stats import DominoTreeStats, StepCounts, fold_steps
from .tree_step import TreeRows, TreeStep, TreeStepBuffers, TreeVerification, install
from .v2_sampler import TreeRejectionSampler, step_law
from .v2_speculator import DominoTreeSpeculator

# The counters the V2 runner keeps (its report and the /metrics block), of
# step_stats.DominoTreeStats.
V2_COUNTERS = (
    "steps",
    "trees",
    "tree_nodes",
    "accepted_tokens",
    "sibling_accepts",
    "tree_leaves",
    "kv_moves",
    "graph_accepts",
    "eager_accepts",
    "one_pass_steps",
)


class DominoTreeV2RunnerMixin:
    """Mixed into vLLM's V2 GPUModelRunner / CPUModelRunner (gpu_worker.py, cpu_worker.py)."""

    def __init__(self, vllm_config, device):
        with v2_runner_builds_speculator(DominoTreeSpeculator):
            super().__init__(vllm_config, device)
        assert isinstance(self.speculator, DominoTreeSpeculator), "see patches/worker_classes.py"
        # The step's stages as profiler ranges while a benchmark traces the worker
        # (profiling.KernelTraceExtension turns `labels` on): verify (the target's
        # forward, prepare inside it), sample (vLLM's sampling and bookkeeping, accept
        # and draft inside it), commit and draft (the speculator). Off, a no-op.
        self.stage_clock = StageClock(torch.device(device))
        self.speculator.stage = self.stage_clock.stage
        self._trees = not self.speculator.chain
        self._step: TreeStep | None = None
        self._accepted: Accepted | None = None
        # The trees' counters (step_stats.py): the step counters V1 keeps and how each
        # step accepted (graph or eager); none for the chain, which vLLM verifies (its
        # spec-decode metrics count it).
        self._stats = DominoTreeStats()
        self._accept_graphs: AcceptGraphs | None = None  # CUDA, once the KV cache exists
        self._step_counts = StepCounts(torch.device(device))
        self._metrics = None  # the /metrics block (metrics.py), on the first rank
        self._published = DominoTreeStats()

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        if not self._trees:
            return
        speculator = self.speculator
        forward_context = self.compilation_config.static_forward_context
        self._target_layers = frozenset(
            name
            for name, layer in forward_context.items()
            if hasattr(layer, "impl") and name not in speculator.draft_attn_layer_names
        )
        self._tree_buffers = TreeStepBuffers(self.max_num_tokens, self.device)
        self._verification = TreeVerification(
            self._tree_buffers, self._target_layers, speculator.shape.budget + 1
        )
        self.tree_attention = "cpu"
        self._verification.one_pass = self.device.type == "cpu"  # cpu_attention.py's one pass
        if self.device.type == "cuda":
            budget = speculator.shape.budget
            self.tree_attention = tree_attention_setup.configure(
                self._verification,
                forward_context[min(self._target_layers)],
                no_one_pass=self._no_one_pass(),
                max_paths=min(self.max_num_reqs * budget, self.max_num_tokens),
                max_tokens=self.max_num_tokens,
                max_len=self.max_model_len,
                device=self.device,
            )
        install(self._verification)
        self._stats.accept_kernel = accept_kernel(self.device.type == "cuda")
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() == 0:  # every rank has the same figures
            self._metrics = engine_block()
        self.rejection_sampler = TreeRejectionSampler(self._accept)
        speculator.commit = self._commit

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        if not self._trees:
            return
        forward_context = self.compilation_config.static_forward_context
        layers = {n: forward_context[n] for n in self._target_layers}
        self._target_group, self._kv_mover = target_kv(kv_cache_config, layers, self.device)
        if self.device.type == "cuda":
            self._accept_graphs = AcceptGraphs(
                self._tree_buffers,
                self._accept_and_move,
                self.speculator.shape.budget + 1,
                self.max_num_reqs,
                self.device,
            )
            positions, slots = self.input_buffers.positions, self.block_tables.slot_mappings
            tree_attention_setup.check_backend(
                self._verification,
                layers[min(layers)],
                lambda every_row: self._build_paths(1, 1, 0, positions, slots, every_row),
            )

    def _no_one_pass(self) -> str | None:
        """Why this engine cannot take one pass (None: it can). V2 captures FULL graphs
        without a batch descriptor, and one pass tells those that hold trees alone by
        their shape (cuda_attention.full_graph_of_trees_alone): under cudagraph_mode FULL
        a FULL graph of mixed batches, and with adaptive verification a varlen decode
        graph (requests of 1 .. 1 + budget rows), could have that shape too."""
        from vllm.config import CUDAGraphMode

        if self.compilation_config.cudagraph_mode.mixed_mode() == CUDAGraphMode.FULL:
            return (
                "with model_runner 'v2' one pass needs vLLM's mixed batches outside FULL "
                "graphs; use cudagraph_mode FULL_AND_PIECEWISE (vLLM's default) or "
                "model_runner 'v1'"
            )
        # vLLM's own test (model_runner.initialize_kv_cache), which comes after this.
        if getattr(self.speculator, "enable_adaptive_verification", False):
            return (
                "with model_runner 'v2' one pass cannot tell vLLM's varlen decode graphs "
                "(adaptive verification) from graphs of trees alone; turn adaptive "
                "verification off or use model_runner 'v1'"
            )
        return None

    def capture_model(self, *args, **kwargs):
        if not self._trees:
            return super().capture_model(*args, **kwargs)
        # While vLLM captures, the tree kernel launches even without trees, so that the
        # FULL graphs contain it (cuda_attention.py); its replays read each step's trees.
        self._verification.capturing = True
        try:
            out = super().capture_model(*args, **kwargs)
        finally:
            self._verification.capturing = False
        if not kwargs.get("profile_only", False):
            self.speculator.capture_builder()
            if self.device.type == "cuda":  # the step description's gather, one replay
                self._tree_buffers.capture(self.speculator.state_table)
            if self._accept_graphs is not None:
                self._tree_buffers.clear()  # no trees: the warm-up runs move no K/V
                self._accept_graphs.capture()
        return out

    def execute_model(self, *args, **kwargs):
        with self.stage_clock.stage("verify"):
            try:
                return super().execute_model(*args, **kwargs)
            finally:
                if self._trees:  # this forward's one pass ends with it
                    self._verification.every_row = False

    def sample_tokens(self, *args, **kwargs):
        with self.stage_clock.stage("sample"):
            return super().sample_tokens(*args, **kwargs)

    def stats_report(self) -> dict:
        """How this engine verifies and, for trees, the step counters V2 keeps, the
        builds that ran outside vLLM's graphs (replays of the builder's own graph, or
        eager; those in vLLM's FULL graphs replay with them, unseen) and how the steps'
        descriptions were gathered (V1's other counters are not kept here: left out, not
        zero). The chain is verified by vLLM: its spec-decode metrics count it."""
        report = {
            "model_runner": "v2",
            "scorer": self.speculator.options.scorer,
            "scorer_step": self.speculator.scorer.step,
            "draft_vocab": draft_vocab_size(self.speculator.scorer),
            "score_temperature": self.speculator.scorer.temperature,
            "candidates": corrected_candidates(self.speculator.scorer),
            "budget": self.speculator.shape.budget,
            "max_leaves": self.speculator.shape.max_leaves,
            "step_leaves": self.speculator.shape.step_leaves,
            "step_nodes": self.speculator.shape.step_nodes,  # 0: refused here (speculative.py)
            "stage_seconds": dict(self.stage_clock.seconds),
            # The largest step vLLM captured (graph_sizes.py); 0 without graphs.
            "graph_tokens": self.compilation_config.max_cudagraph_capture_size or 0,
        }
        if self._trees:
            self._fold_step_stats(wait=True)
            stats = self._stats
            report |= {name: getattr(stats, name) for name in V2_COUNTERS}
            builds = self.speculator.builder.counts
            report["graph_builds"] = builds.graph_builds
            report["eager_builds"] = builds.eager_builds
            report["graph_descriptions"] = self._tree_buffers.graph_gathers
            report["eager_descriptions"] = self._tree_buffers.eager_gathers
            report["mean_accept_length"] = stats.mean_accept_length
            report["mean_leaves"] = stats.mean_leaves
            report["tree_attention"] = self.tree_attention
            report["accept_kernel"] = stats.accept_kernel
            # FULL graphs captured without the stock pass (one pass)
            report["one_pass_graphs"] = len(self._verification.one_pass_graphs)
            paths = self._verification.paths
            if paths is not None:
                report["path_splits"] = "vllm" if paths.splits is None else str(paths.splits)
        return report

    def _fold_step_stats(self, wait: bool) -> None:
        """The landed steps' figures into the stats and the /metrics block."""
        fold_steps(self._stats, self._step_counts, wait)
        if self._metrics is not None:
            now, before = self._stats, self._published
            self._metrics.add(
                {name: getattr(now, name) - getattr(before, name) for name in V2_COUNTERS}
            )
            self._published = replace(now)

    # 1. prepare ------------------------------------------------------------------------
    def prepare_attn(self, input_batch):
        block_tables, slot_mappings = super().prepare_attn(input_batch)
        if self._trees:
            with self.stage_clock.stage("prepare"):
                self._step = self._describe_trees(input_batch)
                self._verification.step = self._step
                trees = self._step.trees if self._step is not None else []
                # One pass: a step whose requests are all trees skips the stock pass.
                all_trees = 0 < len(trees) == input_batch.num_reqs
                fixes_rows = self._tree_buffers.may_fix_rows(self._step)
                choice = self._verification.begin_step(
                    len(trees), all_trees, input_batch.positions, fixes_rows
                )
                self._stats.one_pass_steps += choice.every_row
                if choice.builds_paths:
                    self._build_paths(
                        len(trees),
                        # Each owns a drafted row; one pass: a tree of the root alone too.
                        sum(max(t.num_rows - 1, int(choice.every_row)) for t in trees),
                        max((t.start for t in trees), default=0),
                        input_batch.positions,
                        slot_mappings,
                        choice.every_row,
                    )
                if self._step is not None:
                    input_batch.positions[: self._step.num_tokens] += self._step.token_delta
        return block_tables, slot_mappings

    def _build_paths(
        self,
        num_trees: int,
        num_paths: int,
        max_root: int,
        positions: torch.Tensor,  # [>= T] linear (a root row's: the root's position)
        slot_mappings: torch.Tensor,  # [groups, >= T]
        every_row: bool = False,
    ) -> None:
        """The step's path requests (tree_paths.py), built on the device from its
        description and vLLM's batch-ordered block table: each tree's fixed rows under the
        stock pass, or every row (one pass). max_root bounds the roots' positions (the
        host's counts are exact or optimistic under asynchronous scheduling)."""
        rows_per_tree = self._verification.rows_per_tree
        tables = self._verification.paths
        group = self._target_group
        tables.build(
            self._tree_buffers.tree_rows(num_trees),
            rows_per_tree,
            num_paths=num_paths,
            num_keys=min(max_root + rows_per_tree, tables.max_len),
            ancestors=self._tree_buffers.token_ancestors,
            needs_fix=self._tree_buffers.token_needs_fix,
            positions=positions,
            block_table=self.block_tables.input_block_tables[group],
            block_size=self.block_tables.block_sizes[group],
            slot_mapping=slot_mappings[group],
            every_row=every_row,
        )

    def _describe_trees(self, input_batch) -> TreeStep | None:
        num_reqs = input_batch.num_reqs
        drafts = input_batch.num_draft_tokens_per_req
        if input_batch.num_draft_tokens == 0 or drafts is None:
            self._tree_buffers.clear()
            return None
        token_starts = input_batch.query_start_loc_np[:num_reqs].astype("int64")
        token_ends = input_batch.query_start_loc_np[1 : num_reqs + 1].astype("int64")
        logits_bounds = input_batch.cu_num_logits_np[: num_reqs + 1].astype("int64")
        logits_starts, logits_ends = logits_bounds[:-1], logits_bounds[1:]
        # The roots' positions, which the CPU attention reads on the host: the device's
        # (read in place on CPU), exact under asynchronous scheduling too. CUDA reads
        # them on the device; the host's count (an upper bound) is not waited for.
        if self.device.type == "cuda":
            roots = input_batch.num_computed_tokens_np[:num_reqs].tolist()
        else:
            roots = input_batch.positions[torch.as_tensor(token_starts)].tolist()
        slots = input_batch.idx_mapping_np[:num_reqs]
        trees = [
            TreeRows(
                i,
                int(token_starts[i]),
                int(logits_starts[i]),
                int(roots[i]),
                int(drafts[i]) + 1,
                int(slots[i]),
            )
            for i in range(num_reqs)
            if drafts[i]
        ]
        logits_requests = np.repeat(np.arange(num_reqs), logits_ends - logits_starts)
        # A request's logits rows are its last rows.
        logits_token_rows = token_ends[logits_requests] - (
            logits_ends[logits_requests] - np.arange(len(logits_requests))
        )
        return self._tree_buffers.publish(
            trees,
            input_batch.num_tokens,
            logits_requests=logits_requests,
            logits_ranges=list(zip(logits_starts.tolist(), logits_ends.tolist(), strict=True)),
            logits_token_rows=logits_token_rows,
            table=self.speculator.state_table,
        )

    # 3. accept (and move the K/V) ------------------------------------------------------
    def _accept(self, logits: torch.Tensor, input_batch) -> SamplerOutput:
        with self.stage_clock.stage("accept"):
            self._fold_step_stats(wait=False)  # earlier steps' counters, if landed
            return self._accept_trees(logits, input_batch)

    def _accept_trees(self, logits: torch.Tensor, input_batch) -> SamplerOutput:
        step = self._step
        if step is None:
            raise RuntimeError("dominotree: drafts were verified without a tree description")
        num_reqs = input_batch.num_reqs
        law = step_law(self.sampler.sampling_states, input_batch)
        last_rows = input_batch.cu_num_logits[1 : num_reqs + 1].long() - 1
        graphs, result = self._accept_graphs, None
        if graphs is not None and law.all_greedy:
            result = graphs(logits, last_rows, step.width)
        if result is None:  # sampled requests, CPU, no graph for the shape
            target = draw_targets(
                logits,
                step.request,
                step.logits_ranges,
                # A row at (tree) position p draws the token of position p + 1.
                input_batch.positions[step.token_row] + 1,
                law,
            )
            result = self._accept_and_move(step, target, last_rows, num_reqs, step.width)
            self._stats.eager_accepts += 1
        else:
            self._stats.graph_accepts += 1
        accepted, counters = result
        self._accepted = accepted
        self._step_counts.push(counters, step)
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            (accepted.num_accepted + 1).to(torch.int32),
            input_batch.seq_lens,
            input_batch.cu_num_logits,
            input_batch.idx_mapping,
            self.req_states.prefill_len.gpu,
        )
        return SamplerOutput(
            sampled_token_ids=accepted.sampled.to(torch.int64),
            logprobs_tensors=None,
            num_nans=None,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )

    def _accept_and_move(
        self,
        step: TreeStep,
        target: torch.Tensor,
        last_rows: torch.Tensor,
        num_reqs: int,
        width: int,
    ) -> tuple[Accepted, torch.Tensor]:
        """accept_graphs.accept_and_move on V2's slot mappings and query starts."""
        slot_mapping = self.block_tables.slot_mappings[self._target_group]
        return accept_and_move(step, target, last_rows, num_reqs, width, self._kv_mover,
                               slot_mapping, self.input_buffers.query_start_loc,
                               self._stats.accept_kernel == "triton")  # fmt: skip

    # 4. commit the drafter's rows (the speculator calls this before it drafts) ----------
    def _commit(self, input_batch, aux_hidden_states) -> None:
        if self._accepted is None:
            return
        drafter_rows_first(
            self._step,
            self._accepted,
            input_batch.input_ids,
            input_batch.positions,
            aux_hidden_states,
        )
        self._accepted = None
