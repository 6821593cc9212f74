"""Children functions for the best-first builder.

Both scorers are prepared once per step with the backbone's outputs for every request,
then answer `expand()` for a batch of new nodes.

ConditionalScorer (DominoTree): a node at depth d holds the GRU state S after its own
token (the root's state is the GRU run over the anchor from zeros). Its children are the
top-C tokens of `log_softmax(L_base[d] + embed_proj([h_d ; S]))` over the marginal top-M
candidates of depth d (only those rows of embed_proj.2 are gathered, once per step), with
no correction for the first `pure_draft_prefix_len` drafts. M >= V means the whole
vocabulary, with no gather.

MarginalScorer (DDTree): children at depth d are the top-C tokens of
`log_softmax(L_base[d])`, whatever the path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..drafter.model import DominoHead
from .builder import Children, DraftTree, Expansion, TreeShape, chain_tree


class MarginalScorer:
    def __init__(self, max_children: int):
        self.max_children = max_children
        self._tokens: list[list[list[int]]] = []
        self._logprobs: list[list[list[float]]] = []

    def prepare(self, hidden: torch.Tensor, base_logits: torch.Tensor) -> None:
        """base_logits: [R, K, V] marginal logits of every request's drafts (hidden is
        not needed: the marginals are path-independent)."""
        logprobs = torch.log_softmax(base_logits.float(), dim=-1)
        values, tokens = logprobs.topk(min(self.max_children, logprobs.shape[-1]), dim=-1)
        self._tokens, self._logprobs = tokens.tolist(), values.tolist()

    def expand(self, items: list[Expansion]) -> list[Children]:
        return [
            Children(self._tokens[i.request][i.depth], self._logprobs[i.request][i.depth])
            for i in items
        ]

    def chains(self, anchors: torch.Tensor) -> list[DraftTree]:
        """The marginal argmax path of every request (DFlash's own chain)."""
        rows = zip(anchors.tolist(), self._tokens, self._logprobs, strict=False)
        return [chain_tree(a, [t[0] for t in tok], [v[0] for v in lp]) for a, tok, lp in rows]


class ConditionalScorer:
    """Domino's path-conditioned children, computed on the device for a batch of nodes.

    All per-step tables and node states live in buffers allocated once for
    `max_requests`, so the per-node step (`_expand_rows`) reads and writes fixed
    addresses and can be captured in CUDA graphs (`use_cuda_graphs`). The eager path
    runs the very same function on the same padded shapes, which is why the two
    builders give bit-identical trees.
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
        use_cuda_graphs: bool = False,
    ):
        vocab, emb_dim = head.proj_out.shape
        device, dtype = head.proj_out.device, head.proj_out.dtype
        self.head = head
        self.embed_tokens = embed_tokens  # [V, H] the target's embedding
        self.w_hid, self.w_state = head.split_proj_in()  # [E, H], [E, G]
        self.restricted = candidates < vocab
        self.width = candidates if self.restricted else vocab
        self.max_children = min(max_children, self.width)
        self.prefix_len = prefix_len
        self.device = device
        self.max_requests = max_requests
        r, k, m = max_requests, num_drafts, self.width
        # Node slots per request: budget + 1 tree nodes, then a slot of zeros that
        # stands for the root's parent, then a scratch slot that padding rows write.
        self.zero_slot, self.scratch_slot = budget + 1, budget + 2
        self.states = torch.zeros(
            r, budget + 3, head.spec.gru_hidden_dim, device=device, dtype=dtype
        )
        self.hid_part = torch.zeros(r, k, emb_dim, device=device, dtype=dtype)  # W_h h_d
        self.base = torch.zeros(r, k, m, device=device, dtype=dtype)  # L_base on candidates
        if self.restricted:
            self.cand = torch.zeros(r, k, m, device=device, dtype=torch.long)
            self.proj_rows = torch.zeros(r, k, m, emb_dim, device=device, dtype=dtype)
        # Per-node inputs (request, node, parent slot, token, depth) and outputs (log-probs
        # and tokens of the best children, both exact in float64) cross to and from the
        # host through pinned buffers: one copy each way and one sync per pop.
        pinned = device.type == "cuda"
        # Row-major per node, so that the first p nodes are one contiguous block: a copy
        # of a strided view would go through an unpinned staging buffer.
        self.rows_in = torch.zeros(r, 5, device=device, dtype=torch.long)
        self.rows_host = torch.zeros(r, 5, dtype=torch.long, pin_memory=pinned)
        self.children_out = torch.zeros(r, 2, self.max_children, device=device, dtype=torch.float64)
        self.children_host = torch.zeros(
            r, 2, self.max_children, dtype=torch.float64, pin_memory=pinned
        )
        self.use_cuda_graphs = use_cuda_graphs
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        # On CUDA the step is compiled (Inductor fuses its ~30 small kernels into a few,
        # halving its device time); the eager and graph builders share the compiled
        # function, which keeps their trees bit-identical.
        self._expand = (
            torch.compile(self._expand_rows, fullgraph=True)
            if device.type == "cuda"
            else self._expand_rows
        )

    @torch.no_grad()
    def prepare(self, hidden: torch.Tensor, base_logits: torch.Tensor) -> None:
        """hidden: [R, K, H] the drafter's final-normed rows; base_logits: [R, K, V]."""
        n = hidden.shape[0]
        if n > self.max_requests:
            raise ValueError(f"{n} requests in a step, scorer sized for {self.max_requests}")
        self.hid_part[:n] = hidden.to(self.hid_part.dtype) @ self.w_hid.T
        if self.restricted:
            values, cand = base_logits.topk(self.width, dim=-1)
            self.base[:n] = values
            self.cand[:n] = cand
            self.proj_rows[:n] = self.head.proj_out[cand]
        else:
            self.base[:n] = base_logits

    def _expand_rows(self, p: int) -> None:
        """The per-node step for p padded rows: GRU update, correction, top-C children."""
        req, node, parent, token, depth = self.rows_in[:p].T
        state = self.head.gru_step(self.embed_tokens[token], self.states[req, parent])
        self.states[req, node] = state
        u = F.silu(self.hid_part[req, depth] + state @ self.w_state.T)  # [p, E]
        if self.restricted:
            corr = torch.bmm(self.proj_rows[req, depth], u[:, :, None])[:, :, 0]  # [p, M]
        else:
            corr = u @ self.head.proj_out.T  # [p, V]
        corrected = (depth >= self.prefix_len)[:, None]
        logits = self.base[req, depth] + corr * corrected
        values, index = torch.log_softmax(logits.float(), dim=-1).topk(self.max_children, dim=-1)
        tokens = self.cand[req, depth].gather(1, index) if self.restricted else index
        self.children_out[:p, 0] = values
        self.children_out[:p, 1] = tokens

    @torch.no_grad()
    def chains(self, anchors: torch.Tensor) -> list[DraftTree]:
        """Domino's released chain decoder for every request at once, as plain unrolled
        steps on the device (no host round trip until the end): the same arithmetic as
        `_expand_rows` on a one-child path. anchors: [R] long, on the device."""
        n = anchors.shape[0]
        rows = torch.arange(n, device=anchors.device)
        state = self.head.gru_step(self.embed_tokens[anchors], self.states[:n, self.zero_slot])
        tokens, logprobs = [], []
        for depth in range(self.hid_part.shape[1]):
            u = F.silu(self.hid_part[:n, depth] + state @ self.w_state.T)  # [n, E]
            if self.restricted:
                corr = torch.bmm(self.proj_rows[:n, depth], u[:, :, None])[:, :, 0]
            else:
                corr = u @ self.head.proj_out.T
            logits = self.base[:n, depth] + corr * (depth >= self.prefix_len)
            value, index = torch.log_softmax(logits.float(), dim=-1).topk(1, dim=-1)
            value, index = value[:, 0], index[:, 0]
            token = self.cand[rows, depth, index] if self.restricted else index
            tokens.append(token)
            logprobs.append(value)
            state = self.head.gru_step(self.embed_tokens[token], state)
        drafts = torch.stack(tokens, 1).tolist()  # the one device-to-host copy
        scores = torch.stack(logprobs, 1).tolist()
        return [chain_tree(int(a), d, v) for a, d, v in zip(anchors.tolist(), drafts, scores,
                                                              strict=True)]  # fmt: skip

    def _padded_rows(self, n: int) -> int:
        p = 1
        while p < n:
            p *= 2
        return min(p, self.max_requests)

    def _step(self, p: int) -> None:
        """Inputs in, the step, outputs out: with graphs, the two copies are captured too."""
        self.rows_in[:p].copy_(self.rows_host[:p], non_blocking=True)
        self._expand(p)
        self.children_host[:p].copy_(self.children_out[:p], non_blocking=True)

    def _run(self, p: int) -> None:
        if not self.use_cuda_graphs:
            self._step(p)
            return
        graph = self._graphs.get(p)
        if graph is None:
            graph = self._capture(p)
        graph.replay()

    def _capture(self, p: int) -> torch.cuda.CUDAGraph:
        # Warm-up runs the step on the current rows; it only rewrites the same states
        # with the same values (and the scratch slot), so no state needs restoring.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(p)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(p)
        self._pool = graph.pool()
        self._graphs[p] = graph
        return graph

    @torch.no_grad()
    def expand(self, items: list[Expansion]) -> list[Children]:
        n = len(items)
        p = self._padded_rows(n)
        rows = self.rows_host.numpy()
        for k, i in enumerate(items):
            parent = i.parent if i.parent >= 0 else self.zero_slot
            rows[k] = (i.request, i.node, parent, i.token, i.depth)
        rows[n:p] = (0, self.scratch_slot, self.zero_slot, 0, 0)
        self._run(p)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return [Children([int(t) for t in tok], lp) for lp, tok in self.children_host[:n].tolist()]


def make_scorer(
    kind: str,
    head: DominoHead | None,
    embed_tokens: torch.Tensor,
    *,
    shape: TreeShape,
    candidates: int,
    prefix_len: int,
    max_requests: int,
    use_cuda_graphs: bool = False,
) -> ConditionalScorer | MarginalScorer:
    """The scorer for a config's `scorer` kind. The chain is Domino's released decoder
    (corrected argmax over the whole vocabulary) or, for a plain DFlash drafter, the
    marginal argmax; the shape (one child, one block) makes it a path."""
    if kind == "marginal" or (kind == "chain" and head is None):
        return MarginalScorer(shape.max_children)
    if head is None:
        raise ValueError("the conditional scorer needs a Domino head")
    return ConditionalScorer(
        head,
        embed_tokens,
        max_requests=max_requests,
        num_drafts=shape.max_depth,
        budget=shape.budget,
        candidates=candidates if kind == "conditional" else head.proj_out.shape[0],
        max_children=shape.max_children,
        prefix_len=prefix_len,
        use_cuda_graphs=use_cuda_graphs,
    )
