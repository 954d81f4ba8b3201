"One filter per Learner, one rule: adding a filter, whichever way, replaces the one the Learner had, with a warning."
import pytest, torch
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, accuracy, set_seed
import fastai.callback.all   # `no_bar`, `fit_one_cycle`
from loss_filters.batch import LossFilterBase, LossFilterColumns, BatchLossFilterCallback, SelectiveBackpropCallback
from loss_filters.sampler import StaleLossPruningCallback, HideLearnedCallback
from loss_filters.controls import RandomPruningCallback
from conftest import mlp, col

def learner(dls, **kw): return Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy, **kw)

def fit(learn, n=2, **kw):
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(n, 1e-2, **kw)
    return learn

def filters(learn): return [cb for cb in learn.cbs if isinstance(cb, (LossFilterBase, LossFilterColumns))]

def only(learn, cls):
    "`learn` holds exactly one filter, of type `cls`, with its columns, and `learn.loss_filter` is it"
    fs = [cb for cb in learn.cbs if isinstance(cb, LossFilterBase)]
    assert len(fs) == 1 and type(fs[0]) is cls and learn.loss_filter is fs[0]
    assert [cb for cb in learn.cbs if isinstance(cb, LossFilterColumns)] == [fs[0].columns]
    return fs[0]

def test_add_cb_after_a_patch_replaces_the_filter(digits_dls):
    learn = fit(learner(digits_dls).batch_loss_filter())
    old = learn.loss_filter
    with pytest.warns(UserWarning, match='SelectiveBackpropCallback replaces BatchLossFilterCallback'):
        learn.add_cb(SelectiveBackpropCallback(keep=.5, start=0., interrupt=0))
    sb = only(learn, SelectiveBackpropCallback)
    assert old.learn is None and old.columns.learn is None
    fit(learn)
    assert col(learn, 'samp_perc')[-1] < 1 and list(learn.recorder.metric_names).count('samp_perc') == 1
    assert sb.epoch_stats and len(old.epoch_stats) == 2                  # the old one did not act in the new fit

def test_a_patch_after_add_cb_replaces_the_filter_and_gives_the_loader_back(digits_dls):
    class Stop(Callback):
        def after_batch(self):
            if self.training and self.epoch == 1 and self.iter == 2: raise KeyboardInterrupt()
    learn = learner(digits_dls).add_cb(StaleLossPruningCallback())
    dl, n = digits_dls.train, digits_dls.train.n
    with pytest.raises(KeyboardInterrupt): fit(learn, 3, cbs=Stop())
    assert dl.n == n and 'get_idxs' not in dl.__dict__                     # died in a pruned epoch: the order given back as the fit ended
    with pytest.warns(UserWarning, match='SelectiveBackpropCallback replaces StaleLossPruningCallback'):
        assert learn.selective_backprop(keep=.5) is learn
    only(learn, SelectiveBackpropCallback)
    assert dl.n == n and 'get_idxs' not in dl.__dict__                     # the replaced filter's `_leave` restored it

def test_stale_then_hide(digits_dls):
    learn = fit(learner(digits_dls).stale_loss_pruning(), 2)
    with pytest.warns(UserWarning, match='HideLearnedCallback replaces StaleLossPruningCallback'):
        assert learn.hide_learned(max_hide=.2, anneal=0.) is learn
    cb = only(learn, HideLearnedCallback)
    assert (cb.max_hide, cb.confidence, cb.lr_scale, cb.anneal) == (.2, .9, True, 0.)
    fit(learn, 3)
    assert len(cb.epoch_stats) == 3 and list(learn.recorder.metric_names).count('samp_perc') == 1

def test_fit_cbs_replaces_the_filter_for_that_fit(digits_dls):
    learn = learner(digits_dls).batch_loss_filter(skip_epochs=0)
    own = learn.loss_filter
    sb = SelectiveBackpropCallback(keep=.25, start=0., interrupt=0)
    with pytest.warns(UserWarning, match='SelectiveBackpropCallback replaces BatchLossFilterCallback'): fit(learn, 1, cbs=sb)
    assert sb.stats and all(b['kept'] == 16 for b in sb.stats)            # the filter given to `fit` acted
    assert learn.loss_filter is own and own.learn is learn and sb.learn is None   # it left with the fit: the Learner's own is back
    fit(learn, 1)
    assert list(learn.recorder.metric_names).count('samp_perc') == 1 and own.epoch_stats

def test_learner_cbs_keep_the_last_filter(digits_dls):
    with pytest.warns(UserWarning, match='RandomPruningCallback replaces BatchLossFilterCallback'):
        learn = learner(digits_dls, cbs=[BatchLossFilterCallback(), RandomPruningCallback(keep=.5)])
    only(learn, RandomPruningCallback)
    fit(learn, 2)
    assert col(learn, 'samp_perc')[1] < 1

def test_adding_the_same_filter_again_keeps_it_without_a_warning(digits_dls, recwarn):
    learn = learner(digits_dls).batch_loss_filter()
    learn.loss_filter.learn = learn                                       # what a second `add_cb` of it does first
    only(learn, BatchLossFilterCallback)
    assert not [w for w in recwarn if 'replaces' in str(w.message)]

def test_everything_in_one_import():
    import loss_filters.all as lf
    ns = {}
    exec('from loss_filters.all import *', ns)
    for n in ('SelectiveBackpropCallback', 'BatchLossFilterCallback', 'LossFilterCallback', 'StaleLossPruningCallback',
              'HideLearnedCallback', 'SamplerPruningCallback', 'RandomPruningCallback', 'RandomBatchCallback',
              'select_by_rank', 'select_by_loss_share', 'prune_by_stale_loss', 'hide_learned', 'per_sample_loss'):
        assert n in ns, n
    assert ns['hide_learned'] is lf.core.hide_learned                     # the core rule, not the `Learner` patch
    for p in ('batch_loss_filter', 'selective_backprop', 'stale_loss_pruning', 'hide_learned'): assert hasattr(Learner, p)

def test_the_old_module_names_still_import():
    "`loss_filters.callback` and `loss_filters.stale` became `batch` and `sampler`; the old paths re-export the same objects"
    import loss_filters.batch as batch, loss_filters.sampler as sampler
    from loss_filters.callback import SelectiveBackpropCallback as SB, LossFilterBase as Base
    from loss_filters.stale import StaleLossPruningCallback as Stale, HideLearnedCallback as Hide, anneals
    assert SB is batch.SelectiveBackpropCallback and Base is batch.LossFilterBase
    assert Stale is sampler.StaleLossPruningCallback and Hide is sampler.HideLearnedCallback and anneals is sampler.anneals
    for old, new in (('callback', batch), ('stale', sampler)):
        ns = {}
        exec(f'from loss_filters.{old} import *', ns)
        assert set(new.__all__) <= set(ns) and all(ns[n] is getattr(new, n) for n in new.__all__)
