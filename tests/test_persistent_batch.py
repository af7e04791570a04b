"""The persistent batch: a SamplingBatch updated with append() / select() / concat() gives
exactly the outputs of a batch rebuilt with from_params(..., output_token_ids=history) from the
full history (penalties, bad words, min_tokens, logit_bias, filters, allowed tokens, seeds)."""

from __future__ import annotations

import random

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams
from specsample.outputs import SampleOutput, VerifyOutput

V = 24
EOS = (3,)


def _random_params(rng: random.Random, seed: int) -> SamplingParams:
    kw = dict(temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), seed=seed,
              logprobs=rng.choice([None, None, 0, 2]))
    if rng.random() < 0.5:
        kw.update(presence_penalty=rng.choice([0.0, 0.5, -0.3]),
                  frequency_penalty=rng.choice([0.0, 0.4]),
                  repetition_penalty=rng.choice([1.0, 1.3, 0.8]))
    if rng.random() < 0.5:
        kw["bad_words_token_ids"] = rng.choice([[[5]], [[1, 2]], [[2, 4, 6], [7, 8]],
                                                [[9, 9, 9, 1]]])
    if rng.random() < 0.5:
        kw.update(min_tokens=rng.randint(1, 6), stop_token_ids=rng.choice([[], [0], [10, 11]]))
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randrange(V): rng.uniform(-3, 3) for _ in range(2)}
    if rng.random() < 0.3:
        kw.update(rng.choice([dict(top_k=4), dict(top_p=0.8), dict(min_p=0.1),
                              dict(top_k=6, top_p=0.9)]))
    if rng.random() < 0.15:
        kw["allowed_token_ids"] = rng.sample(range(V), 12)
    return SamplingParams(**kw)


class Track:
    """The persistent batch and the host history it must match."""

    def __init__(self, rng: random.Random, n: int, seed0: int):
        self.params = [_random_params(rng, seed0 + i) for i in range(n)]
        self.prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 5))] for _ in range(n)]
        self.outputs = [[rng.randrange(V) for _ in range(rng.randint(0, 3))] for _ in range(n)]
        self.batch = self.rebuilt()

    def rebuilt(self) -> SamplingBatch:
        return SamplingBatch.from_params(self.params, vocab_size=V,
                                         prompt_token_ids=self.prompts,
                                         output_token_ids=self.outputs, eos_token_ids=EOS)

    def record(self, out) -> None:
        tok = out.token_ids if isinstance(out, VerifyOutput) else out.token_ids[:, None]
        for i in range(len(self.params)):
            if not out.invalid[i]:
                self.outputs[i] += [t for t in tok[i].tolist() if t >= 0]

    def select(self, idx: list[int]) -> None:
        self.batch = self.batch.select(idx)
        for name in ("params", "prompts", "outputs"):
            setattr(self, name, [getattr(self, name)[i] for i in idx])

    def concat(self, other: Track) -> None:
        self.batch = SamplingBatch.concat([self.batch, other.batch])
        for name in ("params", "prompts", "outputs"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def _same(a, b) -> None:
    assert torch.equal(a.token_ids, b.token_ids), (a.token_ids, b.token_ids)
    assert torch.equal(a.invalid, b.invalid)
    if isinstance(a, VerifyOutput):
        assert torch.equal(a.num_accepted, b.num_accepted)
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None:
        assert torch.equal(a.logprobs, b.logprobs)
        assert torch.equal(a.logprob_token_ids, b.logprob_token_ids)


def _step(track: Track, rng: random.Random, gen: torch.Generator, step: int):
    n = len(track.params)
    pos = torch.tensor([100 * step + i for i in range(n)])
    rebuilt = track.rebuilt()
    if rng.random() < 0.3:
        logits = torch.randn(n, V, generator=gen) * 2
        out = specsample.sample(logits, track.batch, positions=pos, strict=False)
        ref = specsample.sample(logits, rebuilt, positions=pos, strict=False)
    else:
        ks = [rng.randint(0, 3) for _ in range(n)]
        logits = torch.randn(n + sum(ks), V, generator=gen) * 2
        d = torch.randint(0, V, (sum(ks),), generator=gen)
        extra = {}
        kind = rng.choice(["onehot", "draft_logits", "draft_probs"])
        if kind == "draft_logits":
            extra["draft_logits"] = torch.randn(sum(ks), V, generator=gen)
        elif kind == "draft_probs":
            extra["draft_probs"] = torch.softmax(torch.randn(sum(ks), V, generator=gen), -1)
        method = rng.choice(["token", "block"])
        out = specsample.verify(logits, d, ks, track.batch, positions=pos, method=method,
                                strict=False, **extra)
        ref = specsample.verify(logits, d, ks, rebuilt, positions=pos, method=method,
                                strict=False, **extra)
    _same(out, ref)
    # The state matches the rebuilt batch's (tails: the requests' own words only look back
    # as far as their own longest word, which concat may have left -1 further back).
    assert torch.equal(track.batch.num_output, rebuilt.num_output)
    assert torch.equal(track.batch.output_counts, rebuilt.output_counts)
    assert torch.equal(track.batch.prompt_mask, rebuilt.prompt_mask)
    for i, p in enumerate(track.params):
        w = max((len(word) - 1 for word in p.bad_words_token_ids or ()), default=0)
        if w:
            assert torch.equal(track.batch.context_tail[i, -w:], rebuilt.context_tail[i, -w:])
    return out


def _run(seed: int, steps: int, n: int) -> int:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    track = Track(rng, n, seed * 1000)
    emitted = 0
    for step in range(steps):
        out = _step(track, rng, gen, step)
        track.batch.append(out)
        track.record(out)
        emitted += int((~out.invalid).sum())
        r = rng.random()
        if r < 0.15 and len(track.params) > 1:  # some requests finish; the order changes
            keep = rng.sample(range(len(track.params)), rng.randint(1, len(track.params) - 1))
            track.select(keep)
        elif r < 0.3:
            track.concat(Track(rng, rng.randint(1, 3), seed * 1000 + 100 * (step + 1)))
        elif r < 0.4:
            track.batch.refresh_min_tokens()
    return emitted


@pytest.mark.parametrize("seed", range(8))
def test_persistent_batch_matches_rebuilt_torch(seed, monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    assert _run(seed, 25, 4) > 40  # tokens were emitted (the comparison is not vacuous)


@pytest.mark.parametrize("seed", range(2))
def test_persistent_batch_matches_rebuilt_triton(seed, monkeypatch):
    pytest.importorskip("specsample.triton_backend")
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    assert _run(100 + seed, 10, 3) > 10


def test_append_counts_only_emitted_tokens():
    ps = [SamplingParams(seed=1, presence_penalty=0.5, bad_words_token_ids=[[1, 2, 3]],
                         min_tokens=4, stop_token_ids=[7]),
          SamplingParams(seed=2), SamplingParams(seed=3, frequency_penalty=0.2)]
    b = SamplingBatch.from_params(ps, vocab_size=10, prompt_token_ids=[[4, 5], [1], [2]],
                                  eos_token_ids=[9])
    out = VerifyOutput(token_ids=torch.tensor([[1, 2, 6], [5, -1, -1], [8, 8, 8]]),
                       num_accepted=torch.tensor([2, 0, 2]), logprobs=None,
                       logprob_token_ids=None, invalid=torch.tensor([False, False, True]))
    b.append(out)
    assert b.num_output.tolist() == [3, 1, 0]  # the invalid request emitted nothing
    assert b.output_counts[0, [1, 2, 6]].tolist() == [1, 1, 1]
    assert b.output_counts[1].sum() == 0  # no penalty: not recorded (as from_params)
    assert b.output_counts[2].sum() == 0
    assert b.context_tail[0].tolist() == [2, 6]
    b.append(SampleOutput(token_ids=torch.tensor([4, 0, 1]), logprobs=None,
                          logprob_token_ids=None, invalid=torch.tensor([False, True, False])))
    assert b.num_output.tolist() == [4, 1, 1]
    assert b.context_tail[0].tolist() == [6, 4]
    assert b.output_counts[2, 1] == 1
    # min_tokens reached on the device: the stop tokens stay listed (exact: compared per row)
    # until refresh_min_tokens() reads the count.
    assert b.needs_bans and b.stop_users == (0,)
    assert b.refresh_min_tokens() and b.stop_users == () and b.stop_req.numel() == 0
    assert b.needs_bans  # bad words still ban
    assert not b.refresh_min_tokens()


def test_refresh_min_tokens_clears_needs_bans():
    b = SamplingBatch.from_params([SamplingParams(seed=1, min_tokens=1)], vocab_size=8,
                                  eos_token_ids=[2])
    assert b.needs_bans
    b.append(SampleOutput(token_ids=torch.tensor([5]), logprobs=None, logprob_token_ids=None,
                          invalid=torch.tensor([False])))
    assert b.needs_bans  # conservatively: the host has not read the count
    logits = torch.zeros(1, 8)
    logits[0, 2] = 50.0  # eos is the only likely token: banned while below min_tokens
    assert specsample.sample(logits, b, positions=[0]).token_ids.item() == 2  # reached: exact
    assert b.refresh_min_tokens() and not b.needs_bans
    assert specsample.sample(logits, b, positions=[0]).token_ids.item() == 2


def test_select_and_concat_keep_seeds_and_counter():
    torch.manual_seed(0)
    a = SamplingBatch.from_params([SamplingParams(), SamplingParams(), SamplingParams()],
                                  vocab_size=6)
    s = a.select([2, 0])
    assert s.seed_lo.tolist() == [a.seed_lo[2], a.seed_lo[0]]
    assert s.fresh_counter is a.fresh_counter  # shared: fresh noise on both
    b = SamplingBatch.from_params([SamplingParams(seed=4)], vocab_size=6)
    c = SamplingBatch.concat([s, b])
    assert c.seed_hi.tolist() == [a.seed_hi[2], a.seed_hi[0], b.seed_hi[0]]
    assert c.user_seeded and c.fresh_counter.item() == max(a.fresh_counter.item(), 0)


def test_bad_arguments():
    b = SamplingBatch.from_params([SamplingParams(seed=1)] * 2, vocab_size=6)
    for idx, match in (([], "at least one"), ([2], r"in \[0, 2\)"), ([0, 0], "distinct"),
                       ([0.5], "must be an int"), (5, "sequence of ints")):
        with pytest.raises(ValueError, match=match):
            b.select(idx)
    other = SamplingBatch.from_params([SamplingParams(seed=1)], vocab_size=7)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingBatch.concat([b, other])
    with pytest.raises(ValueError, match="non-empty"):
        SamplingBatch.concat([])
    with pytest.raises(ValueError, match="SampleOutput or VerifyOutput"):
        b.append(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"must be \[2\]"):
        b.append(SampleOutput(token_ids=torch.tensor([1]), logprobs=None,
                              logprob_token_ids=None, invalid=torch.tensor([False])))


@pytest.mark.gpu
def test_append_is_captured_in_a_cuda_graph():
    from specsample.bench import capture_graph

    ps = [SamplingParams(seed=i, temperature=0.8, top_k=20) for i in range(3)]
    b = SamplingBatch.from_params(ps, vocab_size=1000, device="cuda",
                                  output_token_ids=[[1], [], [2, 3]])
    logits = torch.randn(3, 1000, device="cuda")
    pos = torch.zeros(3, dtype=torch.int64, device="cuda")

    def call():
        out = specsample.sample(logits, b, positions=pos, strict=False)
        b.append(out)
        return out

    graph, _ = capture_graph(call)  # 3 warm-up calls + the captured one appended
    before = b.num_output.clone()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert (b.num_output - before).tolist() == [2, 2, 2]


@pytest.mark.gpu
def test_append_with_penalties_and_bad_words_is_captured():
    # append() alone is captured too (without the sampler call that reads its state): its
    # count, tail and min_tokens updates replay with new outputs copied in.
    from specsample.bench import capture_graph

    ps = [SamplingParams(seed=1, frequency_penalty=0.5, bad_words_token_ids=[[1, 2, 3]],
                         min_tokens=5),
          SamplingParams(seed=2, repetition_penalty=1.2)]

    def make():
        return SamplingBatch.from_params(ps, vocab_size=50, device="cuda",
                                         prompt_token_ids=[[4, 5], [6]], eos_token_ids=[0])

    graphed, eager = make(), make()
    out = VerifyOutput(token_ids=torch.zeros(2, 3, dtype=torch.int64, device="cuda"),
                       num_accepted=torch.zeros(2, dtype=torch.int64, device="cuda"),
                       logprobs=None, logprob_token_ids=None,
                       invalid=torch.zeros(2, dtype=torch.bool, device="cuda"))
    graph, _ = capture_graph(lambda: graphed.append(out))
    for name in ("output_counts", "num_output", "context_tail"):  # (the warm-up appended 0s)
        getattr(graphed, name).copy_(getattr(eager, name))
    steps = [([[7, 1, 2], [8, 9, -1]], [2, 1], [False, False]),
             ([[3, -1, -1], [5, 5, 5]], [0, 2], [False, True])]
    for tok, acc, inv in steps:
        out.token_ids.copy_(torch.tensor(tok))
        out.num_accepted.copy_(torch.tensor(acc))
        out.invalid.copy_(torch.tensor(inv))
        graph.replay()
        eager.append(out)
        torch.cuda.synchronize()
        for name in ("output_counts", "num_output", "context_tail"):
            assert torch.equal(getattr(graphed, name), getattr(eager, name)), name
    assert eager.num_output.tolist() == [4, 2]
    assert eager.context_tail[0].tolist() == [2, 3]


def _seen_by_scan(batch):
    return sorted(set(zip(*(t.tolist() for t in (
        (batch.output_counts > 0) | batch.prompt_mask).nonzero(as_tuple=True)))))


def test_seen_pairs_follow_append_and_in_place_changes():
    """SamplingBatch.seen_pairs (the tokens repetition_penalty touches) equals a scan of the
    [N, V] state after from_params, after append() (which extends the kept pairs on the CPU:
    invalid requests, -1 slots and requests without penalties add nothing), and after the
    state is changed in place or replaced; and a stale copy would fail the comparison."""
    v = 32
    params = [SamplingParams(temperature=0.8, seed=1, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, seed=2),
              SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.5)]
    batch = SamplingBatch.from_params(params, vocab_size=v, prompt_token_ids=[[1, 2], [3], [4]],
                                      output_token_ids=[[5], [6], [7, 7]])

    def seen():
        return sorted(set(zip(*(t.tolist() for t in batch.seen_pairs()))))

    assert seen() == _seen_by_scan(batch) == [(0, 1), (0, 2), (0, 5), (2, 7)]
    out = VerifyOutput(token_ids=torch.tensor([[9, 10, -1], [11, -1, -1], [12, 13, 14]]),
                       num_accepted=torch.tensor([1, 0, 2]), logprobs=None,
                       logprob_token_ids=None, invalid=torch.tensor([False, False, True]))
    before = batch.seen_pairs()
    batch.append(out)
    assert batch.seen_pairs() is not before
    assert seen() == _seen_by_scan(batch)
    assert (0, 9) in seen() and (0, 10) in seen() and not any(p[0] == 1 for p in seen())
    assert not any(p[1] in (12, 13, 14) for p in seen())  # (the invalid request)
    stale = seen()
    batch.output_counts[2, 20] = 1.0  # in place, by hand
    assert seen() == _seen_by_scan(batch) != stale
    batch.prompt_mask = torch.zeros_like(batch.prompt_mask)  # replaced
    assert seen() == _seen_by_scan(batch)


def test_seen_pairs_stay_as_many_as_the_distinct_tokens():
    """A decode loop's append() adds a token to seen_pairs only the first time it is
    counted: after 200 steps of the same two tokens the pairs hold them once each."""
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.8, seed=1,
                                                      repetition_penalty=1.2)],
                                      vocab_size=16, prompt_token_ids=[[3]])
    batch.seen_pairs()
    out = VerifyOutput(token_ids=torch.tensor([[5, 6]]), num_accepted=torch.tensor([1]),
                       logprobs=None, logprob_token_ids=None, invalid=torch.tensor([False]))
    for _ in range(200):
        batch.append(out)
    req, tok = batch.seen_pairs()
    assert sorted(tok.tolist()) == [3, 5, 6] and req.tolist() == [0, 0, 0]


def test_derived_tensors_follow_in_place_edits():
    """The torch backend's stacked seeds (SamplingBatch.derived) follow an in-place edit of
    seed_lo, so every draw of a call reads the same seeds."""
    from specsample import torch_backend as tb
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.8, seed=1)], vocab_size=16)
    assert tb._seeds(batch)[0, 0] == batch.seed_lo[0]
    batch.seed_lo.fill_(123)
    assert tb._seeds(batch)[0, 0] == 123
