"""The model runner: vLLM's V1 runner with tree verification and tree acceptance.

One step, in vLLM's own order (execute_model, then sample_tokens):
1. prepare   `_prepare_inputs`: after vLLM laid out the rows (each verification row in
             its own KV slot), describe the step's trees in the persistent buffers the
             attention reads (tree_step.py) and shift tree rows to their tree positions.
2. verify    `_model_forward`: the target's forward; the attention backends fix the
             rows whose ancestors are not their causal prefix (cuda_attention.py,
             cpu_attention.py). Under FULL CUDA graphs this is one graph replay.
3. accept    `_sample`: sample-and-match for every tree at once on the device
             (acceptance.py; each row's law as vLLM shapes it for the row's own path:
             sampling_constraints.py), in vLLM's [R, max_spec_len + 1] layout, with the
             emitted tokens' logprobs when asked for,
4. commit    with the accepted paths' K/V moved into rows 1..k (commit.py); greedy
             steps on CUDA replay both as one graph (accept_graphs.py). Then, right
             before the proposer runs, the drafter's rows reordered (root, path, rest)
             at linear positions.
5. propose   the proposer (`DominoTreeProposer`) drafts the next trees into the builder's
             table on the device; the next step's prepare reads them there.
Nothing in a step waits for the device beyond what vLLM's own step waits for, so vLLM's
asynchronous scheduling (its default for DFlash on CUDA) prepares the next step while the
GPU runs this one; the step's figures and the tensor-parallel check are read a step late.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import numpy as np
import torch
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.sampler import Sampler

from ..config import accept_kernel
from ..metrics import COUNTERS as METRIC_COUNTERS
from ..metrics import engine_block
from ..openmp import process_runtime
from ..patches.worker_classes import runner_builds_every_logitsproc, runner_builds_proposer
from ..stage_clock import StageClock
from ..tree.scorers import corrected_candidates, draft_vocab_size
from . import attention_check, tree_attention_setup
from .accept_graphs import AcceptGraphs, accept_and_move
from .acceptance import Accepted, accepted_logprobs
from .commit import drafter_rows_first, target_kv
from .profiling import LaunchTrace
from .proposer import DominoTreeProposer
from .rank_check import make_rank_check
from .sampling_constraints import draw_constrained, path_tokens, reshapes_greedy
from .step_stats import DominoTreeStats, StepCounts, fold_steps
from .tree_step import TreeRows, TreeStep, TreeStepBuffers, TreeVerification, install


class DominoTreeWorkerMixin:
    """Mixed into the DominoTree workers: the RPCs the tests and benchmarks call."""

    def dominotree_stats(self) -> dict:
        """The runner's report (read with LLM.collective_rpc): the tree runner's counters
        and the seconds per stage while profiling (profiling.py); the V2 runner's is
        shorter (v2_runner.py). Both name the OpenMP runtime the worker preloaded
        (openmp.py)."""
        return self.model_runner.stats_report() | {"openmp": process_runtime()}

    def dominotree_profile(self, enabled: bool) -> None:
        """Start (or stop) timing the stages; the stage totals start again from zero."""
        self.model_runner.stage_clock.reset(enabled)

    def dominotree_trace(self, enabled: bool) -> dict | None:
        """Start tracing CUDA API calls; stopping returns their counts (profiling.py) and
        the verification steps taken meanwhile."""
        runner = self.model_runner
        if enabled:
            self._trace_steps = runner.read_stats().steps
            runner.launch_trace.start()
            runner.stage_clock.labels = True
            return None
        runner.stage_clock.labels = False
        counts = runner.launch_trace.stop()
        return counts | {"steps": runner.read_stats().steps - self._trace_steps}


class DominoTreeRunnerMixin:
    """Mixed into vLLM's V1 GPUModelRunner / CPUModelRunner (cpu_worker.py, gpu_worker.py)."""

    def __init__(self, vllm_config, device):
        # The proposer, built inside vLLM's __init__ with this runner, shares the clock.
        self.stage_clock = StageClock(torch.device(device))
        with runner_builds_proposer(DominoTreeProposer), runner_builds_every_logitsproc():
            super().__init__(vllm_config, device)
        assert isinstance(self.drafter, DominoTreeProposer), "see patches/worker_classes.py"
        self.launch_trace = LaunchTrace()
        self._stats = DominoTreeStats()  # builds excepted (the proposer's builder counts)
        # Each step's figures: the counts known on the host, and the device's (accepted
        # tokens, sibling accepts, K/V moves, leaves), folded into the stats once landed.
        self._step_counts = StepCounts(self.device)
        self._metrics = None  # the block /metrics reads (metrics.py), on the first rank
        self._published = DominoTreeStats()  # what the block holds
        # Request id -> its row in the builder's table, for the trees proposed last step.
        self._proposed: dict[str, int] = {}
        self._tree_buffers = TreeStepBuffers(self.max_num_tokens, self.device)
        self._step: TreeStep | None = None
        self._accepted: Accepted | None = None
        self._accept_graphs: AcceptGraphs | None = None  # CUDA, once the KV cache exists

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        forward_context = self.compilation_config.static_forward_context
        self._target_layers = frozenset(
            name
            for name, layer in forward_context.items()
            if hasattr(layer, "impl") and name not in self.drafter._draft_attn_layer_names
        )
        self._verification = TreeVerification(
            self._tree_buffers,
            self._target_layers,
            self.drafter.budget + 1,
            check=self.device.type == "cuda" and attention_check.enabled(),
        )
        target = forward_context[min(self._target_layers)]
        cuda = self.device.type == "cuda"
        self._stats.tree_attention = "cpu"
        self._verification.one_pass = not cuda  # CPU: cpu_attention.py's one pass
        if cuda:
            self._stats.tree_attention = tree_attention_setup.configure(
                self._verification,
                target,
                no_one_pass=None,
                max_paths=min(self.max_num_reqs * self.drafter.budget, self.max_num_tokens),
                max_tokens=self.max_num_tokens,
                max_len=self.max_model_len,
                device=self.device,
            )
        install(self._verification)
        paths = self._verification.paths
        self._stats.scorer_step = self.drafter.scorer.step
        self._stats.accept_kernel = accept_kernel(cuda)
        self._stats.draft_vocab = draft_vocab_size(self.drafter.scorer)
        self._stats.score_temperature = self.drafter.scorer.temperature
        self._stats.candidates = corrected_candidates(self.drafter.scorer)
        self._stats.budget = self.drafter.budget
        self._stats.max_leaves = self.drafter.shape.max_leaves
        self._stats.step_leaves = self.drafter.shape.step_leaves
        self._stats.step_nodes = self.drafter.shape.step_nodes
        if paths is not None:
            self._stats.path_splits = "vllm" if paths.splits is None else str(paths.splits)
        elif cuda:
            from .cuda_attention import fixup_rounding

            self._stats.fixup_rounding = fixup_rounding(target.impl)
        # Tensor parallelism: the ranks' trees agree.
        self._rank_check = make_rank_check(self.device)
        if get_tensor_model_parallel_rank() == 0:  # every rank has the same figures
            self._metrics = engine_block()

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        forward_context = self.compilation_config.static_forward_context
        layers = {n: forward_context[n] for n in self._target_layers}
        self._target_group, self._kv_mover = target_kv(kv_cache_config, layers, self.device)
        if self.device.type == "cuda":
            self._accept_graphs = AcceptGraphs(
                self._tree_buffers,
                self._accept_and_move,
                self.drafter.budget + 1,
                self.max_num_reqs,
                self.device,
            )
            tree_attention_setup.check_backend(
                self._verification,
                layers[min(layers)],
                lambda every_row: self._build_paths(1, 1, max_root=0, every_row=every_row),
            )

    def _prepare_tree_attention(self, step: TreeStep | None) -> None:
        """Whether this step runs one pass (its requests all trees), and the step's path
        requests into the tables (DOMINOTREE_CUDA_TREE_ATTENTION=paths, one-pass), built
        on the device from the step's description: no wait for the trees."""
        trees = step.trees if step is not None else []
        fixes_rows = self._tree_buffers.may_fix_rows(step)
        choice = self._verification.begin_step(
            len(trees), self._all_trees(step), self.positions, fixes_rows
        )
        self._stats.one_pass_steps += choice.every_row
        if not choice.builds_paths:
            return
        self._build_paths(
            len(trees),
            # Each owns a drafted row; one pass: a tree of the root alone has one too.
            num_paths=sum(max(t.num_rows - 1, int(choice.every_row)) for t in trees),
            # The host's root positions are exact or optimistic (asynchronous): a bound.
            max_root=max((t.start for t in trees), default=0),
            every_row=choice.every_row,
        )

    def _all_trees(self, step: TreeStep | None) -> bool:
        """Every request of the step is a tree: one pass can compute every row."""
        return step is not None and len(step.trees) == self.input_batch.num_reqs

    def _build_paths(
        self, num_trees: int, num_paths: int, max_root: int, every_row: bool = False
    ) -> None:
        tables = self._verification.paths
        rows_per_tree = self._verification.rows_per_tree
        table = self.input_batch.block_table[self._target_group]
        tables.build(
            self._tree_buffers.tree_rows(num_trees),
            rows_per_tree,
            num_paths=num_paths,
            num_keys=min(max_root + rows_per_tree, tables.max_len),
            ancestors=self._tree_buffers.token_ancestors,
            needs_fix=self._tree_buffers.token_needs_fix,
            positions=self.positions,
            block_table=table.block_table.gpu,
            block_size=table.block_size,
            slot_mapping=table.slot_mapping.gpu,
            every_row=every_row,
        )

    def capture_model(self, *args, **kwargs):
        self._verification.capturing = True
        try:
            out = super().capture_model(*args, **kwargs)
        finally:
            self._verification.capturing = False
        if self.device.type == "cuda":
            self.drafter.capture_builder()
            self._tree_buffers.clear()  # no trees: the warm-up runs move no K/V
            self._accept_graphs.capture()
            self._tree_buffers.capture(self.drafter.builder.table)
            tables = self.input_batch.block_table[self.drafter.kv_cache_gid]
            self.drafter.capture_query_pass(tables.get_device_tensor)
        return out

    def attention_check(self) -> dict | None:
        """DOMINOTREE_CHECK_TREE_ATTENTION=1: the checked rows and their largest error
        against the reference (engine/attention_check.py); None when off."""
        return asdict(attention_check.CHECK) if self._verification.check else None

    def stats_report(self) -> dict:
        stats = self.read_stats()
        return asdict(stats) | {
            "model_runner": "v1",
            "mean_accept_length": stats.mean_accept_length,
            "mean_leaves": stats.mean_leaves,
            "stage_seconds": dict(self.stage_clock.seconds),
            # vLLM's asynchronous scheduling (the next step prepared while this one runs)
            "async_scheduling": bool(self.use_async_scheduling),
            # DOMINOTREE_CHECK_TREE_ATTENTION=1: the recomputed rows against the reference
            "tree_attention_check": self.attention_check(),
            # FULL graphs captured without the stock pass (one pass)
            "one_pass_graphs": len(self._verification.one_pass_graphs),
            # The largest step vLLM captured (graph_sizes.py: decode steps of up to
            # graph_requests trees); 0 without graphs.
            "graph_tokens": self.compilation_config.max_cudagraph_capture_size or 0,
        }

    def read_stats(self) -> DominoTreeStats:
        self._fold_step_stats(wait=True)
        return self._with_graph_counts(self._stats)

    def _with_graph_counts(self, stats: DominoTreeStats) -> DominoTreeStats:
        """The stats with the builder's and the step description's own counts."""
        drafter, buffers = self.drafter, self._tree_buffers
        return replace(
            stats,
            graph_builds=drafter.builder.counts.graph_builds,
            eager_builds=drafter.builder.counts.eager_builds,
            prepared_in_build=drafter.builder.counts.prepared_in_build,
            graph_descriptions=buffers.graph_gathers,
            eager_descriptions=buffers.eager_gathers,
            graph_drafts=drafter.graph_drafts,
            eager_drafts=drafter.eager_drafts,
        )

    def execute_model(self, *args, **kwargs):
        with self.stage_clock.stage("step"):
            return super().execute_model(*args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        with self.stage_clock.stage("step"):
            return super().sample_tokens(*args, **kwargs)

    # 1. prepare ------------------------------------------------------------------------
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        spec_decode_metadata = out[1]
        with self.stage_clock.stage("prepare"):
            self._step = self._describe_trees(num_scheduled_tokens, spec_decode_metadata)
            self._prepare_tree_attention(self._step)
        self._verification.step = self._step
        if self._step is not None:
            self.positions[: self._step.num_tokens] += self._step.token_delta
        # Consumed: if the drafter is skipped this step (input too long), vLLM schedules
        # zero drafts, which then verify as the table's no-tree chain (never accepted).
        self._proposed = {}
        return out

    def _describe_trees(self, num_scheduled_tokens, spec_decode_metadata) -> TreeStep | None:
        if spec_decode_metadata is None:
            self._tree_buffers.clear()
            return None
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_drafts = np.asarray(spec_decode_metadata.num_draft_tokens)
        # Each request's first row in the forward's tokens and among the logits (the root
        # and its drafts), in batch order.
        tokens_per_request = np.asarray(num_scheduled_tokens[:num_reqs])
        token_starts = np.cumsum(tokens_per_request) - tokens_per_request
        logits_per_request = num_drafts + 1
        logits_ends = np.cumsum(logits_per_request)
        logits_starts = logits_ends - logits_per_request
        builder = self.drafter.builder
        trees = [
            TreeRows(
                i,
                int(token_starts[i]),
                int(logits_starts[i]),
                int(batch.num_computed_tokens_cpu[i]),
                int(num_drafts[i]) + 1,
                self._proposed.get(req_id, builder.no_tree_row),
            )
            for i, req_id in enumerate(batch.req_ids[:num_reqs])
            if num_drafts[i]
        ]
        logits_requests = np.repeat(np.arange(num_reqs), logits_per_request)
        # A request's logits rows are its last 1 + drafts scheduled tokens.
        token_ends = token_starts + tokens_per_request
        logits_token_rows = token_ends[logits_requests] - (
            logits_ends[logits_requests] - np.arange(len(logits_requests))
        )
        return self._tree_buffers.publish(
            trees,
            int(tokens_per_request.sum()),
            logits_requests=logits_requests,
            logits_ranges=list(zip(logits_starts.tolist(), logits_ends.tolist(), strict=True)),
            logits_token_rows=logits_token_rows,
            table=builder.table,
        )

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        verification = self._verification
        if (
            verification.one_pass
            and self.device.type == "cuda"  # FULL graphs
            and kwargs.get("force_uniform_decode") is None  # a step, not a capture
            and not verification.every_row
            and self._is_uniform_decode(
                kwargs["max_num_scheduled_tokens"],
                self.uniform_decode_query_len,
                kwargs["num_tokens"],
                kwargs["num_reqs"],
            )
        ):
            # One pass: a FULL graph runs the target's attention without the stock pass
            # (cuda_attention.py), right only when every request is a tree. vLLM calls a
            # batch of budget + 1 rows per request uniform even when some are prefill
            # chunks; such a step runs piecewise, its attention eager (stock + fixed rows).
            kwargs["force_uniform_decode"] = False
            self._stats.split_uniform_steps += 1
        decision = super()._determine_batch_execution_and_padding(*args, **kwargs)
        if self._step is not None and self._step.trees:  # a verification step
            mode = decision[0].name  # CUDAGraphMode of this forward
            host = self._stats
            if mode == "FULL":
                host.full_graph_steps += 1
            elif mode == "PIECEWISE":
                host.piecewise_steps += 1
            else:
                host.eager_steps += 1
        return decision

    # 2. verify -------------------------------------------------------------------------
    def _model_forward(self, *args, **kwargs):
        with self.stage_clock.stage("verify"):
            out = super()._model_forward(*args, **kwargs)
        # This step is spent: a forward that no step prepared (vLLM's dummy runs) must
        # not skip the stock pass.
        self._verification.every_row = False
        return out

    # 3. accept (and commit the K/V) ----------------------------------------------------
    def _sample(self, logits, spec_decode_metadata) -> SamplerOutput:
        self._accepted = None
        if spec_decode_metadata is None:
            return self._sample_without_trees(logits)
        with self.stage_clock.stage("accept"):
            step, batch = self._step, self.input_batch
            num_reqs = batch.num_reqs
            last_rows = spec_decode_metadata.cu_num_sampled_tokens.long() - 1
            width = spec_decode_metadata.max_spec_len + 1
            graphs = self._accept_graphs
            metadata = batch.sampling_metadata
            result = None
            if graphs is not None and metadata.all_greedy and not reshapes_greedy(metadata):
                result = graphs(logits, last_rows, width)
            if result is None:
                self.input_batch.update_async_output_token_ids()  # penalties read them
                target = draw_constrained(
                    logits,
                    step.logits_ranges,
                    step.request,
                    step.depth,
                    lambda: path_tokens(step, logits.shape[1]),
                    # A row at (tree) position p draws the token of position p + 1.
                    self.positions[step.token_row] + 1,
                    metadata,
                )
                result = self._accept_and_move(step, target, last_rows, num_reqs, width)
                self._stats.eager_accepts += 1
            else:
                self._stats.graph_accepts += 1
            accepted, counters = result
            self._step_counts.push(counters, step)
            self._accepted = accepted
            num_logprobs = metadata.max_num_logprobs
            logprobs = None
            if num_logprobs is not None:  # some request asks for them
                as_logits = self.model_config.logprobs_mode == "raw_logits"
                logprobs = accepted_logprobs(logits, accepted, last_rows, num_logprobs, as_logits)
        return SamplerOutput(sampled_token_ids=accepted.sampled, logprobs_tensors=logprobs)

    def _accept_and_move(
        self,
        step: TreeStep,
        target: torch.Tensor,
        last_rows: torch.Tensor,
        num_reqs: int,
        width: int,
    ) -> tuple[Accepted, torch.Tensor]:
        """accept_graphs.accept_and_move on V1's slot mapping and query starts."""
        table = self.input_batch.block_table[self._target_group]
        return accept_and_move(step, target, last_rows, num_reqs, width, self._kv_mover,
                               table.slot_mapping.gpu, self.query_start_loc.gpu,
                               self._stats.accept_kernel == "triton")  # fmt: skip

    def _sample_without_trees(self, logits: torch.Tensor) -> SamplerOutput:
        """vLLM's sampler, except for seeded requests: they draw with the keyed noise of
        the tree steps (acceptance.py), so that every token of a seeded request comes
        from the same function of (seed, position) whether its step verified trees or
        not (a prefill that ends beside trees, or alone); their logprobs, when asked
        for, are those of the tokens they drew."""
        metadata = self.input_batch.sampling_metadata
        seeded = list(metadata.generators)
        if not seeded:
            return super()._sample(logits, None)
        num_reqs = self.input_batch.num_reqs
        last_rows = self.query_start_loc.gpu[1 : num_reqs + 1].long() - 1
        requests = torch.arange(num_reqs, device=logits.device)
        ranges = [(r, r + 1) for r in range(num_reqs)]
        # Drawn, and their raw logits kept, before vLLM's sampler runs: it scales float32
        # logits by the temperature (and constrains them) in place.
        self.input_batch.update_async_output_token_ids()
        drawn = draw_constrained(
            logits,
            ranges,
            requests,
            torch.zeros_like(requests),  # no drafts: every row is its request's next token
            lambda: None,
            self.positions[last_rows] + 1,
            metadata,
        )[seeded]
        raw = logits[seeded].float()  # [S, V], a copy
        out = super()._sample(logits, None)
        out.sampled_token_ids[seeded, 0] = drawn.to(out.sampled_token_ids.dtype)
        if out.logprobs_tensors is not None:
            if self.model_config.logprobs_mode != "raw_logits":
                raw = Sampler.compute_logprobs(raw)
            ours = Sampler.gather_logprobs(raw, metadata.max_num_logprobs, drawn.long())
            for theirs, mine in zip(out.logprobs_tensors[:3], ours[:3], strict=True):
                theirs[seeded] = mine
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        # vLLM rewinds the generator of every request whose sampled token it discards
        # (a prefill chunk), assuming its sampler drew for it; ours does not draw from
        # generators (seeded noise is keyed, acceptance.py), and a CPU generator cannot
        # be rewound at all (get_offset raises). Hide them.
        generators = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]
        hidden = {int(i): generators.pop(int(i)) for i in discarded if int(i) in generators}
        try:
            out = super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(hidden)
        self._fold_step_stats(wait=False)
        return out

    def _fold_step_stats(self, wait: bool) -> None:
        """The landed steps' figures into the stats (and the /metrics block)."""
        fold_steps(self._stats, self._step_counts, wait)
        times = self.drafter.times.ready()  # read on every rank: they are kept until read
        if self._metrics is not None:
            self._publish(times)

    def _publish(self, times: list[tuple[float, float]]) -> None:
        """The figures since the last publication, and the steps' (draft, build) seconds,
        into the /metrics block."""
        now, before = self._with_graph_counts(self._stats), self._published
        self._metrics.add(
            {name: getattr(now, name) - getattr(before, name) for name in METRIC_COUNTERS}
        )
        self._published = now
        for draft, build in times:
            self._metrics.observe("draft_seconds", draft)
            self._metrics.observe("build_seconds", build)

    # 4. commit the drafter's rows, 5. propose ------------------------------------------
    def propose_draft_token_ids(
        self,
        scheduler_output,
        sampled_token_ids,
        sampling_metadata,
        hidden_states,
        sample_hidden_states,
        aux_hidden_states,
        *args,
    ):
        if self._accepted is not None:
            drafter_rows_first(
                self._step, self._accepted, self.input_ids.gpu, self.positions, aux_hidden_states
            )
        drafts = super().propose_draft_token_ids(
            scheduler_output,
            sampled_token_ids,
            sampling_metadata,
            hidden_states,
            sample_hidden_states,
            aux_hidden_states,
            *args,
        )
        req_ids = self.input_batch.req_ids[: self.input_batch.num_reqs]
        if self._rank_check is not None:
            self._rank_check(self.drafter.builder.table[:, : len(req_ids)])
        self._proposed = {req_id: i for i, req_id in enumerate(req_ids)}
        return drafts
