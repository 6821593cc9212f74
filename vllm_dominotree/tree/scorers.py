"""Children functions for the best-first builders.

Both scorers are prepared once per step with the backbone's outputs for every request,
then answer `children()` for one new node per request (the device builder,
device_builder.py) or `expand()` for a list of new nodes (the host heap, builder.py, the
reference). `expand()` lays request r's node on row r of the very same `children()` call
on the same padded row count (`step_rows`), so both builders see bit-identical children.

ConditionalScorer (DominoTree): a node at depth d holds the GRU state S after its own
token (the root's state is the GRU run over the anchor from zeros). Its children are the
top-C tokens of `log_softmax(L_base[d] + embed_proj([h_d ; S]))` over the marginal top-M
candidates of depth d (only those rows of embed_proj.2 are gathered, once per step), with
no correction for the first `pure_draft_prefix_len` drafts. M >= V means the whole
vocabulary, with no gather.

MarginalScorer (DDTree): children at depth d are the top-C tokens of
`log_softmax(L_base[d])`, whatever the path.

Both also give the chain (one child per node, one block) as plain unrolled steps:
Domino's decoder (the corrected argmax over the same marginal top-M candidates as a
tree's; M >= V: the released decoder's argmax over the whole vocabulary) or DFlash's
marginal argmax.

With a draft vocabulary (`vocab_ids`, [S] token ids; drafter/draft_vocab.py) the
marginal logits a scorer is prepared with cover those S tokens only ([R, K, S]), and
"the whole vocabulary" above means those S: a candidate's index is mapped to its token
id before anything is embedded or returned.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ..drafter.model import DominoHead
from .builder import Children, Expansion, TreeShape


def padded_rows(n: int, max_requests: int) -> int:
    """Rows a step of n requests computes: the next power of two (at most max_requests),
    so that a few captured shapes serve every batch."""
    p = 1
    while p < n:
        p *= 2
    return min(p, max_requests)


def compiled(fn, device: torch.device):
    """On CUDA, Inductor fuses a step's ~30 small kernels into a few (one dynamic-shape
    compilation serves every padded row count); on CPU the step runs as written."""
    return torch.compile(fn, fullgraph=True, dynamic=True) if device.type == "cuda" else fn


RANKED_WIDTH = 256  # candidate widths whose top-C is taken by counting ranks


def top_by_rank(values: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` largest of values [p, M] and their indices [p, count], best first,
    equal values in index order. For the small M of a top-M restriction: M x M
    comparisons and a one-hot pick, which Inductor fuses into a couple of kernels inside
    the builder's graph, where torch.topk launches a selection and a sort per pop."""
    m = values.shape[-1]
    index = torch.arange(m, device=values.device)
    a, b = values[:, :, None], values[:, None, :]  # [p, i, j]: does j rank above i?
    above = (b > a) | ((b == a) & (index[None, None, :] < index[None, :, None]))
    rank = above.sum(-1)  # [p, M], a permutation of 0..M-1 per row
    slots = torch.arange(count, device=values.device)
    picked = ((rank[:, None, :] == slots[None, :, None]) * index).sum(-1)  # [p, count]
    return values.gather(1, picked), picked


REDUCTION_CHUNK = 2048  # logits a program reduces in the first of two stages


def best_and_log_normalizer(
    logits: torch.Tensor, chunked: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The largest logit of each row of logits [..., W], the index of its first
    occurrence, and log sum exp over the row, in float32 -> [...] each.

    On CUDA (chunked None) in two stages over chunks of REDUCTION_CHUNK, because Inductor
    compiles a reduction over rows of a dynamic count as one program per row: over the
    151,936 logits of one request's row that program took ~40 us, 16 times a chain (H100,
    2026-12-06c), where chunks give every row ~75 programs. The index is torch.max's (the
    first of tied maxima: the first chunk holding the maximum, its first position there);
    the normaliser sums the chunks' sums rescaled to the maximum, so it rounds apart from
    torch.logsumexp by a few ulps. Eager on CPU, torch's own reductions are one pass
    (the chunks cost 3x there: 2.6 against 0.9 ms over 16 x 49,152 logits, 2 cores)."""
    logits = logits.float()
    if not (logits.is_cuda if chunked is None else chunked):
        best, index = logits.max(dim=-1)
        return best, index, torch.logsumexp(logits, dim=-1)
    *rows, width = logits.shape
    chunks = -(-width // REDUCTION_CHUNK)
    padded = F.pad(logits, (0, chunks * REDUCTION_CHUNK - width), value=float("-inf"))
    padded = padded.view(*rows, chunks, REDUCTION_CHUNK)
    chunk_max, chunk_arg = padded.max(dim=-1)  # [..., chunks]
    # A chunk of -inf logits alone (masked tokens) sums to 0, not to exp(-inf + inf).
    shift = torch.where(chunk_max > float("-inf"), chunk_max, 0.0)
    chunk_sum = torch.exp(padded - shift[..., None]).sum(dim=-1)
    best, which = chunk_max.max(dim=-1, keepdim=True)  # [..., 1]
    index = which * REDUCTION_CHUNK + chunk_arg.gather(-1, which)
    scaled = (chunk_sum * torch.exp(shift - best)).sum(dim=-1)
    best, index = best.squeeze(-1), index.squeeze(-1)
    return best, index, best + torch.log(scaled)


def _log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """log sum exp over the last dimension, in float32. [..., V] -> [...]: on CUDA in
    chunks (whose maximum and index, unused, Inductor leaves out); eager on CPU without
    the maximum, which would double the cost there."""
    if logits.is_cuda:
        return best_and_log_normalizer(logits)[2]
    return torch.logsumexp(logits.float(), dim=-1)


class MarginalScorer:
    def __init__(
        self,
        max_children: int,
        *,
        max_requests: int,
        num_drafts: int,
        vocab: int,
        device,
        vocab_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
    ):
        """vocab: the marginals' width; vocab_ids: [S] the draft vocabulary's token ids
        (None: the logits' index is the token id); temperature: the marginals' log-probs
        are those of logits / temperature (drafter/score_temperature.py)."""
        if vocab_ids is not None:
            vocab = vocab_ids.numel()
            vocab_ids = vocab_ids.to(device)
        self.vocab_ids = vocab_ids
        self.max_children = min(max_children, vocab)
        self.max_requests = max_requests
        self.temperature = temperature
        self.step_rows = 1
        self.step = "table"  # children are read from the per-depth tables
        self.zero_slot = self.scratch_slot = 0  # node state slots: marginals keep none
        r, k, c = max_requests, num_drafts, self.max_children
        self.logprobs = torch.zeros(r, k, c, device=device, dtype=torch.float64)  # top-C per depth
        self.tokens = torch.zeros(r, k, c, device=device, dtype=torch.long)
        self._log_normalizer = compiled(_log_normalizer, device)
        self._rows = 0  # requests of this step
        self._host: tuple[list, list] | None = None  # their tables, read by expand()

    @torch.no_grad()
    def prepare(self, hidden: torch.Tensor, base_logits: torch.Tensor) -> None:
        """base_logits: [R, K, V or S] marginal logits of every request's drafts (hidden
        is not needed: the marginals are path-independent)."""
        n = base_logits.shape[0]
        if n > self.max_requests:
            raise ValueError(f"{n} requests in a step, scorer sized for {self.max_requests}")
        self.step_rows = padded_rows(n, self.max_requests)
        # log p = logit - log Z: the top-C of the logits themselves, so no float32 copy
        # of the [R, K, V] logits is made (on CUDA the normalizer is one fused reduction);
        # at a temperature other than 1, one copy in their dtype, divided by it.
        if self.temperature != 1.0:
            base_logits = base_logits / self.temperature
        values, tokens = base_logits.topk(self.max_children, -1)
        log_z = self._log_normalizer(base_logits)
        self.logprobs[:n] = values.float() - log_z[..., None]  # float32 -> float64 exact
        self.tokens[:n] = tokens if self.vocab_ids is None else self.vocab_ids[tokens]
        self._rows, self._host = n, None

    def children(self, req, node, parent, token, depth) -> tuple[torch.Tensor, torch.Tensor]:
        """[p] rows -> the best children's log-probs [p, C] float64 and tokens [p, C]."""
        return self.logprobs[req, depth], self.tokens[req, depth]

    def expand(self, items: list[Expansion]) -> list[Children]:
        if self._host is None:  # one host copy per step
            self._host = (self.tokens[: self._rows].tolist(), self.logprobs[: self._rows].tolist())
        tokens, logprobs = self._host
        return [Children(tokens[i.request][i.depth], logprobs[i.request][i.depth]) for i in items]

    def chain(self, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The marginal argmax path of every request (DFlash's own chain). anchors: [p]
        -> drafts [p, K] and their log-probs [p, K] float64."""
        p = anchors.shape[0]
        return self.tokens[:p, :, 0], self.logprobs[:p, :, 0]


class ConditionalScorer:
    """Domino's path-conditioned children, computed on the device for a batch of nodes.

    All per-step tables and node states live in buffers allocated once for
    `max_requests`, so the per-node step reads and writes fixed addresses and can be
    captured in a CUDA graph with the rest of the build (device_builder.py).
    """

    def __init__(
        self,
        head: DominoHead,
        embed_tokens: torch.Tensor,
        *,
        max_requests: int,
        num_drafts: int,
        budget: int,
        candidates: int,
        max_children: int,
        prefix_len: int,
        kernels: bool = False,
        vocab_ids: torch.Tensor | None = None,
        step_dtype: torch.dtype | None = None,
        temperature: float = 1.0,
    ):
        """kernels: the per-node step as two Triton launches (kernels/domino_step.py;
        needs a top-M restriction; tests run them on CPU under Triton's interpreter).
        vocab_ids: [S] the draft vocabulary's token ids (None: the whole vocabulary).
        step_dtype: the per-node step's dtype (None: the head's); the CPU engine takes
        float32, whose one-row products there cost a half to a ninth of bfloat16's
        (benchmarks/results/draft_vocab_cpu.md). temperature: children's log-probs are
        those of the corrected logits / temperature (drafter/score_temperature.py); the
        division is folded into the step's tables (the marginal logits and the
        correction's output rows), so the node step itself is the same."""
        if step_dtype is not None and step_dtype != head.proj_out.dtype:
            head = copy.deepcopy(head).to(step_dtype)
        vocab, emb_dim = head.proj_out.shape
        device, dtype = head.proj_out.device, head.proj_out.dtype
        self.dtype = dtype
        self.head = head
        self.embed_tokens = embed_tokens  # [V, H] the target's embedding
        self.w_hid, self.w_state = head.split_proj_in()  # [E, H], [E, G]
        # The correction's output rows over the logits' width: [V or S, E].
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(device)
        self.vocab_proj = head.proj_out if vocab_ids is None else head.proj_out[self.vocab_ids]
        self.temperature = temperature
        if vocab_ids is not None:
            vocab = vocab_ids.numel()
        self.restricted = candidates < vocab
        if temperature != 1.0 and not self.restricted:
            # The step multiplies by these rows over the whole width: scaled once here.
            self.vocab_proj = self.vocab_proj / temperature
        self.width = candidates if self.restricted else vocab
        self.max_children = min(max_children, self.width)
        self.prefix_len = prefix_len
        self.device = device
        self.max_requests = max_requests
        self.step_rows = 1
        r, k, m = max_requests, num_drafts, self.width
        # Node slots per request: budget + 1 tree nodes (numbered as the tree's), then a
        # slot of zeros that stands for the root's parent, then a scratch slot that rows
        # without a node write.
        self.zero_slot, self.scratch_slot = budget + 1, budget + 2
        self.states = torch.zeros(
            r, budget + 3, head.spec.gru_hidden_dim, device=device, dtype=dtype
        )
        self.hid_part = torch.zeros(r, k, emb_dim, device=device, dtype=dtype)  # W_h h_d
        self.base = torch.zeros(r, k, m, device=device, dtype=dtype)  # L_base on candidates
        # The candidates' token ids and correction rows (None without a restriction).
        # Dynamo keeps one cache for the step's code, whichever scorer compiled it, and
        # explains a recompilation by reading the attributes the others' guards name:
        # a scorer without them failed there (H100, 2026-12-06f, a whole-vocabulary
        # chain after a top-64 one in one process).
        self.cand = self.proj_rows = None
        if self.restricted:
            self.cand = torch.zeros(r, k, m, device=device, dtype=torch.long)
            self.proj_rows = torch.zeros(r, k, m, emb_dim, device=device, dtype=dtype)
        # The per-node step: the torch step below, compiled on CUDA, or with `kernels`
        # two Triton launches (config.node_step says which an engine runs and why;
        # builder_bench.py --steps measures both). `step` names it in the engine's stats.
        if kernels and not self.restricted:
            raise ValueError("the Triton step needs a top-M restriction (candidates < vocab)")
        self.step = "triton" if kernels else "torch"
        self.kernel_step = None  # the Triton step, whose children launch can also pop
        if kernels:
            from ..kernels.domino_step import DominoStep

            self.kernel_step = self._children = DominoStep(self, max_requests)
        else:
            self._children = compiled(self._children_rows, device)

    @torch.no_grad()
    def prepare(self, hidden: torch.Tensor, base_logits: torch.Tensor) -> None:
        """hidden: [R, K, H] the drafter's final-normed rows; base_logits: [R, K, V or S]."""
        n = hidden.shape[0]
        if n > self.max_requests:
            raise ValueError(f"{n} requests in a step, scorer sized for {self.max_requests}")
        self.step_rows = padded_rows(n, self.max_requests)
        self.hid_part[:n] = hidden.to(self.hid_part.dtype) @ self.w_hid.T
        # The step's logits are base + correction, the correction a product with the
        # output rows: both divided by the temperature, so are the logits.
        scale = 1.0 / self.temperature
        if self.restricted:
            values, index = base_logits.topk(self.width, dim=-1)
            self.base[:n] = values if scale == 1.0 else values * scale
            self.cand[:n] = self._token_ids(index)
            rows = self.head.proj_out[self.cand[:n]]
            self.proj_rows[:n] = rows if scale == 1.0 else rows * scale
            if self.kernel_step is not None:
                self.kernel_step.fill_table(n)
        else:
            self.base[:n] = base_logits if scale == 1.0 else base_logits * scale

    def children(self, req, node, parent, token, depth) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-node step for [p] rows (request, the node's state slot, its parent's
        state slot, its token, its depth): GRU update, correction, top-C children ->
        log-probs [p, C] float64 and tokens [p, C]."""
        return self._children(req, node, parent, token, depth)

    def _children_rows(self, req, node, parent, token, depth):
        state = self.head.gru_step(self._embed(token), self.states[req, parent])
        self.states[req, node] = state
        values, index = self._top_children(state, req, depth, self.max_children)
        if self.restricted:
            return values.double(), self.cand[req, depth].gather(1, index)
        return values.double(), self._token_ids(index)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The target's embedding rows of tokens [p] -> [p, H] in the step's dtype."""
        return self.embed_tokens[tokens].to(self.dtype)

    def _token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the logits' width -> token ids."""
        return index if self.vocab_ids is None else self.vocab_ids[index]

    def _top_children(self, state, req, depth, count: int):
        """The corrected log-probs of a node's candidates, their top `count`."""
        u = F.silu(self.hid_part[req, depth] + state @ self.w_state.T)  # [p, E]
        if self.restricted:
            # A product and a float32 sum over E, which Inductor fuses with the gather of
            # the candidates' rows (a bmm would copy them out first). [p, M]
            corr = (self.proj_rows[req, depth].float() * u.float()[:, None, :]).sum(-1)
        else:
            corr = (u @ self.vocab_proj.T).float()  # [p, V or S]
        corrected = (depth >= self.prefix_len)[:, None]
        logits = self.base[req, depth].float() + corr * corrected  # [p, W]
        if count == 1 and self.width > RANKED_WIDTH:
            # One child (the chain): an argmax and a log normalizer, where a top-1 over
            # the vocabulary is a radix selection of several kernels per step (0.7 ms of
            # the chain's 6.2 ms round on the H200 at batch 1, 2026-12-04f); on CUDA in
            # chunks (best_and_log_normalizer). The first of tied maxima, as torch.max.
            best, index, log_z = best_and_log_normalizer(logits)
            return (best - log_z)[:, None], index[:, None]
        logprobs = torch.log_softmax(logits, dim=-1)
        if self.width <= RANKED_WIDTH:
            if self.device.type == "cuda":
                return top_by_rank(logprobs, count)
            # Run eagerly (CPU), top_by_rank's M x M comparisons cost more than one
            # stable sort (0.24 ms of a 1.3 ms budget-4 build), which breaks ties alike.
            values, index = logprobs.sort(dim=-1, descending=True, stable=True)
            return values[:, :count], index[:, :count]
        return logprobs.topk(count, dim=-1)

    @torch.no_grad()
    def expand(self, items: list[Expansion]) -> list[Children]:
        """The host heap's call: request r's node on row r of `step_rows` rows."""
        # Rows without a node compute into the scratch slot from the zero state.
        rows = [[r, self.scratch_slot, self.zero_slot, 0, 0] for r in range(self.step_rows)]
        for i in items:
            parent = i.parent if i.parent >= 0 else self.zero_slot
            rows[i.request] = [i.request, i.node, parent, i.token, i.depth]
        columns = torch.tensor(rows, dtype=torch.long).T.contiguous()  # [5, p]
        values, tokens = self.children(*columns.to(self.device))
        values, tokens = values.tolist(), tokens.tolist()
        return [Children(tokens[i.request], values[i.request]) for i in items]

    @torch.no_grad()
    def chain(self, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Domino's chain decoder for every request at once, as plain unrolled steps on
        the device (over the top-M candidates; without a restriction, the released
        decoder). anchors: [p] -> drafts [p, K] and their log-probs [p, K] float64.

        Each step is the very `children` call the host heap makes for the path's node
        (node d at depth d, its parent d - 1, the root's the zero slot), so both build
        the same chain bit for bit (compiled as one graph, the unrolled steps let
        Inductor fuse the top-M correction's product and sum otherwise than in the
        per-node step, and the log-probs came out a float32 rounding apart: H100,
        2026-12-06e, 8 requests), and on CUDA the chain takes the Triton step where the
        trees do: two launches a draft, in place (DominoStep.chain). The torch step takes
        each draft's columns as one new tensor: Dynamo guards the compiled step's inputs'
        storage offsets, so views of fixed buffers at each depth's offset compiled it
        again at every depth (CPU, Dynamo's eager backend, 2026-12-06h)."""
        if self.kernel_step is not None:
            return self.kernel_step.chain(anchors)
        p = anchors.shape[0]
        req = torch.arange(p, device=anchors.device)
        token, parent = anchors, torch.full_like(req, self.zero_slot)
        tokens, logprobs = [], []
        for d in range(self.hid_part.shape[1]):
            node = torch.full_like(req, d)  # on a path, a node's index is its depth
            # The five columns as rows of one tensor, as `expand` passes them: the same
            # arguments for the compiled step (one tensor passed as both node and depth
            # would fail Dynamo's no-aliasing guard, and compile the step again).
            columns = torch.stack([req, node, parent, token, node])  # [5, p]
            values, children = self.children(*columns)
            # The Triton step returns views of its buffers, which its next call rewrites.
            token, parent = children[:, 0].clone(), node
            tokens.append(token)
            logprobs.append(values[:, 0].clone())
        return torch.stack(tokens, 1), torch.stack(logprobs, 1)


def draft_vocab_size(scorer: ConditionalScorer | MarginalScorer) -> int:
    """The tokens a scorer drafts from: its draft vocabulary's size, 0 for all."""
    return 0 if scorer.vocab_ids is None else scorer.vocab_ids.numel()


def corrected_candidates(scorer: ConditionalScorer | MarginalScorer) -> int:
    """The candidates per depth a conditional scorer (trees or the chain) corrects: M, or
    its logits' width without a restriction; 0 for a marginal scorer (it corrects none)."""
    return scorer.width if isinstance(scorer, ConditionalScorer) else 0


def make_scorer(
    kind: str,
    head: DominoHead | None,
    embed_tokens: torch.Tensor,
    *,
    shape: TreeShape,
    candidates: int,
    prefix_len: int,
    max_requests: int,
    vocab: int | None = None,
    kernels: bool = False,
    vocab_ids: torch.Tensor | None = None,
    step_dtype: torch.dtype | None = None,
    temperature: float = 1.0,
) -> ConditionalScorer | MarginalScorer:
    """The scorer for a config's `scorer` kind. The chain is Domino's decoder (the
    corrected argmax over the marginal top-`candidates` of each depth, as a tree's
    children; candidates >= the vocabulary: the released decoder) or, for a plain DFlash
    drafter, the marginal argmax; the shape (one child, one block) makes it a path. Why
    the chain takes the restriction too: over the whole vocabulary its correction is one
    GEMV of the head's [V, E] rows per drafted token (0.46 ms of a batch-1 round for
    Qwen3's 151,936 tokens, H100 2026-12-06c), over M candidates a gather of M rows done
    once per step. vocab: the
    marginals' width (default: the embedding's rows); kernels: the conditional scorer's
    Triton step; vocab_ids: [S] the draft vocabulary (None: the whole vocabulary);
    step_dtype: the conditional scorer's per-node step dtype (None: the head's);
    temperature: the scores' (drafter/score_temperature.py)."""
    if kind == "marginal" or (kind == "chain" and head is None):
        return MarginalScorer(
            shape.max_children,
            max_requests=max_requests,
            num_drafts=shape.max_depth,
            vocab=vocab or embed_tokens.shape[0],
            device=embed_tokens.device,
            vocab_ids=vocab_ids,
            temperature=temperature,
        )
    if head is None:
        raise ValueError("the conditional scorer needs a Domino head")
    return ConditionalScorer(
        head,
        embed_tokens,
        max_requests=max_requests,
        num_drafts=shape.max_depth,
        budget=shape.budget,
        candidates=candidates,
        max_children=shape.max_children,
        prefix_len=prefix_len,
        kernels=kernels,
        vocab_ids=vocab_ids,
        step_dtype=step_dtype,
        temperature=temperature,
    )
