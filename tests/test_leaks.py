"Nothing a filter does leaks into the model, the data order or the comparison: norm statistics, random draws, step sizes, loss scale."
import copy, math, random
import numpy as np, pytest, torch, torch.nn as nn, torch.nn.functional as F
from fastai.basics import Learner, Callback, DataLoaders, CrossEntropyLossFlat, accuracy, set_seed
from fastai.callback.all import MixUp, MixedPrecision
from loss_filters.batch import *
from loss_filters.sampler import StaleLossPruningCallback, HideLearnedCallback
from loss_filters.controls import RandomPruningCallback, RandomBatchCallback
from conftest import make_dls, mlp, bn_cnn, bn_mlp, BatchSpy, ItemList, col

def fit(learn, n=1, lr=1e-2, one_cycle=False, **kw):
    with learn.no_bar(), learn.no_logging(): (learn.fit_one_cycle if one_cycle else learn.fit)(n, lr, **kw)
    return learn

def id_dls(n=400, bs=32, n_valid=96, seed=0, **kw):
    "Random 4-feature examples whose last input column is their index in the training set"
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(n, 4, generator=g), torch.arange(n, dtype=torch.float32)[:, None]], 1)
    y = torch.randint(0, 4, (n,), generator=g)
    items = list(zip(x, y))
    return DataLoaders.from_dsets(ItemList(items[:n - n_valid]), ItemList(items[n - n_valid:]), bs=bs, device='cpu', **kw)

class IdModel(nn.Module):
    "Logits from every input column but the last, which carries the example's id; dropout makes the forward draw random numbers"
    def __init__(self, p=0.): super().__init__(); self.lin, self.drop = nn.Linear(4, 4), nn.Dropout(p)
    def forward(self, x): return self.lin(self.drop(x[:, :-1]))

class LoaderIds(Callback):
    "Ids of each training batch as the loader made it, before any filter touched it"
    order = LossFilterBase.order - 1
    def before_fit(self): self.ids = []
    def before_batch(self):
        if self.training: self.ids.append((self.epoch, self.xb[0][:, -1].long().tolist()))
    def of_epoch(self, e): return [i for ep, ids in self.ids if ep == e for i in ids]

class StepIds(Callback):
    "Ids of what each training step trained on (not the filter's scoring pass)"
    order = 100
    def before_fit(self): self.steps = []
    def after_pred(self):
        filt = getattr(self.learn, 'loss_filter', None)
        if self.training and not getattr(filt, 'scoring', False): self.steps.append((self.epoch, self.xb[0][:, -1].long().tolist()))

def learner(dls, model, **kw): return Learner(dls, model, loss_func=kw.pop('loss_func', CrossEntropyLossFlat()), **kw)

# ------------------------------------------------------------------ 1. norm layers swapped after the filter's `before_fit`
class SwapNorms(Callback):
    "What `DistributedTrainer` does under `sync_bn=True` (`convert_sync_batchnorm`), on one CPU process: new norm layers in `before_fit`"
    order = MixedPrecision.order + 1   # `DistributedTrainer`'s order
    def before_fit(self):
        for mod in list(self.learn.model.modules()):
            for name, child in mod.named_children():
                if isinstance(child, nn.BatchNorm2d): setattr(mod, name, copy.deepcopy(child))

def test_scoring_leaves_the_norm_layers_alone_when_another_callback_swaps_them(digits):
    set_seed(0)
    dls = make_dls(*digits, bs=64)
    learn = learner(dls, bn_cnn(), cbs=[SelectiveBackpropCallback(keep=.5, start=0., end=1., interrupt=0), SwapNorms()])
    fit(learn, 1)
    live = [m for m in learn.model.modules() if isinstance(m, nn.BatchNorm2d)]
    n = len(dls.train)
    assert len(live) == 2 and len(learn.loss_filter.stats) == n
    for m in live: assert int(m.num_batches_tracked) == n    # one per training step: no scoring pass folded in

# ------------------------------------------------------------------ 2. a pruner's full epochs are the plain model's epochs
PRUNERS = {'stale': lambda: StaleLossPruningCallback(anneal=0.), 'hide': lambda: HideLearnedCallback(anneal=0., confidence=.3),
           'random': lambda: RandomPruningCallback(keep=.5, anneal=0.)}

def _ids_of(make, epochs=3, num_workers=0):
    set_seed(0)
    dls = id_dls(drop_last=False, num_workers=num_workers)
    dls.train.rng = random.Random(0)
    ids = LoaderIds()
    learn = learner(dls, IdModel(), cbs=ids)
    if make is not None: learn.add_cb(make())
    fit(learn, epochs)
    return ids

@pytest.mark.parametrize('num_workers', [0, 2])   # with workers, each builds its own share of the epoch's batches
@pytest.mark.parametrize('name', PRUNERS)
def test_a_pruners_full_epoch_trains_the_plain_models_batches_and_pruned_ones_keep_its_order(name, num_workers):
    plain, pruned = _ids_of(None, num_workers=num_workers), _ids_of(PRUNERS[name], num_workers=num_workers)
    first = lambda ids: [b for e, b in ids.ids if e == 0]
    assert len(first(plain)) == 10 and first(pruned) == first(plain)                     # epoch 0 trains on all data: the plain model's batches
    for e in (1, 2):   # a pruned epoch: the plain epoch's order, less the examples it leaves out
        kept = set(pruned.of_epoch(e))
        assert len(kept) < len(plain.of_epoch(e))
        assert pruned.of_epoch(e)[:len(kept)] == [i for i in plain.of_epoch(e) if i in kept][:len(kept)]

# ------------------------------------------------------------------ 3. no step trains more than `bs` examples
def test_fill_batch_never_trains_more_than_a_batch(digits):
    set_seed(0)
    dls = make_dls(*digits, bs=50)
    spy = BatchSpy()
    fit(learner(dls, mlp(), cbs=spy).selective_backprop(keep=.3, start=0., end=1., interrupt=2, fill_batch=True), 3)
    sizes = [n for _, _, n in spy.sizes]
    assert max(sizes) <= 50 and sum(n == 50 for n in sizes) >= len(sizes) - 3

def test_fill_batch_trains_the_selected_examples_in_order_each_once():
    "The pool is first in, first out: the steps train the selected examples in the order they were selected, each once"
    set_seed(0)
    dls = id_dls()
    raw, steps = LoaderIds(), StepIds()
    cb = SelectiveBackpropCallback(keep=.3, start=0., end=1., interrupt=3, fill_batch=True)
    picks = []
    sel = cb.select
    cb.select = lambda s: picks.append(sel(s)) or picks[-1]
    fit(learner(dls, IdModel(), cbs=[cb, raw, steps]), 3)
    it, selected, n = iter(picks), [], len(dls.train)
    for k, (_, ids) in enumerate(raw.ids):   # batch `i` of an epoch is unfiltered when `(i + 1) % 3 == 0`
        selected += ids if (k % n + 1) % 3 == 0 else [ids[j] for j in sorted(next(it).tolist())]
    trained = [i for _, ids in steps.steps for i in ids]
    assert trained == selected[:len(trained)] and len(selected) - len(trained) < 32   # only the fit's last partial pool is left
    assert all(len(ids) <= 32 for _, ids in steps.steps) and len(steps.steps) < len(raw.ids)

# ------------------------------------------------------------------ 4. `fill_batch` on text is refused up front
def test_fill_batch_on_a_sorted_text_loader_is_refused_before_any_step():
    import pandas as pd
    from fastai.text.all import TextDataLoaders, text_classifier_learner, AWD_LSTM, SortedDL
    rng, words = random.Random(0), 'the a film plot actor scene good bad'.split()
    df = pd.DataFrame([(' '.join(rng.choice(words) for _ in range(rng.choice([3, 9, 30]))), 'pos' if i % 2 else 'neg')
                       for i in range(96)], columns=['text', 'label'])
    dls = TextDataLoaders.from_df(df, text_col='text', label_col='label', valid_pct=.25, seed=0, bs=16, device='cpu')
    learn = text_classifier_learner(dls, AWD_LSTM, pretrained=False, config=dict(emb_sz=16, n_hid=16, n_layers=1), drop_mult=.1)
    assert isinstance(learn.dls.train, SortedDL)
    learn.batch_loss_filter(skip_epochs=0, fill_batch=True)
    w = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match=r'`fill_batch=True` cannot pool the batches of a SortedDL'): fit(learn, 1)
    assert all(torch.equal(a, b) for a, b in zip(w, learn.model.parameters()))

def test_pooling_batches_of_different_shapes_names_the_problem():
    from loss_filters.batch import BatchPool
    pool = BatchPool()
    pool.add((torch.zeros(3, 5), torch.zeros(3)))
    pool.add((torch.zeros(2, 7), torch.zeros(2)))
    with pytest.raises(ValueError, match=r'pool.*\(3, 5\).*\(2, 7\)'): pool.take(4)

# ------------------------------------------------------------------ 6. the filters' own random draws; the first batch
def _rng_after(make, data):
    set_seed(0)
    learn = learner(make_dls(*data, bs=64), mlp())
    if make is not None: learn.add_cb(make())
    fit(learn, 2)
    return torch.get_rng_state()

FILTERS = {'sb': lambda: SelectiveBackpropCallback(keep=.5, start=0., end=1., interrupt=0),
           'random_batch': lambda: RandomBatchCallback(keep=.5), 'blf': lambda: BatchLossFilterCallback(skip_epochs=0),
           'stale': lambda: StaleLossPruningCallback(anneal=0.), 'random_pruning': lambda: RandomPruningCallback(keep=.5, anneal=0.)}

@pytest.fixture
def digits_t(digits): return digits

@pytest.mark.parametrize('name', FILTERS)
def test_a_filter_draws_nothing_from_torchs_global_generator(digits_t, name):
    "A model that draws nothing itself: after the fit torch's global generator is where a plain fit leaves it"
    assert torch.equal(_rng_after(FILTERS[name], digits_t), _rng_after(None, digits_t))

def test_a_filters_draws_are_reproducible_from_the_seed(digits_t):
    def kept():
        set_seed(3)
        cb = SelectiveBackpropCallback(keep=.5, start=0., end=1., interrupt=0)
        fit(learner(make_dls(*digits_t, bs=64), mlp(), cbs=cb), 1)
        return [(b['kept'], b['full_loss']) for b in cb.stats]
    assert kept() == kept()

class Weights(Callback):
    order = 100
    def before_fit(self): self.after_steps = []
    def after_step(self): self.after_steps.append([p.detach().clone() for p in self.learn.model.parameters()])

@pytest.mark.parametrize('make', [lambda: SelectiveBackpropCallback(keep=.5, start=.5, end=1., interrupt=0),
                                  lambda: BatchLossFilterCallback(skip_epochs=1)])
def test_a_filter_that_has_not_started_trains_exactly_like_the_plain_model(make):
    "With dropout, a scoring forward at the first batch would move the global generator: the steps before the filter starts match"
    def steps(cb):
        set_seed(0)
        dls = id_dls()
        w = Weights()
        learn = learner(dls, IdModel(p=.5), cbs=[w] + ([cb] if cb else []))
        fit(learn, 2)
        return w.after_steps, learn
    plain, _ = steps(None)
    filt, learn = steps(make())
    n = len(learn.dls.train)   # epoch 0 is unfiltered for both filters
    for a, b in zip(plain[:n], filt[:n]): assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert learn.loss_filter.fit_scored == sum(b['bs'] for b in learn.loss_filter.stats)   # nothing scored outside its schedule

def test_the_first_batch_check_still_refuses_a_loss_without_per_example_values(digits_t):
    def scalar_loss(pred, targ, reduction='mean'): return F.cross_entropy(pred, targ)
    w = Weights()
    learn = Learner(make_dls(*digits_t, bs=64), mlp(), loss_func=scalar_loss, cbs=[BatchLossFilterCallback(), w])
    with pytest.raises(TypeError, match='scalar_loss'): fit(learn, 2)
    assert w.after_steps == []

# ------------------------------------------------------------------ 7. a pruned epoch's loss reduces as the user's loss does
class LossGrad(Callback):
    order = 100
    def before_fit(self): self.rec = []
    def after_loss(self):
        if self.training: self.rec.append((self.epoch, self.learn.loss_grad.detach().clone(), self.pred.detach().clone(),
                                            self.yb[0].clone(), self.xb[0][:, -1].long().clone()))

def test_a_pruned_epochs_weighted_loss_divides_by_the_class_weights_as_torch_does():
    set_seed(0)
    cw = torch.tensor([1., 4., .5, 2.])
    spy, cb = LossGrad(), StaleLossPruningCallback(prune=.5, anneal=0.)
    learn = learner(id_dls(), IdModel(), loss_func=CrossEntropyLossFlat(weight=cw), cbs=[cb, spy])
    fit(learn, 2)
    pruned = [r for r in spy.rec if r[0] == 1]
    assert pruned and cb.weights is not None and (cb.weights > 1).any()
    for _, got, pred, y, ids in pruned:
        w = cb.weights[ids]
        per = F.cross_entropy(pred, y, weight=cw, reduction='none')
        assert float(got) == pytest.approx(float((per * w).sum() / cw[y].sum()), rel=1e-5)
    for _, got, pred, y, _ in (r for r in spy.rec if r[0] == 0):   # a full epoch: the user's own loss
        assert float(got) == pytest.approx(float(F.cross_entropy(pred, y, weight=cw)), rel=1e-5)

# ------------------------------------------------------------------ 8. `full_train_loss`: one quantity
class StepLoss(Callback):
    order = 100
    def before_fit(self): self.rec = []
    def after_loss(self):
        if self.training: self.rec.append((self.epoch, float(self.loss.detach()), self.yb[0].shape[0]))

def test_full_train_loss_leaves_out_the_downsampled_scoring_losses(digits_t):
    "Under `scale_factor<1` the scoring pass sees smaller images: the column is the plain steps' full-size losses only"
    set_seed(0)
    spy, cb = StepLoss(), SelectiveBackpropCallback(keep=.5, start=0., end=1., interrupt=2, scale_factor=.5)
    fit(learner(make_dls(*digits_t, bs=64), bn_cnn(), cbs=[cb, spy]), 1)
    plain_steps = [(l, n) for e, l, n in spy.rec if n == 64]
    assert cb.stats and plain_steps
    assert cb.epoch_stats[0]['full_loss'] == pytest.approx(sum(l * n for l, n in plain_steps) / sum(n for _, n in plain_steps), rel=1e-5)

def test_full_train_loss_leaves_out_mixed_steps(digits_t):
    "Under MixUp a plain step's loss is a mixed one: the column is the un-mixed losses of the scoring pass, NaN where there are none"
    set_seed(0)
    cb = BatchLossFilterCallback(skip_epochs=1)
    learn = fit(learner(make_dls(*digits_t, bs=64), mlp(), metrics=accuracy, cbs=[cb, MixUp(.4)]), 2)
    full = col(learn, 'full_train_loss')
    assert math.isnan(full[0])                   # epoch 0 trained unfiltered on mixed inputs: no un-mixed loss was seen
    batches = [b for b in cb.stats if b['epoch'] == 1]
    assert full[1] == pytest.approx(sum(b['full_loss'] * b['bs'] for b in batches) / sum(b['bs'] for b in batches), rel=1e-5)

# ------------------------------------------------------------------ 9. `fit(cbs=...)` and batches of one
def test_fit_cbs_gives_the_learners_own_filter_back_after_the_fit(digits_t):
    learn = learner(make_dls(*digits_t, bs=64), mlp()).batch_loss_filter(skip_epochs=0)
    own = learn.loss_filter
    sb = SelectiveBackpropCallback(keep=.25, start=0., interrupt=0)
    with pytest.warns(UserWarning, match='SelectiveBackpropCallback replaces BatchLossFilterCallback'): fit(learn, 1, cbs=sb)
    assert sb.stats and sb.learn is None
    assert learn.loss_filter is own and own.learn is learn and [cb for cb in learn.cbs if isinstance(cb, LossFilterBase)] == [own]
    fit(learn, 1)
    assert col(learn, 'samp_perc')[0] < 1 and list(learn.recorder.metric_names).count('samp_perc') == 1

def test_fit_cbs_gives_the_filter_back_when_the_fit_dies(digits_t):
    class Boom(Callback):
        def after_batch(self):
            if self.training and self.iter == 2: raise RuntimeError('boom')
    learn = learner(make_dls(*digits_t, bs=64), mlp()).stale_loss_pruning()
    own = learn.loss_filter
    with pytest.warns(UserWarning, match='replaces'), pytest.raises(RuntimeError, match='boom'):
        fit(learn, 2, cbs=[SelectiveBackpropCallback(start=0.), Boom()])
    assert learn.loss_filter is own and own.learn is learn

@pytest.mark.parametrize('make', [lambda: BatchLossFilterCallback(min_loss_perc=.01, skip_epochs=0),
                                  lambda: SelectiveBackpropCallback(keep=.01, start=0., end=1., interrupt=0),
                                  lambda: RandomBatchCallback(keep=.01)])
def test_a_batch_filter_never_trains_a_single_example_of_a_larger_batch(digits_t, make):
    set_seed(0)
    spy = BatchSpy()
    fit(learner(make_dls(*digits_t, bs=64), bn_mlp(), cbs=[make(), spy]), 2)   # BatchNorm1d fails on one example
    assert min(n for _, _, n in spy.sizes) == 2
