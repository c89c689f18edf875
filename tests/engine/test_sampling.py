"""The sampler: each filter keeps exactly the tokens its rule names; penalties follow llama.cpp."""
from __future__ import annotations

import math

import pytest
import torch

from engine.errors import ConfigError
from engine.sched.sampling import SamplingParams, adjust_logits, choose, distribution, make_generator, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def kept(probs: torch.Tensor) -> list[int]:
    return torch.nonzero(probs > 0).flatten().tolist()


def test_greedy_is_a_one_hot_at_the_argmax():
    probs = distribution(LOGITS, SamplingParams(temperature=0))
    assert probs.tolist() == [1.0, 0, 0, 0, 0, 0]


def test_temperature_one_is_the_softmax():
    assert torch.allclose(distribution(LOGITS, SamplingParams()), torch.softmax(LOGITS, -1))


def test_top_k_keeps_the_k_most_likely():
    assert kept(distribution(LOGITS, SamplingParams(top_k=3))) == [0, 1, 2]


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = torch.softmax(LOGITS, -1)
    # the first two tokens hold less than 0.8 of the mass, the first three more
    assert p[:2].sum() < 0.8 < p[:3].sum()
    probs = distribution(LOGITS, SamplingParams(top_p=0.8))
    assert kept(probs) == [0, 1, 2]
    assert torch.allclose(probs[:3], p[:3] / p[:3].sum())


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    p = torch.softmax(LOGITS, -1)
    probs = distribution(LOGITS, SamplingParams(min_p=0.3))
    assert kept(probs) == [i for i in range(6) if p[i] >= 0.3 * p[0]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    out = adjust_logits(LOGITS, SamplingParams(repetition_penalty=2.0), history=[0, 4])
    assert out[0] == 1.0 and out[4] == -2.0 and out[1] == LOGITS[1]


def test_presence_and_frequency_penalties_subtract_per_occurrence():
    out = adjust_logits(LOGITS, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), history=[1, 1, 1, 2])
    assert out[1] == pytest.approx(1.0 - 0.5 - 3 * 0.25)
    assert out[2] == pytest.approx(0.5 - 0.5 - 0.25)
    assert out[0] == LOGITS[0]


def test_logit_bias_can_force_a_token():
    params = SamplingParams(temperature=0, logit_bias={5: 100.0})
    assert choose(LOGITS, params, [], make_generator(0)) == 5


def test_sampling_follows_the_distribution():
    params = SamplingParams(temperature=1.0, seed=3)
    g = make_generator(3)
    draws = torch.tensor([choose(LOGITS, params, [], g) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=6).float() / 4000
    assert torch.allclose(freq, torch.softmax(LOGITS, -1), atol=0.03)


def test_a_draw_follows_the_distribution_and_never_takes_a_token_without_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])  # mass at the end and gaps between
    g = make_generator(7)
    draws = torch.tensor([sample(probs, g) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=6).float() / 4000
    assert freq[probs == 0].sum() == 0
    assert torch.allclose(freq, probs, atol=0.03)
    assert sample(torch.tensor([0.0, 0.0, 1.0]), g) == 2


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -0.5, "temperature=-0.5: must be a finite number >= 0"),
    ("temperature", math.nan, "temperature=nan: must be a finite number >= 0"),
    ("top_p", 0.0, "top_p=0.0: must be in (0, 1]"),
    ("top_p", 1.5, "top_p=1.5: must be in (0, 1]"),
    ("max_tokens", 0, "max_tokens=0: must be >= 1"),
    ("logprobs", 21, "top_logprobs=21: must be in [0, 20]"),
])
def test_bad_parameters_are_refused_with_field_and_rule(field, value, message):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**{field: value})
    assert str(e.value) == message


EXTREMES = [0.0, 5e-324, 1e-300, 1e-6, 1.0, 1e39, 1.7976931348623157e308]


def _extreme_params() -> list[SamplingParams]:
    """Every numeric sampling field at every extreme value validation admits."""
    out = []
    for v in EXTREMES:
        out += [SamplingParams(temperature=v), SamplingParams(top_p=v) if 0 < v <= 1 else SamplingParams(),
                SamplingParams(min_p=v) if v <= 1 else SamplingParams(), SamplingParams(top_k=min(int(v), 2**62))]
        if v > 0:
            out.append(SamplingParams(repetition_penalty=v))
        for sign in (1, -1):
            out += [SamplingParams(presence_penalty=sign * v), SamplingParams(frequency_penalty=sign * v),
                    SamplingParams(logit_bias={3: sign * v, 1: -sign * v})]
    out.append(SamplingParams(temperature=1e-300, top_p=1e-300, min_p=1.0, repetition_penalty=1e-300,
                              presence_penalty=-1.7e308, frequency_penalty=1.7e308, logit_bias={2: 1e308}))
    return out


@pytest.mark.parametrize("params", _extreme_params(), ids=repr)
def test_sampling_is_total_over_every_value_validation_admits(params):
    history = [0, 1, 1, 4]
    for greedy in (params, SamplingParams(**{**params.__dict__, "temperature": 0})):
        probs = distribution(adjust_logits(LOGITS, greedy, history), greedy)
        assert torch.isfinite(probs).all() and probs.min() >= 0 and float(probs.sum()) == pytest.approx(1.0)
        assert 0 <= choose(LOGITS, greedy, history, make_generator(1)) < len(LOGITS)


def test_extreme_values_have_their_documented_meaning():
    g = make_generator(0)
    assert SamplingParams(temperature=1e-300).greedy
    assert distribution(LOGITS, SamplingParams(top_p=1e-300)).tolist() == [1.0, 0, 0, 0, 0, 0]
    assert choose(LOGITS, SamplingParams(logit_bias={5: 1e39}), [], g) == 5
    assert choose(LOGITS, SamplingParams(temperature=0, logit_bias={0: -1e39}), [], g) == 1
    # a huge repetition penalty takes recent positive logits to 0; a vanishing one favours them
    assert choose(LOGITS, SamplingParams(temperature=0, repetition_penalty=1e308), [0, 1], g) == 2
    assert choose(LOGITS, SamplingParams(temperature=0, repetition_penalty=1e-300), [1, 2], g) == 1
