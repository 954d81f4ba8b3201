"Gradient-norm scores, the score histogram, and the diagnostic pictures."
import math, sys, tracemalloc
import numpy as np, pytest, torch, torch.nn as nn, torch.nn.functional as F
import matplotlib; matplotlib.use('Agg')
import matplotlib.pyplot as plt
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, LabelSmoothingCrossEntropyFlat, MSELossFlat, set_seed, find_bs
import fastai.callback.all   # the `no_bar`, `fit_one_cycle` patches
from loss_filters.core import (per_sample_grad_norm, loss_and_grad_norm, loss_and_score, check_score, per_sample_loss,
                               select_by_loss_share, ScoreHistogram, _plain_ce)
from loss_filters.batch import *
from loss_filters.sampler import StaleLossPruningCallback
from conftest import make_dls, mlp, BatchSpy, col

def autograd_norms(loss_func, pred, *yb):
    "Reference: per-example gradient norms, one backward per example"
    out = []
    for i in range(pred.shape[0]):
        z = pred.detach().clone().requires_grad_()
        l = per_sample_loss(loss_func, z, *yb)[i]
        g, = torch.autograd.grad(l, z)
        out.append(g.norm())
    return torch.stack(out)

# ---------------------------------------------------------------- the closed form
@pytest.mark.parametrize('seed', range(20))
def test_closed_form_equals_autograd_for_cross_entropy(seed):
    g = torch.Generator().manual_seed(seed)
    n, c = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(2, 12, (1,), generator=g))
    z = torch.randn(n, c, generator=g) * float(torch.rand(1, generator=g) * 10)
    y = torch.randint(0, c, (n,), generator=g)
    ref = autograd_norms(F.cross_entropy, z, y)
    for lf in (F.cross_entropy, nn.CrossEntropyLoss(), CrossEntropyLossFlat()):
        assert _plain_ce(lf) is not None                       # the closed form is the route taken
        torch.testing.assert_close(per_sample_grad_norm(lf, z, y), ref, rtol=1e-5, atol=1e-6)

def test_closed_form_is_exactly_softmax_minus_onehot():
    z, y = torch.tensor([[2., 0., -1.]]), torch.tensor([1])
    p = z.softmax(1)[0]
    expected = torch.sqrt(p[0]**2 + (p[1] - 1)**2 + p[2]**2)
    torch.testing.assert_close(per_sample_grad_norm(F.cross_entropy, z, y), expected[None])

def test_byte_targets_take_the_closed_form():
    "cross-entropy accepts uint8 targets; the one-hot of the closed form must too"
    z, y = torch.randn(6, 4), torch.tensor([0, 3, 1, 2, 2, 0])
    torch.testing.assert_close(per_sample_grad_norm(F.cross_entropy, z, y.to(torch.uint8)), per_sample_grad_norm(F.cross_entropy, z, y))

def test_score_is_zero_for_a_confident_correct_example():
    z = torch.tensor([[1000., 0., 0.], [0., 0., 1000.], [1000., 0., 0.]])
    y = torch.tensor([0, 2, 1])
    gn = per_sample_grad_norm(CrossEntropyLossFlat(), z, y)
    assert gn[:2].tolist() == [0., 0.]
    assert gn[2].item() == pytest.approx(math.sqrt(2))          # confidently wrong: the largest possible norm

def test_ignored_targets_score_zero():
    z, y = torch.randn(4, 3), torch.tensor([0, -100, 2, -100])
    gn = per_sample_grad_norm(nn.CrossEntropyLoss(), z, y)
    assert gn[1] == 0 and gn[3] == 0 and (gn[[0, 2]] > 0).all()
    torch.testing.assert_close(gn, autograd_norms(nn.CrossEntropyLoss(), z, y))

@pytest.mark.parametrize('lf', [nn.CrossEntropyLoss(label_smoothing=.1), nn.CrossEntropyLoss(weight=torch.tensor([1., 2., 3.])),
                                LabelSmoothingCrossEntropyFlat()], ids=['smoothing', 'weight', 'fastai-smoothing'])
def test_other_cross_entropies_take_the_autograd_route(lf):
    assert _plain_ce(lf) is None
    z, y = torch.randn(7, 3), torch.randint(0, 3, (7,))
    torch.testing.assert_close(per_sample_grad_norm(lf, z, y), autograd_norms(lf, z, y))
    assert lf.reduction == 'mean' if hasattr(lf, 'reduction') else True

def test_autograd_route_for_regression_and_per_pixel_losses():
    pred, targ = torch.randn(5, 3), torch.randn(5, 3)
    # MSE averaged per example: d/dpred mean((p - t)^2) = 2 (p - t) / 3
    torch.testing.assert_close(per_sample_grad_norm(MSELossFlat(), pred, targ), (2 * (pred - targ) / 3).norm(dim=1))
    seg, sy = torch.randn(2, 4, 3, 3), torch.randint(0, 4, (2, 3, 3))
    torch.testing.assert_close(per_sample_grad_norm(F.cross_entropy, seg, sy), autograd_norms(F.cross_entropy, seg, sy))

def test_tuple_outputs_combine_their_norms():
    a, b, y = torch.randn(4, 3), torch.randn(4, 2), torch.randint(0, 2, (4,))
    def two_heads(pred, y, reduction='mean'):
        return F.cross_entropy(pred[0], y, reduction=reduction) + F.cross_entropy(pred[1], y, reduction=reduction)
    expected = (per_sample_grad_norm(F.cross_entropy, a, y)**2 + per_sample_grad_norm(F.cross_entropy, b, y)**2).sqrt()
    torch.testing.assert_close(per_sample_grad_norm(two_heads, (a, b), y), expected)

def test_grad_norm_works_under_no_grad_and_leaves_no_graph():
    z, y = torch.randn(3, 4), torch.randint(0, 4, (3,))
    with torch.no_grad():
        l, gn = loss_and_grad_norm(nn.CrossEntropyLoss(label_smoothing=.2), z, y)
    assert not l.requires_grad and not gn.requires_grad and gn.shape == (3,)

def test_loss_and_score_and_check_score():
    z, y = torch.randn(6, 4), torch.randint(0, 4, (6,))
    l, s = loss_and_score('loss', F.cross_entropy, z, y)
    assert s is l
    l2, s2 = loss_and_score('grad_norm', F.cross_entropy, z, y)
    torch.testing.assert_close(l2, l); torch.testing.assert_close(s2, per_sample_grad_norm(F.cross_entropy, z, y))
    with pytest.raises(ValueError, match="`score` must be one of 'loss', 'grad_norm', got 'norm'"): check_score('norm')

def test_loss_share_on_grad_norm_scores_uses_their_shares():
    z, y = torch.randn(50, 10) * 3, torch.randint(0, 10, (50,))
    gn = per_sample_grad_norm(F.cross_entropy, z, y)
    idx = select_by_loss_share(gn, .7)
    srt = gn.sort(descending=True).values.double()
    k = int((srt.cumsum(0) < .7 * srt.sum()).sum()) + 1
    assert len(idx) == k and set(idx.tolist()) == set(gn.argsort(descending=True)[:k].tolist())

# ---------------------------------------------------------------- the histogram store
def test_histogram_memory_is_bounded_over_30k_iterations():
    h = ScoreHistogram(rows=64, bins=20)
    x = torch.tensor([1e-3, .1, 10.])
    h.add(x, 0, torch.tensor([2]))
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    for it in range(1, 30_000): h.add(x, it, torch.tensor([2]))
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in snap1.compare_to(snap0, 'filename'))
    assert h.counts.shape == (64, 2, 20) and h.stride == 512             # 30,000 iterations in 59 rows of 512
    assert grown < 100_000                                               # no per-iteration Python objects kept (one small object an iteration: 700 kB or more)
    tensors = [v for v in vars(h).values() if isinstance(v, torch.Tensor)]   # tracemalloc does not see tensor storage
    assert sum(t.numel() for t in tensors) == 64 * 2 * 20 + 21 + 19      # counts, bin edges, inner edges: nothing else
    c, its, edges = h.table()
    assert c[:, 0].sum() == 90_000 and c[:, 1].sum() == 30_000           # nothing lost in the merges
    assert len(c) == math.ceil(30_000 / 512) and its[1] == 512

def test_histogram_matches_a_naive_count_after_merges():
    g = torch.Generator().manual_seed(0)
    h = ScoreHistogram(lo=1e-3, hi=10, bins=8, rows=4)
    rows = {}
    for it in range(0, 37, 3):
        s = torch.rand(16, generator=g) * 20
        s[0] = float('nan')
        kept = torch.randperm(16, generator=g)[:5]
        h.add(s, it, kept)
        rows[it] = (s, kept)
    c, its, edges = h.table()
    assert h.stride == 16 and len(c) == 3
    for r in range(len(c)):
        vals = [(s, k) for it, (s, k) in rows.items() if r * 16 <= it < (r + 1) * 16]
        allv = torch.cat([s for s, _ in vals]); keptv = torch.cat([s[k] for s, k in vals])
        def naive(v):
            v = torch.nan_to_num(v, nan=math.inf).numpy()
            b = np.clip(np.searchsorted(edges[1:-1].numpy(), v, side='left'), 0, 7)
            return np.bincount(b, minlength=8).tolist()
        assert c[r, 0].tolist() == naive(allv) and c[r, 1].tolist() == naive(keptv)

def test_histogram_bad_arguments():
    with pytest.raises(ValueError, match='`lo`'): ScoreHistogram(lo=0)
    with pytest.raises(ValueError, match='`rows`'): ScoreHistogram(rows=3)

# ---------------------------------------------------------------- the callbacks with score='grad_norm'
def learner(dls, **kw): return Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), **kw)

def fit(learn, n=2):
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(n, 1e-2)
    return learn

class ScoreSpy:
    "Keeps what each `select` call ranked, and the gradient norms and losses of that batch computed here"
    def __init__(self, cb): self.calls, self._select, self.cb = [], cb.select, cb; cb.select = self
    def __call__(self, scores):
        learn = self.cb.learn
        with torch.no_grad(): pred = learn.model(*learn.xb)     # the mlp has no dropout or batch norm: same output
        self.calls.append((scores.clone(), per_sample_grad_norm(F.cross_entropy, pred, *learn.yb),
                           per_sample_loss(F.cross_entropy, pred, *learn.yb)))
        return self._select(scores)

@pytest.mark.parametrize('make', [lambda: BatchLossFilterCallback(min_loss_perc=.8, score='grad_norm'),
                                  lambda: SelectiveBackpropCallback(keep=.5, start=0, end=1, interrupt=0, score='grad_norm')],
                         ids=['blf', 'sb'])
def test_filters_rank_by_the_gradient_norm(digits_dls, make):
    set_seed(0)
    learn = learner(digits_dls).add_cb(make())
    spy = ScoreSpy(learn.loss_filter)
    fit(learn, 2)
    assert len(spy.calls) >= len(digits_dls.train)
    for scores, gn, losses in spy.calls:      # what was ranked is the gradient norm at the output, not the loss
        torch.testing.assert_close(scores, gn, rtol=1e-4, atol=1e-6)
        assert not torch.allclose(scores, losses)

def test_grad_norm_scores_share_per_batch_and_loss_share_per_epoch(digits_dls):
    "Each batch's `loss_share` is on the score it ranked; the `loss_perc` column stays the kept share of the loss"
    set_seed(0)
    learn = learner(digits_dls).batch_loss_filter(min_loss_perc=.8, score='grad_norm')
    spy = ScoreSpy(learn.loss_filter)
    fit(learn, 2)
    for (s, _, _), r in zip(spy.calls, learn.loss_filter.stats):
        assert r['loss_share'] == pytest.approx(float(s[select_by_loss_share(s, .8)].sum() / s.sum()), rel=1e-5) and r['loss_share'] >= .8
    kept = sum(float(l[select_by_loss_share(s, .8)].sum()) for s, _, l in spy.calls)
    total = sum(float(l.sum()) for s, _, l in spy.calls)
    assert col(learn, 'loss_perc')[-1] == pytest.approx(kept / total, rel=1e-4)
    # the full-batch loss is still the loss, not the score
    assert learn.loss_filter.epoch_stats[-1]['full_loss'] == pytest.approx(
        np.mean([r['full_loss'] for r in learn.loss_filter.stats]), rel=1e-4)

def test_bad_score_is_refused_in_every_constructor():
    for make in (BatchLossFilterCallback, SelectiveBackpropCallback, StaleLossPruningCallback):
        with pytest.raises(ValueError, match='`score` must be one of'): make(score='gradnorm')

class LastStep(Callback):
    "After the stale callback's `after_loss`: the positions and gradient norms of the step"
    order = 100
    def after_loss(self):
        if not self.training: return
        bs, cb = self.dl.bs, self.learn.loss_filter
        self.idx = cb.epoch_order[self.iter * bs:(self.iter + 1) * bs].clone()
        with torch.no_grad(): self.gn = per_sample_grad_norm(F.cross_entropy, self.learn.pred, *self.learn.yb)

def test_stale_pruning_remembers_gradient_norms(digits_dls):
    set_seed(0)
    spy = LastStep()
    learn = learner(digits_dls, cbs=spy).stale_loss_pruning(prune=.5, score='grad_norm')
    fit(learn, 3)
    cb, n = learn.loss_filter, len(digits_dls.train_ds)
    t = cb.table
    assert t.isfinite().all() and t.min() >= 0 and t.max() <= math.sqrt(2) + 1e-6
    torch.testing.assert_close(t[spy.idx], spy.gn)     # the last step's examples hold their gradient norms
    assert col(learn, 'samp_perc')[1] < 1
    # every trained example was counted once in the histogram (the training loader drops its last partial batch)
    trained = sum(round(e['samp_perc'] * n) // 64 * 64 for e in cb.epoch_stats)
    assert int(cb.hist.table()[0][:, 0].sum()) == trained

# ---------------------------------------------------------------- pictures
def test_plots_before_any_batch_was_filtered(digits_dls):
    cb = BatchLossFilterCallback()
    for f in (cb.plot_kept, cb.plot_loss_share, cb.plot_score_hist, cb.plot_diagnostics): plt.close(f())
    learn = fit(learner(digits_dls).batch_loss_filter(), 1)    # the first epoch is never filtered
    fig = learn.loss_filter.plot_diagnostics()
    assert len(fig.axes) == 5 and len(fig.axes[0].lines[0].get_xdata()) == 0        # kept, share, two heat maps, a colour bar
    plt.close(fig)

def test_each_plot_has_its_axes_and_points(digits_dls):
    learn = fit(learner(digits_dls).batch_loss_filter(min_loss_perc=.8), 3)
    cb, n_b = learn.loss_filter, len(digits_dls.train)
    fig = cb.plot_kept()
    ax = fig.axes[0]
    assert len(fig.axes) == 1 and len(ax.lines[0].get_xdata()) == len(cb.stats) == 2 * n_b
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [b['kept'] / b['bs'] for b in cb.stats])
    assert [l.get_xdata()[0] for l in ax.lines[1:]] == [n_b, 2 * n_b]          # a line where epochs 1 and 2 start
    plt.close(fig)
    fig = cb.plot_loss_share()
    np.testing.assert_allclose(fig.axes[0].lines[0].get_ydata(), [b['loss_share'] for b in cb.stats])
    assert all(.8 <= y <= 1 for y in fig.axes[0].lines[0].get_ydata())
    plt.close(fig)
    fig = cb.plot_score_hist()
    assert len(fig.axes) == 3                                                   # two heat maps and a colour bar
    counts, its, edges = cb.hist.table()
    assert len(its) == 3 * n_b and its[-1] == 3 * n_b - 1                       # a row per iteration (the stride is 1)
    assert counts[:n_b].sum() == 0 and (counts[n_b:, 0].sum(1) == 64).all()     # epoch 0 unfiltered, then 64 per batch
    for ax in fig.axes[:2]: assert ax.collections[0].get_array().size == 3 * n_b * cb.hist_bins
    assert counts[:, 0].sum() == 2 * n_b * 64                                  # every example of the two filtered epochs
    plt.close(fig)
    fig = cb.plot_diagnostics()
    assert len(fig.axes) == 5 and [a.get_title() for a in fig.axes[:2]] == ['Samples kept per batch', 'Kept loss share per batch']
    plt.close(fig)

def test_stale_pruning_diagnostics(digits_dls):
    learn = fit(learner(digits_dls).stale_loss_pruning(), 3)
    fig = learn.loss_filter.plot_score_hist()
    assert fig.axes[0].collections[0].get_array().size == learn.loss_filter.hist.n_rows * learn.loss_filter.hist_bins
    plt.close(fig)
    fig = learn.loss_filter.plot_kept()
    assert len(fig.axes[0].lines[0].get_xdata()) == 3
    plt.close(fig)

# ---------------------------------------------------------------- records made once per epoch equal per-batch ones
def test_histogram_add_many_equals_one_add_per_batch():
    g = torch.Generator().manual_seed(1)
    one, many = ScoreHistogram(lo=1e-3, hi=10, bins=8, rows=4), ScoreHistogram(lo=1e-3, hi=10, bins=8, rows=4)
    batches = [(it, torch.rand(12, generator=g) * 20, torch.randperm(12, generator=g)[:4]) for it in range(0, 50, 3)]
    for it, s, k in batches: one.add(s, it, k)
    for part in (batches[:6], batches[6:]):   # two "epochs", the second forcing merges
        mask = torch.zeros(12 * len(part), dtype=torch.bool)
        for j, (_, _, k) in enumerate(part): mask[k + 12 * j] = True
        many.add_many(torch.cat([s for _, s, _ in part]), torch.tensor([it for it, _, _ in part]).repeat_interleave(12), mask)
    (c1, i1, _), (c2, i2, _) = one.table(), many.table()
    assert torch.equal(c1, c2) and torch.equal(i1, i2) and one.stride == many.stride == 16

class PlainSpy:
    "What `select` is given and returns, with the batch's losses: the per-batch reference for the epoch-end records"
    def __init__(self, cb): self.calls, self._select, self.cb = [], cb.select, cb; cb.select = self
    def __call__(self, scores):
        idxs = self._select(scores)
        self.calls.append((type(scores), type(idxs), scores.clone(), idxs.clone()))
        return idxs

class PlainSteps(Callback):
    "The summed loss of each unfiltered training step, per epoch"
    order = 100
    def before_fit(self): self.sums = {}
    def after_loss(self):
        if self.training and self.learn.loss_filter._plain_step:
            self.sums[self.epoch] = self.sums.get(self.epoch, 0.) + float(self.loss) * find_bs(self.yb)

@pytest.mark.parametrize('make', [lambda: BatchLossFilterCallback(min_loss_perc=.8, skip_epochs=0),
                                  lambda: SelectiveBackpropCallback(keep=.3, start=0, end=1, interrupt=2)], ids=['blf', 'sb'])
def test_records_equal_a_per_batch_recount(digits_dls, make):
    set_seed(0)
    learn = learner(digits_dls).add_cb(make())
    spy, steps = PlainSpy(learn.loss_filter), PlainSteps()
    fit(learn.add_cb(steps), 2)
    cb = learn.loss_filter
    assert all(ts is torch.Tensor and ti is torch.Tensor for ts, ti, _, _ in spy.calls)   # plain tensors, no fastai types
    assert len(cb.stats) == len(spy.calls)
    for r, (_, _, s, k) in zip(cb.stats, spy.calls):
        s64 = s.double()
        assert r['kept'] == len(k) and r['bs'] == len(s) and r['loss_share'] == pytest.approx(float(s64[k].sum() / s64.sum()), rel=1e-9)
    for e in range(2):
        calls = [c for c, r in zip(spy.calls, cb.stats) if r['epoch'] == e]
        kept, total = sum(float(s.double()[k].sum()) for _, _, s, k in calls), sum(float(s.double().sum()) for _, _, s, _ in calls)
        plain = steps.sums.get(e, 0.)                                           # unfiltered steps count in full
        assert cb.epoch_stats[e]['loss_perc'] == pytest.approx((kept + plain) / (total + plain), rel=1e-6)
    ref = ScoreHistogram(*cb.hist_range, bins=cb.hist_bins, rows=cb.hist_rows)
    for r, (_, _, s, k) in zip(cb.stats, spy.calls): ref.add(s, r['iter'], k)
    assert torch.equal(ref.table()[0], cb.hist.table()[0])
