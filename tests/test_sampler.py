"""sampler: greedy is argmax, seeded sampling is reproducible, the knobs do what they say."""

import pytest
import torch

from h2o_chat.chat.conversation import Sampling
from h2o_chat.chat.sampler import Sampler

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 50
STOP = {7, 11}


def make(**sampling):
    return Sampler(Sampling(**sampling), STOP, "cpu")


def random_logits(n, seed=0):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    sampler = make(temperature=0)
    for logits in random_logits(200):
        token = sampler.sample(logits)
        assert token.shape == () and token.device == logits.device  # a tensor on the device: no host sync
        assert int(token) == int(logits.argmax())


def test_greedy_with_the_stop_tokens_banned_is_the_best_other_token():
    sampler = make(temperature=0)
    for logits in random_logits(100, seed=1):
        logits[7] = 100.0  # a stop token is the best
        allowed = logits.clone()
        allowed[list(STOP)] = -float("inf")
        assert int(sampler.sample(logits, ban_stop=True)) == int(allowed.argmax())
        assert int(sampler.sample(logits)) == 7
        assert logits[7] == 100.0  # the caller's logits are not changed


def test_top_k_1_and_a_tiny_top_p_are_greedy():
    for sampler in (make(temperature=1.0, top_k=1, top_p=1.0, seed=0), make(temperature=1.0, top_p=1e-6, seed=0)):
        for logits in random_logits(100, seed=2):
            assert int(sampler.sample(logits)) == int(logits.argmax())


def draws(sampler, n=200):
    logits = random_logits(1, seed=3)[0] / 3
    return [int(sampler.sample(logits)) for _ in range(n)]


def test_seeded_sampling_is_reproducible():
    a = draws(make(temperature=1.0, top_p=0.9, top_k=20, seed=123))
    b = draws(make(temperature=1.0, top_p=0.9, top_k=20, seed=123))
    c = draws(make(temperature=1.0, top_p=0.9, top_k=20, seed=124))
    assert a == b and a != c and len(set(a)) > 5


def test_sampling_follows_the_softmax():
    logits = torch.linspace(-2, 2, VOCAB)
    sampler = make(temperature=1.0, top_p=1.0, top_k=0, seed=0)
    n = 20_000
    counts = torch.bincount(torch.stack([sampler.sample(logits) for _ in range(n)]), minlength=VOCAB).double()
    expected = torch.softmax(logits.double(), 0) * n
    assert ((counts - expected).abs() <= 5 * expected.sqrt() + 5).all()


def test_top_k_and_top_p_never_draw_outside_their_set():
    logits = torch.linspace(-2, 2, VOCAB)
    top5 = set(logits.topk(5).indices.tolist())
    assert set(draws(make(temperature=2.0, top_k=5, seed=0), 500)) <= set(range(VOCAB))
    assert {int(make(temperature=2.0, top_k=5, seed=s).sample(logits)) for s in range(300)} <= top5
    probs = torch.softmax(logits, 0)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())
    assert {int(make(temperature=1.0, top_p=0.5, seed=s).sample(logits)) for s in range(300)} == nucleus


@pytest.mark.parametrize("penalty", [1.5, 3.0])
def test_repetition_penalty_steers_greedy_away_from_seen_tokens(penalty):
    logits = torch.zeros(VOCAB)
    logits[3], logits[4] = 2.0, 1.9
    sampler = make(temperature=0, repetition_penalty=penalty)
    sampler.begin([3], VOCAB)
    assert int(sampler.sample(logits)) == 4  # 3 was seen: 2.0 / penalty < 1.9
    logits[5] = 1.8
    assert int(sampler.sample(logits)) == 5  # and 4 now was drawn, so it is seen too
    plain = make(temperature=0)
    plain.begin([3], VOCAB)
    assert int(plain.sample(logits)) == 3
