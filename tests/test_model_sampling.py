"""glm53.runtime.sampling: request validation, the filters, and randomness keyed by (seed, position) only."""
from __future__ import annotations

import math

import pytest
import torch

from glm53.runtime.errors import SamplingError
from glm53.runtime.sampling import SamplingParams, filtered_logprobs, sample


@pytest.mark.parametrize("field, value, message", [
    ("temperature", "hot", "'temperature' must be a number"),
    ("temperature", -0.5, "'temperature' is -0.5"),
    ("top_p", 0.0, "'top_p' is 0.0; it must lie in (0.0, 1.0]"),
    ("top_k", 2.5, "'top_k' must be an integer"),
    ("min_p", 1.5, "'min_p' is 1.5"),
    ("seed", "7", "'seed' must be an integer"),
    ("draft", "no", "'draft' must be true or false"),
])
def test_from_request_names_the_bad_field(field: str, value: object, message: str) -> None:
    with pytest.raises(SamplingError) as err:
        SamplingParams.from_request({field: value})
    assert message in str(err.value)


def test_from_request_reads_openai_fields_and_ignores_others() -> None:
    p = SamplingParams.from_request({"temperature": 1, "top_p": 0.9, "top_k": 40, "seed": 5, "draft": False,
                                     "ignore_eos": True, "messages": [], "min_p": None})
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.draft, p.ignore_eos, p.min_p) == (1.0, 0.9, 40, 5, False, True, 0.0)
    assert SamplingParams.from_request({}).greedy


def test_filters_keep_what_they_promise() -> None:
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04]))
    kept = lambda **kw: torch.isfinite(filtered_logprobs(logits, SamplingParams(temperature=1.0, seed=0, **kw))).tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.7) == [True, True, False, False, False]  # 0.5 < 0.7 <= 0.75
    assert kept(top_p=0.75) == [True, True, False, False, False]
    assert kept(top_p=0.76) == [True, True, True, False, False]
    assert kept(min_p=0.29) == [True, True, True, False, False]  # >= 0.29 * 0.5
    assert kept(min_p=0.31) == [True, True, False, False, False]
    assert kept(top_p=1e-9) == [True, False, False, False, False]  # never empty


def test_randomness_depends_on_seed_and_position_only() -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=42)
    picks = [sample(logits, p, pos) for pos in range(50)]
    assert picks == [sample(logits.clone(), p, pos) for pos in range(50)]  # same key, same token
    assert len(set(picks)) > 10  # positions draw different noise
    assert picks != [sample(logits, SamplingParams(temperature=1.0, seed=43), pos) for pos in range(50)]
    assert sample(logits.to(torch.bfloat16).float(), p, 3) == sample(logits.to(torch.bfloat16).float(), p, 3)


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0])
    counts = torch.bincount(torch.tensor([sample(logits, SamplingParams(temperature=1.0, seed=1), i)
                                          for i in range(3000)]), minlength=3)
    expected = torch.softmax(logits, 0) * 3000
    assert ((counts - expected).abs() < 4 * expected.sqrt() + 5).all()  # within ~4 sigma
    assert sample(logits, SamplingParams(), 0) == 2  # greedy


def test_unseeded_sampling_gets_one_seed_per_request() -> None:
    p = SamplingParams(temperature=0.8)
    with pytest.raises(SamplingError, match="needs a seed"):
        sample(torch.zeros(4), p, 0)
    seeded = p.with_seed()
    assert isinstance(seeded.seed, int) and 0 <= seeded.seed < 2 ** 63 and seeded.with_seed() is seeded
    assert SamplingParams().with_seed().seed is None  # greedy needs none
    assert not math.isnan(seeded.temperature)
