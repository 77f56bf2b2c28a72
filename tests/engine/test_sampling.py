import math

import pytest
import torch

from engine.base.errors import InvalidRequestError
from engine.generation.sampling import SamplingParams, apply_repetition_penalty, filter_scores, make_sampler

NO_HISTORY = torch.empty(0, dtype=torch.long)


def test_greedy_picks_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert make_sampler(SamplingParams())(logits, NO_HISTORY) == 1


def test_top_k_one_is_greedy_even_when_sampling():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    sample = make_sampler(SamplingParams(temperature=1.5, top_k=1, seed=3))
    assert {sample(logits, NO_HISTORY) for _ in range(20)} == {int(logits.argmax())}


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.zeros(1000)  # uniform: every draw is up to the generator

    def draws(seed):
        sample = make_sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sample(logits, NO_HISTORY) for _ in range(30)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    scores = filter_scores(probs.log(), top_k=0, top_p=0.8, min_p=0.0)
    kept = torch.isfinite(scores) & (scores > torch.finfo(scores.dtype).min)
    assert kept.tolist() == [True, True, False, False]


def test_top_p_always_keeps_the_best_token():
    scores = filter_scores(torch.tensor([2.0, 1.0, 0.0]), top_k=0, top_p=0.01, min_p=0.0)
    assert scores[0] == 2.0 and scores[1] < -1e30 and scores[2] < -1e30


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    scores = filter_scores(probs.log(), top_k=0, top_p=1.0, min_p=0.2)  # threshold 0.12
    assert (scores > -1e30).tolist() == [True, True, False, False]


def test_top_k_keeps_k():
    scores = filter_scores(torch.tensor([1.0, 5.0, 3.0, 4.0]), top_k=2, top_p=1.0, min_p=0.0)
    assert (scores > -1e30).tolist() == [False, True, False, True]


def test_sampling_never_picks_filtered_tokens():
    logits = torch.tensor([5.0, 4.9, -3.0, -3.0, -3.0])
    sample = make_sampler(SamplingParams(temperature=2.0, top_k=2, seed=0))
    assert {sample(logits, NO_HISTORY) for _ in range(200)} == {0, 1}


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    scores = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(scores, torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]
    assert scores.tolist() == [2.0, -2.0, 1.0], "the input must not change"


def test_repetition_penalty_can_change_the_greedy_choice():
    logits = torch.tensor([2.0, 1.5])
    sample = make_sampler(SamplingParams(repetition_penalty=2.0))
    assert sample(logits, NO_HISTORY) == 0
    assert sample(logits, torch.tensor([0])) == 1


def test_sampled_frequencies_follow_probabilities():
    probs = torch.tensor([0.7, 0.2, 0.1])
    sample = make_sampler(SamplingParams(temperature=1.0, seed=11))
    counts = torch.bincount(torch.tensor([sample(probs.log(), NO_HISTORY) for _ in range(3000)]), minlength=3)
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_a_certain_guess_leaves_the_targets_distribution():
    """Prompt lookup's guess is a certainty (q all on it): the target keeps it with its own
    probability p(d) and otherwise draws from p without it, so the token it gives is still
    distributed as p."""
    from engine.generation.sampling import choose

    probs = torch.tensor([0.5, 0.3, 0.2])
    rows = probs.log().repeat(2, 1)
    certain = torch.tensor([0.0, 1.0, 0.0])
    sampler = make_sampler(SamplingParams(temperature=1.0, seed=7))
    first = [choose(sampler, rows, [0.0, 0.0], NO_HISTORY, (1,), (certain,)).tokens[0][0] for _ in range(4000)]
    assert torch.allclose(torch.bincount(torch.tensor(first), minlength=3) / 4000, probs, atol=0.03)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", "abc"), ("temperature", math.nan), ("top_k", 2.5),
    ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", 1.0), ("repetition_penalty", 0),
    ("seed", -3), ("seed", "x"), ("temperature", None), ("temperature", 1e-40), ("temperature", 1000),
])
def test_bad_parameters_are_refused_with_a_message(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value}).validated()


def test_numeric_strings_are_accepted():
    params = SamplingParams(temperature="0.7", top_k="40", seed="3").validated()
    assert (params.temperature, params.top_k, params.seed) == (0.7, 40, 3)


@pytest.mark.parametrize("vocab", [49152, 32000, 50257, 151936, 300])
def test_top_scores_are_the_largest_scores_best_first(vocab):
    """The chunked search (the k largest lie in the k chunks with the largest maxima) gives what
    sorting the whole vocabulary gives, the tail past the last whole chunk and ties included."""
    import numpy as np

    from engine.generation.decoding import top_scores

    rng = np.random.default_rng(vocab)
    for trial in range(200):
        values = rng.standard_normal(vocab).astype(np.float32)
        if trial % 2:
            values = np.round(values * 2) / 2  # many ties
        if trial % 5 == 0:
            values[-1] = 10.0  # the best score in the tail past the last whole chunk of 128
        k = int(rng.integers(1, 21))
        ids, scores = top_scores(torch.from_numpy(values), k)
        expected = np.lexsort((np.arange(vocab), -values))[:k]
        assert scores == values[expected].tolist()
        assert len(set(ids)) == k and [float(values[i]) for i in ids] == scores
        if trial % 2 == 0:  # no ties: the very ids
            assert ids == expected.tolist()


def test_stop_strings_are_found_and_held_back_in_one_place():
    from engine.generation.output import StopTrimmer, find_stop, pending_stop

    assert find_stop("a b STOP c END", ("END", "STOP")) == (4, "STOP")  # the earliest, whichever is listed first
    assert find_stop("abc", ("x",)) is None
    assert pending_stop("hello ST", ("STOP",)) == 2 and pending_stop("hello", ("STOP",)) == 0
    assert pending_stop("xEN", ("END", "ENDING")) == 2
    trimmer = StopTrimmer(("STOP",))
    assert trimmer.add("Hello S") == "Hello "  # "S" might begin STOP: held
    assert trimmer.add("TA") == "STA"  # it didn't
    assert trimmer.add("y ST") == "y "
    assert trimmer.add("OP and more") == ""  # the stop string and what follows never go out
    assert trimmer.final("stop_string", "STOP") == "Hello STAy "


def test_row_totals_are_torchs_argmax_and_logsumexp_and_say_when_a_row_is_not_finite(monkeypatch):
    """Without the int8 kernels (their pass: test_kernels.py): numpy for one row, torch for several."""
    from engine.generation.sampling import row_totals
    from engine.models import kernels

    monkeypatch.setattr(kernels, "loaded", lambda: None)
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 5000, generator=generator) * 10
    scores[1, 17] = scores[1, 4000] = 80.0  # a tie: the first index, as torch.argmax and numpy take it
    scores[2] -= 1e4  # far from zero: the maximum is taken out before exponentiating
    picked, totals, largest = row_totals(scores, top=5)  # several rows (torch's logsumexp) and each alone (numpy's)
    assert picked == torch.argmax(scores, dim=-1).tolist() and picked[1] == 17
    assert totals == pytest.approx(torch.logsumexp(scores.double(), dim=-1).tolist(), rel=1e-6)
    assert largest is None  # the alternatives are searched for per token (decoding.top_scores)
    for i in range(4):
        assert row_totals(scores[i:i + 1]) == ([picked[i]], [pytest.approx(totals[i], rel=1e-6)], None)
    assert row_totals(scores, picks=False) == (None, totals, None)  # no greedy row: no argmax pass
    for bad in (float("nan"), float("inf")):
        broken = scores.clone()
        broken[3, 9] = bad
        _, totals, _ = row_totals(broken)
        assert math.isfinite(totals[0]) and not math.isfinite(totals[3])
        assert not math.isfinite(row_totals(broken[3:])[1][0])
    _, totals, _ = row_totals(torch.full((1, 8), float("-inf")))  # nothing possible: no total
    assert not math.isfinite(totals[0])


def test_seen_tokens_hold_the_prompt_and_every_answer_token_as_they_grow():
    """The ids the repetition penalty reads: the prompt, then each token appended, past the room
    first given (it doubles), as one int64 tensor; the tensor handed out before a token was
    appended still holds what it held."""
    from engine.generation.decoding import SeenTokens

    seen = SeenTokens([5, 6, 7], room=2, device="cpu")
    before = seen.all()
    answer = list(range(100, 111))
    for token in answer:
        seen.append(token)
    assert seen.all().dtype == torch.long and seen.all().tolist() == [5, 6, 7, *answer]
    assert before.tolist() == [5, 6, 7] and seen.last().tolist() == [[110]]
