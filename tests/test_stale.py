"Stale-loss pruning: the pure pruning rule, and the callback on real Learners with losses the test controls."
import math, warnings
import numpy as np, pytest, torch, torch.nn as nn, torch.nn.functional as F
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, accuracy, set_seed
from fastai.callback.all import MixUp
from loss_filters.core import prune_by_stale_loss
from loss_filters.sampler import StaleLossPruningCallback, HideLearnedCallback, RandomPruningCallback, anneals
from loss_filters.batch import BatchLossFilterCallback
from conftest import make_dls, mlp

nan = math.nan

# ------------------------------------------------------------------ the rule
def test_prune_counts_only_below_mean_and_weights_the_rest():
    l = torch.tensor([.1, .2, .3, .4, 5., 6., nan, .05])      # mean of known = 1.72; 5 below it
    keep, w = prune_by_stale_loss(l, .5, generator=torch.Generator().manual_seed(1))
    low = (l < 1.72)
    assert int((~keep).sum()) == 2                               # floor(.5 * 5)
    assert not (~keep & ~low).any()                              # never prunes hard or unknown examples
    assert torch.equal(w, torch.where(low & keep, 2., 1.))
    keep0, w0 = prune_by_stale_loss(l, 0.)
    assert keep0.all() and (w0 == 1).all()
    keep_u, _ = prune_by_stale_loss(torch.full((5,), nan), .5)
    assert keep_u.all()

def test_pruned_examples_are_uniform_over_the_below_mean_ones():
    l = torch.tensor([.1, .2, .3, .4, .5, .6, 9., 9.])          # 6 below the mean, floor(.5*6) = 3 pruned per draw
    g, draws = torch.Generator().manual_seed(0), 6000
    counts = np.zeros(8)
    for _ in range(draws): counts += (~prune_by_stale_loss(l, .5, generator=g)[0]).numpy()
    assert counts[6] == counts[7] == 0
    exp = draws * 3 / 6
    stat = ((counts[:6] - exp) ** 2 / exp).sum()
    assert stat < 20.5                                           # chi-square, 5 df, p = .001
    assert not ((counts[:6] - draws * .25) ** 2 / (draws * .25)).sum() < 20.5   # a wrong rate is rejected

@pytest.mark.parametrize('kw,name', [(dict(prune=1.), 'prune'), (dict(prune=-.1), 'prune'), (dict(anneal=1.5), 'anneal')])
def test_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=f'`{name}`'): StaleLossPruningCallback(**kw)

# ------------------------------------------------------------------ the callback, with fixed losses
class FixedLogits(nn.Module):
    "Logits are all input columns but the last, which is the example's id; nothing to learn at lr=0"
    def __init__(self): super().__init__(); self.w = nn.Parameter(torch.zeros(1))
    def forward(self, x): return x[:, :-1] + 0 * self.w

class Steps(Callback):
    "Ids, per-example losses and loss_grad of every training step"
    order = 100
    def before_fit(self): self.steps = []
    def after_loss(self):
        if self.training:
            self.steps.append((self.epoch, self.xb[0][:, -1].long().clone(), float(self.loss_grad), float(self.loss)))

def fixed_learner(n=256, bs=32, **kw):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, 4, generator=g) * 3
    x = torch.cat([logits, torch.arange(n, dtype=torch.float32)[:, None]], 1)
    y = torch.randint(0, 4, (n,), generator=g)
    dls = make_dls(x, y, bs=bs, valid_pct=.25)
    learn = Learner(dls, FixedLogits(), loss_func=CrossEntropyLossFlat(), lr=0., **kw)
    losses = F.cross_entropy(logits, y, reduction='none')
    return learn, losses

def _fit(learn, n, lr=0., one_cycle=False):
    with learn.no_bar(), learn.no_logging(): (learn.fit_one_cycle if one_cycle else learn.fit)(n, lr)

def test_full_data_first_and_in_the_annealing_tail_pruned_between():
    learn, losses = fixed_learner()
    cb = StaleLossPruningCallback(prune=.5, anneal=.25)
    steps = Steps()
    learn.add_cbs([cb, steps])
    _fit(learn, 8)
    train_pos = torch.tensor(sorted(learn.dls.train_ds[i][0][-1].long().item() for i in range(len(learn.dls.train_ds))))
    n = len(train_pos)
    l = losses[train_pos]
    n_low = int((l < l.mean()).sum())
    samp = [e['samp_perc'] for e in cb.epoch_stats]
    assert samp[0] == 1. and samp[6] == samp[7] == 1.            # epochs 6, 7 >= 8 * (1 - .25)
    for s in samp[1:6]: assert s == (n - n_low // 2) // 32 * 32 / (n // 32 * 32)   # what trained, over a plain epoch
    ids_of = lambda ep: torch.cat([s[1] for s in steps.steps if s[0] == ep]).tolist()
    low = {int(p) for p, v in zip(train_pos, l) if v < l.mean()}
    tail = (n - n_low // 2) % 32                                 # drop_last leaves the end of the kept order out
    for ep in range(1, 6):
        trained = ids_of(ep)
        assert len(trained) == len(set(trained))                 # nobody twice
        left_out = set(train_pos.tolist()) - set(trained)
        assert len(left_out) == n_low // 2 + tail
        assert len(left_out & low) >= n_low // 2 and len(left_out - low) <= tail   # the pruned are all below the mean
    for ep in (0, 6, 7): assert len(ids_of(ep)) == n                          # full data

@pytest.mark.parametrize('n_epoch,anneal,full', [(5, .125, [0]), (5, .2, [0, 4]), (7, .125, [0]), (8, .125, [0, 7]), (10, .3, [0, 7, 8, 9]), (9, 1/3, [0, 6, 7, 8])])
def test_an_epoch_anneals_when_it_starts_in_the_last_anneal_share(n_epoch, anneal, full):
    "The InfoBatch rule: epoch e uses all data when e >= (1 - anneal) * n_epoch, so the default anneals nothing in a fit under 8 epochs"
    learn, _ = fixed_learner()
    cb = StaleLossPruningCallback(prune=.5, anneal=anneal)
    learn.add_cb(cb)
    _fit(learn, n_epoch)
    assert [e for e, s in enumerate(cb.epoch_stats) if s['samp_perc'] == 1.] == full
    assert all(s['samp_perc'] < .9 for e, s in enumerate(cb.epoch_stats) if e not in full)

def test_anneal_k_over_n_anneals_exactly_k_epochs():
    "No rounding surprise: n_epoch * (1 - k/n_epoch) is often a hair above n_epoch - k in floating point"
    for n in range(1, 201):
        for k in range(n + 1):
            assert [e for e in range(n) if anneals(e, n, k / n)] == list(range(n - k, n)), (n, k)

def test_loss_grad_upweights_exactly_the_kept_easy_examples():
    learn, losses = fixed_learner()
    cb, steps = StaleLossPruningCallback(prune=.5, anneal=0.), Steps()
    learn.add_cbs([cb, steps])
    _fit(learn, 3)
    train_pos = torch.tensor([learn.dls.train_ds[i][0][-1].long().item() for i in range(len(learn.dls.train_ds))])
    mean = losses[train_pos].mean()
    checked = 0
    for ep, ids, loss_grad, loss in steps.steps:
        l = losses[ids]
        if ep == 0: assert loss_grad == pytest.approx(float(l.mean()), rel=1e-5); continue
        w = torch.where(l < mean, 2., 1.)                         # every kept below-mean example weighs 1/(1-.5)
        assert loss_grad == pytest.approx(float((l * w).mean()), rel=1e-5)
        assert loss == pytest.approx(float(l.mean()), rel=1e-5)   # the reported loss stays unweighted
        checked += 1
    assert checked > 0

def test_schedule_ends_at_100_percent_with_fewer_batches(digits_dls):
    set_seed(0)
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy).stale_loss_pruning(prune=.7)
    _fit(learn, 4, lr=1e-2, one_cycle=True)
    full = len(digits_dls.train)
    assert learn.train_iter < 4 * full                           # epochs 1 and 2 had fewer batches
    assert learn.pct_train == pytest.approx(1.)
    lrs = learn.recorder.hps['lr']
    assert lrs[-1] < max(lrs) / 100                               # the one-cycle schedule ran to its end
    assert learn.recorder.values[-1][2] > .8

def test_loader_order_restored_after_fit_and_after_an_error(digits_dls):
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat()).stale_loss_pruning()
    dl = digits_dls.train
    n0 = dl.n
    _fit(learn, 3, lr=1e-2)
    assert dl.n == n0 and 'get_idxs' not in dl.__dict__
    class Boom(Callback):
        def after_batch(self):
            if self.epoch == 1 and self.iter == 2: raise RuntimeError('boom')
    learn.add_cb(Boom())
    with pytest.raises(RuntimeError, match='boom'): _fit(learn, 3, lr=1e-2)
    learn.remove_cb(learn.boom)
    _fit(learn, 1, lr=1e-2)                                      # the next fit repairs what the failed one left
    assert dl.n == n0 and 'get_idxs' not in dl.__dict__ and len(list(dl)) == len(dl)

@pytest.mark.parametrize('cancel', ['CancelEpochException', 'CancelTrainException'])
def test_a_cancelled_epoch_leaves_no_order_behind(digits_dls, cancel):
    "`CancelEpochException` skips `after_train`: the next epoch must still start from the loader's own order"
    import fastai.callback.core as fcc
    class Skip(Callback):
        def after_batch(self):
            if self.training and self.epoch == 1 and self.iter == 2: raise getattr(fcc, cancel)()
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=Skip()).stale_loss_pruning()
    dl, shared = digits_dls.train, []
    learn.loss_filter._share_table = lambda: shared.append(learn.epoch)   # a no-op with one process; spied on here
    n0 = dl.n
    _fit(learn, 4, lr=1e-2)
    assert dl.n == n0 and 'get_idxs' not in dl.__dict__
    assert shared == [0, 1, 2, 3]                      # the cancelled epoch's scores are shared too: the ranks' tables agree
    assert learn.loss_filter.epoch_stats[-1]['samp_perc'] < 1                  # epoch 3 was still pruned

def test_validate_keeps_the_last_fits_table_and_records(digits_dls):
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy).stale_loss_pruning()
    _fit(learn, 3, lr=1e-2)
    cb = learn.loss_filter
    table, n_epochs, gen = cb.table.clone(), len(cb.epoch_stats), cb.gen
    assert len(learn.validate()) == 2                                         # loss and accuracy: no share columns
    assert torch.equal(cb.table.nan_to_num(-1), table.nan_to_num(-1)) and len(cb.epoch_stats) == n_epochs and cb.gen is gen
    _fit(learn, 1, lr=1e-2)                                                    # a new fit starts afresh
    assert len(cb.epoch_stats) == 1 and cb.gen is not gen

def test_columns_once_and_lr_find_untouched(digits_dls):
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy).stale_loss_pruning()
    for _ in range(2): _fit(learn, 2, lr=1e-2)
    names = list(learn.recorder.metric_names)
    assert names.count('samp_perc') == 1 and names.count('loss_perc') == 1
    with learn.no_bar(): learn.lr_find(num_it=10, show_plot=False)
    assert digits_dls.train.n == len(digits_dls.train_ds) and 'get_idxs' not in digits_dls.train.__dict__

def test_refuses_mixup_and_a_second_filter_replaces_the_first(digits_dls):
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=MixUp()).stale_loss_pruning()
    with pytest.raises(ValueError, match='MixUp'): _fit(learn, 1, lr=1e-2)
    with pytest.warns(UserWarning, match='BatchLossFilterCallback replaces StaleLossPruningCallback'):
        learn2 = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=[StaleLossPruningCallback(), BatchLossFilterCallback()])
    assert isinstance(learn2.loss_filter, BatchLossFilterCallback)
    assert sum(isinstance(o, (StaleLossPruningCallback, BatchLossFilterCallback)) for o in learn2.cbs) == 1

def test_export_and_load_after_a_pruned_fit(digits_dls, tmp_path):
    from fastai.learner import load_learner
    import fastai.callback.all   # `no_bar`, `fit_one_cycle`
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), path=tmp_path).stale_loss_pruning()
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(3, 1e-2)
    learn.export('stale.pkl')
    back = load_learner(tmp_path / 'stale.pkl')
    assert not hasattr(back, 'loss_filter') and isinstance(learn.loss_filter.gen, torch.Generator)   # exported for inference
    learn.loss_filter.learn = None                                # the filter itself still pickles, without its generator
    import pickle
    assert 'gen' not in pickle.loads(pickle.dumps(learn.loss_filter)).__dict__
    x = next(iter(digits_dls.valid))[0]
    assert torch.equal(back.model.eval()(x), learn.model.eval()(x))

def test_rank_share_splits_evenly_into_whole_batches():
    from loss_filters.sampler import rank_share
    order = torch.arange(10) * 10
    shares = [rank_share(order, r, 3, bs=2, drop_last=False) for r in range(3)]
    assert [s.tolist() for s in shares] == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90, 0, 10]]   # padded with the first two
    assert [len(rank_share(order, r, 3, bs=3, drop_last=True)) for r in range(3)] == [3, 3, 3]     # 4 each, cut to one batch
    assert rank_share(order, 0, 1, bs=3, drop_last=True) is order
    assert rank_share(torch.arange(1), 1, 4, bs=1, drop_last=False).tolist() == [0]                # fewer examples than ranks

class InterruptAt(Callback):
    "A `KeyboardInterrupt` at a given training batch of a given epoch, as a user's Ctrl-C"
    def __init__(self, epoch, it): self.epoch_, self.it = epoch, it
    def after_batch(self):
        if self.training and self.epoch == self.epoch_ and self.iter == self.it:
            self.n_at = self.learn.dl.n   # the pruned epoch's length
            raise KeyboardInterrupt()

@pytest.mark.parametrize('patch', ['stale_loss_pruning', 'hide_learned'])
def test_predictions_after_an_interrupted_pruned_epoch_miss_no_row(patch, digits_dls):
    stop = InterruptAt(2, 1)
    learn = Learner(digits_dls, nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), loss_func=CrossEntropyLossFlat(), cbs=stop)
    getattr(learn, patch)(**({'confidence': .2} if patch == 'hide_learned' else {}))
    with pytest.raises(KeyboardInterrupt), learn.no_bar(), learn.no_logging(): learn.fit(4, 3e-2)
    n = len(learn.dls.train_ds)
    assert stop.n_at < n   # it stopped in a pruned epoch
    assert len(learn.get_preds(ds_idx=0)[0]) == n and len(learn.get_preds(ds_idx=0)[0]) == n
    assert learn.dls.train.n == n

def test_a_loader_that_draws_with_replacement_is_warned_about():
    from fastai.tabular.all import TabularDataLoaders, tabular_learner, Categorify, Normalize
    from fastai.tabular.core import TabularPandas
    from conftest import tabular_df
    dls = TabularDataLoaders.from_df(tabular_df(), procs=[Categorify, Normalize], cat_names=['c'], cont_names=['a', 'b'], y_names='y',
                                     valid_idx=list(range(450, 600)), bs=64, device='cpu')
    if not type(dls.train).__name__ == 'TabWeightedDL': pytest.skip('this fastai draws tabular rows without replacement')
    learn = tabular_learner(dls, layers=[16], n_out=2).stale_loss_pruning()
    with pytest.warns(UserWarning, match='have a loss from an earlier epoch'), learn.no_bar(), learn.no_logging(): learn.fit(3, 1e-2)

def test_a_drop_last_loader_on_small_data_is_not_warned_about(digits):
    "fastai's training loaders drop a partial last batch: on small data an epoch then leaves many examples out, as a plain epoch does"
    set_seed(0)
    dls = make_dls(*digits, bs=512, drop_last=True)
    n = len(dls.train_ds)
    assert len(dls.train) * 512 < .9 * n   # a plain epoch trains under 90% of the examples
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat()).stale_loss_pruning()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter('always')
        with learn.no_bar(), learn.no_logging(): learn.fit(3, 1e-2)
    assert not [w for w in seen if 'have a loss from an earlier epoch' in str(w.message)]

def test_a_loader_that_draws_half_the_data_each_epoch_is_warned_about(digits):
    "A loader whose `n` is half its dataset, a new half each epoch: the other half has no loss, which a plain epoch's size does not explain"
    set_seed(0)
    dls = make_dls(*digits, bs=64)
    tr, N = dls.train, len(dls.train_ds)
    class Half(type(tr)):
        def get_idxs(self): return torch.randperm(N)[:self.n].tolist()
    tr.__class__, tr.n = Half, N // 2
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat()).stale_loss_pruning()
    with pytest.warns(UserWarning, match='have a loss from an earlier epoch'), learn.no_bar(), learn.no_logging(): learn.fit(3, 1e-2)

# ------------------------------------------------------------------ an epoch never pruned to nothing
class TrainedRows(Callback):
    "The examples each epoch trained on, counted at the loss"
    order = 100
    def before_fit(self): self.n = {}
    def after_loss(self):
        if self.training: self.n[self.epoch] = self.n.get(self.epoch, 0) + len(self.yb[0])

@pytest.mark.parametrize('make', [lambda: StaleLossPruningCallback(anneal=0.), lambda: RandomPruningCallback(keep=.5, anneal=0.),
                                  lambda: HideLearnedCallback(confidence=.05, max_hide=.9, anneal=0.)], ids=['stale', 'random', 'hide'])
def test_one_batch_an_epoch_still_trains_every_epoch(make):
    "75 training rows at bs=64 with `drop_last`: a plain epoch trains one batch, and so does every pruned epoch, said once"
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(100, 64, generator=g), torch.randint(0, 10, (100,), generator=g)
    spy = TrainedRows()
    learn = Learner(make_dls(x, y, bs=64, drop_last=True), mlp(), loss_func=CrossEntropyLossFlat(), cbs=[spy, make()])
    with pytest.warns(UserWarning, match=r'epoch 1 would keep too few examples to fill one batch .*`bs=64` with `drop_last=True`.* trains one batch') as rec:
        _fit(learn, 3, lr=1e-2)
    assert sum('would keep too few' in str(w.message) for w in rec) == 1  # once per fit
    assert spy.n == {0: 64, 1: 64, 2: 64}
    stats = learn.loss_filter.epoch_stats
    assert all(e['samp_perc'] == 1. and math.isfinite(e['full_loss']) for e in stats)

def test_an_epoch_that_keeps_a_batch_is_not_topped_up(digits_dls):
    set_seed(0)
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat()).stale_loss_pruning(prune=.5)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        _fit(learn, 3, lr=1e-2)
    assert not [w for w in ws if 'too few' in str(w.message)] and learn.loss_filter.epoch_stats[1]['samp_perc'] < .9

# ------------------------------------------------------------------ the panels agree on a loader that draws with replacement
def test_hide_learned_on_tabular_regression_panels_agree():
    "`TabWeightedDL` draws its epoch with replacement: an example it did not draw is not left out, and the histogram counts draws as `samp_perc` does"
    from fastai.tabular.all import TabularDataLoaders, tabular_learner, Categorify, Normalize, MSELossFlat
    from conftest import tabular_df
    from loss_filters.sampler import plain_epoch_size
    df = tabular_df()
    df['y'] = (2 * df.a + df.b).astype('float32')
    set_seed(0)
    dls = TabularDataLoaders.from_df(df, procs=[Categorify, Normalize], cat_names=['c'], cont_names=['a', 'b'], y_names='y',
                                     valid_idx=list(range(450, 600)), bs=64, device='cpu')
    spy = TrainedRows()
    learn = tabular_learner(dls, layers=[32], n_out=1, loss_func=MSELossFlat(), cbs=spy).hide_learned()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')   # the draws-with-replacement note
        _fit(learn, 6, lr=1e-2, one_cycle=True)
    cb, n_seen = learn.loss_filter, plain_epoch_size(450, 64, dls.train.drop_last)
    rows = cb.prune_hist
    assert rows and any(r['left_out'].sum() > 0 for r in rows)
    for r in rows:
        e = r['epoch']
        assert int(r['left_out'].sum()) == n_seen - spy.n[e]                # left out: what the loader drew and the epoch did not train
        assert cb.epoch_stats[e]['samp_perc'] == spy.n[e] / n_seen           # the share panel, on the same draws
        assert int(r['kept'].sum()) <= spy.n[e]                              # trained draws with a stale loss
    fig = cb.plot_diagnostics()
    share, hist = fig.axes[:2]
    left = int(sum(r['left_out'].sum() for r in rows))
    assert f'left out ({left})' in [t.get_text() for t in hist.get_legend().get_texts()]
    assert left == sum(round((1 - y) * n_seen) for e, y in zip(share.lines[0].get_xdata(), share.lines[0].get_ydata()) if e in [r['epoch'] for r in rows])
    import matplotlib.pyplot as plt; plt.close(fig)
