"The callbacks on real fastai Learners: what is kept, what is recorded, and what else fastai users combine them with."
import math, pickle, warnings
import numpy as np, pytest, torch, torch.nn as nn, torch.nn.functional as F
from fastai.basics import Learner, Callback, accuracy, CrossEntropyLossFlat, set_seed, load_learner, find_bs
from fastai.callback.all import (GradientAccumulation, MixedPrecision, MixUp, CutMix, CSVLogger, SaveModelCallback,
                                 EarlyStoppingCallback, ShowGraphCallback)
from loss_filters.core import select_by_loss_share
from loss_filters.batch import *
from conftest import make_dls, mlp, bn_cnn, BatchSpy, ItemList, col

def learner(dls, model, **kw):
    "A Learner with cross-entropy unless the test names its own loss"
    return Learner(dls, model, loss_func=kw.pop('loss_func', CrossEntropyLossFlat()), **kw)

def fit(learn, n=2, lr=1e-2, one_cycle=True):
    with learn.no_bar(), learn.no_logging(): (learn.fit_one_cycle if one_cycle else learn.fit)(n, lr)
    return learn

class SelectSpy:
    "Wraps a filter's `select` to keep every (losses, kept indices) pair"
    def __init__(self, cb):
        self.calls, self._select = [], cb.select
        cb.select = self
    def __call__(self, losses):
        idxs = self._select(losses)
        self.calls.append((losses.clone(), idxs.clone()))
        return idxs

def _share_rule_size(losses, p, s):
    l = np.sort(np.where(np.isnan(losses), np.inf, losses))[::-1].astype(np.float64)
    cum = np.cumsum(np.where(np.isfinite(l), l, 0.))
    return max(int(np.argmax(cum >= p * cum[-1])) + 1, int((~np.isfinite(l)).sum()), math.ceil(round(len(l) * s, 9)), 1)

# ------------------------------------------------------------------ each callback fits and keeps what its rule says
def test_batch_loss_filter_kept_sizes_follow_the_rule(digits_dls):
    set_seed(0)
    learn = learner(digits_dls, mlp(), metrics=accuracy).batch_loss_filter(min_loss_perc=.8, min_sample_perc=.1)
    spy, bspy = SelectSpy(learn.loss_filter), BatchSpy()
    fit(learn.add_cb(bspy), 3)
    n_batches = len(digits_dls.train)
    assert len(spy.calls) == 2 * n_batches                      # epochs 1 and 2 filtered, epoch 0 not
    trained = {(e, i): n for e, i, n in bspy.sizes}
    for (losses, idxs), rec in zip(spy.calls, learn.loss_filter.stats):
        assert len(idxs) == _share_rule_size(losses.numpy(), .8, .1) == rec['kept']
        assert trained[(rec['epoch'], rec['iter'] % n_batches)] == rec['kept']   # the step really trained on that many
    assert all(n == 64 for e, i, n in bspy.sizes if e == 0)

def test_selective_backprop_kept_sizes_and_schedule(digits_dls):
    set_seed(0)
    learn = learner(digits_dls, mlp(), metrics=accuracy).selective_backprop(keep=.25, start=.5, end=1., interrupt=2)
    bspy = BatchSpy()
    fit(learn.add_cb(bspy), 4)
    n_batches = len(digits_dls.train)
    for e, i, n in bspy.sizes:
        pct = (e * n_batches + i) / (4 * n_batches)
        assert n == (16 if pct >= .5 - 1e-9 and (i + 1) % 2 != 0 else 64), (e, i, pct, n)
    samp = col(learn, 'samp_perc')
    assert samp[0] == samp[1] == 1. and samp[2] < 1 and samp[3] < 1
    expected = [sum(n for e, i, n in bspy.sizes if e == ep) / (64 * n_batches) for ep in range(4)]
    assert samp == pytest.approx(expected)

def test_samp_perc_one_before_filtering_and_below_after(digits_dls):
    set_seed(0)
    learn = fit(learner(digits_dls, mlp(), metrics=accuracy).batch_loss_filter(), 3)
    names = list(learn.recorder.metric_names)
    si, li = names.index('samp_perc') - 1, names.index('loss_perc') - 1
    assert learn.recorder.values[0][si] == 1. and learn.recorder.values[0][li] == 1.
    for v in learn.recorder.values[1:]:
        assert v[si] < 1 and .9 <= v[li] <= 1.                    # at least 90% of the loss was kept
    assert learn.recorder.values[-1][2] > .5                      # and it still learns: accuracy well above chance

class Passthrough(nn.Module):
    "The input is the logits: the losses are whatever the test puts in the batch"
    def __init__(self): super().__init__(); self.w = nn.Parameter(torch.zeros(1))
    def forward(self, x): return x + 0 * self.w

def test_loss_share_keeps_exactly_the_top_loss_examples():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g) * 3, torch.randint(0, 4, (32,), generator=g)
    dls = make_dls(x, y, bs=32, valid_pct=.0)
    dls.valid = dls.train.new(shuffle=False, drop_last=False)
    learn = learner(dls, Passthrough(), loss_func=CrossEntropyLossFlat(), lr=0.).batch_loss_filter(min_loss_perc=.6, skip_epochs=0)
    spy = BatchSpy(keep_inputs=True)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 0.)
    learn.add_cb(spy)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 0.)
    (trained_x,), = spy.inputs
    losses = F.cross_entropy(x, y, reduction='none')
    # the kept examples are the highest-loss rows of x, in descending loss order, and exactly as many as the rule needs
    l_trained = F.cross_entropy(trained_x, y[_rows(x, trained_x)], reduction='none')
    order = losses.argsort(descending=True)
    k = _share_rule_size(losses.numpy(), .6, 0.)
    assert sorted(_rows(x, trained_x).tolist()) == sorted(order[:k].tolist())
    assert l_trained.sum() >= .6 * losses.sum() and l_trained.sum() - l_trained.min() < .6 * losses.sum()

def _rows(x, sub):
    "Row indices of `x` that `sub`'s rows are"
    return torch.stack([torch.nonzero((x == r).all(1))[0, 0] for r in sub])

# ------------------------------------------------------------------ the scoring pass leaves no trace
class _Snapshot(Callback):
    def __init__(self, order): self.order, self.states = order, []
    def before_batch(self):
        if self.training: self.states.append({k: v.clone() for k, v in self.model.state_dict().items()})

def test_scoring_pass_leaves_batchnorm_statistics_untouched(digits_dls):
    set_seed(0)
    learn = learner(digits_dls, bn_cnn(), metrics=accuracy).batch_loss_filter(skip_epochs=0)
    before, after = _Snapshot(LossFilterCallback.order - .5), _Snapshot(LossFilterCallback.order + .5)
    fit(learn.add_cbs([before, after]), 1)
    assert len(before.states) == len(digits_dls.train) and len(learn.loss_filter.stats) == len(digits_dls.train)
    for a, b in zip(before.states, after.states):
        for k in a: assert torch.equal(a[k], b[k]), k
    bns = [m for m in learn.model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(m.num_batches_tracked.item() == len(digits_dls.train) for m in bns)   # one count per training step, not two
    assert all(m.track_running_stats for m in bns)

# ------------------------------------------------------------------ batches of several inputs and targets
def test_multi_input_model():
    class TwoIn(nn.Module):
        def __init__(self): super().__init__(); self.a, self.b = nn.Linear(5, 2), nn.Linear(3, 2)
        def forward(self, x1, x2): return self.a(x1) + self.b(x2)
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(256, 5, generator=g), torch.randn(256, 3, generator=g)
    y = ((x1[:, 0] + x2[:, 0]) > 0).long()
    learn = learner(make_dls((x1, x2), y, bs=32), TwoIn(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    spy = BatchSpy(keep_inputs=True)
    fit(learn.batch_loss_filter(skip_epochs=0).add_cb(spy), 5, lr=5e-2)
    assert any(n < 32 for _, _, n in spy.sizes)
    for xs, (_, _, n) in zip(spy.inputs, spy.sizes): assert xs[0].shape == (n, 5) and xs[1].shape == (n, 3)
    assert learn.recorder.values[-1][2] > .8

def test_tuple_targets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=g)
    y1, y2 = (x[:, 0] > 0).long(), (x[:, 1] > 0).long()
    def two_heads(pred, t1, t2, reduction='mean'):
        return F.cross_entropy(pred[:, :2], t1, reduction=reduction) + F.cross_entropy(pred[:, 2:], t2, reduction=reduction)
    learn = learner(make_dls(x, (y1, y2), bs=32), nn.Linear(6, 4), loss_func=two_heads)
    spy = BatchSpy()
    fit(learn.selective_backprop(keep=.5, start=0., end=1., interrupt=0).add_cb(spy), 2)
    assert all(n == 16 for _, _, n in spy.sizes)

# ------------------------------------------------------------------ Recorder columns: once, wherever the callback came from
def _names(learn): return list(learn.recorder.metric_names)

@pytest.mark.parametrize('how', ['cbs', 'add_cb', 'patch'])
def test_columns_appear_exactly_once(digits_dls, how):
    kw = dict(cbs=BatchLossFilterCallback()) if how == 'cbs' else {}
    learn = learner(digits_dls, mlp(), metrics=accuracy, **kw)
    if how == 'add_cb': learn.add_cb(BatchLossFilterCallback())
    if how == 'patch': learn.batch_loss_filter()
    for _ in range(3): fit(learn, 1)
    assert _names(learn) == ['epoch', 'train_loss', 'valid_loss', 'accuracy', 'samp_perc', 'loss_perc', 'full_train_loss', 'time']
    assert len(learn.recorder.values[-1]) == 6
    assert [type(m).__name__ for m in learn.metrics] == ['AvgMetric']   # the user's metrics are never touched

def test_columns_once_after_a_failed_fit(digits_dls):
    class Boom(Callback):
        def after_batch(self): raise RuntimeError('boom')
    learn = learner(digits_dls, mlp(), metrics=accuracy).batch_loss_filter()
    with pytest.raises(RuntimeError): fit(learn.add_cb(Boom()), 1)
    learn.remove_cb(learn.boom)
    fit(learn, 1)
    assert _names(learn).count('samp_perc') == 1 and _names(learn).count('loss_perc') == 1

def test_patch_replaces_the_filter_and_returns_the_learner(digits_dls):
    learn = learner(digits_dls, mlp())
    assert learn.batch_loss_filter() is learn
    assert learn.selective_backprop(keep=.3) is learn
    filters = [cb for cb in learn.cbs if isinstance(cb, LossFilterCallback)]
    assert len(filters) == 1 and isinstance(learn.loss_filter, SelectiveBackpropCallback) and learn.loss_filter.keep == .3

def test_two_filters_put_in_cbs_by_hand_are_refused_before_training(digits_dls):
    learn = learner(digits_dls, mlp(), cbs=BatchLossFilterCallback())
    learn.cbs.append(SelectiveBackpropCallback())                      # past `add_cb`, which would replace the first
    w = learn.model[1].weight.detach().clone()
    with pytest.raises(ValueError, match='only one loss filter per Learner: BatchLossFilterCallback and SelectiveBackpropCallback'):
        fit(learn, 1)
    assert torch.equal(w, learn.model[1].weight)

# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize('make,name', [
    (lambda: SelectiveBackpropCallback(keep=0.), 'keep'), (lambda: SelectiveBackpropCallback(keep=1.5), 'keep'),
    (lambda: SelectiveBackpropCallback(start=.9, end=.5), 'start'), (lambda: SelectiveBackpropCallback(start=-.1), 'start'),
    (lambda: SelectiveBackpropCallback(end=1.1), 'end'), (lambda: SelectiveBackpropCallback(interrupt=-1), 'interrupt'),
    (lambda: SelectiveBackpropCallback(scale_factor=0.), 'scale_factor'), (lambda: SelectiveBackpropCallback(scale_factor=2.), 'scale_factor'),
    (lambda: BatchLossFilterCallback(min_loss_perc=1.1), 'min_loss_perc'), (lambda: BatchLossFilterCallback(min_sample_perc=-.1), 'min_sample_perc'),
    (lambda: BatchLossFilterCallback(skip_epochs=-1), 'skip_epochs'), (lambda: Learner.batch_loss_filter(None, min_loss_perc=2), 'min_loss_perc')])
def test_bad_hyperparameters_raise_in_the_constructor(make, name):
    with pytest.raises(ValueError, match=f'`{name}`'): make()

def test_loss_without_per_example_values_is_refused_at_before_fit(digits_dls):
    def mean_ce(pred, y): return F.cross_entropy(pred, y)
    learn = learner(digits_dls, mlp(), loss_func=mean_ce).batch_loss_filter()
    spy = BatchSpy(); learn.add_cb(spy)
    w = learn.model[1].weight.detach().clone()
    with pytest.raises(TypeError, match='`mean_ce` cannot give per-example losses'): fit(learn, 1)
    assert spy.sizes == [] and torch.equal(w, learn.model[1].weight)

def test_exception_mid_batch_restores_reduction_and_norm_layers(digits_dls):
    class Fragile(nn.Module):
        "Fails during the 3rd scoring pass"
        def __init__(self): super().__init__(); self.net, self.calls = bn_cnn(), 0
        def forward(self, x):
            if not torch.is_grad_enabled() and self.training:
                self.calls += 1
                if self.calls == 3: raise RuntimeError('fails while scoring')
            return self.net(x)
    lf = CrossEntropyLossFlat()
    learn = learner(digits_dls, Fragile(), loss_func=lf).batch_loss_filter(skip_epochs=0)
    with pytest.raises(RuntimeError, match='fails while scoring'): fit(learn, 1)
    assert lf.reduction == 'mean' and learn.model.training
    assert all(m.track_running_stats for m in learn.model.modules() if isinstance(m, nn.BatchNorm2d))

def test_scale_factor_on_non_image_input_is_a_clear_error(digits_dls):
    x, y = torch.randn(128, 6), torch.randint(0, 2, (128,))
    learn = learner(make_dls(x, y, bs=32), nn.Linear(6, 2), loss_func=CrossEntropyLossFlat())
    learn.selective_backprop(start=0., scale_factor=.5)
    with pytest.raises(ValueError, match='`scale_factor`=0.5 needs a 3-D to 5-D'): fit(learn, 1)

def test_scale_factor_scores_a_downsampled_batch(digits_dls):
    seen = []
    class Shapes(nn.Module):
        def __init__(self): super().__init__(); self.net = bn_cnn()
        def forward(self, x): seen.append((torch.is_grad_enabled(), x.shape[-1])); return self.net(x)
    learn = learner(digits_dls, Shapes()).selective_backprop(start=0., end=1., interrupt=0, scale_factor=.5)
    fit(learn, 1)
    train_calls = seen[:2 * len(digits_dls.train)]
    assert [s for g, s in train_calls if not g] == [4] * len(digits_dls.train)   # scoring: 8x8 -> 4x4
    assert [s for g, s in train_calls if g] == [8] * len(digits_dls.train)       # training step: full size

# ------------------------------------------------------------------ fastai interop
def test_lr_find_is_left_alone(digits_dls):
    learn = learner(digits_dls, mlp(), metrics=accuracy).batch_loss_filter(skip_epochs=0)
    spy = BatchSpy(); learn.add_cb(spy)
    with learn.no_bar(): learn.lr_find(num_it=20, show_plot=False)
    assert spy.sizes and all(n == 64 for _, _, n in spy.sizes)
    assert not hasattr(learn.loss_filter, 'stats') or len(learn.loss_filter.stats) == 0
    assert [type(m).__name__ for m in learn.metrics] == ['AvgMetric']

def test_get_preds_and_validate_are_unfiltered(digits_dls):
    learn = fit(learner(digits_dls, mlp(), metrics=accuracy).batch_loss_filter(skip_epochs=0), 1)
    cb = learn.loss_filter
    stats, n_hist = list(cb.stats), int(cb.hist.table()[0].sum())
    preds, targs = learn.get_preds()
    assert len(preds) == len(digits_dls.valid_ds)
    assert len(learn.validate()) == 2
    assert stats and cb.stats == stats and int(cb.hist.table()[0].sum()) == n_hist   # the fit's records are kept

def test_gradient_accumulation_refused_under_several_processes(digits_dls, monkeypatch):
    import loss_filters.base as lfb
    monkeypatch.setattr(lfb, 'dist_world', lambda: (0, 2))                     # refused in `before_fit`, before any collective
    learn = learner(digits_dls, mlp(), cbs=[GradientAccumulation(n_acc=128), BatchLossFilterCallback()])
    with pytest.raises(ValueError, match='GradientAccumulation` with several processes'): fit(learn, 1)
    with pytest.raises(ValueError, match='with `fill_batch=True` cannot run with several processes'):
        fit(learner(digits_dls, mlp(), cbs=BatchLossFilterCallback(fill_batch=True)), 1)
    sb = SelectiveBackpropCallback(fill_batch=True)     # a fixed count per batch: the ranks stay in step, so both are allowed
    learner(digits_dls, mlp(), cbs=[GradientAccumulation(n_acc=128), sb])
    assert sb._check_distributed() is None

def test_gradient_accumulation(digits_dls):
    set_seed(0)
    learn = learner(digits_dls, mlp(), metrics=accuracy, cbs=GradientAccumulation(n_acc=128)).selective_backprop(start=0., end=1., interrupt=0)
    spy = BatchSpy(); fit(learn.add_cb(spy), 2)
    assert all(n == 32 for _, _, n in spy.sizes) and learn.recorder.values[-1][2] > .3

def test_to_fp16_scores_inside_the_training_autocast(digits_dls):
    "On a CPU fastai's autocast is a no-op; what matters is that scoring enters the very context the step uses"
    class AutocastSpy:
        def __init__(self, inner): self.inner, self.depth = inner, 0
        def __enter__(self): self.depth += 1; return self.inner.__enter__()
        def __exit__(self, *a): self.depth -= 1; return self.inner.__exit__(*a)
    class InstallSpy(Callback):
        order = MixedPrecision.order + 1
        def before_fit(self): self.spy = self.learn.mixed_precision.autocast = AutocastSpy(self.learn.mixed_precision.autocast)
    depths = []
    class Model(nn.Module):
        def __init__(self): super().__init__(); self.net = mlp()
        def forward(self, x): depths.append((torch.is_grad_enabled(), installer.spy.depth)); return self.net(x)
    installer = InstallSpy()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn = learner(digits_dls, Model(), metrics=accuracy, cbs=installer).to_fp16().batch_loss_filter(skip_epochs=0)
        fit(learn, 1)
    scoring = [d for g, d in depths if not g][:len(digits_dls.train) * 2]
    assert len([1 for g, d in depths if g]) == len(digits_dls.train)
    assert scoring and all(d == 1 for d in scoring[:len(digits_dls.train)])   # every scoring pass ran inside it

@pytest.mark.parametrize('mix', [MixUp, CutMix])
def test_mixup_and_cutmix_mix_what_is_kept(digits_dls, mix):
    set_seed(0)
    learn = learner(digits_dls, bn_cnn(), metrics=accuracy, cbs=mix()).selective_backprop(keep=.5, start=0., end=1., interrupt=0)
    spy = BatchSpy(); fit(learn.add_cb(spy), 2)
    assert all(n == 32 for _, _, n in spy.sizes)
    assert learn.loss_func is learn.loss_filter.score_func       # MixUp gave the loss function back
    assert not math.isnan(learn.recorder.values[-1][0])

def test_csvlogger_savemodel_earlystopping(digits_dls, tmp_path):
    learn = learner(digits_dls, mlp(), metrics=accuracy, path=tmp_path).batch_loss_filter()
    cbs = [CSVLogger(fname='hist.csv'), SaveModelCallback(monitor='valid_loss', fname='best'),
           EarlyStoppingCallback(monitor='valid_loss', patience=5)]
    fit(learn.add_cbs(cbs), 3)
    lines = (tmp_path / 'hist.csv').read_text().strip().splitlines()
    header = lines[0].split(',')
    assert header.count('samp_perc') == 1 and header.count('loss_perc') == 1 and len(lines) == 4
    samp = [float(l.split(',')[header.index('samp_perc')]) for l in lines[1:]]
    assert samp[0] == 1. and samp[1] < 1
    assert (tmp_path / 'models' / 'best.pth').exists()

def test_show_graph_and_progress_bar(digits_dls, capsys):
    import matplotlib; matplotlib.use('Agg')
    learn = learner(digits_dls, mlp(), metrics=accuracy, cbs=ShowGraphCallback()).batch_loss_filter()
    learn.fit_one_cycle(2, 1e-2)                       # with fastai's progress output, as a user runs it
    printed = capsys.readouterr().out
    assert 'samp_perc' in printed and 'loss_perc' in printed
    assert len(learn.recorder.values) == 2 and col(learn, 'samp_perc')[1] < 1

def test_early_stopping_can_monitor_samp_perc(digits_dls):
    learn = learner(digits_dls, mlp(), metrics=accuracy).batch_loss_filter()
    fit(learn.add_cb(EarlyStoppingCallback(monitor='samp_perc', comp=np.greater, patience=0)), 5)
    assert len(learn.recorder.values) < 5

def test_export_and_load_learner(digits_dls, tmp_path):
    learn = fit(learner(digits_dls, mlp(), metrics=accuracy, path=tmp_path).batch_loss_filter(min_loss_perc=.8), 2)
    cbs = list(learn.cbs)
    learn.export('exp.pkl')
    loaded = load_learner(tmp_path / 'exp.pkl')
    assert not hasattr(loaded, 'loss_filter') and not any(isinstance(c, (LossFilterBase, LossFilterColumns)) for c in loaded.cbs)
    assert list(learn.cbs) == cbs and learn.loss_filter.min_loss_perc == .8 and learn.loss_filter.epoch_stats   # kept here
    assert learn.loss_filter_columns is learn.loss_filter.columns
    x = digits_dls.valid.one_batch()[0]
    learn.model.eval()
    assert torch.allclose(loaded.model(x), learn.model(x))

def test_remove_cb_restores_plain_training(digits_dls):
    learn = fit(learner(digits_dls, mlp(), metrics=accuracy).batch_loss_filter(skip_epochs=0), 1)
    learn.remove_cb(learn.loss_filter)
    spy = BatchSpy(); fit(learn.add_cb(spy), 1)
    assert all(n == 64 for _, _, n in spy.sizes) and 'samp_perc' not in _names(learn)

def test_nonfinite_losses_warn_once_per_fit(digits_dls):
    class NaNOnce(nn.Module):
        def __init__(self): super().__init__(); self.net = mlp()
        def forward(self, x):
            out = self.net(x)
            if not torch.is_grad_enabled(): out = out.clone(); out[0] = float('nan')   # scoring pass only
            return out
    learn = learner(digits_dls, NaNOnce()).batch_loss_filter(skip_epochs=0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        fit(learn, 2)
    msgs = [str(x.message) for x in w if 'NaN or infinite' in str(x.message)]
    assert len(msgs) == 1
    assert all(r['kept'] >= 1 for r in learn.loss_filter.stats)

class LossSpy(Callback):
    "The training loss and batch size of every step"
    order = 100
    def __init__(self): self.rec = []
    def after_loss(self):
        if self.training: self.rec.append((self.epoch, float(self.loss), find_bs(self.yb)))

def test_full_train_loss_column_is_every_examples_loss(digits_dls):
    spy = LossSpy()
    learn = fit(learner(digits_dls, mlp(), metrics=accuracy).batch_loss_filter().add_cb(spy), 2)   # epoch 0 unfiltered
    ep = learn.loss_filter.epoch_stats
    first = [(l, n) for e, l, n in spy.rec if e == 0]
    assert ep[0]['full_loss'] == pytest.approx(sum(l * n for l, n in first) / sum(n for _, n in first), rel=1e-5)
    batches = [r for r in learn.loss_filter.stats if r['epoch'] == 1]
    assert ep[1]['full_loss'] == pytest.approx(sum(r['full_loss'] * r['bs'] for r in batches) / sum(r['bs'] for r in batches), rel=1e-5)
    assert all(0 < r['full_loss'] for r in learn.loss_filter.stats)
    assert col(learn, 'full_train_loss') == pytest.approx([ep[0]['full_loss'], ep[1]['full_loss']])
    kept = [l for e, l, _ in spy.rec if e == 1]
    assert ep[1]['full_loss'] < np.mean(kept)   # fastai's train_loss is the kept, harder examples' loss

def test_plot_kept_returns_a_figure(digits_dls):
    import matplotlib; matplotlib.use('Agg')
    learn = fit(learner(digits_dls, mlp()).batch_loss_filter(), 2)
    fig = learn.loss_filter.plot_kept()
    line = fig.axes[0].lines[0]
    assert len(line.get_xdata()) == len(learn.loss_filter.stats) == len(digits_dls.train)

# ------------------------------------------------------------------ fill_batch: pooled full batches
class IdModel(nn.Module):
    "Logits are all columns but the last, which carries the example's id"
    def __init__(self): super().__init__(); self.lin = nn.Linear(4, 4)
    def forward(self, x): return self.lin(x[:, :-1])

class RawIds(Callback):
    "Ids of each loader batch, before any filter touched it"
    order = LossFilterCallback.order - .5
    def before_fit(self): self.ids = []
    def before_batch(self):
        if self.training: self.ids.append((self.epoch, self.iter, self.xb[0][:, -1].long().clone()))

class TrainedIds(Callback):
    "Ids of what each training step really trained on"
    order = 100
    def before_fit(self): self.ids = []
    def after_pred(self):
        if self.training and not self.learn.loss_filter.scoring: self.ids.append((self.epoch, self.xb[0][:, -1].long().clone()))

@pytest.mark.parametrize('make', [lambda: BatchLossFilterCallback(min_loss_perc=.7, skip_epochs=0, fill_batch=True),
                                  lambda: SelectiveBackpropCallback(keep=.3, start=0., end=1., interrupt=3, fill_batch=True)])
def test_fill_batch_trains_every_selected_example_once_in_full_batches(make):
    g = torch.Generator().manual_seed(0)
    n = 400
    x = torch.cat([torch.randn(n, 4, generator=g), torch.arange(n, dtype=torch.float32)[:, None]], 1)
    y = torch.randint(0, 4, (n,), generator=g)
    dls = make_dls(x, y, bs=32)
    cb = make()
    spy = SelectSpy(cb)
    raw, trained = RawIds(), TrainedIds()
    learn = learner(dls, IdModel(), metrics=accuracy, cbs=[cb, raw, trained])
    fit(learn, 3)
    n_batches = len(dls.train)
    calls, waiting = iter(spy.calls), []
    for ep in range(3):
        selected = list(waiting)                       # the pool is first in, first out, and lives for the fit
        for e, i, ids in raw.ids:
            if e != ep: continue
            filtered = isinstance(cb, BatchLossFilterCallback) or (i + 1) % 3 != 0
            selected += (ids[next(calls)[1].sort().values] if filtered else ids).tolist()
        steps = [ids for e, ids in trained.ids if e == ep]
        got = torch.cat(steps).tolist()
        assert got == selected[:len(got)] and len(selected) - len(got) < 32   # in order, each once; less than a batch waits
        waiting = selected[len(got):]
        assert all(len(s) == 32 for s in steps[:-1]) and 2 <= len(steps[-1]) <= 32
        assert len(steps) < n_batches                                              # fewer, fuller steps
    samp = col(learn, 'samp_perc')
    assert all(s < 1 for s in samp)
    assert not any(math.isnan(v[0]) for v in learn.recorder.values)               # train loss ignores skipped batches

def test_fill_batch_keeps_the_schedule_running_over_skipped_batches(digits_dls):
    learn = learner(digits_dls, mlp(), metrics=accuracy).selective_backprop(keep=.25, start=0., end=1., interrupt=0, fill_batch=True)
    fit(learn, 2)
    hps = learn.recorder.hps['lr']
    assert len(hps) == 2 * len(digits_dls.train)
    assert hps[-1] < hps[0] * 1.01 and max(hps) > 10 * hps[-1]     # one cycle ran to its end
    assert learn.train_iter == 2 * len(digits_dls.train) and learn.pct_train == pytest.approx(1.)


def test_an_export_loads_where_loss_filters_cannot_be_imported(tmp_path):
    "The exported file is for inference: no filter, no records, and `load_learner` needs no `loss_filters`"
    import subprocess, sys
    from pathlib import Path
    from fastai.basics import DataLoaders
    g = torch.Generator().manual_seed(0)
    ds = ItemList(zip(torch.randn(256, 8, generator=g), torch.randint(0, 2, (256,), generator=g)))
    dls = DataLoaders.from_dsets(ItemList(ds[:192]), ItemList(ds[192:]), bs=32, device='cpu')
    model = lambda: nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    plain = fit(learner(dls, model(), path=tmp_path), 3)                  # the same fit, without a filter: the same Recorder
    plain.export('plain.pkl')
    learn = fit(learner(dls, model(), path=tmp_path).selective_backprop(keep=.5, start=0.), 3)
    learn.export('filtered.pkl')
    assert (tmp_path / 'filtered.pkl').stat().st_size < 1.02 * (tmp_path / 'plain.pkl').stat().st_size
    code = (f"import sys; sys.modules['loss_filters'] = None; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"   # `conftest.ItemList`
            "import warnings; warnings.simplefilter('ignore')\n"
            "from fastai.learner import load_learner\n"
            f"l = load_learner({str(tmp_path / 'filtered.pkl')!r})\n"
            "print(type(l).__name__, sorted(type(c).__name__ for c in l.cbs))")
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[0] == 'Learner' and 'Filter' not in res.stdout
    assert isinstance(learn.loss_filter, SelectiveBackpropCallback) and learn.loss_filter.stats   # the Learner keeps its filter
    fit(learn, 1)
    assert learn.loss_filter.epoch_stats and col(learn, 'samp_perc')[0] < 1
