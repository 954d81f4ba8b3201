"What a user reads of a comparison: the metric under its own name and direction, one sign for every difference, a factory with a filter refused, friendly inputs."
import pytest, torch
from torch import nn
from fastai.basics import Learner, DataLoaders, CrossEntropyLossFlat
from fastai.metrics import accuracy, error_rate
from loss_filters.compare import compare_filters, load_comparison
from conftest import make_dls
from loss_filters.report import full_text, brief_table

@pytest.fixture(scope='module')
def dls(digits): return make_dls(*digits, bs=64)

@pytest.fixture(scope='module')
def err_cmp(dls):
    "A comparison judged on a metric that is better lower"
    make = lambda: Learner(dls, nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), loss_func=CrossEntropyLossFlat(), metrics=error_rate)
    return compare_filters(make, 'baseline blf', epochs=3, lr=3e-2, seeds=2, budgets='.67', show_progress=False)

def test_what_is_printed_first_fits_a_terminal_and_names_the_metric(err_cmp):
    text = repr(err_cmp)
    assert 'error_rate (lower is better)' in text and 'pays' not in text.split('payoff')[0].split('\n')[-1]
    assert max(len(l) for l in text.splitlines()) <= 100 and 'blf' in text and 'cmp.table' in text

def test_a_lower_is_better_metric_is_printed_under_its_own_name_and_units(err_cmp):
    text = full_text(err_cmp)
    assert 'final_error_rate' in text and 'final_metric' not in text and 'lower is better' in text
    header, base = text.splitlines()[1:3]
    value = float(base[header.index('final_error_rate'):].split()[0])
    assert value == pytest.approx(err_cmp.table.loc['baseline', 'final_error_rate'], abs=1e-4) and value > 0   # the error rate itself, not negated

def test_every_printout_gives_a_difference_the_same_sign(err_cmp):
    r = next(r for r in err_cmp.rows if r['method'] == 'blf')
    want = f"{r['vs_plain']['diff'] * 100:+.2f}"
    assert want in brief_table(err_cmp) and want in '\n'.join(err_cmp.verdicts)
    assert err_cmp.table.loc['blf', 'vs_random'].split()[0] == f"{r['vs_random']['diff'] * 100:+.2f}"

def test_a_factory_that_brings_a_filter_is_refused(dls):
    make = lambda: Learner(dls, nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), loss_func=CrossEntropyLossFlat(), metrics=accuracy).batch_loss_filter(min_loss_perc=.5)
    with pytest.raises(ValueError, match='loss filter on it'): compare_filters(make, 'baseline blf', epochs=2, seeds=1, show_progress=False)

def test_methods_as_a_list_and_a_folder_that_is_a_file(dls, tmp_path):
    make = lambda: Learner(dls, nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    cmp = compare_filters(make, ['baseline', 'blf'], epochs=2, seeds=1, controls=False, show_progress=False)
    assert [r['method'] for r in cmp.runs] == ['baseline', 'blf']
    f = tmp_path / 'runs.txt'; f.write_text('x')
    with pytest.raises(ValueError, match='`folder` must be a folder'): compare_filters(make, 'baseline blf', folder=f, show_progress=False)

def test_the_time_estimate_says_what_it_counts():
    from loss_filters.report import estimate_text
    t = estimate_text(.4, 12.3)
    assert 'about 12 more such fits' in t and 'about 4.9 s' in t and '0.4 s' in t and 'about 0 s' not in t

def test_a_target_finer_than_one_validation_example_is_warned(dls):
    make = lambda: Learner(dls, nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    with pytest.warns(UserWarning, match='finer than one of the 450 validation examples'):   # asked for
        compare_filters(make, 'baseline', epochs=1, seeds=1, controls=False, show_progress=False, target_drop=.001)

def test_the_comparisons_figure_is_one_picture_a_reader_can_read(err_cmp):
    import matplotlib; matplotlib.use('Agg')
    from matplotlib.figure import Figure
    import copy
    from loss_filters.verdicts import seconds_unread
    assert len(err_cmp.plot().axes) == (2 if seconds_unread(err_cmp.runs) is None else 1)   # the time panel only where seconds are read
    steady = copy.copy(err_cmp); steady.runs = [r | dict(train_s=r['work']) for r in err_cmp.runs]   # one speed throughout: its seconds read
    fig = steady.plot()
    assert isinstance(fig, Figure) and len(fig.axes) == 2          # `plt.savefig` after it saves both panels
    top, bottom = fig.axes
    assert 'interval of the test' in top.get_title() and 'error_rate' in top.get_ylabel() and 'error_rate' in bottom.get_ylabel()
    top_labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert len(top_labels) <= 8 and any(l.startswith('plain model, its schedules') for l in top_labels) and any(l.startswith('random choice at every') for l in top_labels)
    assert "the plain model at a method's work (its colour)" in top_labels and "random choice at a method's work (its colour)" in top_labels   # the two controls, told apart
    labels = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
    assert all(len(l) <= 60 for l in labels) and not any(l.startswith('random_batch:') for l in labels)
    assert any(l.startswith('plain, ') for l in labels)
    colour = lambda ax, name: next(h.get_color() if hasattr(h, 'get_color') else h.lines[0].get_color()
                                   for h, t in zip(*ax.get_legend_handles_labels()) if t.split(':')[0] == name)
    assert tuple(colour(top, 'blf')) == tuple(colour(bottom, 'blf'))   # a method keeps its colour across the panels
    assert all(any(t.startswith('target ') for t in ax.get_legend_handles_labels()[1]) for ax in (top, bottom))   # the target in both panels

def test_short_labels_say_the_controls_in_words():
    from loss_filters.report import short_label
    assert short_label('random_batch:keep=0.557,start=0,end=1,interrupt=0,skip_epochs=1,fill_batch=0') == 'random choice, keep 0.56'
    assert short_label('baseline:epochs=7') == 'plain, 7 epochs' and short_label('blf:proxy=.25') == 'blf:proxy=.25'
    assert short_label('baseline:same_work=topk/proxy=.25') == "plain at topk:proxy=.25's work"   # the alternatives at a method's own work
    assert short_label('random_batch:keep=0.806,epochs=7,same_work=blf/epochs=7') == "random choice, keep 0.81 at blf:epochs=7's work"

def test_the_defaults_agree_with_each_other():
    "The default `budgets` give four distinct plain schedules at the default 5 epochs, without a warning"
    import inspect, warnings
    from loss_filters.plan import plain_schedules as _plain_schedules, Design
    budgets, epochs = (inspect.signature(Design).parameters[k].default for k in ('budgets', 'epochs'))   # what `compare_filters` trains by default
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert _plain_schedules(epochs, budgets) == ['baseline:epochs=3', 'baseline:epochs=4', 'baseline:epochs=6', 'baseline:epochs=7']

def test_a_default_target_says_nothing_a_finer_one_asked_for_warns(dls):
    "Left to its default, the target's distance brings no warning for a setting the user never passed; asked finer than one validation example, it warns"
    import warnings
    from loss_filters.compare import _target_drop
    n = len(dls.valid_ds)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert _target_drop('accuracy', None, n) is None and _target_drop('accuracy', 2 / n, n) == 2 / n
    with pytest.warns(UserWarning, match='finer than one of the'): assert _target_drop('accuracy', .001, n) == .001

def test_a_comparison_that_cannot_give_a_verdict_says_so_before_it_trains(dls):
    "One seed, or no controls: the warning comes before the first fit"
    trained = []
    def make():
        trained.append(1)
        return Learner(dls, nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    class Stop(Exception): pass
    def on_run(*a): raise Stop   # before the first fit is handed over
    for kw, words in ((dict(seeds=1), 'one seed gives no verdict'), (dict(seeds=2, controls=False), 'no method can be judged')):
        with pytest.warns(UserWarning, match=words), pytest.raises(Stop):
            compare_filters(make, 'baseline blf', epochs=2, budgets='.5 1.5', show_progress=False, warmup=False, on_run=on_run, **kw)
