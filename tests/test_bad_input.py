"Bad input named: wrong types, unknown keywords and degenerate settings, each with a message that says what to change."
import warnings
import numpy as np, pytest
from fastai.basics import Learner, CrossEntropyLossFlat
from torch import nn
from loss_filters.core import check_range, check_int, select_by_rank
from loss_filters.batch import SelectiveBackpropCallback, BatchLossFilterCallback, LossFilterCallback, TopLossCallback
from loss_filters.sampler import StaleLossPruningCallback, HideLearnedCallback
from loss_filters.controls import RandomPruningCallback, RandomBatchCallback

@pytest.mark.parametrize('make,msg', [
    (lambda: SelectiveBackpropCallback(keep='half'), "`keep` must be a real number in (0, 1], got 'half' of type str"),
    (lambda: SelectiveBackpropCallback(keep=None), "`keep` must be a real number in (0, 1], got None of type NoneType"),
    (lambda: SelectiveBackpropCallback(keep=True), "`keep` must be a real number in (0, 1], got True of type bool"),
    (lambda: SelectiveBackpropCallback(start='0'), "`start` must be a real number in [0, 1]"),
    (lambda: SelectiveBackpropCallback(interrupt=2.), "`interrupt` must be an integer >= 0, got 2.0 of type float"),
    (lambda: SelectiveBackpropCallback(scale_factor=[.5]), "`scale_factor` must be a real number in (0, 1]"),
    (lambda: BatchLossFilterCallback(min_loss_perc='90%'), "`min_loss_perc` must be a real number in (0, 1]"),
    (lambda: BatchLossFilterCallback(skip_epochs=1.), "`skip_epochs` must be an integer >= 0, got 1.0 of type float"),
    (lambda: StaleLossPruningCallback(prune='.5'), "`prune` must be a real number in [0, 1)"),
    (lambda: HideLearnedCallback(confidence=None), "`confidence` must be a real number in (0, 1]"),
    (lambda: HideLearnedCallback(follow_lr='yes'), "`follow_lr` must be True or False, got 'yes'"),
    (lambda: RandomPruningCallback(keep='all'), "`keep` must be a real number in (0, 1]"),
    (lambda: select_by_rank(__import__('torch').rand(4), '1'), "`keep` must be a real number in (0, 1]")])
def test_a_wrong_type_is_a_type_error_naming_the_argument(make, msg):
    with pytest.raises(TypeError) as e: make()
    assert msg in str(e.value)

def test_numpy_numbers_are_real_numbers():
    assert check_range('keep', np.float32(.5), 0, 1) == .5 and check_int('interrupt', np.int64(3)) == 3
    assert SelectiveBackpropCallback(keep=np.float64(.25)).keep == .25

@pytest.mark.parametrize('make,cls', [(lambda: BatchLossFilterCallback(keep=.5), 'BatchLossFilterCallback'),
                                      (lambda: Learner.batch_loss_filter(None, keep=.5), 'BatchLossFilterCallback')])
def test_an_unknown_keyword_names_the_class_called_and_its_arguments(make, cls):
    with pytest.raises(TypeError) as e: make()
    msg = str(e.value)
    assert msg.startswith(f"{cls} got an unexpected keyword argument 'keep'; its arguments are min_sample_perc, min_loss_perc, "
                          "skip_epochs, start, end, interrupt, scale_factor, fill_batch, score, score_precision")
    assert 'LossFilterCallback.__init__' not in msg

def test_min_loss_perc_zero_is_refused():
    with pytest.raises(ValueError, match=r'`min_loss_perc` must be in \(0, 1\], got 0'): BatchLossFilterCallback(min_loss_perc=0)
    assert BatchLossFilterCallback(min_loss_perc=1e-3).min_loss_perc == 1e-3

@pytest.mark.parametrize('make,msg', [
    (lambda: BatchLossFilterCallback(min_sample_perc=1), 'BatchLossFilterCallback(min_sample_perc=1) keeps every example'),
    (lambda: SelectiveBackpropCallback(keep=1), 'SelectiveBackpropCallback(keep=1) keeps every example'),
    (lambda: RandomBatchCallback(keep=1.), 'RandomBatchCallback(keep=1) keeps every example'),
    (lambda: StaleLossPruningCallback(prune=0), 'StaleLossPruningCallback(prune=0) leaves no example out'),
    (lambda: HideLearnedCallback(max_hide=0), 'HideLearnedCallback(max_hide=0) hides no example'),
    (lambda: RandomPruningCallback(keep=1), 'RandomPruningCallback(keep=1) leaves no example out')])
def test_a_setting_that_makes_a_filter_a_no_op_warns(make, msg):
    with pytest.warns(UserWarning, match='trains as plain fastai would') as rec: make()
    assert msg in str(rec[0].message) and rec[0].filename == __file__     # pointed at the caller's line

def test_working_settings_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        BatchLossFilterCallback(); SelectiveBackpropCallback(); StaleLossPruningCallback(); HideLearnedCallback()
        RandomPruningCallback(); RandomBatchCallback()

@pytest.mark.parametrize('patch', ['batch_loss_filter', 'selective_backprop', 'top_loss', 'stale_loss_pruning', 'hide_learned'])
def test_a_patch_refuses_a_positional_setting_and_names_its_settings(patch, digits_dls):
    learn = Learner(digits_dls, nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), loss_func=CrossEntropyLossFlat())
    with pytest.raises(TypeError, match=f'`Learner.{patch}` takes its settings by keyword'): getattr(learn, patch)(.9)
    assert not hasattr(learn, 'loss_filter')   # the Learner is untouched

@pytest.mark.parametrize('cls', [BatchLossFilterCallback, SelectiveBackpropCallback, TopLossCallback, StaleLossPruningCallback, HideLearnedCallback])
def test_a_filter_takes_its_settings_by_keyword(cls):
    with pytest.raises(TypeError, match='positional argument'): cls(.9)
