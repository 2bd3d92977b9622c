"""sampler: greedy is argmax, seeded sampling is reproducible, the knobs do what they say."""

import pytest
import torch

from h2o_chat.chat.conversation import Sampling
from h2o_chat.chat.sampler import NUCLEUS_CANDIDATES, Sampler, nucleus

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


@pytest.mark.slow
@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0])  # flat (the whole vocabulary sorted) to peaked (the candidates)
def test_top_p_keeps_what_sorting_the_whole_vocabulary_keeps(scale):
    # the nucleus from the likeliest candidates equals the one from a full sort, bit for bit, on a
    # real vocabulary's size, whichever way it is found
    def sorted_whole(probs, top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
        return torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(outside, 0))

    g = torch.Generator().manual_seed(int(scale * 10))
    found_among_candidates = 0
    for rows in (1, 3):
        for _ in range(12):
            probs = torch.softmax(torch.randn(rows, 49152, generator=g) * scale, -1)
            for top_p in (0.5, 0.9, 0.999):
                assert torch.equal(nucleus(probs, top_p), sorted_whole(probs, top_p))
                found_among_candidates += int((nucleus(probs, top_p) > 0).sum(-1).max()) < NUCLEUS_CANDIDATES
    assert found_among_candidates > 0 if scale >= 3 else found_among_candidates == 0  # both ways were taken


def test_top_p_with_ties_at_its_edge_keeps_as_many_tokens_of_the_same_probabilities():
    # a bf16 model's probabilities tie often (4% of the embedded model's draws, at the nucleus's
    # edge); which of the tied tokens stays is the sort's choice, there and in a full sort alike
    probs = torch.zeros(1, 49152)
    probs[0, [5, 900, 17, 30000, 44]] = torch.tensor([0.5, 0.3, 0.1, 0.1, 0.0])  # 17 and 30000 tie at 0.9
    kept = nucleus(probs, 0.85)
    assert int((kept > 0).sum()) == 3 and kept[0, 5] == 0.5 and kept[0, 900] == 0.3
    assert kept[0, [17, 30000]].sort().values.tolist() == [0.0, pytest.approx(0.1)]


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


# ---------------------------------------------------------------------------------------------
# What frontends send: each knob changes the distribution as its formula says


def test_frequency_and_presence_penalties_follow_openais_formula():
    """logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty, counting the
    tokens this reply has drawn."""
    sampler = make(temperature=0, frequency_penalty=0.5, presence_penalty=0.25)
    sampler.begin([1, 2, 3], VOCAB)  # the prompt's tokens do not count
    logits = torch.zeros(VOCAB)
    logits[9], logits[8] = 3.0, 2.0
    drawn = [int(sampler.sample(logits)) for _ in range(3)]
    counts = torch.bincount(torch.tensor(drawn), minlength=VOCAB).float()
    expected = logits - counts * 0.5 - (counts > 0) * 0.25
    assert torch.equal(sampler.adjusted(logits[None])[0], expected)
    assert drawn == [9, 9, 8]  # 3.0 -> 2.25 -> 1.75 < 2.0


def test_logit_bias_is_added_and_minus_100_bans_the_token():
    logits = random_logits(1, seed=4)[0]
    best = int(logits.argmax())
    sampler = make(temperature=1.0, top_p=1.0, logit_bias={best: -100, "3": 2.5})
    adjusted = sampler.adjusted(logits[None])[0]
    assert adjusted[3] == logits[3] + 2.5 and adjusted[best] == -float("inf")
    assert all(int(make(temperature=2.0, top_p=1.0, seed=s, logit_bias={best: -100}).sample(logits)) != best
               for s in range(300))
    assert int(make(temperature=0, logit_bias=[[best, -100]]).sample(logits)) == int(logits.topk(2).indices[1])


def test_top_p_0_is_greedy():
    for logits in random_logits(50, seed=5):
        assert int(make(temperature=1.0, top_p=0, seed=1).sample(logits)) == int(make(temperature=0).sample(logits))


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    logits = torch.linspace(-2, 2, VOCAB)
    probs = torch.softmax(logits, 0)
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    drawn = {int(make(temperature=1.0, top_p=1.0, min_p=0.2, seed=s).sample(logits)) for s in range(400)}
    assert drawn == allowed


def test_typical_p_keeps_the_tokens_closest_to_the_expected_surprise():
    logits = random_logits(1, seed=6)[0]
    probs = torch.softmax(logits.double(), 0)
    entropy = -(probs * probs.log()).sum()
    order = (-probs.log() - entropy).abs().argsort()
    kept = order[: int((probs[order].cumsum(0) < 0.6).sum()) + 1]
    drawn = {int(make(temperature=1.0, top_p=1.0, typical_p=0.6, seed=s).sample(logits)) for s in range(400)}
    assert drawn == set(kept.tolist())


def test_logprobs_are_the_log_softmax_and_sum_to_one():
    sampler = Sampler(Sampling(temperature=1.0, top_p=0.9, seed=0, logit_bias={"2": 1.0}), STOP, "cpu",
                      top_logprobs=5)
    logits = random_logits(1, seed=7)[0]
    token = int(sampler.sample(logits))
    full = torch.log_softmax(sampler.adjusted(logits[None])[0].double(), 0)
    assert abs(full.exp().sum().item() - 1) < 1e-9
    row = sampler.logprobs[0].tolist()
    assert int(row[0]) == token and abs(row[1] - full[token].item()) < 1e-6
    top = full.topk(5)
    assert [int(i) for i in row[2:7]] == top.indices.tolist()
    assert torch.allclose(torch.tensor(row[7:12], dtype=torch.float64), top.values, atol=1e-6)


def test_rows_are_independent_draws_and_reproducible():
    logits = random_logits(1, seed=8)[0].expand(3, VOCAB)
    a = make(temperature=1.0, top_p=1.0, seed=9).sample(logits)
    b = make(temperature=1.0, top_p=1.0, seed=9).sample(logits)
    assert a.shape == (3,) and torch.equal(a, b)
    greedy = make(temperature=0).sample(logits)
    assert greedy.tolist() == [int(logits[0].argmax())] * 3
