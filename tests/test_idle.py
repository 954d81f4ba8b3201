"A fit too short for the filter to act says so before its first batch, naming the setting to change."
import warnings
import pytest
from fastai.basics import Learner, CrossEntropyLossFlat, accuracy, set_seed
import fastai.callback.all   # `no_bar`, `fit_one_cycle`, `fine_tune`
from loss_filters.batch import SelectiveBackpropCallback, BatchLossFilterCallback
from loss_filters.sampler import StaleLossPruningCallback, HideLearnedCallback
from loss_filters.controls import RandomPruningCallback
from conftest import mlp

def learner(dls, cb): return Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=cb)

def idle_warnings(run) -> list:
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        run()
    return [str(w.message) for w in ws if 'will not act' in str(w.message)]

def fit(learn, n):
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(n, 1e-2)

def test_batch_loss_filter_in_a_one_epoch_fit_names_skip_epochs(digits_dls):
    learn = learner(digits_dls, BatchLossFilterCallback())
    ws = idle_warnings(lambda: fit(learn, 1))
    assert len(ws) == 1 and ws[0].startswith('BatchLossFilterCallback will not act in this fit of 1 epoch(s): it leaves the first '
                                             '`skip_epochs=1` epoch(s) of each fit unfiltered')
    assert 'pass a smaller `skip_epochs`' in ws[0] and learn.loss_filter.epoch_stats[0]['samp_perc'] == 1.
    assert idle_warnings(lambda: fit(learn, 2)) == []

def test_fine_tune_one_warns_for_both_of_its_fits(digits_dls):
    learn = learner(digits_dls, BatchLossFilterCallback())
    def tune():
        with learn.no_bar(), learn.no_logging(): learn.fine_tune(1, 1e-2)
    ws = idle_warnings(tune)
    assert len(ws) == 2 and all('`skip_epochs=1`' in w and '`fine_tune` runs two fits' in w for w in ws)

@pytest.mark.parametrize('kw,what', [(dict(start=.5, end=.5), 'window `start=0.5` to `end=0.5`'),
                                     (dict(start=0., end=1., interrupt=1), 'with `interrupt=1`')])
def test_selective_backprop_with_an_empty_window_names_it(digits_dls, kw, what):
    learn = learner(digits_dls, SelectiveBackpropCallback(**kw))
    ws = idle_warnings(lambda: fit(learn, 2))
    assert len(ws) == 1 and what in ws[0] and 'widen the window' in ws[0]
    assert all(e['samp_perc'] == 1. for e in learn.loss_filter.epoch_stats)

def test_a_window_with_one_batch_does_not_warn(digits_dls):
    n = 2 * len(digits_dls.train)
    learn = learner(digits_dls, SelectiveBackpropCallback(start=(n - 1) / n, end=1., interrupt=0))
    assert idle_warnings(lambda: fit(learn, 2)) == [] and len(learn.loss_filter.stats) == 1

@pytest.mark.parametrize('make,n,what', [(lambda: StaleLossPruningCallback(), 1, 'its first epoch trains on all data'),
                                         (lambda: HideLearnedCallback(anneal=.5), 2, 'every epoch after the first anneals'),
                                         (lambda: RandomPruningCallback(anneal=.7), 3, 'lower `anneal`')])
def test_a_sampler_pruner_with_no_pruned_epoch_says_so(digits_dls, make, n, what):
    learn = learner(digits_dls, make())
    ws = idle_warnings(lambda: fit(learn, n))
    assert len(ws) == 1 and what in ws[0] and f'in this fit of {n} epoch(s)' in ws[0]
    assert idle_warnings(lambda: fit(learner(digits_dls, StaleLossPruningCallback()), 2)) == []

def test_validate_does_not_warn(digits_dls):
    learn = learner(digits_dls, BatchLossFilterCallback())
    fit(learn, 2)
    assert idle_warnings(lambda: learn.validate()) == []
