"Each kind of filter's diagnostics show what it did: the data each panel plots, checked against the records."
import matplotlib; matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np, pytest, torch
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
