"Exact shares on every kind of loader, the work counters, and the learning rate each step used."
import pytest, torch
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, accuracy, set_seed, find_bs
from fastai.callback.all import GradientAccumulation
from fastai.vision.all import ImageBlock, CategoryBlock
from fastai.text.all import SortedDL
from fastai.tabular.all import TabDataLoader
from loss_filters.batch import SelectiveBackpropCallback, BatchLossFilterCallback
from loss_filters.sampler import HideLearnedCallback, StaleLossPruningCallback, plain_epoch_size, _keeps_batches
from loss_filters.controls import RandomPruningCallback, RandomBatchCallback
from conftest import make_dls, mlp
from test_apps import image_dir, text_df, image_dls, small_cnn, text_learner, tabular_df, tab_learner   # fixtures too
from test_stale import fixed_learner

def fit(learn, n=2, lr=1e-2):
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(n, lr)
    return learn

class Trained(Callback):
    "Examples that reached the loss of a training step, per epoch, and each step's batch size"
    order = 100
    def before_fit(self): self.n, self.sizes = {}, []
    def after_loss(self):
        if not self.training: return
        bs = find_bs(self.yb)
        self.n[self.epoch] = self.n.get(self.epoch, 0) + bs
        self.sizes.append((self.epoch, bs))

def plain_sizes(dl) -> list:
    "The batch sizes of a plain epoch of `dl`, by iterating it"
    return [find_bs(b[dl.n_inp:] if hasattr(dl, 'n_inp') else b[-1:]) for b in dl]

# ------------------------------------------------------------------ samp_perc: a share of a plain epoch of the same loader
def _learner(kind, drop_last, image_dir, text_df):
    if kind == 'image':
        labels = image_dir[1]
        dls = image_dls(image_dir, (ImageBlock, CategoryBlock), lambda p: 'r' in labels[p.name].split(), drop_last=drop_last)
        return Learner(dls, small_cnn(2), loss_func=CrossEntropyLossFlat())
    if kind == 'tensor':
        g = torch.Generator().manual_seed(0)
        return Learner(make_dls(torch.randn(200, 8, generator=g), torch.randint(0, 2, (200,), generator=g), bs=32,
                                drop_last=drop_last), mlp(8, 2), loss_func=CrossEntropyLossFlat())
    if kind == 'tabular': return tab_learner(tabular_df(), drop_last=drop_last)
    return text_learner(text_df, drop_last=drop_last)

KINDS = ['image', 'tensor', 'tabular', 'text']

@pytest.mark.parametrize('drop_last', [True, False])
@pytest.mark.parametrize('kind', KINDS)
def test_sampler_pruner_shares_are_exact_on_every_loader(kind, drop_last, image_dir, text_df, monkeypatch):
    "`tabular_learner`'s loader is a `TabWeightedDL` (it draws with replacement) and text's a `SortedDL`: both order their batches"
    set_seed(0)
    learn = _learner(kind, drop_last, image_dir, text_df)
    dl = learn.dls.train
    assert dl.drop_last == drop_last and dl.n % dl.bs                         # the case that matters: a partial last batch
    assert isinstance(dl, {'text': SortedDL, 'tabular': TabDataLoader}.get(kind, type(dl)))
    plain = sum(plain_sizes(dl))
    assert plain == plain_epoch_size(dl.n, dl.bs, drop_last)
    cb, spy, owns, keeps, own_batches = RandomPruningCallback(keep=.75, anneal=1/3), Trained(), [], [], _keeps_batches(dl)
    owner = next(c for c in type(dl).__mro__ if 'get_idxs' in c.__dict__)   # the callback asks the loader for its own order
    own_order = owner.get_idxs
    def spy_order(self):
        res = list(own_order(self))
        if self is dl: owns.append(res)
        return res
    monkeypatch.setattr(owner, 'get_idxs', spy_order)
    pick = cb.epoch_keep
    cb.epoch_keep = lambda: keeps.append(pick()) or keeps[-1]
    fit(learn.add_cbs([cb, spy]), 3)
    samp = [e['samp_perc'] for e in cb.epoch_stats]
    assert samp[0] == samp[2] == 1. and spy.n[0] == spy.n[2] == plain        # unfiltered epochs: exactly 1.0
    assert samp[1] == spy.n[1] / plain < 1                                   # the pruned epoch: what trained, over a plain epoch
    keep, bs = keeps[0][0], dl.bs
    not_one = lambda k, of: 2 if k == 1 and of > 1 else k                  # never a batch of one (BatchNorm) where there were more
    if own_batches:   # its own batches, each less its pruned examples
        own = torch.tensor(owns[1])[:plain]
        assert spy.n[1] == sum(not_one(int(keep[own[i:i + bs]].sum()), len(own[i:i + bs])) for i in range(0, plain, bs))
    else:
        k = int(keep.sum())
        assert spy.n[1] == (k // bs * bs if drop_last else k + (k % bs == 1))
    assert dl.n == len(dl.dataset) and 'get_idxs' not in dl.__dict__

@pytest.mark.parametrize('drop_last', [True, False])
@pytest.mark.parametrize('kind', KINDS)
def test_batch_filter_shares_are_exact_on_every_loader(kind, drop_last, image_dir, text_df):
    set_seed(0)
    learn = _learner(kind, drop_last, image_dir, text_df)
    sizes = plain_sizes(learn.dls.train)
    cb, spy = RandomBatchCallback(keep=.75, skip_epochs=1), Trained()   # .75: tabular's last batch of 2 keeps 2, as BatchNorm needs
    fit(learn.add_cbs([cb, spy]), 2)
    samp = [e['samp_perc'] for e in cb.epoch_stats]
    assert samp[0] == 1. and spy.n[0] == sum(sizes)
    assert spy.n[1] == sum(max(1, round(.75 * b)) for b in sizes) and samp[1] == spy.n[1] / sum(sizes)

# ------------------------------------------------------------------ work counters
@pytest.mark.parametrize('drop_last', [True, False])
def test_work_counters_of_a_batch_filter_are_exact(digits, drop_last):
    set_seed(0)
    dls = make_dls(*digits, bs=64, drop_last=drop_last)
    sizes = plain_sizes(dls.train)
    cb = RandomBatchCallback(keep=.25, skip_epochs=1, scored=True)   # scores each filtered batch (for its records), keeps `round(.25*b)` of a batch of `b`, and at least two of two or more
    learn = fit(Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=cb), 2)
    assert cb.fit_scored == sum(sizes)                                       # every batch of epoch 1: the first-batch check scores nothing
    assert cb.fit_trained == sum(sizes) + sum(max(min(b, 2), round(.25 * b)) for b in sizes)
    assert type(cb.fit_trained) is int and type(cb.fit_scored) is int
    with learn.no_bar(): learn.validate()
    assert cb.fit_trained == sum(sizes) + sum(max(min(b, 2), round(.25 * b)) for b in sizes)   # `validate` runs `before_fit` too
    fit(learn, 1)
    assert cb.fit_trained == sum(sizes) and cb.fit_scored == 0               # a new fit counts afresh

def test_work_counters_of_selective_backprop_with_interrupt(digits_dls):
    set_seed(0)
    sizes = plain_sizes(digits_dls.train)                                    # 21 batches of 64
    cb = SelectiveBackpropCallback(keep=.5, start=0., end=1., interrupt=2)   # batches 0, 2, 4... scored and halved
    fit(Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=cb), 1)
    active = [b for i, b in enumerate(sizes) if (i + 1) % 2 != 0]
    assert cb.fit_scored == sum(active)                                      # the first batch is scored anyway: no extra pass
    assert cb.fit_trained == sum(int(.5 * b) for b in active) + sum(b for i, b in enumerate(sizes) if (i + 1) % 2 == 0)

def test_work_counters_of_a_sampler_pruner(digits_dls):
    set_seed(0)
    cb, spy = StaleLossPruningCallback(prune=.5, anneal=0.), Trained()
    fit(Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=[cb, spy]), 3)
    assert cb.fit_scored == 0 and cb.fit_trained == sum(spy.n.values()) and spy.n[1] < spy.n[0]

# ------------------------------------------------------------------ the learning rate of every step
class LRSpy(Callback):
    "The rate the optimiser steps with (last group), per real step"
    order = 100
    def before_fit(self): self.lrs = []
    def before_step(self): self.lrs.append(self.opt.hypers[-1]['lr'])

@pytest.mark.parametrize('make', [lambda: HideLearnedCallback(max_hide=.08, confidence=.5, anneal=0.),
                                  lambda: RandomPruningCallback(keep=.5, anneal=0., lr_scale=True)], ids=['hide', 'random'])
def test_lr_scale_raises_by_plain_over_trained_and_records_it(make):
    learn, _ = fixed_learner()
    cb, spy, lrs = make(), Trained(), LRSpy()
    learn.add_cbs([cb, spy, lrs])
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(3, 1e-2)
    assert cb.lr_scale
    plain = len(learn.dls.train_ds) // 32 * 32
    its, used, sched = map(list, zip(*cb.lr_stats))
    assert its == list(range(len(spy.sizes))) and used == pytest.approx(lrs.lrs)   # one record per step: the rate it used
    assert sched == pytest.approx(learn.recorder.hps['lr'])                    # the scheduled rate, as the Recorder saw it
    epochs = [e for e, _ in spy.sizes]
    mult = [1. if e == 0 else plain / spy.n[e] for e in epochs]
    assert [u / s for u, s in zip(used, sched)] == pytest.approx(mult)
    assert spy.n[1] < plain and cb.mean_lr_mult == pytest.approx(sum(mult) / len(mult)) and cb.mean_lr_mult > 1
    assert learn.opt.hypers[-1]['lr'] == pytest.approx(sched[-1])             # the scheduled rate is back after each step

def test_the_random_control_has_no_raise_by_default():
    learn, _ = fixed_learner()
    cb = RandomPruningCallback(keep=.5, anneal=0.)
    learn.add_cb(cb)
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
    assert not cb.lr_scale and cb.mean_lr_mult == 1. and all(u == s for _, u, s in cb.lr_stats)
    assert StaleLossPruningCallback().lr_scale is False and HideLearnedCallback().lr_scale is True

def test_random_control_gives_the_raised_rate_back_after_an_error():
    class Boom(Callback):
        order = 100
        def before_step(self):
            if self.epoch == 1: raise RuntimeError('boom')
    learn, _ = fixed_learner()
    cb = RandomPruningCallback(keep=.5, anneal=0., lr_scale=True)
    learn.add_cbs([cb, Boom()])
    with pytest.raises(RuntimeError, match='boom'):
        with learn.no_bar(), learn.no_logging(): learn.fit(3, 1e-2)
    assert learn.opt.hypers[0]['lr'] == pytest.approx(1e-2)   # died between its scaling and its step: given back as the fit ended
    learn.remove_cb(cb)
    assert learn.opt.hypers[0]['lr'] == pytest.approx(1e-2)

def test_a_batch_filter_leaves_the_rate_alone(digits_dls):
    class StepLR(Callback):
        order = 100
        def before_fit(self): self.at = {}
        def before_step(self): self.at[self.train_iter] = self.opt.hypers[-1]['lr']
    set_seed(0)
    cb, spy = BatchLossFilterCallback(skip_epochs=0), StepLR()
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=[cb, spy, GradientAccumulation(n_acc=128)])
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
    assert cb.stats and 0 < len(spy.at) < 2 * len(digits_dls.train)              # it filtered, and only some batches stepped
    assert list(spy.at.values()) == pytest.approx([learn.recorder.hps['lr'][i] for i in spy.at])   # each at the scheduled rate
    assert not hasattr(cb, 'lr_stats') and not hasattr(cb, 'mean_lr_mult')       # the rate raise and its records are the pruners'

# ------------------------------------------------------------------ loss_perc: on the same examples as samp_perc
class Ident(torch.nn.Module):
    "Each example's loss is its input: an L1 loss against 0 of the first column (the weight does not count)"
    def __init__(self): super().__init__(); self.w = torch.nn.Parameter(torch.zeros(1))
    def forward(self, x): return x[:, 0] + 0 * self.w

def ident_learner(train_losses, **kw):
    from fastai.basics import DataLoaders
    from conftest import ItemList
    items = lambda ls: ItemList([(torch.tensor([float(l)]), torch.tensor(0.)) for l in ls])
    dls = DataLoaders.from_dsets(items(train_losses), items([1., 1.]), bs=4, shuffle=False, drop_last=False, device='cpu')
    return Learner(dls, Ident(), loss_func=torch.nn.L1Loss(), lr=0., **kw)

def test_loss_perc_counts_unfiltered_batches_in_full():
    "Batch 0 (8, 1, 1, 2) is filtered to its 8 (half its loss) and the 2 (two at least); batch 1 (4, 4, 1, 1) is the `interrupt` step and trains in full"
    learn = ident_learner([8, 1, 1, 2, 4, 4, 1, 1], cbs=BatchLossFilterCallback(min_loss_perc=.5, skip_epochs=1, interrupt=2))
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 0.)
    e0, e1 = learn.loss_filter.epoch_stats
    assert (e0['samp_perc'], e0['loss_perc'], e0['full_loss']) == (1., 1., 22 / 8)
    assert e1['samp_perc'] == 6 / 8 and e1['loss_perc'] == pytest.approx(20 / 22, abs=1e-12) and e1['full_loss'] == 22 / 8
    assert e1['loss_perc'] > e1['samp_perc']                                 # the filter keeps the high-loss examples
    assert [b['loss_share'] for b in learn.loss_filter.stats] == [10 / 12]

class EvenPositions(RandomPruningCallback):
    "Pruned epochs train the examples at even positions of the dataset"
    def epoch_keep(self): return torch.arange(len(self.table), device=self.table.device) % 2 == 0, None

def test_sampler_loss_perc_is_the_stale_loss_share_of_what_trains():
    learn = ident_learner([1, 2, 3, 4, 5, 6, 7, 8], cbs=EvenPositions(anneal=0.))
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 0.)
    e0, e1 = learn.loss_filter.epoch_stats
    assert (e0['samp_perc'], e0['loss_perc']) == (1., 1.)
    assert e1['samp_perc'] == 4 / 8 and e1['loss_perc'] == pytest.approx(16 / 36, abs=1e-7)   # 1 + 3 + 5 + 7 of 36
    assert e1['full_loss'] == 16 / 4                                         # the fresh loss of what trained

def test_sampler_loss_perc_under_drop_last_is_over_a_plain_epoch():
    "10 examples, batches of 4 with `drop_last`: a plain epoch trains 8; the kept 5 (even positions) train 4"
    from fastai.basics import DataLoaders
    from conftest import ItemList
    items = lambda ls: ItemList([(torch.tensor([float(l)]), torch.tensor(0.)) for l in ls])
    dls = DataLoaders.from_dsets(items(range(1, 11)), items([1.]), bs=4, shuffle=False, drop_last=True, device='cpu')
    learn = Learner(dls, Ident(), loss_func=torch.nn.L1Loss(), lr=0., cbs=EvenPositions(anneal=0.))
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 0.)
    e1 = learn.loss_filter.epoch_stats[1]
    mean = (36 + 4.5 * 2) / 10                           # examples 9 and 10 never trained in epoch 0: they count at the mean (4.5)
    assert e1['samp_perc'] == 4 / 8 and e1['loss_perc'] == pytest.approx((1 + 3 + 5 + 7) / (mean * 8), abs=1e-7)
