"""The batched sampler: greedy, seeded draws that ignore batch mates, filters, penalties (vs HF), logprobs."""

from __future__ import annotations

import doctest
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from autodeploy.runtime import sampler
from autodeploy.runtime.sampler import SampleResult, SamplingRow, _apply_logit_bias, _apply_penalties, sample
from autodeploy.runtime.sampling_params import SamplingParams


def row(seed: int = 0, step: int = 0, prompt=(), output=(), **fields) -> SamplingRow:
    params = SamplingParams(**fields)
    params.validate()
    return SamplingRow(params, seed, step, list(prompt), list(output))


def draws(logits: torch.Tensor, count: int, seed: int = 7, **fields) -> torch.Tensor:
    """``count`` independent draws from one row of logits: the same seed at steps 0..count-1, in one batch."""
    rows = [row(seed=seed, step=step, **fields) for step in range(count)]
    return torch.tensor(sample(logits.expand(count, -1), rows).token_ids)


def chi_square_p_value(tokens: torch.Tensor, probabilities: torch.Tensor) -> float:
    """P-value of the observed token counts under ``probabilities`` (over the tokens with probability > 0)."""
    support = probabilities > 0
    if int(support.sum()) == 1:  # no degrees of freedom: every draw must be the one possible token
        return float(support[tokens].all())
    counts = torch.bincount(tokens, minlength=len(probabilities)).double()
    expected = probabilities.double() * len(tokens)
    statistic = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    degrees_of_freedom = int(support.sum()) - 1
    # The chi-square survival function is the regularized upper incomplete gamma Q(df/2, x/2).
    return float(torch.special.gammaincc(torch.tensor(degrees_of_freedom / 2, dtype=torch.float64), statistic / 2))


# --- greedy --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_rows_take_the_argmax(dtype):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    result = sample(logits, [row(temperature=0) for _ in range(6)])
    assert result == SampleResult(logits.argmax(-1).tolist(), [None] * 6, [None] * 6)


def test_greedy_rows_take_the_argmax_among_sampled_rows():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    rows = [row(temperature=0), row(temperature=1.5, seed=3), row(temperature=0, logprobs=2)] * 2
    tokens = sample(logits, rows).token_ids
    argmax = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 2, 3, 5)] == [argmax[i] for i in (0, 2, 3, 5)]


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.integers(-3, 3), min_size=1, max_size=30),  # small integers: many ties
    temperature=st.floats(1e-4, 1e4),
    seed=st.integers(-(2**70), 2**70),
    step=st.integers(0, 10_000),
)
def test_top_k_one_is_the_greedy_token_under_any_temperature(values, temperature, seed, step):
    logits = torch.tensor([values], dtype=torch.float32)
    (token,) = sample(logits, [row(seed, step, top_k=1, temperature=temperature)]).token_ids
    assert token == int(logits.argmax())


def test_top_k_one_is_greedy_with_penalties_too():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    penalties = {"repetition_penalty": 1.8, "presence_penalty": 0.7, "frequency_penalty": 0.3}
    history = {"prompt": [1, 2, 3], "output": [int(t) for t in logits.argmax(-1)]}
    greedy = sample(logits, [row(temperature=0, **history, **penalties)] * 4).token_ids
    top1 = sample(logits, [row(seed=s, top_k=1, temperature=0.9, **history, **penalties) for s in range(4)]).token_ids
    assert top1 == greedy


# --- seeded randomness ---------------------------------------------------------------------------------------


def test_a_seeded_draw_ignores_batch_mates_and_row_order():
    targets = [
        row(seed=11, step=0, temperature=1.0),
        row(seed=11, step=5, temperature=0.7, top_p=0.95),
        row(seed=-4, step=2, temperature=1.3, top_k=50, min_p=0.01, prompt=[3, 4], output=[4, 9], repetition_penalty=1.2),
        row(seed=2**63 + 9, step=1, temperature=2.0, presence_penalty=0.5, output=[7], logprobs=3),
    ]
    mates = [
        row(temperature=0),
        row(seed=5, temperature=0.5, top_p=0.5, frequency_penalty=1.0, output=[1, 1, 2]),
        row(seed=6, temperature=1.0, logprobs=20),
    ]
    everyone = targets + mates
    logits = torch.randn(len(everyone), 500, generator=torch.Generator().manual_seed(3))
    alone = [sample(logits[i : i + 1], [target]).token_ids[0] for i, target in enumerate(targets)]
    for shuffle_seed in range(3):
        order = list(range(len(targets) + 1 + shuffle_seed))  # one, two, then three mates
        random.Random(shuffle_seed).shuffle(order)
        tokens = sample(logits[order], [everyone[i] for i in order]).token_ids
        assert [tokens[order.index(i)] for i in range(len(targets))] == alone


def test_draws_ignore_the_global_rng():
    logits = torch.zeros(8, 1000)
    rows = [row(seed=s, step=3) for s in range(8)]
    torch.manual_seed(1)
    first = sample(logits, rows).token_ids
    torch.manual_seed(2)
    torch.rand(100)
    assert sample(logits, rows).token_ids == first


def test_different_seeds_and_steps_draw_different_tokens():
    logits = torch.zeros(50, 1000)
    over_seeds = sample(logits, [row(seed=s) for s in range(50)]).token_ids
    over_steps = sample(logits, [row(seed=0, step=s) for s in range(50)]).token_ids
    assert len(set(over_seeds)) > 40 and len(set(over_steps)) > 40


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_softmax_of_logits_over_temperature(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, -3.0])
    expected = torch.softmax(logits / temperature, dim=-1)
    assert chi_square_p_value(draws(logits, 20_000, temperature=temperature), expected) > 1e-6


def test_draws_across_seeds_follow_the_softmax():
    logits = torch.tensor([0.3, -0.2, 1.1, 0.0, -1.5])
    tokens = sample(logits.expand(20_000, -1), [row(seed=s) for s in range(20_000)]).token_ids
    assert chi_square_p_value(torch.tensor(tokens), logits.softmax(-1)) > 1e-6


# --- filters -------------------------------------------------------------------------------------------------

PROBABILITIES = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
SHUFFLE = torch.tensor([3, 0, 5, 1, 4, 2])  # token SHUFFLE[r] has the r-th largest probability

FILTERS = [
    pytest.param({}, [0, 1, 2, 3, 4, 5], id="off"),
    pytest.param({"top_k": 3}, [0, 1, 2], id="top_k=3"),
    pytest.param({"top_p": 0.7}, [0, 1, 2], id="top_p=0.7"),
    pytest.param({"top_p": 0.6}, [0, 1], id="top_p=0.6"),
    pytest.param({"top_p": 0.01}, [0], id="top_p=0.01-keeps-the-top-token"),
    pytest.param({"min_p": 0.3}, [0, 1, 2], id="min_p=0.3"),
    pytest.param({"min_p": 0.2}, [0, 1, 2, 3], id="min_p=0.2"),
    pytest.param({"top_k": 4, "top_p": 0.8}, [0, 1, 2], id="top_p-of-what-top_k-left"),
    pytest.param({"temperature": 2.0, "min_p": 0.55}, [0, 1, 2], id="min_p-after-temperature"),
    pytest.param({"temperature": 0.5, "top_p": 0.75}, [0, 1], id="top_p-after-temperature"),
]


@pytest.mark.parametrize("fields, allowed_ranks", FILTERS)
def test_filters_draw_exactly_the_allowed_tokens_in_proportion(fields, allowed_ranks):
    logits = torch.empty(6).index_copy_(0, SHUFFLE, PROBABILITIES.log())
    tokens = draws(logits, 6000, **{"temperature": 1.0, **fields})
    allowed = SHUFFLE[allowed_ranks]
    assert set(tokens.tolist()) == set(allowed.tolist())
    kept = torch.full_like(logits, float("-inf")).index_copy_(0, allowed, logits[allowed])
    assert chi_square_p_value(tokens, torch.softmax(kept / fields.get("temperature", 1.0), dim=-1)) > 1e-6


ROW_FILTERS = st.fixed_dictionaries(
    {
        "temperature": st.floats(0.05, 5.0),
        "top_k": st.integers(0, 35),
        "top_p": st.floats(0.05, 1.0),
        "min_p": st.floats(0.0, 1.0),
        "seed": st.integers(0, 2**64),
        "step": st.integers(0, 2**20),
    }
)


def test_top_k_ranks_the_logits_not_their_rounded_shifted_values():
    # 1e-40 and 0.0 both round to -1.0 once shifted by the max (1.0): top-2 still keeps 1e-40, never 0.0.
    logits = torch.tensor([[1.0, 0.0, 1e-40, -5.0]])
    drawn = {sample(logits, [row(temperature=1.0, top_k=2, seed=seed)]).token_ids[0] for seed in range(200)}
    assert drawn == {0, 2}


@settings(max_examples=80, deadline=None)
@given(vocab=st.integers(2, 30), filters=st.lists(ROW_FILTERS, min_size=1, max_size=4), data=st.data())
def test_a_drawn_token_is_always_one_the_filters_keep(vocab, filters, data):
    logit_rows = st.lists(st.floats(-10, 10), min_size=vocab, max_size=vocab)
    logits = torch.tensor(data.draw(st.lists(logit_rows, min_size=len(filters), max_size=len(filters))))
    rows = [row(**f) for f in filters]
    for logit_row, f, token in zip(logits.double(), filters, sample(logits, rows).token_ids):
        probabilities = torch.softmax(logit_row / f["temperature"], dim=-1)
        order = torch.sort(logit_row, descending=True, stable=True).indices
        rank = int((order == token).nonzero())
        top_k = f["top_k"] or vocab
        assert rank < top_k
        in_top_k = probabilities[order[:top_k]] / probabilities[order[:top_k]].sum()
        assert in_top_k[:rank].sum() < f["top_p"] + 1e-5  # the more likely tokens had not reached top_p yet
        assert probabilities[token] >= f["min_p"] * probabilities.max() * (1 - 1e-5)


# --- penalties -----------------------------------------------------------------------------------------------


def test_repetition_penalty_equals_hf_processor():
    logits = 3 * torch.randn(4, 50, generator=torch.Generator().manual_seed(4))  # both signs
    histories = [([1, 2, 2, 7], [7, 8]), ([0, 49], []), ([5], [5, 5, 6, 30]), ([10, 11], [12])]
    penalties = [1.3, 0.7, 2.0, 1.0]
    rows = [row(prompt=p, output=o, repetition_penalty=r) for (p, o), r in zip(histories, penalties)]
    ours = _apply_penalties(logits, rows)
    for i, ((prompt, output), penalty) in enumerate(zip(histories, penalties)):
        hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], hf)
    assert torch.equal(ours[3], logits[3])  # penalty 1 leaves the row alone


def test_presence_and_frequency_penalties_follow_the_openai_formula_on_output_tokens_only():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(5))
    cases = [
        ({"presence_penalty": 0.5, "frequency_penalty": 0.25}, [4, 4, 4, 9]),
        ({"presence_penalty": -1.0, "frequency_penalty": 2.0}, [0, 19, 19]),
        ({"presence_penalty": 2.0}, []),
    ]
    rows = [row(prompt=[1, 2, 3, 4], output=output, **fields) for fields, output in cases]
    expected = logits.clone()
    for i, (fields, output) in enumerate(cases):
        for token, count in Counter(output).items():
            expected[i, token] -= fields.get("presence_penalty", 0.0) + fields.get("frequency_penalty", 0.0) * count
    torch.testing.assert_close(_apply_penalties(logits, rows), expected)


def test_repetition_penalty_comes_before_presence_and_frequency():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    rows = [row(prompt=[0], output=[1, 1], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    expected = torch.tensor([[2.0 / 2, -1.0 * 2 - 0.5 - 0.25 * 2, 0.5]])
    torch.testing.assert_close(_apply_penalties(logits, rows), expected)


def test_a_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    assert sample(logits, [row(temperature=0, output=[1])]).token_ids == [1]
    assert sample(logits, [row(temperature=0, output=[1], repetition_penalty=1.5)]).token_ids == [2]


def test_logit_bias_adds_to_its_rows_tokens_and_leaves_logprobs_raw():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(6))
    rows = [row(logit_bias={2: 5.0, 7: -100.0}), row(), row(logit_bias={0: 1.5})]
    expected = logits.clone()
    expected[0, 2] += 5.0
    expected[0, 7] -= 100.0
    expected[2, 0] += 1.5
    torch.testing.assert_close(_apply_logit_bias(logits, rows), expected)
    favourite = int(logits[1].argmin())
    result = sample(logits, [row(temperature=0), row(temperature=0, logit_bias={favourite: 100.0}, logprobs=0),
                             row(temperature=0.8, seed=3, logit_bias={t: -100.0 for t in range(10) if t != 4})])
    assert result.token_ids == [int(logits[0].argmax()), favourite, 4]
    assert result.logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1)[favourite].item(), abs=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_bias_on_the_gpu_equals_the_cpu(dtype):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(8)).to(dtype)
    rows = [row(logit_bias={3: 7.5, 999: -100.0}), row(), row(logit_bias={0: 100.0}, temperature=0), row(logit_bias={500: 0.25})]
    torch.testing.assert_close(_apply_logit_bias(logits.cuda(), rows).cpu(), _apply_logit_bias(logits, rows))
    assert sample(logits.cuda(), rows).token_ids[2] == 0


# --- logprobs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_the_raw_log_softmax_and_the_true_top_tokens(dtype):
    logits = (2 * torch.randn(5, 64, generator=torch.Generator().manual_seed(6))).to(dtype)
    rows = [
        row(temperature=0, logprobs=3),
        row(seed=1, temperature=0.7, top_k=5, repetition_penalty=1.5, prompt=[1, 2], output=[3], logprobs=5),
        row(seed=2, temperature=1.0, logprobs=0),
        row(seed=3, temperature=1.0),
        row(temperature=0, presence_penalty=1.0, output=[7], logprobs=20),
    ]
    result = sample(logits, rows)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for i, r in enumerate(rows):
        if r.params.logprobs is None:
            assert result.logprobs[i] is None and result.top_logprobs[i] is None
            continue
        assert result.logprobs[i] == pytest.approx(float(raw[i, result.token_ids[i]]), abs=1e-6)
        best = raw[i].topk(r.params.logprobs)
        assert list(result.top_logprobs[i]) == best.indices.tolist()  # most likely first
        assert list(result.top_logprobs[i].values()) == pytest.approx(best.values.tolist(), abs=1e-6)


# --- API -----------------------------------------------------------------------------------------------------


def test_logits_must_have_one_row_per_sampling_row():
    with pytest.raises(ValueError, match="len\\(rows\\)=2"):
        sample(torch.zeros(3, 10), [row(), row()])


def test_docstring_example():
    result = doctest.testmod(sampler)
    assert result.attempted > 0 and result.failed == 0


def test_greedy_tokens_in_chunks_are_the_argmax_lowest_index_first():
    from autodeploy.runtime.sampler import _argmax_chunk, greedy_tokens

    vocab = 256 * 70
    assert _argmax_chunk(vocab) == 256
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen).to(torch.bfloat16)  # bf16 rounding makes equal values common
    logits[1, [10, 300, 9000]] = 50.0          # a tie across chunks: the first chunk's wins
    logits[2, [3000, 3001]] = 50.0             # a tie inside one chunk
    logits[3, 7777] = float("nan")             # argmax takes NaN as the maximum
    logits[4] = 1.0                            # all equal: token 0
    for rows in (logits, logits[:1], logits.float()):
        assert torch.equal(greedy_tokens(rows), rows.argmax(dim=-1))
    assert greedy_tokens(logits).tolist()[1:] == [10, 3000, 7777, 0]
    wide = torch.randn(40, vocab, generator=gen)  # many rows: the plain argmax
    assert torch.equal(greedy_tokens(wide), wide.argmax(dim=-1))
    odd = torch.randn(3, 50257, generator=gen)  # no divisor to chunk by
    assert torch.equal(greedy_tokens(odd), odd.argmax(dim=-1))
