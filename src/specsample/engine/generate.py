"""The speculative generation loop.

Per step, for every unfinished request i with committed sequence ``tokens`` (prompt +
generated ids) and absolute position ``pos = len(tokens)`` of the next token:

1. draft ``k_i <= min(K, max_new_tokens - generated - 1)`` tokens (the drafter);
2. score ``k_i + 1`` positions with the target in one forward over its KV cache: the cache
   holds ``tokens[:-1]``, the forward feeds ``[tokens[-1], d_0 .. d_{k_i-1}]``, and row j scores
   draft j (row ``k_i`` is the bonus row);
3. one ``specsample.verify()`` call for all requests (``positions[i] = pos``), or one
   ``specsample.sample()`` call with the ``none`` drafter;
4. commit the accepted drafts and the correction / bonus token, stopping at EOS or
   ``max_new_tokens``, and roll the target cache back to the accepted prefix (crop
   ``k_i - accepted`` entries).

Tree speculation (``tree=True``, ``specsample generate --tree``): step 1 drafts a token tree
per request (depth <= k, at most ``tree_nodes`` nodes; :class:`~specsample.engine.drafters.
TreeDraft`), step 2 feeds the root ``tokens[-1]`` and every node in one target forward with
position ids ``pos - 1 + depth`` and a tree attention mask (each node sees the committed
prefix, its ancestors and itself: :meth:`ModelCache.forward_tree`), step 3 is one
``specsample.verify_tree()`` call (``draft_probs=None``: the trees are deterministic functions
of the context), and step 4 compacts the target cache to the committed prefix plus the
accepted path (:meth:`ModelCache.keep_tree_path`); the correction / bonus token is fed at the
next step, as with chains.

Each request has its own KV cache (batch size 1 per forward), so prompts of any lengths mix
without padding; verification and sampling are batched over all requests, each routed by its
own ``SamplingParams`` inside the core library (temperature 0 greedy, > 0 sampled).

Reproducibility: positions are absolute, so a seeded request's output depends only on its
prompt, params, seed and the target's logits. With one-hot drafts (``ngram``) speculation does
not change it (API.md guarantee 4) as long as the target gives bit-identical logits for a
position in a one-token and a (k+1)-token forward. On CPU that holds after the float32 cast for
float64 models; float32 models differ by ~1e-5 in the logits between the two forward shapes,
which can (rarely) flip a near-tie. See docs/generate.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache import ModelCache
from .drafters import Draft, DraftContext, Drafter, TreeDraft, make_drafter
from .stats import GenerationStats, RequestStats, paths_delta

METHODS = ("token", "block")

#: Default node budget of a tree (``tree_nodes``, ``--tree-nodes``).
DEFAULT_TREE_NODES = 8

#: ``on_tokens(request_index, new_token_ids)``: called after each step with the ids just
#: committed for a request.
TokenCallback = Callable[[int, list[int]], None]


@dataclass
class RequestOutput:
    """The result of one request.

    Attributes:
        prompt_token_ids: the prompt.
        token_ids: the generated ids (an EOS token, when it ended the request, is included).
        finish_reason: ``"stop"`` (EOS), ``"length"`` (max_new_tokens or the model's context),
            ``"interrupted"`` (only in :attr:`GenerationInterrupted.result`).
        params: the request's ``SamplingParams`` (with the seed the engine used).
        user_seeded: whether the caller gave the seed.
        stats: its counters.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    params: Any
    user_seeded: bool
    stats: RequestStats


@dataclass
class GenerationResult:
    """Outputs (one per prompt, in order) and statistics of a ``generate()`` call."""

    outputs: list[RequestOutput]
    stats: GenerationStats = field(default_factory=GenerationStats)


class GenerationInterrupted(KeyboardInterrupt):
    """``generate()`` was interrupted (Ctrl-C); ``result`` holds what was generated so far.

    A :class:`KeyboardInterrupt`, so callers that do not look for it stop as usual. In
    ``result`` the unfinished requests have ``finish_reason == "interrupted"``; a request's
    stats may miss the step that was cut short.
    """

    def __init__(self, result: GenerationResult) -> None:
        super().__init__("generation interrupted")
        self.result = result


@dataclass
class _Request:
    index: int
    prompt: list[int]
    params: Any
    user_seeded: bool
    seed_lo: int
    seed_hi: int
    cache: ModelCache
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


def _import_core():
    import specsample

    return specsample


class SpeculativeEngine:
    """Speculative decoding of a transformers causal LM with specsample's sampler and verifier.

    Args:
        target: the target causal LM (a transformers ``PreTrainedModel``, or a
            :class:`~specsample.engine.models.LoadedModel`).
        drafter: a :class:`~specsample.engine.drafters.Drafter` or a name (``"ngram"``,
            ``"model"``, ``"none"``).
        num_speculative_tokens: K >= 0, the most drafts per request and step (0 disables
            speculation: every step verifies no drafts).
        method: ``"token"`` or ``"block"`` verification.
        draft_model: the drafter's model when ``drafter="model"`` (a transformers model or a
            ``LoadedModel``).
        eos_token_ids: ids that end a request (default: from the target's generation config).
        ngram_max, ngram_min: prompt-lookup suffix lengths.
        tree: draft token trees of depth <= ``num_speculative_tokens`` and verify them with
            ``specsample.verify_tree`` (one target forward per request and step); needs the
            ``ngram`` or ``model`` drafter (or a drafter with ``propose_tree``) and method
            ``"token"``.
        tree_nodes: the node budget of a tree (>= 1; root not counted).
        tree_branching: the most children of one tree node (None: the drafter's default).

    Raises:
        ValueError: an unknown drafter or method, ``num_speculative_tokens < 0``, a draft model
            whose vocabulary is wider than the target's; with ``tree``: method ``"block"``,
            the ``none`` drafter or one without trees, ``tree_nodes < 1``,
            ``tree_branching < 1``; ``tree_branching`` without ``tree``.
    """

    def __init__(self, target: Any, drafter: Drafter | str = "ngram", *,
                 num_speculative_tokens: int = 4, method: str = "token",
                 draft_model: Any = None, eos_token_ids: Sequence[int] | None = None,
                 ngram_max: int = 3, ngram_min: int = 1, tree: bool = False,
                 tree_nodes: int = DEFAULT_TREE_NODES,
                 tree_branching: int | None = None) -> None:
        from .models import LoadedModel

        if isinstance(target, LoadedModel):
            if eos_token_ids is None:
                eos_token_ids = target.eos_token_ids
            target = target.model
        if isinstance(draft_model, LoadedModel):
            draft_model = draft_model.model
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens,
                                                                       int):
            raise ValueError(f"num_speculative_tokens must be an int, got "
                             f"{num_speculative_tokens!r}")
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose 'token' or 'block'")
        if tree:
            if method != "token":
                raise ValueError(f"tree speculation verifies with verify_tree (token-level); "
                                 f"method {method!r} is not available with trees")
            if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or \
                    tree_nodes < 1:
                raise ValueError(f"tree_nodes must be an int >= 1, got {tree_nodes!r}")
        elif tree_branching is not None:
            raise ValueError("tree_branching is only used with tree=True")
        if isinstance(drafter, str):
            drafter = make_drafter(drafter, draft_model=draft_model, ngram_max=ngram_max,
                                   ngram_min=ngram_min, tree=tree, tree_branching=tree_branching)
        elif tree and (not drafter.speculative
                       or type(drafter).propose_tree is Drafter.propose_tree):
            raise ValueError(f"tree speculation needs a drafter that proposes trees "
                             f"(propose_tree); {type(drafter).__name__} does not")
        self.target = target
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.method = method
        self.tree = bool(tree)
        self.tree_nodes = tree_nodes
        self.vocab_size = int(target.get_output_embeddings().weight.shape[0])
        draft_vocab = getattr(drafter, "vocab_size", None)
        if draft_vocab is not None and draft_vocab > self.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab}) is wider than the "
                             f"target's ({self.vocab_size}); they must share a tokenizer")
        if eos_token_ids is None:
            gen = getattr(target, "generation_config", None)
            eos = getattr(gen, "eos_token_id", None)
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.eos_token_ids = {int(t) for t in eos_token_ids}
        self.max_positions = getattr(target.config, "max_position_embeddings", None)
        self.device = target.get_input_embeddings().weight.device

    # ------------------------------------------------------------------ public

    def warm_up_sampler(self, params: Any = None, num_requests: int = 1) -> None:
        """Untimed sample() and, with a speculative chain drafter, verify() calls of K drafts
        for ``params`` (a ``SamplingParams``, default temperature 1) on random logits of the
        target's vocabulary, dtype and device, under inference mode as decoding runs, for one
        request and, with ``num_requests`` > 1, two: the drafts are one-hot, or with a drafter
        that gives its distributions, carry ``draft_logits`` (``draft_probs`` when ``params``
        filters, as such a drafter then drafts from the filtered distribution). The CPU path
        compiles the variants a decode needs (``specsample.cpu_compile``, 20-45 s each on an
        empty cache) here instead of inside the first timed steps."""
        core = _import_core()
        params = core.SamplingParams() if params is None else params
        dtype = self.target.get_output_embeddings().weight.dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            dtype = torch.float32  # (as the decode converts such a model's logits)
        gen = torch.Generator().manual_seed(0)
        v = self.vocab_size
        v_draft = getattr(self.drafter, "vocab_size", None) or v
        filtered = params.top_k not in (0, -1) or params.top_p < 1 or params.min_p > 0
        chain = self.drafter.speculative and not self.tree
        with torch.inference_mode():
            for n in sorted({1, min(num_requests, 2)}):
                for k in ((0, self.k) if chain else (0,)):
                    batch = core.SamplingBatch.from_params([params] * n, vocab_size=v,
                                                           device=self.device)
                    logits = torch.randn(n * (k + 1), v, generator=gen).to(self.device, dtype)
                    drafts = torch.randint(0, v_draft, (n * k,), generator=gen).to(self.device)
                    dist = {}
                    if k and self.drafter.gives_logits:
                        q = torch.randn(n * k, v_draft, generator=gen).to(self.device)
                        dist = ({"draft_probs": torch.softmax(q, -1)} if filtered
                                else {"draft_logits": q.to(dtype)})
                    core.verify(logits, drafts, [k] * n, batch, positions=torch.zeros(
                        n, dtype=torch.int64, device=self.device), strict=False,
                        method=self.method, **dist)

    def generate(self, prompts: Sequence[Sequence[int]], params: Any = None, *,
                 max_new_tokens: int = 64, on_tokens: TokenCallback | None = None
                 ) -> GenerationResult:
        """Generate for several prompts at once, each with its own ``SamplingParams``.

        Args:
            prompts: token-id lists, one per request (each non-empty, ids in [0, V)).
            params: one ``SamplingParams`` for all, or a sequence of one per prompt
                (None: ``SamplingParams()``). A request without a seed gets one drawn from
                torch's default generator here, used for its whole generation.
            max_new_tokens: the most tokens generated per request (>= 1).
            on_tokens: optional streaming callback ``(request_index, new_ids)``.

        Returns:
            :class:`GenerationResult`: ``outputs[i].token_ids`` (list of int) per prompt and the
            statistics (path counts are ``specsample.paths`` deltas over the call).

        Raises:
            ValueError: no prompts, an empty prompt, a token id outside the vocabulary, a
                params list of the wrong length, ``max_new_tokens < 1``.
            specsample.SamplingError: NaN / infinite logits from a model.
            GenerationInterrupted: a KeyboardInterrupt during prefill or decoding; it carries
                the partial result.
        """
        core = _import_core()
        prompts = [[int(t) for t in p] for p in prompts]
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
                max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} holds token ids outside [0, {self.vocab_size}): "
                                 f"{bad[:5]}")
        if params is None:
            params = core.SamplingParams()
        if isinstance(params, core.SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")

        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            user_seeded = p.seed is not None
            if not user_seeded:
                p = dataclasses.replace(
                    p, seed=int(torch.randint(0, 2**62, (), dtype=torch.int64).item()))
            lo, hi = core.rng.split_seed(p.seed)
            requests.append(_Request(i, prompt, p, user_seeded, lo, hi, ModelCache(self.target)))

        stats = GenerationStats(drafter=self.drafter.name, method=self.method,
                                num_speculative_tokens=self.k if self.drafter.speculative else 0,
                                tree_nodes=self.tree_nodes if self.tree else 0)
        paths_before = core.paths.counts()
        self.drafter.start(len(requests))

        self._sampler_s = 0.0
        t0 = t1 = time.perf_counter()
        interrupted = False
        try:
            with torch.inference_mode():
                for req in requests:
                    if len(req.prompt) > 1:
                        req.cache.forward(req.prompt[:-1], logits_to_keep=1)
                    if self.max_positions is not None and len(req.prompt) >= self.max_positions:
                        req.finish_reason = "length"
                t1 = time.perf_counter()
                batch = None  # the active requests' SamplingBatch, kept across steps
                while True:
                    active = [r for r in requests if r.finish_reason is None]
                    if not active:
                        break
                    step = self._tree_step if self.tree else self._step
                    batch = step(core, active, batch, max_new_tokens, on_tokens)
                    stats.steps += 1
        except KeyboardInterrupt:
            interrupted = True
        t2 = time.perf_counter()

        stats.prefill_s = t1 - t0
        stats.decode_s = t2 - t1
        stats.sampler_s = self._sampler_s
        stats.paths = paths_delta(paths_before, core.paths.counts())
        stats.requests = [r.stats for r in requests]
        unfinished = "interrupted" if interrupted else "length"
        outputs = [RequestOutput(r.prompt, r.generated, r.finish_reason or unfinished, r.params,
                                 r.user_seeded, r.stats) for r in requests]
        result = GenerationResult(outputs, stats)
        if interrupted:
            raise GenerationInterrupted(result)
        return result

    # ------------------------------------------------------------------ internals

    def _num_drafts(self, req: _Request, max_new_tokens: int) -> int:
        if not self.drafter.speculative:
            return 0
        k = min(self.k, max_new_tokens - len(req.generated) - 1)
        if self.max_positions is not None:
            k = min(k, self.max_positions - len(req.prompt) - len(req.generated) - 1)
        return max(k, 0)

    def _draft(self, req: _Request, k: int) -> Draft:
        if k == 0:
            return Draft([])
        draft = self.drafter.propose(DraftContext(
            index=req.index, tokens=req.tokens, k=k, temperature=req.params.temperature,
            seed_lo=req.seed_lo, seed_hi=req.seed_hi, params=req.params))
        if len(draft.token_ids) > k:
            raise RuntimeError(f"drafter {self.drafter.name!r} proposed {len(draft.token_ids)} "
                               f"tokens, more than k={k}")
        return draft

    def _batch(self, core: Any, active: list[_Request], device: torch.device) -> Any:
        """The SamplingBatch of ``active`` (built once; later steps update it in place)."""
        return core.SamplingBatch.from_params(
            [r.params for r in active], vocab_size=self.vocab_size, device=device,
            prompt_token_ids=[r.prompt for r in active],
            output_token_ids=[r.generated for r in active],
            # min_tokens bans them (an id outside the vocabulary is never emitted anyway)
            eos_token_ids=sorted(t for t in self.eos_token_ids if t < self.vocab_size))

    def _step(self, core: Any, active: list[_Request], batch: Any, max_new_tokens: int,
              on_tokens: TokenCallback | None) -> Any:
        """One step for ``active`` (in ``batch``'s order; None: build it here). ``batch`` gets
        the emitted tokens (``append``: penalties, bad words and min_tokens see them next
        step); returns it restricted to the requests still unfinished (``select``), or None
        when none is."""
        drafts = [self._draft(req, self._num_drafts(req, max_new_tokens)) for req in active]
        rows = []
        for req, draft in zip(active, drafts, strict=True):
            fed = [req.tokens[-1], *draft.token_ids]
            rows.append(req.cache.forward(fed))  # [k_i + 1, V], the model's dtype
        target_logits = torch.cat(rows, dim=0)
        positions = torch.tensor([len(r.prompt) + len(r.generated) for r in active],
                                 dtype=torch.int64, device=target_logits.device)
        if batch is None:
            batch = self._batch(core, active, target_logits.device)

        if target_logits.device.type == "cuda":  # (the sampler's time, not the forward's)
            torch.cuda.synchronize(target_logits.device)
        started = time.perf_counter()
        if not self.drafter.speculative:
            out = core.sample(target_logits, batch, positions=positions)
            emitted = [[t] for t in out.token_ids.tolist()]
            accepted = [0] * len(active)
        else:
            num_drafts = [len(d.token_ids) for d in drafts]
            draft_ids = torch.tensor([t for d in drafts for t in d.token_ids], dtype=torch.int64,
                                     device=target_logits.device)
            draft_logits = draft_probs = None
            if self.drafter.gives_logits and sum(num_drafts) > 0:
                if any(d.probs is not None for d in drafts):
                    # Some request drafted from its filtered distribution: every request's
                    # exact q goes as draft_probs (softmax(logits / T) for the others).
                    draft_probs = torch.cat([
                        d.distribution(req.params.temperature)
                        for req, d in zip(active, drafts, strict=True) if d.token_ids
                    ]).to(target_logits.device)
                else:
                    draft_logits = torch.cat([d.logits for d in drafts if d.token_ids], dim=0)
                    draft_logits = draft_logits.to(target_logits.device)
            out = core.verify(target_logits, draft_ids, num_drafts, batch,
                              draft_logits=draft_logits, draft_probs=draft_probs,
                              positions=positions, method=self.method)
            accepted = out.num_accepted.tolist()
            ids = out.token_ids.tolist()
            emitted = [ids[j][: accepted[j] + 1] for j in range(len(active))]
        # All emitted tokens: a request whose commit stops early (EOS, length) leaves below.
        batch.append(out)
        self._sampler_s += time.perf_counter() - started

        for req, draft, acc, new in zip(active, drafts, accepted, emitted, strict=True):
            # The cache now holds tokens[:-1] + [tokens[-1]] + drafts; keep the accepted ones.
            req.cache.crop(len(req.prompt) + len(req.generated) + acc)
            self._commit(req, len(draft.token_ids), acc, new, max_new_tokens, on_tokens)
        return self._still_active(active, batch)

    def _commit(self, req: _Request, drafted: int, acc: int, new: list[int],
                max_new_tokens: int, on_tokens: TokenCallback | None) -> None:
        """Commit a request's emitted tokens ``new`` (``acc`` accepted drafts, then the
        correction / bonus token), stopping at EOS or the length limits, and count them."""
        req.stats.steps += 1
        req.stats.drafted += drafted
        committed = []
        for t in new:
            committed.append(t)
            req.generated.append(t)
            if t in self.eos_token_ids:
                req.finish_reason = "stop"
                break
            if len(req.generated) >= max_new_tokens:
                req.finish_reason = "length"
                break
            if self.max_positions is not None and \
                    len(req.prompt) + len(req.generated) >= self.max_positions:
                req.finish_reason = "length"
                break
        # Accepted drafts that were emitted (none past an EOS or the token budget).
        req.stats.accepted += min(acc, len(committed))
        req.stats.emitted += len(committed)
        if on_tokens is not None and committed:
            on_tokens(req.index, committed)

    @staticmethod
    def _still_active(active: list[_Request], batch: Any) -> Any:
        """``batch`` restricted to the requests of ``active`` still unfinished (None: none)."""
        still = [j for j, req in enumerate(active) if req.finish_reason is None]
        if not still:
            return None
        if len(still) < len(active):
            batch = batch.select(still)
        batch.refresh_min_tokens()  # (the tokens were read above: this sync costs little)
        return batch

    def _draft_tree(self, req: _Request, depth: int) -> TreeDraft:
        if depth == 0:
            return TreeDraft()
        tree = self.drafter.propose_tree(DraftContext(
            index=req.index, tokens=req.tokens, k=depth, temperature=req.params.temperature,
            seed_lo=req.seed_lo, seed_hi=req.seed_hi, params=req.params), self.tree_nodes)
        tree.check(depth, self.tree_nodes)
        return tree

    def _tree_step(self, core: Any, active: list[_Request], batch: Any, max_new_tokens: int,
                   on_tokens: TokenCallback | None) -> Any:
        """One tree step for ``active`` (module docstring; as :meth:`_step`, with one
        ``verify_tree()`` call): returns the batch of the requests still unfinished, or None."""
        trees = [self._draft_tree(req, self._num_drafts(req, max_new_tokens)) for req in active]
        rows = []
        for req, tree in zip(active, trees, strict=True):
            # The cache holds tokens[:-1]: the root tokens[-1] is tree entry 0, node n entry n.
            rows.append(req.cache.forward_tree([req.tokens[-1], *tree.token_ids],
                                               [-1, *tree.parents],
                                               tree_start=len(req.tokens) - 1))
        target_logits = torch.cat(rows, dim=0)  # [N + sum m_i, V] float32
        dev = target_logits.device
        positions = torch.tensor([len(r.prompt) + len(r.generated) for r in active],
                                 dtype=torch.int64, device=dev)
        if batch is None:
            batch = self._batch(core, active, dev)
        if dev.type == "cuda":  # (the sampler's time, not the forward's)
            torch.cuda.synchronize(dev)
        started = time.perf_counter()
        out = core.verify_tree(
            target_logits, [t for tree in trees for t in tree.token_ids],
            [p for tree in trees for p in tree.parents], [len(t.token_ids) for t in trees],
            batch, positions=positions)
        accepted = out.num_accepted.tolist()
        ids = out.token_ids.tolist()
        paths = out.accepted_node_ids.tolist()
        # The emitted tokens as verify() would give them (accepted path, then the correction
        # or bonus token): the batch's append() takes a VerifyOutput.
        batch.append(core.VerifyOutput(token_ids=out.token_ids, num_accepted=out.num_accepted,
                                       logprobs=None, logprob_token_ids=None,
                                       invalid=out.invalid))
        self._sampler_s += time.perf_counter() - started

        for j, (req, tree) in enumerate(zip(active, trees, strict=True)):
            acc = accepted[j]
            # Keep the committed prefix, the root and the accepted nodes (tree entries 0, n..).
            req.cache.keep_tree_path([0, *paths[j][:acc]])
            self._commit(req, len(tree.token_ids), acc, ids[j][: acc + 1], max_new_tokens,
                         on_tokens)
        return self._still_active(active, batch)


def generate(target: Any, prompts: Sequence[Sequence[int]], params: Any = None, *,
             drafter: Drafter | str = "ngram", num_speculative_tokens: int = 4,
             method: str = "token", draft_model: Any = None, max_new_tokens: int = 64,
             eos_token_ids: Sequence[int] | None = None,
             on_tokens: TokenCallback | None = None, tree: bool = False,
             tree_nodes: int = DEFAULT_TREE_NODES,
             tree_branching: int | None = None) -> GenerationResult:
    """One-call form of :class:`SpeculativeEngine` ``(...).generate(...)`` (same arguments and
    errors)."""
    engine = SpeculativeEngine(target, drafter, num_speculative_tokens=num_speculative_tokens,
                               method=method, draft_model=draft_model,
                               eos_token_ids=eos_token_ids, tree=tree, tree_nodes=tree_nodes,
                               tree_branching=tree_branching)
    return engine.generate(prompts, params, max_new_tokens=max_new_tokens, on_tokens=on_tokens)
