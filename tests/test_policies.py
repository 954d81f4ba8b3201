"Sampler-level policies on one base, KAKURENBO-style hiding, and the scoring pass's precision."
import math
import pytest, torch, torch.nn as nn
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, set_seed
import fastai.callback.all   # `no_bar`, `fit_one_cycle`
from loss_filters.core import hide_learned, share_by_rate
from fastai.callback.schedule import combined_cos
from loss_filters.batch import LossFilterBase, LossFilterCallback, BatchLossFilterCallback, SelectiveBackpropCallback
from loss_filters.sampler import SamplerPruningCallback, StaleLossPruningCallback, HideLearnedCallback, rate_ahead
from loss_filters.controls import RandomPruningCallback
from conftest import col
from test_stale import fixed_learner, Steps, _fit

nan = math.nan

# ------------------------------------------------------------------ the pure rule
def test_hide_learned_hides_the_lowest_known_losses_under_the_cut():
    t = torch.tensor([.01, .5, nan, .02, .05, .2, .001, .09])
    assert (~hide_learned(t, .25, .1)).nonzero().flatten().tolist() == [0, 6]          # floor(.25*8) = 2: the two lowest
    assert (~hide_learned(t, .5, .1)).nonzero().flatten().tolist() == [0, 3, 4, 6]     # 4 of the 5 at or under .1
    assert (~hide_learned(t, .9, .1)).nonzero().flatten().tolist() == [0, 3, 4, 6, 7]  # only those under the cut
    assert hide_learned(t, .9, 0.).all()                                               # none is at or under 0
    assert hide_learned(t, 0., 1.).all()                                               # nothing may hide
    assert hide_learned(torch.full((5,), nan), .5, 1.).all()                           # unknown losses never hide
    assert (~hide_learned(torch.tensor([.05, .05, .05]), .34, .1)).nonzero().flatten().tolist() == [0]   # ties: first one

@pytest.mark.parametrize('kw,match', [(dict(max_hide=1.), '`max_hide` must be in'), (dict(max_hide=-.1), '`max_hide` must be in'),
                                      (dict(max_loss=-1.), '`max_loss` must be >= 0'), (dict(max_loss=nan), '`max_loss` must be >= 0')])
def test_hide_learned_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match): hide_learned(torch.rand(4), **kw)

@pytest.mark.parametrize('kw,name', [(dict(max_hide=1.), 'max_hide'), (dict(confidence=0.), 'confidence'),
                                     (dict(confidence=1.5), 'confidence'), (dict(anneal=2.), 'anneal')])
def test_hide_callback_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=f'`{name}` must be in'): HideLearnedCallback(**kw)

# ------------------------------------------------------------------ one base for every sampler-level policy
class EvenPositions(SamplerPruningCallback):
    "A whole policy in two lines: pruned epochs train the examples at even positions of the dataset"
    def epoch_keep(self): return torch.arange(len(self.table), device=self.table.device) % 2 == 0, None

def _train_ids(learn): return [int(learn.dls.train_ds[i][0][-1]) for i in range(len(learn.dls.train_ds))]

def test_a_new_policy_is_a_subclass_with_one_method():
    learn, _ = fixed_learner()
    cb, steps = EvenPositions(anneal=0.), Steps()
    learn.add_cbs([cb, steps])
    _fit(learn, 3)
    ids, n = _train_ids(learn), len(learn.dls.train_ds)
    for ep in range(3):
        seen = sorted(i for e, batch, *_ in steps.steps if e == ep for i in batch.tolist())
        assert seen == sorted(ids if ep == 0 else ids[::2])                 # every kept example once, the rest never
    assert col(learn, 'samp_perc') == [1., pytest.approx(len(ids[::2]) / n), pytest.approx(len(ids[::2]) / n)]
    assert learn.dls.train.n == n and 'get_idxs' not in learn.dls.train.__dict__     # the loader is given back
    assert isinstance(cb, LossFilterBase) and not isinstance(cb, LossFilterCallback) and learn.loss_filter is cb

def test_the_sampler_pruners_share_the_base_and_the_batch_filters_do_not():
    for c in (StaleLossPruningCallback, RandomPruningCallback, HideLearnedCallback): assert issubclass(c, SamplerPruningCallback)
    for c in (BatchLossFilterCallback, SelectiveBackpropCallback): assert not issubclass(c, SamplerPruningCallback)
    assert not hasattr(SamplerPruningCallback, 'before_batch') or SamplerPruningCallback.before_batch is Callback.before_batch

# ------------------------------------------------------------------ hiding learned examples
class LRSpy(Callback):
    "The learning rate the optimiser steps with, per epoch"
    order = 100
    def before_fit(self): self.lrs = []
    def before_step(self): self.lrs.append((self.epoch, self.opt.hypers[0]['lr']))

def test_hide_trains_all_but_the_most_confident_and_never_the_same_twice_running():
    learn, losses = fixed_learner()
    cut = -math.log(.5)
    cb, steps, lrs = HideLearnedCallback(max_hide=.08, confidence=.5, anneal=0.), Steps(), LRSpy()
    learn.add_cbs([cb, steps, lrs])
    _fit(learn, 4, lr=1e-2)   # the model's output does not depend on its weight: the losses stay fixed
    ids = torch.tensor(_train_ids(learn)); n, k = len(ids), int(.08 * len(ids))
    l = losses[ids]
    assert int((l <= cut).sum()) >= 2 * k                                  # enough confident examples to hit the cap twice
    hidden = torch.zeros(n, dtype=torch.bool)
    for ep in range(4):
        seen = torch.tensor(sorted(i for e, batch, *_ in steps.steps if e == ep for i in batch.tolist()))
        if ep == 0: assert torch.equal(seen, ids.sort().values); continue
        expect = hide_learned(l.masked_fill(hidden, nan), .08, cut)           # the rule, on positions, without last epoch's hidden
        kept = set(ids[expect].tolist())
        assert set(seen.tolist()) <= kept and len(seen) == len(kept) // 32 * 32   # `drop_last`: the part-batch at the end goes
        assert int((~expect).sum()) == k and not (hidden & ~expect).any()   # the cap, and no example hidden twice running
        hidden = ~expect
        assert all(lr == pytest.approx(1e-2 * n / len(seen)) for e, lr in lrs.lrs if e == ep)   # fewer steps, a larger rate
    assert all(lr == pytest.approx(1e-2) for e, lr in lrs.lrs if e == 0)
    assert learn.opt.hypers[0]['lr'] == pytest.approx(1e-2)              # the scheduled rate is back after each step

def test_hide_without_lr_scale_leaves_the_rate_alone():
    learn, _ = fixed_learner()
    lrs = LRSpy()
    learn.add_cbs([HideLearnedCallback(lr_scale=False, anneal=0.), lrs])
    _fit(learn, 3, lr=1e-2)
    assert col(learn, 'samp_perc')[1] < 1 and all(lr == pytest.approx(1e-2) for _, lr in lrs.lrs)

class Boom(Callback):
    order = 100
    def before_step(self):
        if self.epoch == 1: raise RuntimeError('boom')

def test_hide_gives_the_rate_and_the_loader_back_after_an_error():
    learn, _ = fixed_learner()
    cb = HideLearnedCallback(anneal=0.)
    learn.add_cbs([cb, Boom()])
    with pytest.raises(RuntimeError, match='boom'): _fit(learn, 3, lr=1e-2)
    assert learn.opt.hypers[0]['lr'] == pytest.approx(1e-2)             # died between its scaling and its step: given back as the fit ended
    assert learn.dls.train.n == len(learn.dls.train_ds) and 'get_idxs' not in learn.dls.train.__dict__
    learn.remove_cb(cb)
    assert learn.opt.hypers[0]['lr'] == pytest.approx(1e-2)
    assert learn.dls.train.n == len(learn.dls.train_ds) and 'get_idxs' not in learn.dls.train.__dict__

def test_share_by_rate_follows_the_rate_once_it_is_below_the_peak():
    assert share_by_rate(.4, 1e-2, 1e-2) == pytest.approx(.4)        # the peak still ahead: all of it
    assert share_by_rate(.4, 5e-3, 1e-2) == pytest.approx(.2)        # half the peak rate: half the share
    assert share_by_rate(.4, 2e-2, 1e-2) == pytest.approx(.4)        # never more than `share`
    assert share_by_rate(.4, 0., 1e-2) == 0.                          # no rate left: nothing hides
    assert share_by_rate(0., 1e-3, 1e-2) == 0.

@pytest.mark.parametrize('args,match', [((1., 1., 1.), '`share` must be in'), ((.3, -1., 1.), '`lr_ahead` must be in'),
                                        ((.3, 1., 0.), r'`lr_peak` must be in \(0, inf\]'), ((.3, nan, 1.), '`lr_ahead` must be in')])
def test_share_by_rate_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match): share_by_rate(*args)

class HideSpy(Callback):
    "At each epoch's start, after the filter has chosen: the rate read off the schedule, the share allowed, the hidden mask"
    order = 100
    def before_fit(self): self.rows = []
    def before_train(self):
        cb = self.learn.loss_filter
        self.rows.append((rate_ahead(self.learn, self.epoch / self.n_epoch), cb.hide_share(), cb.hidden.clone()))

def test_rate_ahead_reads_the_one_cycle_schedule_and_is_none_without_one():
    learn, _ = fixed_learner()
    spy = HideSpy()
    learn.add_cbs([HideLearnedCallback(anneal=0.), spy])
    _fit(learn, 4, lr=1e-2, one_cycle=True)
    sched = combined_cos(.25, 1e-2 / 25, 1e-2, 1e-2 / 1e5)                # `fit_one_cycle`'s rate, its defaults
    for e, (r, *_) in enumerate(spy.rows):
        assert r[1] == pytest.approx(1e-2)                                  # the peak, at a quarter of the fit
        assert r[0] == pytest.approx(1e-2 if e / 4 <= .25 else sched(e / 4))   # the highest rate still ahead
    _fit(learn, 2, lr=1e-2)                                                 # `fit`: no scheduler sets the rate
    assert [r for r, *_ in spy.rows] == [None, None]

def test_follow_lr_steps_the_hidden_share_down_with_the_rate():
    learn, losses = fixed_learner()
    cut, spy = -math.log(.5), HideSpy()
    learn.add_cbs([HideLearnedCallback(max_hide=.1, confidence=.5, anneal=0., follow_lr=True), spy])
    _fit(learn, 5, lr=1e-2, one_cycle=True)
    ids = torch.tensor(_train_ids(learn)); l, n = losses[ids], len(ids)
    sched, hidden = combined_cos(.25, 1e-2 / 25, 1e-2, 1e-2 / 1e5), torch.zeros(n, dtype=torch.bool)
    shares = [s for _, s, _ in spy.rows]
    assert shares[:2] == [pytest.approx(.1)] * 2 and shares[2:] == [pytest.approx(.1 * sched(e / 5) / 1e-2) for e in (2, 3, 4)]
    for e, (_, share, mask) in enumerate(spy.rows[1:], 1):
        expect = ~hide_learned(l.masked_fill(hidden, nan), share, cut)      # the core rule at the stepped-down share
        assert torch.equal(mask, expect) and int(mask.sum()) == min(int(share * n), int((l.masked_fill(hidden, nan) <= cut).sum()))
        hidden = expect
    assert int(spy.rows[1][2].sum()) > int(spy.rows[4][2].sum()) > 0        # fewer hide as the rate decays

def test_follow_lr_without_a_schedule_hides_max_hide():
    learn, _ = fixed_learner()
    spy = HideSpy()
    learn.add_cbs([HideLearnedCallback(max_hide=.08, confidence=.5, anneal=0., follow_lr=True), spy])
    _fit(learn, 3, lr=1e-2)
    assert [s for _, s, _ in spy.rows] == [.08] * 3 and int(spy.rows[2][2].sum()) == int(.08 * len(learn.dls.train_ds))

# ------------------------------------------------------------------ the scoring pass's precision
class PrecisionSpy(nn.Module):
    "A small model that notes, at every forward, whether gradients are on and which autocast is active"
    def __init__(self):
        super().__init__(); self.lin, self.calls = nn.Linear(64, 10), []
    def forward(self, x):
        on = torch.is_autocast_enabled('cpu')
        self.calls.append((torch.is_grad_enabled(), on, torch.get_autocast_dtype('cpu') if on else None))
        return self.lin(x.flatten(1)).float()

@pytest.mark.parametrize('precision,dtype', [('full', None), ('bf16', torch.bfloat16), ('fp16', torch.float16)])
def test_score_precision_autocasts_the_scoring_pass_only(digits_dls, precision, dtype):
    set_seed(0)
    model = PrecisionSpy()
    learn = Learner(digits_dls, model, loss_func=CrossEntropyLossFlat())
    learn.add_cb(BatchLossFilterCallback(skip_epochs=0, score_precision=precision))
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    scoring = [c for c in model.calls if not c[0]][:len(digits_dls.train)]   # the training epoch's no-grad passes come first
    training = [c for c in model.calls if c[0]]
    assert scoring and training
    assert all(c[1:] == ((dtype is not None), dtype) for c in scoring)
    assert all(c[1:] == (False, None) for c in training)                    # the step itself keeps full precision
    assert col(learn, 'samp_perc')[0] < 1

@pytest.mark.parametrize('precision,dtype', [('full', None), ('bf16', torch.bfloat16)])
def test_score_precision_autocasts_a_proxys_scoring_pass_only(digits_dls, precision, dtype):
    set_seed(0)
    proxy = PrecisionSpy()
    learn = Learner(digits_dls, nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), loss_func=CrossEntropyLossFlat())
    learn.add_cb(BatchLossFilterCallback(skip_epochs=0, score_precision=precision, score_model=proxy))
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    scoring, learning = [c for c in proxy.calls[1:] if not c[0]], [c for c in proxy.calls if c[0]]   # the first call: the proxy's shape check
    assert proxy.calls[0] == (False, False, None) and len(scoring) == len(digits_dls.train) and learning
    assert all(c[1:] == ((dtype is not None), dtype) for c in scoring)      # the proxy scores in the filter's precision
    assert all(c[1:] == (False, None) for c in learning)                    # and learns in full precision

@pytest.mark.parametrize('lacks,mixed', [(True, False), (False, False), (True, True)])
def test_bf16_scoring_warns_on_a_cpu_without_bf16_units(digits_dls, monkeypatch, lacks, mixed):
    "Not under `to_fp16()`, whose autocast sets the scoring pass's precision in place of `score_precision`"
    import warnings, loss_filters.batch as lb
    assert isinstance(lb.cpu_lacks_bf16(), bool)
    monkeypatch.setattr(lb, 'cpu_lacks_bf16', lambda: lacks)
    learn = Learner(digits_dls, PrecisionSpy(), loss_func=CrossEntropyLossFlat())
    if mixed: learn.to_fp16()
    learn.add_cb(BatchLossFilterCallback(skip_epochs=0, score_precision='bf16'))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    said = [str(x.message) for x in w if 'without bf16 units' in str(x.message)]
    assert len(said) == int(lacks and not mixed) and all("keep `score_precision='full'`" in m for m in said)

@pytest.mark.parametrize('make', [lambda: BatchLossFilterCallback(score_precision='int8'),
                                  lambda: SelectiveBackpropCallback(score_precision='half'),
                                  lambda: Learner.selective_backprop(None, score_precision='fp64')])
def test_score_precision_must_be_known(make):
    with pytest.raises(ValueError, match="`score_precision` must be one of 'full', 'bf16', 'fp16'"): make()
