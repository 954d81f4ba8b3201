"Each kind of filter's diagnostics show what it did: the data each panel plots, checked against the records."
import matplotlib; matplotlib.use('Agg')
import matplotlib.pyplot as plt
import math, warnings
import numpy as np, pytest, torch, torch.nn as nn
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, set_seed, find_bs
import fastai.callback.all   # `no_bar`, `fit_one_cycle`
from loss_filters.batch import BatchLossFilterCallback
from loss_filters.sampler import StaleLossPruningCallback, HideLearnedCallback
from loss_filters.controls import RandomPruningCallback
from conftest import make_dls, mlp

class Trained(Callback):
    "The examples each epoch trained on"
    order = 100
    def before_fit(self): self.n = {}
    def after_loss(self):
        if self.training: self.n[self.epoch] = self.n.get(self.epoch, 0) + find_bs(self.yb)

@pytest.mark.parametrize('make', [lambda: StaleLossPruningCallback(prune=.5, anneal=.25),
                                  lambda: RandomPruningCallback(keep=.6, anneal=.25, lr_scale=True),
                                  lambda: HideLearnedCallback(max_hide=.3, confidence=.5, anneal=.25)], ids=['stale', 'random', 'hide'])
def test_sampler_pruner_panels(digits, make):
    set_seed(0)
    dls = make_dls(*digits, bs=64, drop_last=False)          # epoch 0 trains every example: every stale score is known
    cb, spy = make(), Trained()
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=[cb, spy])
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(4, 1e-2)
    n = len(dls.train_ds)
    fig = cb.plot_diagnostics()
    share, hist, lr = fig.axes
    line = share.lines[0]
    assert list(line.get_xdata()) == [0, 1, 2, 3] and list(line.get_ydata()) == [e['samp_perc'] for e in cb.epoch_stats]
    assert all(float(t).is_integer() for t in share.get_xticks())                     # whole epochs on the axis
    pruned = [e for e in (1, 2) if spy.n[e] < n]
    assert pruned and [r['epoch'] for r in cb.prune_hist] == pruned
    kept, left = (s.get_data().values for s in hist.patches)
    assert kept.sum() == sum(spy.n[e] for e in pruned)                              # what the pruned epochs trained
    assert left.sum() == sum(n - spy.n[e] for e in pruned) > 0                      # and what they left out
    assert len(kept) == len(left) == cb.hist_bins
    used, sched = lr.lines[1], lr.lines[0]
    assert list(used.get_ydata()) == [u for _, u, _ in cb.lr_stats] and list(sched.get_ydata()) == [s for _, _, s in cb.lr_stats]
    assert list(used.get_xdata()) == list(range(len(cb.lr_stats))) and len(cb.lr_stats) == learn.train_iter   # every step
    plt.close(fig)

def test_stale_left_out_scores_sit_low(digits):
    "InfoBatch's rule leaves out only examples whose stale loss was below the mean"
    set_seed(0)
    cb = StaleLossPruningCallback(prune=.7, anneal=0.)
    learn = Learner(make_dls(*digits, bs=64, drop_last=False), mlp(), loss_func=CrossEntropyLossFlat(), cbs=cb)
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
    (row,) = cb.prune_hist
    top = lambda c: int(torch.nonzero(c).max())
    assert top(row['left_out']) < top(row['kept'])                                  # the hardest examples are all kept

def test_batch_filter_diagnostics(digits_dls):
    set_seed(0)
    cb = BatchLossFilterCallback(skip_epochs=0)
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=cb)
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
    fig = cb.plot_diagnostics()
    kept, share, hist_all, hist_cut = fig.axes[:4]
    assert len(kept.lines[0].get_xdata()) == len(cb.stats) == 2 * len(digits_dls.train)
    assert list(kept.lines[0].get_ydata()) == [b['kept'] / b['bs'] for b in cb.stats]
    assert list(share.lines[0].get_ydata()) == [b['loss_share'] for b in cb.stats]
    assert hist_all.get_yscale() == 'log' and 'cut' in hist_cut.get_title()
    plt.close(fig)

def test_sampler_diagnostics_before_any_fit():
    fig = StaleLossPruningCallback().plot_diagnostics()
    assert len(fig.axes) == 3 and all(s.get_data().values.sum() == 0 for s in fig.axes[1].patches)
    plt.close(fig)

def test_the_diagnostics_rows_share_the_fits_start(digits):
    "An unfiltered first epoch shows as empty on the per-batch panels, as on the histograms below them, not cut off"
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=64), mlp(), loss_func=CrossEntropyLossFlat()).batch_loss_filter(min_loss_perc=.9)
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
    fig = learn.loss_filter.plot_diagnostics()
    assert [ax.get_xlim()[0] for ax in fig.axes[:2]] == [0, 0] and min(b['iter'] for b in learn.loss_filter.stats) > 0
    plt.close(fig)

# ------------------------------------------------------------------ bins that follow the data
from loss_filters.base import DataRangeHistogram
from loss_filters.core import ScoreHistogram
from fastai.basics import MSELossFlat

def test_data_range_histogram_moves_counts_exactly_as_it_widens():
    "Whatever order the scores come in, the counts are those of a fixed histogram on the final bins; the bins span every positive score"
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        bins = int(torch.randint(2, 70, (1,), generator=g))
        h, batches = DataRangeHistogram(bins, rows=4), []
        for it in range(0, 40, 3):                                        # 14 batches, merged in rows of several iterations
            s = 10 ** (float(torch.rand(1, generator=g)) * 8 - 4 + torch.randn(16, generator=g))
            if trial % 2: s[:2], s[2] = 0., math.nan                      # zeros and NaN go to the end bins
            k = torch.rand(16, generator=g) < .5
            batches.append((s, it, k)); h.add_many(s, torch.full((16,), it), k)
        ref = ScoreHistogram(h.lo, h.hi, bins=bins, rows=4)
        for s, it, k in batches: ref.add_many(s, torch.full((16,), it), k)
        assert torch.equal(h.table()[0], ref.table()[0])
        pos = torch.cat([s for s, _, _ in batches]); pos = pos[pos.isfinite() & (pos > 0)]
        lo, hi = h.occupied()
        assert h.edges[0] <= lo <= pos.min() and pos.max() <= hi <= h.edges[-1]
        assert h.outside() == ((28, 14) if trial % 2 else (0, 0))

def test_the_bins_stay_narrow_around_the_data():
    h = DataRangeHistogram(64)
    h.add(torch.tensor([1200., 2500., 4000., 9000.]), 0)                  # an MSE in the thousands
    counts, _, edges = h.table()
    assert (counts[0, 0] > 0).sum() == 4 and edges[0] <= 1200 and 9000 <= edges[-1] < 1e5
    for it, c in enumerate(torch.linspace(0, -3, 30)): h.add(10 ** (c + torch.rand(8)), it + 1)   # losses falling three decades
    assert math.log10(h.hi / h.lo) <= 8                                    # not the 16+ decades a doubling on every move would give
    with pytest.raises(ValueError, match='`bins`'): DataRangeHistogram(1)

def regression(n=512, scale=60.):
    "Targets whose MSE starts in the thousands"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = scale * (x[:, :3].sum(1, keepdim=True) + torch.randn(n, 1, generator=g))
    return make_dls(x, y, bs=64)

def _scores(cb):
    "Wrap the filter's `select`: the scores of every filtered batch"
    seen, select = [], cb.select
    def spy(scores): seen.append(scores.clone()); return select(scores)
    cb.select = spy
    return seen

def test_batch_filter_histograms_follow_losses_in_the_thousands():
    set_seed(0)
    learn = Learner(regression(), nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), loss_func=MSELossFlat())
    cb = BatchLossFilterCallback(skip_epochs=0)
    learn.add_cb(cb)
    seen = _scores(cb)
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-3)
    s = torch.cat(seen); pos = s[s > 0]
    assert s.max() > 1000                                                   # the losses run into the thousands
    counts, _, edges = cb.hist.table()
    assert (counts[:, 0].sum(0) > 0).sum() > 10                             # not piled into one bin
    assert edges[0] <= pos.min() and pos.max() <= edges[-1]                # the bins span the data
    assert tuple(cb.hist_range) == (cb.hist.lo, cb.hist.hi)
    fig = cb.plot_diagnostics()
    lo, hi = fig.axes[2].get_ylim()
    r = float(edges[1] / edges[0])                                          # one bin, as a ratio
    assert pos.min() / r <= lo <= pos.min() and pos.max() <= hi <= pos.max() * r   # the heat maps' axis spans the data, to a bin
    plt.close(fig)

def test_pruner_histogram_follows_stale_losses_in_the_thousands():
    set_seed(0)
    learn = Learner(regression(), nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), loss_func=MSELossFlat())
    cb = StaleLossPruningCallback(prune=.5, anneal=0.)
    learn.add_cb(cb)
    tables = []
    class Table(Callback):
        order = 100
        def before_train(self): tables.append(cb.table.clone())           # the stale losses each epoch decides on
    with learn.no_bar(), learn.no_logging(): learn.fit(3, 1e-3, cbs=Table())
    t = torch.cat(tables[1:]); t = t[t.isfinite() & (t > 0)]
    assert t.max() > 1000
    kept, left = (sum(r[k] for r in cb.prune_hist) for k in ('kept', 'left_out'))
    assert ((kept + left) > 0).sum() > 10 and left.sum() > 0
    edges = cb.prune_scores.edges
    assert edges[0] <= t.min() and t.max() <= edges[-1]
    fig = cb.plot_diagnostics()
    assert np.allclose(fig.axes[1].patches[0].get_data().edges, edges.numpy())
    lo, hi = fig.axes[1].get_xlim()
    r = float(edges[1] / edges[0])
    assert t.min() / r <= lo <= t.min() and t.max() <= hi <= t.max() * r
    plt.close(fig)

# ------------------------------------------------------------------ what the titles say
def _proxy(): return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

def test_a_proxys_diagnostics_say_the_losses_are_the_proxys(digits):
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=64), mlp(), loss_func=CrossEntropyLossFlat()).batch_loss_filter(skip_epochs=0, score_model=_proxy())
    with pytest.warns(UserWarning, match=r"`full_train_loss` is NaN from epoch 0: a proxy \(`score_model=`\)"), learn.no_bar(), learn.no_logging():
        learn.fit(2, 1e-2)
    assert math.isnan(learn.loss_filter.epoch_stats[-1]['full_loss'])
    fig = learn.loss_filter.plot_diagnostics()
    share, hist_all, hist_cut = fig.axes[1:4]
    assert share.get_title() == "Kept proxy's loss share per batch" and "proxy's loss" in share.get_ylabel()
    assert all(ax.get_title().startswith("proxy's loss:") for ax in (hist_all, hist_cut)) and "proxy's loss" in hist_all.get_ylabel()
    assert "losses are the proxy's" in fig._suptitle.get_text() and 'last fit' not in fig._suptitle.get_text()
    plt.close(fig)
    with warnings.catch_warnings(record=True) as ws:                        # said once per filter
        warnings.simplefilter('always')
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    assert not [w for w in ws if 'full_train_loss' in str(w.message)]

@pytest.mark.parametrize('patch', ['batch_loss_filter', 'stale_loss_pruning'])
def test_a_second_fit_says_the_diagnostics_hold_the_last_fit_only(digits, patch):
    set_seed(0)
    learn = getattr(Learner(make_dls(*digits, bs=64), mlp(), loss_func=CrossEntropyLossFlat()), patch)()
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
    fig = learn.loss_filter.plot_diagnostics()
    assert fig._suptitle.get_text() == type(learn.loss_filter).__name__    # a model's own losses, one fit: nothing to say
    plt.close(fig)
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
    fig = learn.loss_filter.plot_diagnostics()
    assert 'last fit only (of 2)' in fig._suptitle.get_text()
    plt.close(fig)

# ------------------------------------------------------------------ a loader with no batch
@pytest.mark.parametrize('patch', ['batch_loss_filter', 'selective_backprop', 'stale_loss_pruning'])
def test_a_loader_with_no_batch_says_so(patch):
    x, y = torch.randn(14, 64), torch.randint(0, 10, (14,))
    learn = getattr(Learner(make_dls(x, y, bs=64, drop_last=True), mlp(), loss_func=CrossEntropyLossFlat()), patch)()
    assert len(learn.dls.train) == 0
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
    msgs = [str(w.message) for w in ws if 'will not act' in str(w.message)]
    assert len(msgs) == 1 and 'its training loader has no batch (10 item(s) at `bs=64` with `drop_last=True`)' in msgs[0]
    assert 'window' not in msgs[0] and 'drop_last=False' in msgs[0]
