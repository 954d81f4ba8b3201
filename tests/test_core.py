"Behaviour of `loss_filters.core`: exact small cases, properties over random losses, sampling statistics."
import itertools, math, warnings
import numpy as np, pytest, torch, torch.nn as nn, torch.nn.functional as F
from hypothesis import given, settings, strategies as st, HealthCheck
from loss_filters.core import (per_sample_loss, check_per_sample, select_by_rank, select_by_loss_share,
                               should_select, check_schedule, check_range)

inf, nan = math.inf, math.nan
T = lambda *xs: torch.tensor(xs, dtype=torch.float32)

# ---------------------------------------------------------------- select_by_loss_share: exact cases
def test_loss_share_keeps_smallest_top_prefix():
    # total 10: 4+3 = 7 < 8, 4+3+2 = 9 >= 8
    assert select_by_loss_share(T(1, 4, 0, 3, 2), min_loss_perc=.8).tolist() == [1, 3, 4]
    assert select_by_loss_share(T(1, 4, 0, 3, 2), min_loss_perc=.7).tolist() == [1, 3]   # 7 reaches 7 exactly
    assert select_by_loss_share(T(1, 4, 0, 3, 2), min_loss_perc=1.).tolist() == [1, 3, 4, 0]  # the zero is not needed

def test_loss_share_min_sample_perc_wins_when_larger():
    assert select_by_loss_share(T(1, 4, 0, 3, 2), min_loss_perc=.3, min_sample_perc=.6).tolist() == [1, 3, 4]
    # ceil forgives float noise: 0.1 * 30 is 3.0000000000000004 but means 3
    assert len(select_by_loss_share(torch.zeros(30), min_loss_perc=0., min_sample_perc=.1)) == 3

def test_loss_share_degenerate_inputs():
    assert select_by_loss_share(T(2.5)).tolist() == [0]                      # n = 1
    assert select_by_loss_share(torch.zeros(6)).tolist() == [0]              # all zeros: at least one
    assert select_by_loss_share(torch.zeros(6), min_sample_perc=.5).tolist() == [0, 1, 2]
    assert select_by_loss_share(T(1, 1, 1, 1), min_loss_perc=.5).tolist() == [0, 1]   # ties keep batch order
    assert select_by_loss_share(T(1, nan, 5, inf), min_loss_perc=.1).tolist() == [1, 3, 2]  # non-finite always kept
    assert select_by_loss_share(T(nan, nan)).tolist() == [0, 1]
    assert select_by_loss_share(torch.zeros(0)).tolist() == []
    with pytest.raises(ValueError, match='non-negative'): select_by_loss_share(T(1, -.5, 2))
    with pytest.raises(ValueError, match='non-negative'): select_by_loss_share(T(1, -inf))

@pytest.mark.parametrize('kw,name', [(dict(min_loss_perc=1.5), 'min_loss_perc'), (dict(min_loss_perc=-.1), 'min_loss_perc'),
                                     (dict(min_sample_perc=2), 'min_sample_perc'), (dict(min_loss_perc=nan), 'min_loss_perc')])
def test_loss_share_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=f'`{name}` must be in \\[0, 1\\]'): select_by_loss_share(T(1, 2), **kw)

@pytest.mark.parametrize('bad', [torch.ones(2, 3), torch.tensor([1, 2]), [1., 2.]])
def test_losses_must_be_1d_float_tensor(bad):
    with pytest.raises(ValueError, match='1-D floating point'): select_by_loss_share(bad)
    with pytest.raises(ValueError, match='1-D floating point'): select_by_rank(bad, .5)

# ---------------------------------------------------------------- select_by_rank: exact cases and statistics
def test_rank_sizes_and_keep_one():
    l = torch.rand(10)
    assert select_by_rank(l, 1.).tolist() == list(range(10))
    assert len(select_by_rank(l, .5)) == 5
    assert len(select_by_rank(l, .01)) == 1                      # never empty
    assert len(select_by_rank(torch.rand(100), .29)) == 29       # float noise forgiven: .29*100 = 28.999999999999996
    assert select_by_rank(T(3.), .3).tolist() == [0]
    assert select_by_rank(torch.zeros(0), .5).tolist() == []

@pytest.mark.parametrize('keep', [0, -.1, 1.01, nan])
def test_rank_bad_keep(keep):
    with pytest.raises(ValueError, match='`keep` must be in \\(0, 1\\]'): select_by_rank(T(1, 2), keep)

def test_rank_is_deterministic_under_a_generator():
    l = torch.rand(64)
    a = select_by_rank(l, .3, generator=torch.Generator().manual_seed(7))
    b = select_by_rank(l, .3, generator=torch.Generator().manual_seed(7))
    c = select_by_rank(l, .3, generator=torch.Generator().manual_seed(8))
    assert a.tolist() == b.tolist() and a.tolist() != c.tolist()

def test_rank_accepts_negative_and_nonfinite_losses():
    # ranks need only an order; NaN and inf rank as the hardest, so keep=1/n (weight ~ rank**big) picks them nearly always
    l = T(-3, -1, nan, 0, 2, -inf, 1, 4)
    g = torch.Generator().manual_seed(0)
    picks = [select_by_rank(l, 1/8, generator=g).item() for _ in range(200)]
    assert picks.count(2) > 100

def _chi2_ok(counts, probs, draws):
    "Pearson chi-square test at p = 1e-4 (critical values for the df used here)"
    exp = np.asarray(probs) * draws
    stat = float(((np.asarray(counts) - exp) ** 2 / exp).sum())
    crit = {1: 15.14, 3: 21.11, 7: 29.88, 9: 33.72}[len(probs) - 1]
    return stat < crit, stat

@pytest.mark.parametrize('n,keep', [(2, .5), (4, .25), (8, .125), (10, .1)])
def test_rank_single_draw_follows_rank_weights(n, keep):
    "When one example is kept, P(rank i) must be ((i+.5)/n)**(1/keep-1), normalised"
    losses = torch.arange(n, dtype=torch.float32).flip(0)      # rank i is index n-1-i
    w = ((np.arange(n) + .5) / n) ** (1 / keep - 1); w /= w.sum()
    g, draws = torch.Generator().manual_seed(1), 20000
    idx = torch.stack([select_by_rank(losses, keep, generator=g) for _ in range(draws)]).flatten()
    counts = np.bincount((n - 1 - idx).numpy(), minlength=n)
    ok, stat = _chi2_ok(counts, w, draws)
    assert ok, (stat, counts, w * draws)
    # a wrong exponent is rejected by the same test
    w_wrong = ((np.arange(n) + .5) / n) ** (1 / keep); w_wrong /= w_wrong.sum()
    assert not _chi2_ok(counts, w_wrong, draws)[0]

def _inclusion_probs(w, k):
    "Exact inclusion probabilities of successive weighted sampling without replacement"
    n, p = len(w), np.zeros(len(w))
    for seq in itertools.permutations(range(n), k):
        pr, left = 1., w.sum()
        for i in seq: pr *= w[i] / left; left -= w[i]
        p[list(seq)] += pr
    return p

def test_rank_inclusion_frequencies_match_weighted_sampling_without_replacement():
    n, keep, draws = 8, .5, 20000
    w = (np.arange(n) + .5) / n                                  # keep=.5: exponent 1
    exact = _inclusion_probs(w, 4)
    losses = torch.arange(n, dtype=torch.float32)               # index == rank
    g = torch.Generator().manual_seed(3)
    counts = np.bincount(torch.stack([select_by_rank(losses, keep, generator=g) for _ in range(draws)]).flatten().numpy(), minlength=n)
    freq = counts / draws
    se = np.sqrt(exact * (1 - exact) / draws)
    assert np.all(np.abs(freq - exact) < 5 * se), (freq, exact)
    wrong = _inclusion_probs(w ** 2, 4)                          # exponent 2, as keep=1/3 would give
    assert np.any(np.abs(freq - wrong) > 5 * se)

# ---------------------------------------------------------------- properties over random loss vectors
def _losses(n, seed, p_tie, p_zero, p_inf, p_nan, spread):
    rng = np.random.default_rng(seed)
    l = rng.exponential(1., n) ** spread
    if n > 1: l = np.where(rng.random(n) < p_tie, l[rng.integers(0, n, n)], l)
    l[rng.random(n) < p_zero] = 0.
    l[rng.random(n) < p_inf] = inf
    l[rng.random(n) < p_nan] = nan
    return torch.tensor(l, dtype=torch.float32)

prob = st.sampled_from([0., 0., .05, .3, 1.])
loss_vectors = st.builds(_losses, n=st.one_of(st.integers(1, 16), st.integers(1, 4096)), seed=st.integers(0, 2**32 - 1),
                         p_tie=prob, p_zero=prob, p_inf=st.sampled_from([0., 0., 0., .01, .5]),
                         p_nan=st.sampled_from([0., 0., 0., .01, .5]), spread=st.sampled_from([.1, 1., 4.]))
small_vectors = st.lists(st.one_of(st.floats(0, 1e6, width=32), st.just(0.), st.just(inf), st.just(nan), st.just(1.)),
                         min_size=1, max_size=40).map(lambda xs: torch.tensor(xs, dtype=torch.float32))
def fast(n): return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])

def _reference_share(l, p, s):
    "Direct float64 transcription of the rule, for comparison"
    n = len(l)
    key = np.where(np.isnan(l), inf, l)
    order = sorted(range(n), key=lambda i: (-key[i], i))
    fin = np.array([key[i] if np.isfinite(key[i]) else 0. for i in order], dtype=np.float64)
    cum = np.cumsum(fin)
    k_loss = next(i + 1 for i in range(n) if cum[i] >= p * cum[-1])
    k = max(k_loss, int((~np.isfinite(key)).sum()), math.ceil(round(n * s, 9)), 1)
    return order[:min(k, n)]

@pytest.mark.fastai_neutral
@fast(3000)
@given(l=st.one_of(loss_vectors, small_vectors), p=st.floats(0, 1), s=st.sampled_from([0., 0., .1, .25, .5, 1.]))
def test_property_loss_share_is_smallest_top_prefix(l, p, s):
    idx = select_by_loss_share(l, min_loss_perc=p, min_sample_perc=s).tolist()
    assert idx == _reference_share(l.numpy(), p, s)

@pytest.mark.fastai_neutral
@fast(2500)
@given(l=st.one_of(loss_vectors, small_vectors), p=st.floats(0, 1), s=st.floats(0, 1))
def test_property_loss_share_sizes_and_invariants(l, p, s):
    n = len(l)
    idx = select_by_loss_share(l, min_loss_perc=p, min_sample_perc=s)
    k = len(idx)
    assert 1 <= k <= n and len(set(idx.tolist())) == k and idx.min() >= 0 and idx.max() < n
    assert k >= min(n, math.ceil(round(n * s, 9)))
    key = torch.nan_to_num(l, nan=inf)
    left = torch.ones(n, dtype=torch.bool); left[idx] = False
    kept, dropped = key[idx], key[left]
    if len(dropped): assert kept.min() >= dropped.max()          # kept are the hardest
    assert (~l[idx].isfinite()).sum() == (~l.isfinite()).sum()   # every non-finite loss is kept
    fin = torch.where(key.isfinite(), key, 0.).double()
    assert fin[idx].sum() >= p * fin.sum() - 1e-9 * fin.sum()    # the share is reached

@pytest.mark.fastai_neutral
@fast(2500)
@given(l=st.one_of(loss_vectors, small_vectors), keep=st.floats(1e-3, 1), seed=st.integers(0, 2**31))
def test_property_rank_sizes_distinct_in_range(l, keep, seed):
    n = len(l)
    idx = select_by_rank(l, keep, generator=torch.Generator().manual_seed(seed))
    assert len(idx) == max(1, int(round(keep * n, 9))) if keep < 1 else len(idx) == n
    assert len(set(idx.tolist())) == len(idx) and idx.min() >= 0 and idx.max() < n
    assert idx.tolist() == select_by_rank(l, keep, generator=torch.Generator().manual_seed(seed)).tolist()

@pytest.mark.fastai_neutral
@fast(2000)
@given(pct=st.floats(0, 1, exclude_max=True), b=st.integers(0, 10000), start=st.floats(0, 1), end=st.floats(0, 1),
       interrupt=st.integers(0, 7))
def test_property_should_select_truth_table(pct, b, start, end, interrupt):
    expected = (start <= pct < end) and (interrupt == 0 or (b + 1) % interrupt != 0)
    assert should_select(pct, b, start, end, interrupt) is expected

def test_should_select_truth_table_by_hand():
    rows = [  # pct, batch, start, end, interrupt, expected
        (.49, 0, .5, .9, 2, False), (.5, 0, .5, .9, 2, True), (.5, 1, .5, .9, 2, False), (.5, 2, .5, .9, 2, True),
        (.89, 0, .5, .9, 2, True), (.9, 0, .5, .9, 2, False), (.6, 1, .5, .9, 0, True), (.6, 2, .5, .9, 3, False),
        (.6, 1, .5, .9, 3, True), (.0, 0, 0., 1., 1, False), (.0, 0, 0., 1., 0, True), (.3, 0, .3, .3, 0, False)]
    for pct, b, s, e, i, exp in rows: assert should_select(pct, b, s, e, i) is exp, (pct, b, s, e, i)

@pytest.mark.parametrize('args,err,msg', [((-.1, .9, 2), ValueError, '`start`'), ((.5, 1.2, 2), ValueError, '`end`'),
                                          ((.9, .5, 2), ValueError, '`start` must be <= `end`'), ((.5, .9, -1), ValueError, '`interrupt`'),
                                          ((.5, .9, 1.5), TypeError, '`interrupt` must be an integer'),
                                          ((.5, .9, True), TypeError, '`interrupt` must be an integer'),
                                          (('.5', .9, 2), TypeError, '`start` must be a real number')])
def test_check_schedule(args, err, msg):
    with pytest.raises(err, match=msg): check_schedule(*args)

# ---------------------------------------------------------------- per_sample_loss
@pytest.fixture
def batch():
    torch.manual_seed(0)
    return torch.randn(5, 3), torch.randint(0, 3, (5,))

def test_per_sample_loss_torch_forms(batch):
    pred, y = batch
    exp = F.cross_entropy(pred, y, reduction='none')
    lf = nn.CrossEntropyLoss()
    assert torch.allclose(per_sample_loss(lf, pred, y), exp) and lf.reduction == 'mean'
    assert torch.allclose(per_sample_loss(F.cross_entropy, pred, y), exp)
    s = nn.CrossEntropyLoss(reduction='sum')
    assert torch.allclose(per_sample_loss(s, pred, y), exp) and s.reduction == 'sum'

def test_per_sample_loss_fastai_flat_losses(batch):
    from fastai.losses import CrossEntropyLossFlat
    pred, y = batch
    lf = CrossEntropyLossFlat()
    assert torch.allclose(per_sample_loss(lf, pred, y), F.cross_entropy(pred, y, reduction='none'))
    assert lf.reduction == 'mean'
    seq_pred, seq_y = torch.randn(4, 7, 3), torch.randint(0, 3, (4, 7))   # a loss per token, flattened by fastai
    exp = F.cross_entropy(seq_pred.reshape(-1, 3), seq_y.reshape(-1), reduction='none').view(4, 7).mean(1)
    assert torch.allclose(per_sample_loss(lf, seq_pred, seq_y), exp)

def test_per_sample_loss_averages_extra_dims():
    p, y = torch.randn(2, 3), torch.randn(2, 3)
    assert torch.allclose(per_sample_loss(nn.MSELoss(), p, y), ((p - y) ** 2).mean(1))

def test_loss_without_reduction_is_a_type_error(batch):
    def mean_ce(pred, y): return F.cross_entropy(pred, y)
    with pytest.raises(TypeError, match='`mean_ce` cannot give per-example losses'): per_sample_loss(mean_ce, *batch)
    with pytest.raises(TypeError, match='`mean_ce`'): check_per_sample(mean_ce)
    def lying(pred, y, reduction='mean'): return F.cross_entropy(pred, y)   # accepts the keyword but ignores it
    with pytest.raises(TypeError, match="`lying` returned shape \\(\\) with reduction='none'"): per_sample_loss(lying, *batch)
    with pytest.raises(TypeError, match='callable'): check_per_sample(3)

def test_reduction_restored_after_exception(batch):
    class Exploding(nn.CrossEntropyLoss):
        def forward(self, pred, y):
            assert self.reduction == 'none'
            raise RuntimeError('boom')
    lf = Exploding(reduction='sum')
    with pytest.raises(RuntimeError, match='boom'): per_sample_loss(lf, *batch)
    assert lf.reduction == 'sum'
    from fastai.losses import CrossEntropyLossFlat
    flat = CrossEntropyLossFlat()
    with pytest.raises(Exception): per_sample_loss(flat, torch.randn(5, 3), torch.randint(0, 3, (4,)))   # shape mismatch inside
    assert flat.reduction == 'mean'

def test_core_imports_no_fastai():
    import subprocess, sys
    code = "import sys, loss_filters.core; assert not any(m.startswith('fastai') for m in sys.modules), 'fastai imported'"
    subprocess.run([sys.executable, '-c', code], check=True)

def test_selection_stays_on_the_input_device():
    l = torch.rand(16)
    assert select_by_rank(l, .5).device == l.device and select_by_loss_share(l).device == l.device
