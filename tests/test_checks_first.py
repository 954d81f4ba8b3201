"What a comparison can check is checked before its first fit trains: the loss per example, the model's precision and weights, the design's arguments."
import warnings
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from fastai.basics import Learner, CrossEntropyLossFlat, accuracy
from loss_filters.compare import compare_filters
from loss_filters.plan import Design, budget_shares, budget_specs
from conftest import make_dls, mlp

def _scalar_loss(pred, targ, reduction='mean'): return F.cross_entropy(pred, targ)   # asks for `reduction=` but always reduces

@pytest.fixture
def factory(digits):
    dls = make_dls(*digits, bs=64)
    def make(loss=CrossEntropyLossFlat(), model=None):
        return lambda: Learner(dls, model() if model else mlp(), loss_func=loss, metrics=accuracy)
    return make

def _no_fit(factory_, methods, **kw):
    "Run a comparison that must refuse before training; return the exception and the fits it started"
    started = []
    with pytest.raises((TypeError, ValueError)) as e:
        compare_filters(factory_, methods, epochs=1, seeds=1, controls=False, show_progress=False, on_run=lambda *a: started.append(a), **kw)
    return e.value, started

def test_a_loss_without_one_value_per_example_is_refused_before_the_baseline_trains(factory):
    err, started = _no_fit(factory(loss=_scalar_loss), 'baseline blf')
    assert '_scalar_loss' in str(err) and 'one value per example' in str(err) and started == []

def test_the_plain_model_alone_needs_no_per_example_loss(factory):
    cmp = compare_filters(factory(loss=_scalar_loss), 'baseline', epochs=1, seeds=1, controls=False, show_progress=False)
    assert len(cmp.runs) == 1

def test_a_float64_model_is_named_before_any_fit(factory):
    err, started = _no_fit(factory(model=lambda: mlp().double()), 'baseline blf')
    assert isinstance(err, TypeError) and 'torch.float64' in str(err) and 'torch.float32' in str(err) and started == []

def test_a_meta_model_is_named_before_any_fit(factory):
    def meta():
        with torch.device('meta'): return mlp()
    err, started = _no_fit(factory(model=meta), 'baseline blf')
    assert 'meta device' in str(err) and started == []

@pytest.mark.parametrize('b', [.5, [.5, 1.5], (.5,)])
def test_budgets_as_numbers_mean_their_string(b):
    s = ' '.join(map(str, b)) if isinstance(b, (list, tuple)) else str(b)
    assert budget_shares(b) == budget_shares(s) and budget_specs(6, b) == budget_specs(6, s)
    assert Design(['baseline', 'blf'], epochs=6, budgets=b).plain == Design(['baseline', 'blf'], epochs=6, budgets=s).plain

def test_budgets_of_another_type_are_named():
    with pytest.raises(TypeError, match='`budgets` must be shares'): budget_shares(object())

def test_seed_without_seeds_warns(factory):
    "`seed=3` for `seeds=3` is named; the bad `budgets` then stops the comparison before anything trains"
    with pytest.warns(UserWarning, match=r'`seed=3` is the first seed.*pass `seeds=`'), pytest.raises(ValueError, match='`budgets`'):
        compare_filters(factory(), 'baseline', epochs=1, seed=3, controls=False, show_progress=False, budgets='oops')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with pytest.raises(ValueError, match='`budgets`'):
            compare_filters(factory(), 'baseline', epochs=1, seed=3, seeds=2, controls=False, show_progress=False, budgets='oops')
