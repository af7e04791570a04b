"""Tree speculation in the engine (``tree=True``): tree drafters, the tree forward and cache
compaction, and the generation loop against plain decoding and the chain engine, on tiny random
Llama models (float64 unless said otherwise, so that a position's float32 logits are the same in
one-token, chain and tree forwards)."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_llama

import specsample
from specsample.engine import (
    ModelDrafter,
    NgramDrafter,
    SpeculativeEngine,
    ngram_lookup,
)
from specsample.engine.cache import ModelCache, _layer_tensors
from specsample.engine.drafters import (
    Drafter,
    ModelTreeDrafter,
    NgramTreeDrafter,
    TreeDraft,
    make_drafter,
    ngram_tree,
)

REPEAT = [5, 9, 13, 17, 21, 25, 29, 33] * 3 + [5, 9, 13]
# Several continuations of the suffix (1, 2): 3 .., 4 .., 3 .. again.
BRANCHY = [1, 2, 3, 7, 1, 2, 4, 8, 9, 1, 2, 3, 6, 1, 2]
PROMPTS = [REPEAT, BRANCHY, [7, 3, 7, 3, 8]]


def outputs(result):
    return [o.token_ids for o in result.outputs]


def params_for(temperature, n=None, **extra):
    return [specsample.SamplingParams(temperature=temperature, seed=11 + i, **extra)
            for i in range(len(PROMPTS) if n is None else n)]


class ChainAsTree(Drafter):
    """A chain drafter's proposal as a tree of one branch (node n's parent is node n - 1)."""

    def __init__(self, chain: Drafter) -> None:
        self.chain = chain
        self.name = chain.name

    def start(self, num_requests: int) -> None:
        self.chain.start(num_requests)

    def propose_tree(self, ctx, max_nodes: int) -> TreeDraft:
        ids = self.chain.propose(ctx).token_ids[:max_nodes]
        return TreeDraft(list(ids), list(range(len(ids))))


# ----------------------------------------------------------------------------- tree drafters


def check_tree(tree: TreeDraft, depth: int, nodes: int) -> None:
    tree.check(depth, nodes)  # parents first, distinct siblings, within the limits


def test_ngram_tree_single_match_is_the_chain():
    tokens = [4, 1, 2, 3, 5, 6, 7, 8, 1, 2, 3]
    for k in (1, 3, 6):
        tree = ngram_tree(tokens, k, 16, max_n=3, min_n=1)
        assert tree.token_ids == ngram_lookup(tokens, k, 3, 1)
        assert tree.parents == list(range(len(tree.token_ids)))
    assert ngram_tree([4, 5, 6], 4, 8, 3, 1).token_ids == []
    assert ngram_tree([4], 4, 8, 3, 1).token_ids == []
    assert ngram_tree(tokens, 0, 8, 3, 1).token_ids == []
    assert ngram_tree(tokens, 4, 0, 3, 1).token_ids == []


def test_ngram_tree_merges_every_match_into_a_trie():
    tree = ngram_tree(BRANCHY, 3, 32, max_n=2, min_n=1)
    check_tree(tree, 3, 32)
    # matches of (1, 2) end at 2, 6, 11: continuations 3 7 1 | 4 8 9 | 3 6 1; the two "3"
    # branches share their first node; the longer suffix (n = 2) ranks before n = 1 matches.
    paths = set()
    for n in range(1, len(tree.token_ids) + 1):
        path, cur = [], n
        while cur:
            path.append(tree.token_ids[cur - 1])
            cur = tree.parents[cur - 1]
        paths.add(tuple(reversed(path)))
    for chain in [(3, 7, 1), (4, 8, 9), (3, 6, 1)]:
        assert chain in paths
    assert tree.token_ids[0] == 3  # supported by two matches of n = 2
    # the budget takes the best-supported nodes, parents before children
    small = ngram_tree(BRANCHY, 3, 4, max_n=2, min_n=1)
    check_tree(small, 3, 4)
    assert len(small.token_ids) == 4
    assert small.token_ids[:2] == [3, 6]  # 3 (two matches), then its most recent child
    # at most `branching` children per node
    one = ngram_tree(BRANCHY, 3, 32, max_n=2, min_n=1, branching=1)
    check_tree(one, 3, 32)
    assert one.parents == list(range(len(one.token_ids)))


def test_tree_draft_check_names_what_is_wrong():
    with pytest.raises(RuntimeError, match="parent"):
        TreeDraft([1, 2], [0, 2]).check(4, 4)
    with pytest.raises(RuntimeError, match="two children of node 0"):
        TreeDraft([1, 1], [0, 0]).check(4, 4)
    with pytest.raises(RuntimeError, match="budget"):
        TreeDraft([1, 2, 3], [0, 0, 0]).check(4, 2)
    with pytest.raises(RuntimeError, match="depth 3"):
        TreeDraft([1, 2, 3], [0, 1, 2]).check(2, 4)


def test_model_tree_drafter(target_model, draft_model):
    drafter = ModelTreeDrafter(draft_model, branching=3)
    drafter.start(1)
    from specsample.engine import DraftContext

    ctx = DraftContext(index=0, tokens=REPEAT, k=4, temperature=0.0, seed_lo=0, seed_hi=0)
    tree = drafter.propose_tree(ctx, 10)
    check_tree(tree, 4, 10)
    assert len(tree.token_ids) == 10
    assert len(drafter.caches[0]) == len(REPEAT)  # the tree's entries were dropped
    assert drafter.propose_tree(ctx, 10) == tree  # deterministic
    # branching 1, k nodes: the drafter's greedy chain
    chain = ModelDrafter(draft_model)
    chain.start(1)
    greedy = ModelTreeDrafter(draft_model, branching=1)
    greedy.start(1)
    one = greedy.propose_tree(ctx, 4)
    assert one.parents == [0, 1, 2, 3]
    assert one.token_ids == chain.propose(ctx).token_ids
    with pytest.raises(NotImplementedError):
        greedy.propose(ctx)


# ----------------------------------------------------------------------------- cache


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cache_after_tree_step_equals_chain_of_the_accepted_path(dtype):
    model = tiny_llama(3, dtype=dtype)
    prefix = [3, 1, 4, 1, 5, 9, 2, 6]
    # root 6; node 1: 5 (p 0), 2: 3 (p 0), 3: 5 (p 1), 4: 8 (p 2), 5: 9 (p 4), 6: 7 (p 1)
    tokens, parents = [5, 3, 5, 8, 9, 7], [0, 0, 1, 2, 4, 1]
    tree = ModelCache(model)
    tree.forward(prefix[:-1])
    logits = tree.forward_tree([prefix[-1], *tokens], [-1, *parents],
                               tree_start=len(prefix) - 1)
    assert logits.shape == (7, 64) and logits.dtype == torch.float32
    # the accepted path from an actual verify_tree call (greedy)
    batch = specsample.SamplingBatch.from_params([specsample.SamplingParams(temperature=0)],
                                                 vocab_size=64)
    out = specsample.verify_tree(logits, tokens, parents, [len(tokens)], batch,
                                 positions=torch.tensor([len(prefix)]))
    acc = int(out.num_accepted[0])
    path = out.accepted_node_ids[0, :acc].tolist()
    for nodes in {tuple(path), (2, 4, 5), (1, 6), (1, 3), ()}:
        tree = ModelCache(model)
        tree.forward(prefix[:-1])
        logits = tree.forward_tree([prefix[-1], *tokens], [-1, *parents],
                                   tree_start=len(prefix) - 1)
        accepted = [tokens[n - 1] for n in nodes]
        chain = ModelCache(model)
        chain.forward(prefix[:-1])
        chain_logits = chain.forward([prefix[-1], *accepted])
        # the tree's rows of the path are the chain's rows
        assert torch.allclose(logits[[0, *nodes]], chain_logits, atol=1e-4, rtol=0)
        tree.keep_tree_path([0, *nodes])
        assert tree.token_ids == chain.token_ids == prefix + accepted
        for (kt, vt), (kc, vc) in zip(_layer_tensors(tree.cache), _layer_tensors(chain.cache),
                                      strict=True):
            assert kt.shape == kc.shape
            assert torch.allclose(kt, kc, atol=1e-5) and torch.allclose(vt, vc, atol=1e-5)
        # the next step continues from the accepted prefix: same logits
        nxt_tree, nxt_chain = tree.forward([2, 7]), chain.forward([2, 7])
        assert (nxt_tree - nxt_chain).abs().max() < 1e-4
        # and another tree step works after a compaction
        again = tree.forward_tree([1, 2], [-1, 0], tree_start=len(tree))
        assert again.shape == (2, 64)


def test_tree_forward_with_sdpa_attention():
    """The additive mask also drives sdpa attention: the tree's path rows are the chain's."""
    model = tiny_llama(5, dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    tree = ModelCache(model)
    tree.forward([1, 2, 3, 4])
    rows = tree.forward_tree([5, 7, 8, 9], [-1, 0, 0, 1], tree_start=4)
    chain = ModelCache(model)
    chain.forward([1, 2, 3, 4])
    assert (rows[[0, 1, 3]] - chain.forward([5, 7, 9])).abs().max() < 1e-4


def test_cache_tree_errors(target_model):
    cache = ModelCache(target_model)
    cache.forward([1, 2, 3])
    with pytest.raises(ValueError, match="one parent per token"):
        cache.forward_tree([1, 2], [-1], tree_start=3)
    with pytest.raises(ValueError, match="prefix of 2 plus"):
        cache.forward_tree([1], [-1], tree_start=2)
    with pytest.raises(ValueError, match="parents must be earlier"):
        cache.forward_tree([1, 2], [-1, 1], tree_start=3)
    with pytest.raises(ValueError, match="holds no tree"):
        cache.keep_tree_path([0])
    cache.crop(3)
    cache.forward_tree([4, 5, 6], [-1, 0, 0], tree_start=3)
    with pytest.raises(ValueError, match="not a root-to-node path"):
        cache.keep_tree_path([0, 1, 2])
    with pytest.raises(ValueError, match="not a root-to-node path"):
        cache.keep_tree_path([1])
    cache.keep_tree_path([0, 2])
    assert cache.token_ids == [1, 2, 3, 4, 6]


# ----------------------------------------------------------------------------- engine


def run(model, drafter, prompts, params, *, k=4, max_new_tokens=24, eos=(), **kwargs):
    engine = SpeculativeEngine(model, drafter, num_speculative_tokens=k, eos_token_ids=list(eos),
                               **kwargs)
    return engine.generate(prompts, params, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_tree_outputs_identical_to_plain_decoding(target_model, draft_model, drafter,
                                                  temperature):
    params = params_for(temperature)
    plain = run(target_model, "none", PROMPTS, params, max_new_tokens=30)
    tree = run(target_model, drafter, PROMPTS, params, max_new_tokens=30, tree=True,
               tree_nodes=8, draft_model=draft_model if drafter == "model" else None)
    assert outputs(tree) == outputs(plain)
    stats = tree.stats
    assert stats.tree_nodes == 8 and stats.to_dict()["tree_nodes"] == 8
    total = stats.total
    assert total.accepted > 0 and total.drafted > total.accepted
    assert total.emitted == total.steps + total.accepted
    assert stats.paths["torch.verify_tree.onehot"]["calls"] == stats.steps


def test_tree_with_penalties_bans_and_stops_matches_plain(target_model):
    """The persistent batch gets the tree's emitted tokens (append): penalties, bad words,
    min_tokens and EOS behave as in plain decoding."""
    params = [
        specsample.SamplingParams(temperature=0.9, seed=1, presence_penalty=0.8,
                                  repetition_penalty=1.3),
        specsample.SamplingParams(temperature=0.0, bad_words_token_ids=[[13], [9, 21]],
                                  min_tokens=5),
        specsample.SamplingParams(temperature=1.1, seed=3, top_k=6, min_tokens=3),
    ]
    eos = [9]
    plain = run(target_model, "none", PROMPTS, params, max_new_tokens=20, eos=eos)
    tree = run(target_model, "ngram", PROMPTS, params, max_new_tokens=20, eos=eos, tree=True,
               tree_nodes=6)
    assert outputs(tree) == outputs(plain)
    assert [o.finish_reason for o in tree.outputs] == [o.finish_reason for o in plain.outputs]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_one_branch_trees_give_the_chain_engine(target_model, temperature):
    params = params_for(temperature)
    chain = run(target_model, NgramDrafter(), PROMPTS, params, k=3, max_new_tokens=30)
    tree = run(target_model, ChainAsTree(NgramDrafter()), PROMPTS, params, k=3,
               max_new_tokens=30, tree=True, tree_nodes=3)
    assert outputs(tree) == outputs(chain)
    for a, b in zip(tree.stats.requests, chain.stats.requests, strict=True):
        assert (a.steps, a.drafted, a.accepted, a.emitted) == \
            (b.steps, b.drafted, b.accepted, b.emitted)


def test_greedy_model_tree_of_one_branch_is_the_greedy_chain(target_model, draft_model):
    params = params_for(0.0)
    chain = run(target_model, "model", PROMPTS, params, draft_model=draft_model)
    tree = run(target_model, "model", PROMPTS, params, draft_model=draft_model, tree=True,
               tree_nodes=4, tree_branching=1)
    assert outputs(tree) == outputs(chain)
    assert [r.accepted for r in tree.stats.requests] == \
        [r.accepted for r in chain.stats.requests]


def test_tree_depth_respects_max_new_tokens_and_context(target_model):
    params = params_for(0.0, n=1)
    for n in (1, 2, 5):
        res = run(target_model, "ngram", [REPEAT], params, max_new_tokens=n, tree=True)
        assert len(res.outputs[0].token_ids) == n
    model = tiny_llama(0)
    model.config.max_position_embeddings = len(REPEAT) + 3
    res = run(model, "ngram", [REPEAT], params, max_new_tokens=10, tree=True)
    assert res.outputs[0].finish_reason == "length" and len(res.outputs[0].token_ids) == 3


def test_one_call_generate_takes_tree_options(target_model):
    from specsample.engine import generate

    params = params_for(0.8, n=1)
    plain = run(target_model, "none", [BRANCHY], params, max_new_tokens=12)
    res = generate(target_model, [BRANCHY], params, max_new_tokens=12, eos_token_ids=[],
                   tree=True, tree_nodes=5, tree_branching=2)
    assert outputs(res) == outputs(plain) and res.stats.tree_nodes == 5


def test_tree_bad_arguments_are_named(target_model):
    with pytest.raises(ValueError, match="method 'block' is not available with trees"):
        SpeculativeEngine(target_model, "ngram", tree=True, method="block")
    with pytest.raises(ValueError, match="needs a drafter .*not 'none'"):
        SpeculativeEngine(target_model, "none", tree=True)
    with pytest.raises(ValueError, match="tree_nodes must be an int >= 1"):
        SpeculativeEngine(target_model, "ngram", tree=True, tree_nodes=0)
    with pytest.raises(ValueError, match="branching must be >= 1"):
        SpeculativeEngine(target_model, "ngram", tree=True, tree_branching=0)
    with pytest.raises(ValueError, match="tree_branching is only used with tree=True"):
        SpeculativeEngine(target_model, "ngram", tree_branching=2)
    with pytest.raises(ValueError, match="NgramDrafter does not"):
        SpeculativeEngine(target_model, NgramDrafter(), tree=True)
    assert isinstance(make_drafter("ngram", tree=True), NgramTreeDrafter)

    class Bad(Drafter):
        name = "bad"

        def propose_tree(self, ctx, max_nodes):
            return TreeDraft([1, 1], [0, 0])

    with pytest.raises(RuntimeError, match="two children of node 0"):
        run(target_model, Bad(), [REPEAT], params_for(0.0, n=1), tree=True)


def test_tree_forward_needs_a_mask_taking_attention():
    model = tiny_llama(4)
    cache = ModelCache(model)
    cache.forward([1, 2])
    model.config._attn_implementation_internal = "flash_attention_2"  # (no forward after this)
    with pytest.raises(ValueError, match="eager or sdpa attention"):
        cache.forward_tree([3], [-1], tree_start=2)
    assert len(cache) == 2


# ----------------------------------------------------------------------------- command line


class WordTokenizer:
    """Token i is the word ``w{i}`` (enough of a tokenizer for ``specsample generate``)."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text, **kwargs):
        return {"input_ids": [int(w[1:]) for w in text.split()]}

    def decode(self, ids, **kwargs):
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def cli_with_tiny_model(monkeypatch, tmp_path):
    """``specsample generate`` loading a tiny random Llama whatever --model says (a directory
    with a config.json, so that the option checks pass)."""
    from specsample import cli, engine
    from specsample.engine import LoadedModel

    (tmp_path / "config.json").write_text("{}")
    model = tiny_llama(0)
    monkeypatch.setattr(engine, "load_model",
                        lambda *a, **k: LoadedModel(model, WordTokenizer(), "tiny"))
    before = torch.get_num_threads()
    yield lambda *argv: cli.main(["generate", "--model", str(tmp_path), *argv])
    torch.set_num_threads(before)


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_cli_tree_compare_is_identical(cli_with_tiny_model, capsys, temperature):
    import json

    prompt = " ".join(f"w{t}" for t in REPEAT)
    assert cli_with_tiny_model("--prompt", prompt, "--prompt", "w1 w2 w3 w1 w2", "--tree",
                               "--tree-nodes", "6", "--temperature", temperature, "--seed",
                               "5", "--max-new-tokens", "20", "--compare", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] is True
    assert report["stats"]["tree_nodes"] == 6
    assert report["stats"]["mean_accepted_length"] >= 1.0
    assert report["stats"]["paths"]["torch.verify_tree.onehot"]["calls"] >= 1
    # the human report names the tree
    assert cli_with_tiny_model("--prompt", prompt, "--tree", "--max-new-tokens", "4",
                               "--no-warmup") == 0
    assert "tree of 8 nodes, depth 4" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--tree", "--drafter", "none"], "--tree needs a drafter that proposes trees"),
    (["--tree", "--method", "block"], "--method block is not available with --tree"),
    (["--tree-nodes", "8"], "--tree-nodes is only used with --tree"),
    (["--tree-branching", "2"], "--tree-branching is only used with --tree"),
    (["--tree", "--tree-nodes", "0"], "--tree-nodes must be >= 1, got 0"),
    (["--tree", "--tree-branching", "0"], "--tree-branching must be >= 1, got 0"),
])
def test_cli_tree_errors(monkeypatch, capsys, argv, message):
    from specsample import cli, engine

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(engine, "load_model", load_model)
    assert cli.main(["generate", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_cli_tree_nodes_default_is_stated(capsys):
    from specsample import cli
    from specsample.engine.generate import DEFAULT_TREE_NODES

    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert f"(default {DEFAULT_TREE_NODES})" in " ".join(capsys.readouterr().out.split())
