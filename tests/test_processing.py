"""specsample.processing: the penalties against a dense, row-by-row statement of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsample import SamplingBatch, SamplingParams, processing
from specsample.plan import build_plan


def _dense_penalties(z: np.ndarray, params, prompts, outputs, drafts, ks) -> np.ndarray:
    """docs/semantics.md, row by row: a row's outputs are the request's outputs, then its
    drafts before the row (up to its first placeholder); repetition divides / multiplies each
    logit of a token seen in the prompt or those outputs, then frequency subtracts
    count x f, presence subtracts p once per output token id (float32, in that order)."""
    z = z.copy()
    row = 0
    d0 = 0
    for i, p in enumerate(params):
        live = drafts[d0:d0 + ks[i]]
        stop = live.index(-1) if -1 in live else len(live)
        for j in range(ks[i] + 1):
            outs = list(outputs[i]) + live[:min(j, stop)]
            counts = np.zeros(z.shape[1], dtype=np.float32)
            for t in outs:
                counts[t] += 1
            seen = (counts > 0) | np.isin(np.arange(z.shape[1]), prompts[i])
            r = np.float32(p.repetition_penalty)
            zr = z[row]
            zr[seen] = np.where(zr[seen] > 0, zr[seen] / r, zr[seen] * r)
            if p.frequency_penalty:
                zr -= np.float32(p.frequency_penalty) * counts
            if p.presence_penalty:
                zr -= np.float32(p.presence_penalty) * (counts > 0)
            row += 1
        d0 += ks[i]
    return z


def test_logit_bias_is_added_at_its_tokens_of_every_row_of_the_request():
    # Sparse: x + bias at each entry's token on every row of its request (drafts' rows too),
    # every other value untouched bit for bit (-0.0 stays -0.0); requests without a bias and
    # requests with entries at the vocabulary's ends
    v = 50
    logits = torch.randn(7, v, generator=torch.Generator().manual_seed(0))
    logits[:, 10] = -0.0
    biases = [{0: 1.5, 49: -2.0}, {}, {10: 0.25, 3: 3e38}]
    params = [SamplingParams(temperature=1.0, seed=1, logit_bias=b) for b in biases]
    batch = SamplingBatch.from_params(params, vocab_size=v)
    ks = [2, 1, 1]
    plan = build_plan(logits, batch, draft_token_ids=torch.tensor([4, 5, 6, 7]),
                      num_draft_tokens=ks, draft_logits=None, draft_probs=None,
                      positions=[0, 0, 0], method="token")
    got = processing.apply_bias_and_penalties(logits.clone(), plan)
    want = logits.clone()
    r = 0
    for bias, k in zip(biases, ks):
        for tok, val in bias.items():
            want[r:r + k + 1, tok] = want[r:r + k + 1, tok] + val
        r += k + 1
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("others", [False, True])
def test_penalties_match_a_dense_row_by_row_statement(others):
    # repetition from sparse (row, token) pairs (alone) or from the dense counts (with
    # frequency / presence): every request's prompt and outputs at each of its rows, drafts
    # counted at the rows after them up to a placeholder, tokens repeated in prompt, outputs
    # and drafts
    gen = np.random.default_rng(3 + others)
    v = 300
    for _ in range(40):
        n = int(gen.integers(1, 5))
        ks = [int(k) for k in gen.integers(0, 4, size=n)]
        params, prompts, outputs = [], [], []
        for _ in range(n):
            params.append(SamplingParams(
                temperature=1.0, seed=1,
                repetition_penalty=float(gen.choice([1.0, 0.7, 1.3, 2.0])),
                frequency_penalty=float(gen.choice([0.0, 0.5, -0.25])) if others else 0.0,
                presence_penalty=float(gen.choice([0.0, 0.75])) if others else 0.0))
            prompts.append([int(t) for t in gen.integers(0, 20, size=int(gen.integers(0, 6)))])
            outputs.append([int(t) for t in gen.integers(0, 20, size=int(gen.integers(0, 6)))])
        drafts = [int(t) for t in gen.integers(0, 20, size=sum(ks))]
        for s in range(len(drafts)):
            if gen.random() < 0.15:
                drafts[s] = -1
        logits = torch.from_numpy(gen.normal(size=(n + sum(ks), v)).astype(np.float32) * 3)
        batch = SamplingBatch.from_params(params, vocab_size=v, prompt_token_ids=prompts,
                                          output_token_ids=outputs)
        plan = build_plan(logits, batch, draft_token_ids=torch.tensor(drafts, dtype=torch.int64),
                          num_draft_tokens=ks, draft_logits=None, draft_probs=None,
                          positions=list(range(n)), method="token")
        got = processing.apply_bias_and_penalties(logits.clone(), plan).numpy()
        want = _dense_penalties(logits.numpy(), params, prompts, outputs, drafts, ks)
        if not batch.needs_penalties:
            want = logits.numpy()
        live = plan.row_live.numpy()  # (rows past a placeholder are never read)
        assert np.array_equal(got[live].view(np.int32), want[live].view(np.int32)), (
            params, ks, drafts)
