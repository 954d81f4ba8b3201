"Reference scores: each row known as its training example on every loader, nothing leaking into the model, the data order or the validation set, the work charged."
import random
import pytest, torch, torch.nn as nn
from fastai.basics import Learner, CrossEntropyLossFlat, accuracy, Callback, DataLoaders, set_seed
from loss_filters.batch import TopLossCallback, BatchLossFilterCallback, SelectiveBackpropCallback
from loss_filters.sampler import StaleLossPruningCallback, HideLearnedCallback, DropMislabeledCallback
from loss_filters.reference import ReferenceLosses
from loss_filters.runs import run_fit, add_work, parse_method, seed_loaders
from loss_filters.plan import matched_control
from conftest import make_dls, mlp
from test_apps import text_df, text_learner

class RowSpy(Callback):
    "Before the filter subsets a batch: the rows it names, and the batch's targets"
    order = -5
    def before_fit(self): self.seen = []
    def before_batch(self):
        f = self.learn.loss_filter
        if self.training and f._tap is not None and f._tap.order is not None:
            self.seen.append((f.batch_rows(len(self.yb[0])), self.yb[0].clone()))

def test_each_row_is_its_example_on_a_text_sorted_loader(text_df):
    set_seed(0)
    learn = text_learner(text_df)
    spy = RowSpy()
    learn.add_cbs([spy, TopLossCallback(keep=.5, reference='crossfit', reference_epochs=1)])
    learn.fit(2, 1e-2)
    ys = torch.stack([learn.dls.train_ds[int(i)][1] for i in range(len(learn.dls.train_ds))]).view(-1)
    assert len(spy.seen) == 2 * len(learn.dls.train)
    for rows, y in spy.seen: assert torch.equal(ys[rows], y.view(-1).cpu())
    assert 'get_idxs' not in learn.dls.train.__dict__   # `SortedDL`'s own order back

def _weights(learn): return torch.cat([p.detach().flatten() for p in learn.model.parameters()])

class FirstBatchState(Callback):
    "torch's and Python's global random states at the first training batch, before the filter scores it"
    order = -5
    def before_fit(self): self.state = None
    def before_batch(self):
        if self.training and self.state is None: self.state = (torch.get_rng_state(), random.getstate())

def test_a_reference_leaks_nothing_into_the_model_the_order_or_the_steps(digits):
    "A filter that keeps every row trains exactly the plain fit, and meets its first batch with the same random states: the references' training draws nothing the fit sees"
    dls = make_dls(*digits, bs=64)
    def fit(cb=None):
        set_seed(1)
        spy = FirstBatchState()
        learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=spy)
        seed_loaders(learn, 1)   # the loaders are shared: each fit from the same order
        if cb is not None: learn.add_cb(cb)
        with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
        return learn, spy.state
    plain, s0 = fit()
    with pytest.warns(UserWarning, match='keeps every example'):
        cb = BatchLossFilterCallback(min_sample_perc=1., skip_epochs=0, reference='crossfit')
    filt, s1 = fit(cb)
    assert filt.loss_filter.reference_work()['trained'] > 0
    assert torch.equal(s0[0], s1[0]) and s0[1] == s1[1]
    assert torch.equal(_weights(plain), _weights(filt))

def test_the_references_never_draw_the_validation_set(digits):
    dls = make_dls(*digits, bs=64)
    n_valid = []
    class Count(Callback):
        def before_validate(self): n_valid.append(1)
    orig = type(dls.valid).__iter__
    drawn = []
    def watch(self, *a):
        drawn.append(1)
        return orig(self, *a)
    dls.valid.__class__ = type('Watched', (type(dls.valid),), {'__iter__': watch})
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat())
    ReferenceLosses('crossfit', epochs=1).compute(learn)
    assert drawn == []

def test_a_loader_that_cannot_name_its_rows_is_refused_before_any_step(digits):
    x, y = digits
    tdl = torch.utils.data.DataLoader(list(zip(x, y)), batch_size=64, shuffle=True)
    dls = DataLoaders(tdl, torch.utils.data.DataLoader(list(zip(x[:100], y[:100])), batch_size=64))
    class Steps(Callback):
        def __init__(self): self.n = 0
        def after_step(self): self.n += 1
    steps = Steps()
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=steps).top_loss(keep=.5, reference='crossfit')
    with pytest.raises(ValueError, match='a `reference` needs a fastai DataLoader'): learn.fit(1)
    assert steps.n == 0

@pytest.mark.parametrize('spec', ['topk:reference=crossfit,reference_epochs=1', 'drop:reference_epochs=1', 'stale:reference=crossfit,reference_epochs=1'])
def test_the_references_are_charged_in_work_and_seconds(digits, spec):
    dls = make_dls(*digits, bs=64)
    run = run_fit(lambda: Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy), spec, epochs=3, lr=1e-2)
    assert run['ref_trained'] > 0 and run['ref_scored'] == len(dls.train_ds) and 0 < run['ref_s'] <= run['train_s']
    with_refs = add_work(dict(run), score_cost=.5)['work']
    without = add_work(dict(run, ref_trained=0, ref_scored=0, history=[h | dict(ref_trained=0, ref_scored=0) for h in run['history']]), score_cost=.5)['work']
    assert with_refs - without == pytest.approx((run['ref_trained'] + .5 * run['ref_scored']) / run['plain_epoch'])

def test_drop_is_controlled_by_random_pruning_from_the_first_epoch(digits):
    dls = make_dls(*digits, bs=64)
    run = run_fit(lambda: Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy), 'drop:reference_epochs=1', epochs=2, lr=1e-2)
    assert run['history'][0]['samp_perc'] < 1   # pruned from the first epoch
    c = matched_control('drop:reference_epochs=1', [run])
    assert c.startswith('random:keep=') and 'from_first=True' in c and 'anneal=0' in c
    ctl = run_fit(lambda: Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy), c, epochs=2, lr=1e-2)
    assert ctl['history'][0]['samp_perc'] == pytest.approx(run['history'][0]['samp_perc'], abs=.03)

@pytest.mark.parametrize('spec,msg', [('topk:ref_width=.5', 'only a method with `reference=crossfit`'),
                                      ('topk:reference=crossfit,ref_width=2', 'in (0, 1]'),
                                      ('blf:reference=holdout', "`reference` must be 'crossfit'"),
                                      ('stale:reference=crossfit,score=grad_norm', "score='loss'")])
def test_bad_reference_specs_are_named(spec, msg):
    with pytest.raises(ValueError, match=msg.replace('(', r'\(').replace(')', r'\)').replace('[', r'\[')): parse_method(spec)

def test_given_losses_and_a_model_of_yours(digits):
    dls = make_dls(*digits, bs=64)
    n = len(dls.train_ds)
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat()).top_loss(keep=.5, reference=torch.zeros(n))
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert learn.loss_filter.reference_work() == dict(trained=0, scored=0, seconds=learn.loss_filter.reference_work()['seconds'])
    with pytest.raises(ValueError, match=f'holds 3 losses, but the training set has {n}'):
        Learner(dls, mlp(), loss_func=CrossEntropyLossFlat()).top_loss(reference=torch.zeros(3)).fit(1)
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat()).stale_loss_pruning(reference=mlp())
    with learn.no_bar(), learn.no_logging(): learn.fit(2)
    assert learn.loss_filter.reference_work()['scored'] == n and learn.loss_filter.reference_work()['trained'] == 0

def _runs(values:dict, seeds=range(4)) -> list:
    "Synthetic runs: method -> (work, value); a little spread over seeds"
    return [dict(method=m, seed=s, repeat=0, work=w, final_metric=v + .001 * (s % 2), train_s=w) for m, (w, v) in values.items() for s in seeds]

def test_where_the_plain_curve_falls_training_less_is_the_alternative():
    "Wrong labels learned by heart: longer schedules end lower; a method is read against the best schedule at or below its work, not the longer plain run at its own work"
    from loss_filters.verdicts import plain_curve, equal_work
    plain = ['baseline:epochs=10', 'baseline:epochs=15', 'baseline']
    runs = _runs({'baseline:epochs=10': (10, .83), 'baseline:epochs=15': (15, .82), 'baseline': (20, .79),
                  'baseline:same_work=m': (18, .80), 'm': (18, .81)})
    c = plain_curve(runs, plain)
    assert c['falls'] and [round(v, 4) for _, v, _ in c['points']] == [.8305] * 3
    ew = equal_work(runs, 'm', plain, curve=c, same='baseline:same_work=m')
    assert ew['diff'] == pytest.approx(-.02, abs=1e-6) and ew['verdict'] == 'loses' and ew['how'] != 'same work'
    rising = _runs({'baseline:epochs=10': (10, .80), 'baseline:epochs=15': (15, .82), 'baseline': (20, .83)})
    assert not plain_curve(rising, plain)['falls']   # a rising curve is read as before

def test_no_reference_scores_a_row_it_trained_on(digits, monkeypatch):
    "Each reference trains on one half and scores the other: the halves are disjoint and every training example is scored once"
    import loss_filters.reference as ref
    calls, own = [], ref.subset_loader
    monkeypatch.setattr(ref, 'subset_loader', lambda dl, idxs, drop_last=False: calls.append(list(idxs)) or own(dl, idxs, drop_last))
    dls = make_dls(*digits, bs=64)
    r = ReferenceLosses('crossfit', epochs=1).compute(Learner(dls, mlp(), loss_func=CrossEntropyLossFlat()))
    assert len(calls) == 4   # per reference: its training half, then the half it scores
    (t0, s0), (t1, s1) = (calls[0], calls[1]), (calls[2], calls[3])
    assert not set(t0) & set(s0) and not set(t1) & set(s1)
    assert sorted(s0 + s1) == list(range(len(dls.train_ds))) and set(t0) == set(s1) and set(t1) == set(s0)
    assert not r.losses.isnan().any()
