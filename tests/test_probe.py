"The gradient probe and the functions under it: the Gramian against brute force, subsets' cosines against real backward passes, cockpit's α against an exact quadratic and against cockpit, and fits left bit for bit as they were"
import math, random, sys
import numpy as np, pandas as pd, pytest, torch, torch.nn as nn, torch.nn.functional as F
from fastai.basics import Learner, CrossEntropyLossFlat, accuracy, set_seed, SGD, Adam, Callback
from loss_filters.all import *
from loss_filters.geometry import per_example_gramian, gram_cos, gram_norm, directional_derivatives, step_alpha, example_gradients
from loss_filters.probe import GradientProbeCallback
from loss_filters.models import simple_cnn
from conftest import make_dls, mlp, bn_mlp, bn_cnn, tabular_df

def brute_jacobian(model, x, y, params):
    "One backward pass per example, the model in eval mode: the rows of the per-example Jacobian"
    was = model.training; model.eval()
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)])
            for i in range(len(x))]
    model.train(was)
    return torch.stack(rows)

def bench_cnn(): return simple_cnn(1, 10, widths=(8, 16))   # BatchNorm and in-place ReLU, as the benchmark's model

def _rel(a, b): return ((a - b).norm() / b.norm()).item()

@pytest.mark.parametrize('engine', ['hooks', 'torchjd'])
@pytest.mark.parametrize('make,head', [(mlp, False), (bn_mlp, False), (bn_cnn, False), (bn_cnn, True), (bench_cnn, False)])
def test_the_gramian_equals_brute_force_per_example_gradients(digits, make, head, engine):
    torch.manual_seed(0)
    model = make()
    x, y = digits[0][:24], digits[1][:24]
    model(digits[0][100:164])   # running statistics away from their defaults
    mods = [model[-1]] if head else None
    params = list(model[-1].parameters()) if head else list(model.parameters())
    G = per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), modules=mods, engine=engine)
    J = brute_jacobian(model, x, y, params)
    assert _rel(G, J @ J.T) < 1e-5

class _Layers(nn.Module):
    "Every layer the hooked path has a rule for: an embedding with a padding row, a LayerNorm, a 1-d convolution with bias, a linear layer called twice"
    def __init__(self):
        super().__init__()
        self.emb, self.ln, self.conv, self.lin, self.head = nn.Embedding(20, 6, padding_idx=0), nn.LayerNorm(6), nn.Conv1d(6, 5, 3, padding=1), nn.Linear(5, 5), nn.Linear(5, 3)
    def forward(self, x):
        z = F.relu(self.conv(self.ln(self.emb(x)).transpose(1, 2))).mean(2)
        return self.head(torch.tanh(self.lin(torch.tanh(self.lin(z)))))

def test_the_hooked_path_matches_brute_force_on_every_layer_it_takes():
    torch.manual_seed(0)
    model, x, y = _Layers(), torch.randint(0, 20, (16, 7)), torch.randint(0, 3, (16,))
    x[:, -2:] = 0   # padding positions: no gradient for the padding row
    J = brute_jacobian(model, x, y, list(model.parameters()))
    sk = example_gradients(model, (x,), (y,), nn.CrossEntropyLoss())
    assert sk is not None and _rel(sk.gramian(), J @ J.T) < 1e-5
    W = torch.randn(16, 4)
    W[:, 3] = W[:, 1]   # a column twice (a step over the whole batch gives ten equal ones): taken once, put back in both places
    Q, diag, _ = sk.stats(W)
    assert _rel(Q, W.T @ J @ J.T @ W) < 1e-5 and _rel(diag, (J * J).sum(1)) < 1e-5
    d = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    flat = torch.cat([d[k].reshape(-1) for k, _ in model.named_parameters()])
    assert _rel(sk.stats(W, d)[2], J @ flat) < 1e-5
    l, dd = directional_derivatives(model, (x,), (y,), nn.CrossEntropyLoss(), d, engine='hooks')
    assert _rel(dd, J @ flat) < 1e-5 and _rel(sk.along(d), J @ flat) < 1e-5   # the one-pass path and the sketch's factors (α's start)
    half = {k: v for k, v in list(d.items())[::2]}   # a direction that names some parameters only: the others count as 0
    keep = torch.cat([(d[k] if k in half else torch.zeros_like(d[k])).reshape(-1) for k, _ in model.named_parameters()])
    assert _rel(directional_derivatives(model, (x,), (y,), nn.CrossEntropyLoss(), half, engine='hooks')[1], J @ keep) < 1e-5
    assert torch.allclose(l, F.cross_entropy(model(x), y, reduction='none'), atol=1e-6)

class _Convs(nn.Module):
    "Convolutions whose patches are copied channels-last (8 or more input channels): a dilated 2-d one with an uneven kernel, stride and padding, with bias, and a 1-d one"
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 6, (3, 2), stride=(1, 2), padding=(2, 0), dilation=(2, 1))
        self.c3 = nn.Conv1d(12, 9, 3, stride=2, padding=1, bias=False)
        self.head = nn.Linear(9, 4)
    def forward(self, x):
        z = torch.tanh(self.c2(torch.tanh(self.c1(x))))   # [B, 6, 9, 4]
        return self.head(torch.tanh(self.c3(z.flatten(2)[:, :, :12].transpose(1, 2).contiguous().view(len(x), 12, -1))).mean(2))

def test_channels_last_patches_match_brute_force_on_any_kernel_stride_padding_and_dilation():
    torch.manual_seed(0)
    model, x, y = _Convs(), torch.randn(10, 3, 9, 7), torch.randint(0, 4, (10,))
    J = brute_jacobian(model, x, y, list(model.parameters()))
    sk = example_gradients(model, (x,), (y,), nn.CrossEntropyLoss())
    W = torch.randn(10, 3)
    Q, diag, _ = sk.stats(W)
    assert _rel(sk.gramian(), J @ J.T) < 1e-5 and _rel(Q, W.T @ J @ J.T @ W) < 1e-5 and _rel(diag, (J * J).sum(1)) < 1e-5
    d = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    ref = J @ torch.cat([d[k].reshape(-1) for k, _ in model.named_parameters()])
    assert _rel(sk.along(d), ref) < 1e-5 and _rel(sk.stats(W, d)[2], ref) < 1e-5   # forward products, and the formed gradients against the direction in their order

def test_the_bench_cnns_sketch_matches_torchjd_and_forward_mode(digits):
    "The bench CNN (BatchNorm, in-place ReLU) at its full widths: the factors against torchjd's Gramian and against forward-mode derivatives, to 1e-5"
    torch.manual_seed(0)
    model = simple_cnn(1, 10, widths=(32, 64, 128))
    model(digits[0][100:228])
    x, y = digits[0][:64], digits[1][:64]
    G_ref = per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='torchjd')
    assert _rel(per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='hooks'), G_ref) < 1e-5
    W = torch.randn(64, 10)
    Q, diag, _ = example_gradients(model, (x,), (y,), nn.CrossEntropyLoss()).stats(W)
    assert _rel(Q, W.T @ G_ref @ W) < 1e-5 and _rel(diag, G_ref.diagonal()) < 1e-5
    d = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    ref = directional_derivatives(model, (x,), (y,), nn.CrossEntropyLoss(), d, engine='jvp')
    got = directional_derivatives(model, (x,), (y,), nn.CrossEntropyLoss(), d, engine='hooks')
    assert _rel(got[1], ref[1]) < 1e-5 and torch.allclose(got[0], ref[0], atol=1e-6)
    Q2, diag2, dd = example_gradients(model, (x,), (y,), nn.CrossEntropyLoss()).stats(W, d)   # α's start: the derivatives with the statistics
    assert _rel(dd, ref[1]) < 1e-5 and _rel(Q2, Q) < 1e-6 and _rel(diag2, diag) < 1e-6

class _Sometimes(nn.Module):
    "A ReLU after the first layer, in place only when `inplace` is set: the layer's output changed in place in some passes and not in others"
    def __init__(self):
        super().__init__()
        self.lin, self.head, self.inplace = nn.Linear(6, 8), nn.Linear(8, 3), False
    def forward(self, x):
        h = self.lin(x)
        return self.head(h.relu_() if self.inplace else h.relu())

def test_an_output_changed_in_place_is_taken_from_a_copy_even_when_it_was_not_before():
    "A layer whose output no in-place op changed is no longer copied; when one does change it, the pass is run again with a copy, and the Gramian stays exact"
    from loss_filters.geometry import _CHANGED
    torch.manual_seed(0)
    model, x, y = _Sometimes(), torch.randn(12, 6), torch.randint(0, 3, (12,))
    J = brute_jacobian(model, x, y, list(model.parameters()))
    assert _rel(per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='hooks'), J @ J.T) < 1e-5
    assert _CHANGED[model.lin] is False   # copied while unknown, not changed: taken as it is next time
    model.inplace = True
    assert _rel(per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='hooks'), J @ J.T) < 1e-5
    assert _CHANGED[model.lin] is True
    assert _rel(per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='hooks'), J @ J.T) < 1e-5   # copied from the start now

@pytest.mark.parametrize('affine', [True, False])
def test_an_eval_batchnorm_as_scale_and_shift_equals_batch_norm_and_brute_force(affine):
    from loss_filters.geometry import _EvalNorm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, affine=affine), nn.ReLU(inplace=True), nn.Linear(8, 3))
    model(torch.randn(64, 6) * 3 + 2)   # running statistics away from their defaults
    bn, x = model[1], torch.randn(12, 8) * 3 + 2
    bn.eval()
    assert torch.allclose(_EvalNorm(bn)(x), bn(x), atol=1e-5)
    if affine:
        with torch.no_grad(): bn.weight.uniform_(.5, 2); bn.bias.normal_()
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    J = brute_jacobian(model, x, y, list(model.parameters()))
    assert _rel(per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='hooks'), J @ J.T) < 1e-5

def test_layers_without_a_rule_go_to_torchjd_or_are_refused():
    class Rnn(nn.Module):
        def __init__(self): super().__init__(); self.emb, self.rnn, self.head = nn.Embedding(12, 6), nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 3)
        def forward(self, x): return self.head(self.rnn(self.emb(x))[0][:, -1])
    torch.manual_seed(0)
    model, x, y = Rnn(), torch.randint(0, 12, (6, 5)), torch.randint(0, 3, (6,))
    assert example_gradients(model, (x,), (y,), nn.CrossEntropyLoss()) is None
    assert example_gradients(model, (x,), (y,), nn.CrossEntropyLoss(), modules=[model.head]) is not None   # the head alone has a rule
    with pytest.raises(ValueError, match="engine='hooks'"): per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='hooks')
    with pytest.raises(ValueError, match="`engine` must be one of"): per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='fast')
    with pytest.raises(ValueError, match="params=None"):
        directional_derivatives(model, (x,), (y,), nn.CrossEntropyLoss(), {}, params={}, engine='hooks')

def test_the_gramian_of_a_recurrent_model_equals_brute_force():
    "An LSTM, which torchjd's batched mode refuses: the general mode, exact"
    class Rnn(nn.Module):
        def __init__(self): super().__init__(); self.emb, self.rnn, self.head = nn.Embedding(12, 6), nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 3)
        def forward(self, x): return self.head(self.rnn(self.emb(x))[0][:, -1])
    torch.manual_seed(0)
    model, x, y = Rnn(), torch.randint(0, 12, (10, 7)), torch.randint(0, 3, (10,))
    G = per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss())
    J = brute_jacobian(model, x, y, list(model.parameters()))
    assert torch.allclose(G, J @ J.T, atol=1e-4, rtol=1e-4)

def test_a_subsets_cosine_from_the_gramian_equals_two_real_backward_passes(digits):
    torch.manual_seed(0)
    model, x, y = bn_mlp(), digits[0][:32], digits[1][:32]
    model.eval()
    G = per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss())
    grad = lambda idx: torch.cat([g.reshape(-1) for g in torch.autograd.grad(F.cross_entropy(model(x[idx]), y[idx]), list(model.parameters()))])
    keep = torch.tensor([1, 4, 5, 9, 17, 30])
    g_keep, g_all = grad(keep), grad(torch.arange(32))   # the subset's step and the batch's, each its own backward pass
    u, v = torch.zeros(32), torch.full((32,), 1 / 32)
    u[keep] = 1 / len(keep)
    assert gram_cos(G, u, v).item() == pytest.approx(F.cosine_similarity(g_keep, g_all, dim=0).item(), abs=1e-5)
    assert gram_norm(G, u).item() == pytest.approx(g_keep.norm().item(), rel=1e-4)

def test_the_missing_extra_is_named(monkeypatch, digits):
    monkeypatch.setitem(sys.modules, 'torchjd', None)   # as if torchjd were not installed
    monkeypatch.setitem(sys.modules, 'torchjd.autogram', None)
    with pytest.raises(ImportError, match=r"pip install 'loss_filters\[grad\]'"):
        per_example_gramian(mlp(), (digits[0][:4],), (digits[1][:4],), nn.CrossEntropyLoss(), engine='torchjd')
    assert per_example_gramian(mlp(), (digits[0][:4],), (digits[1][:4],), nn.CrossEntropyLoss()).shape == (4, 4)   # the hooked path needs no extra

# ------------------------------------------------------------------ α
def test_alpha_on_an_exact_quadratic_is_known():
    "Full-batch SGD on mean((w·xᵢ)²): the step from w to w(1 - 2·lr·mean(x²)) lands at α = 2·lr·mean(x²) - 1"
    torch.manual_seed(0)
    xs = torch.randn(64, 1)
    m = xs.pow(2).mean().item()
    for lr, want in ((.75 / m, .5), (.5 / m, 0.), (.25 / m, -.5)):
        w = nn.Linear(1, 1, bias=False); nn.init.constant_(w.weight, 2.)
        loss = lambda out, *_, reduction='mean': out.squeeze(1).pow(2).mean() if reduction == 'mean' else out.squeeze(1).pow(2)
        before = {k: p.detach().clone() for k, p in w.named_parameters()}
        opt = torch.optim.SGD(w.parameters(), lr=lr)
        opt.zero_grad(); loss(w(xs)).backward(); opt.step()
        d = {k: p.detach() - before[k] for k, p in w.named_parameters()}
        t = math.sqrt(sum(float(v.pow(2).sum()) for v in d.values()))
        unit = {k: v / t for k, v in d.items()}
        l0, d0 = directional_derivatives(w, (xs,), (torch.zeros(64),), loss, unit, params=before)
        l1, d1 = directional_derivatives(w, (xs,), (torch.zeros(64),), loss, unit)
        a = step_alpha(t, (l0.mean(), l1.mean()), (l0.var(), l1.var()), (d0.mean(), d1.mean()), (d0.var(), d1.var()))
        assert a == pytest.approx(want, abs=1e-4)

class _Digits(torch.utils.data.Dataset):
    def __init__(self, x, y): self.x, self.y = x, y
    def __len__(self): return len(self.y)
    def __getitem__(self, i): return self.x[i], self.y[i]

def test_alpha_matches_cockpit_on_the_same_steps(digits):
    "cockpit's own α (BackPACK's per-example gradients) and the probe's, step by step, on a small SGD model"
    pytest.importorskip('backpack'); cockpit = pytest.importorskip('cockpit')
    from backpack import extend
    from cockpit import quantities
    from cockpit.utils.schedules import linear
    x, y = digits[0].flatten(1)[:256], digits[1][:256]
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 16), nn.Sigmoid(), nn.Linear(16, 10))
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32)]
    # cockpit: α of every second step (the schedule marks the start steps)
    model = extend(net()); lossf = extend(nn.CrossEntropyLoss()); each = nn.CrossEntropyLoss(reduction='none')
    opt = torch.optim.SGD(model.parameters(), lr=.5)
    alpha_q = quantities.Alpha(linear(2))
    cp = cockpit.Cockpit(model.parameters(), quantities=[alpha_q])
    for step, (xb, yb) in enumerate(batches):
        opt.zero_grad()
        out = model(xb); loss = lossf(out, yb); losses = each(out, yb)
        with cp(step, info=dict(batch_size=len(yb), individual_losses=losses, loss=loss, optimizer=opt)):
            loss.backward(create_graph=cp.create_graph(step))
        opt.step()
    theirs = {step: float(q['Alpha']) for step, q in cp.get_output().items() if q.get('Alpha') is not None}   # by step, then quantity
    # the probe's functions on the same steps of the same model from the same weights
    model2 = net(); opt2 = torch.optim.SGD(model2.parameters(), lr=.5)
    mine = {}
    for step in range(len(batches) - 1):
        xb, yb = batches[step]
        before = {k: p.detach().clone() for k, p in model2.named_parameters()}
        opt2.zero_grad(); F.cross_entropy(model2(xb), yb).backward(); opt2.step()
        d = {k: p.detach() - before[k] for k, p in model2.named_parameters()}
        t = math.sqrt(sum(float(v.pow(2).sum()) for v in d.values()))
        unit = {k: v / t for k, v in d.items()}
        l0, d0 = directional_derivatives(model2, (xb,), (yb,), nn.CrossEntropyLoss(), unit, params=before)
        l1, d1 = directional_derivatives(model2, batches[step + 1][:1], batches[step + 1][1:], nn.CrossEntropyLoss(), unit)
        mine[step] = step_alpha(t, (l0.mean(), l1.mean()), (l0.var(), l1.var()), (d0.mean(), d1.mean()), (d0.var(), d1.var()))
    assert theirs and set(theirs) <= set(mine)
    for step, a in theirs.items(): assert mine[step] == pytest.approx(a, rel=1e-3, abs=1e-3), (step, a, mine[step])

# ------------------------------------------------------------------ the callback
def _fit(dls_fn, model_fn, *cbs, epochs=2, lr=1e-2, opt_func=Adam, fit='fit_one_cycle'):
    set_seed(0)
    learn = Learner(dls_fn(), model_fn(), loss_func=CrossEntropyLossFlat(), metrics=accuracy, opt_func=opt_func)
    for cb in cbs: learn.add_cb(cb)
    with learn.no_bar(), learn.no_logging(): getattr(learn, fit)(epochs, lr)
    return learn

def _state(learn): return {k: v.detach().clone() for k, v in learn.model.state_dict().items()}

def _same(a, b): return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

@pytest.mark.parametrize('filt', [None, 'blf', 'stale', 'sb', 'sb_fill'])
def test_the_probe_leaves_a_vision_fit_bit_for_bit_as_it_was(digits, filt):
    "Weights and BatchNorm buffers, and torch's global random state after the fit, the same with and without the probe"
    make = {None: None, 'blf': lambda: BatchLossFilterCallback(skip_epochs=0), 'stale': StaleLossPruningCallback,
            'sb': lambda: SelectiveBackpropCallback(start=0, interrupt=0), 'sb_fill': lambda: SelectiveBackpropCallback(start=0, interrupt=0, fill_batch=True)}[filt]
    cbs = (lambda: [make()] if make else [])
    plain = _fit(lambda: make_dls(*digits, bs=64), bn_cnn, *cbs())
    rng_plain = torch.get_rng_state()
    counted = _Steps()
    probed = _fit(lambda: make_dls(*digits, bs=64), bn_cnn, *cbs(), GradientProbeCallback(every=3, n_random=4), counted)
    assert _same(_state(plain), _state(probed)) and torch.equal(rng_plain, torch.get_rng_state())
    assert [list(v[:3]) for v in plain.recorder.values] == [list(v[:3]) for v in probed.recorder.values]   # losses and accuracy
    stats = probed.probe.stats
    assert len(stats) == math.ceil(counted.n / 3) and (counted.n < probed.train_iter) == (filt == 'sb_fill')   # every third step (a pool skips batches)
    assert all(-1 - 1e-6 <= r['grad_cos'] <= 1 + 1e-6 for r in stats)
    if filt is None:
        assert all(r['grad_cos'] == pytest.approx(1, abs=1e-6) and r['norm_ratio'] == pytest.approx(1, abs=1e-6) for r in stats)
    if filt in ('blf', 'sb'): assert any(r['trained'] < r['bs'] for r in stats)

def test_the_probe_leaves_a_tabular_fit_as_it_was():
    from fastai.tabular.all import TabularDataLoaders, tabular_learner, Categorify, Normalize
    df = tabular_df()
    def run(*cbs):
        set_seed(0)
        dls = TabularDataLoaders.from_df(df, procs=[Categorify, Normalize], cat_names=['c'], cont_names=['a', 'b'], y_names='y',
                                         valid_idx=list(range(500, 600)), bs=64, device='cpu')
        learn = tabular_learner(dls, layers=[16], n_out=2, metrics=accuracy, cbs=list(cbs))   # n_out: fastai's guess fails on pandas 3
        with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(3, 1e-2)
        return learn
    plain, probed = run(), run(GradientProbeCallback(every=2))
    assert _same(_state(plain), _state(probed)) and len(probed.probe.stats) > 0

def test_the_probe_leaves_a_text_fit_as_it_was():
    "AWD_LSTM with its `RNNRegularizer`, which reads the step's `raw_out` and `out`: the probe's passes must not replace them"
    from fastai.text.all import TextDataLoaders, text_classifier_learner, AWD_LSTM
    rng, words, rows = random.Random(0), 'the a film plot actor scene music story'.split(), []
    for i in range(96):
        toks = [rng.choice(words) for _ in range(rng.choice([3, 8, 20]))]
        for _ in range(2): toks.insert(rng.randrange(len(toks) + 1), 'good' if i % 2 else 'bad')
        rows.append((' '.join(toks), 'pos' if i % 2 else 'neg'))
    df = pd.DataFrame(rows, columns=['text', 'label'])
    def run(*cbs):
        set_seed(0)
        dls = TextDataLoaders.from_df(df, text_col='text', label_col='label', valid_pct=.25, seed=0, bs=16, device='cpu')
        learn = text_classifier_learner(dls, AWD_LSTM, pretrained=False, config=dict(emb_sz=16, n_hid=24, n_layers=1), drop_mult=.1,
                                        metrics=accuracy, cbs=list(cbs))
        with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
        return learn
    plain = run()
    probed = run(GradientProbeCallback(every=2, modules=None))
    assert _same(_state(plain), _state(probed))
    stats = probed.probe.stats
    assert stats and all(r['alpha'] is not None for r in stats[:-1])

def test_the_probes_columns_are_in_the_fit_table(digits):
    learn = _fit(lambda: make_dls(*digits, bs=64), mlp, GradientProbeCallback(every=2), epochs=2)
    names = list(learn.recorder.metric_names)
    assert names[-5:] == ['grad_cos', 'rand_cos', 'norm_ratio', 'alpha', 'time']
    learn.remove_cb(learn.probe)
    assert 'gradient_probe_columns' not in [type(cb).__name__ for cb in learn.cbs] and not hasattr(learn, 'probe')
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert 'grad_cos' not in learn.recorder.metric_names

def test_the_probe_on_a_pooled_step_compares_it_with_the_batch(digits):
    "`fill_batch=True`: the step trains a pool of earlier batches' examples, so the Gramian covers both"
    learn = _fit(lambda: make_dls(*digits, bs=64), mlp, BatchLossFilterCallback(skip_epochs=0, fill_batch=True),
                 GradientProbeCallback(every=1, n_random=2), epochs=2)
    stats = learn.probe.stats
    assert stats and all(-1 - 1e-6 <= r['grad_cos'] <= 1 + 1e-6 for r in stats)

def test_the_patch_and_bad_settings():
    learn = Learner(make_dls(torch.randn(64, 4), torch.randint(0, 2, (64,))), mlp(4, 2), loss_func=CrossEntropyLossFlat())
    assert learn.gradient_probe(every=7) is learn and learn.probe.every == 7
    learn.gradient_probe(every=9)   # the patch again: the new probe replaces the first
    assert learn.probe.every == 9 and sum(isinstance(cb, GradientProbeCallback) for cb in learn.cbs) == 1
    with pytest.raises(ValueError, match='`every` must be an integer >= 1'): GradientProbeCallback(every=0)
    with pytest.raises(ValueError, match='`n_random` must be an integer >= 1'): GradientProbeCallback(n_random=0)

def test_directional_derivatives_keep_the_parameter_objects_of_a_shared_module():
    "A module reached by two paths (AWD_LSTM's embedding and its dropout wrapper): the optimizer's parameter objects stay the model's"
    emb = nn.Embedding(10, 4)
    class Twice(nn.Module):
        def __init__(self): super().__init__(); self.emb, self.again, self.head = emb, nn.ModuleList([emb]), nn.Linear(4, 3)
        def forward(self, x): return self.head(self.again[0](x).mean(1))
    model = Twice()
    held = {k: p for k, p in model.named_parameters()}
    x, y = torch.randint(0, 10, (6, 5)), torch.randint(0, 3, (6,))
    l, d = directional_derivatives(model, (x,), (y,), nn.CrossEntropyLoss(), {k: torch.ones_like(p) for k, p in held.items()})
    assert all(p is held[k] for k, p in model.named_parameters()) and model.emb.weight is model.again[0].weight
    assert l.shape == d.shape == (6,)

@pytest.mark.parametrize('filt', ['blf', 'stale'])
def test_a_filters_diagnostics_show_the_probes_panels(digits, filt):
    import matplotlib; matplotlib.use('Agg')
    make = dict(blf=lambda: BatchLossFilterCallback(skip_epochs=0), stale=StaleLossPruningCallback)[filt]
    alone = _fit(lambda: make_dls(*digits, bs=64), mlp, make(), epochs=2).loss_filter.plot_diagnostics()
    learn = _fit(lambda: make_dls(*digits, bs=64), mlp, make(), GradientProbeCallback(every=4), epochs=2)
    fig = learn.loss_filter.plot_diagnostics()
    assert len(fig.get_axes()) == len(alone.get_axes()) + 4
    assert len(learn.probe.plot_probe().get_axes()) == 4

def test_the_probe_refuses_several_processes(digits, monkeypatch):
    "Each rank trains its own part of the batch: the probe says so before any step instead of measuring a part"
    import loss_filters.probe as probe_mod
    monkeypatch.setattr(probe_mod, 'dist_world', lambda: (0, 2))
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=64), mlp(), loss_func=CrossEntropyLossFlat(), cbs=[GradientProbeCallback()])
    with pytest.raises(ValueError, match='cannot run with several processes'):
        with learn.no_bar(), learn.no_logging(): learn.fit(1)

class RowsSpy:
    "The rows and weights the probe takes each probed step over, read from its `_step_rows`"
    def __init__(self, probe):
        self.seen, orig = [], probe._step_rows
        def spy():
            xb, yb, u, groups = orig(); self.seen.append((len(u), groups[0][1], u.clone())); return xb, yb, u, groups
        probe._step_rows = spy

def test_a_plain_step_is_probed_once_over_its_batch(digits):
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=32), bench_cnn(), loss_func=CrossEntropyLossFlat())
    learn.gradient_probe(every=5)
    spy = RowsSpy(learn.probe)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    assert spy.seen and all(n == B and torch.allclose(u, torch.full((B,), 1 / B, dtype=torch.float64)) for n, B, u in spy.seen)
    import matplotlib; matplotlib.use('Agg')
    fig = learn.probe.plot_probe()
    assert fig._suptitle.get_text() == f'Gradient probe: one step in 5, {len(spy.seen)} probed' and '< 0 short of the minimum' in fig.axes[2].get_ylabel()
    assert fig.axes[2].get_ylim() == (-2.2, 3.2)   # α far out (a nearly flat fit) is drawn at the edge, not stretching the axis

def test_stale_prunings_loss_weights_reach_the_probe(digits):
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=32), bench_cnn(), loss_func=CrossEntropyLossFlat())
    learn.stale_loss_pruning(prune=.5, anneal=0.)
    learn.gradient_probe(every=3)
    spy = RowsSpy(learn.probe)
    with learn.no_bar(), learn.no_logging(): learn.fit(3, 1e-3)
    pruned = [(n, B, u) for n, B, u in spy.seen if len(u.unique()) > 1]   # up-weighted easy rows: 2/B beside 1/B
    assert pruned and all(n == B and torch.isclose(u.max(), 2 * u.min()) for n, B, u in pruned)

def test_the_probe_warns_of_its_cost_and_of_epochs_it_never_probed(digits):
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=64), bench_cnn(), loss_func=CrossEntropyLossFlat())
    learn.gradient_probe(every=1)
    with pytest.warns(UserWarning, match=r"probes took \d+% of this epoch's training time at `every=1`"), learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    learn.gradient_probe(every=1000)
    with pytest.warns(UserWarning, match='2 of this fit.s epochs had no probed step'), learn.no_bar(), learn.no_logging(): learn.fit(3, 1e-3)

def test_a_summed_loss_gives_the_probe_summed_steps(digits):
    "With `reduction='sum'` the step's gradient is the sum of its rows': weight 1 a row, not 1/k (the norm ratios would be off by k/B)"
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=32), bench_cnn(), loss_func=CrossEntropyLossFlat(reduction='sum'))
    learn.batch_loss_filter(min_loss_perc=.9, skip_epochs=0)
    learn.gradient_probe(every=4)
    spy = RowsSpy(learn.probe)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-4)
    assert spy.seen and all(set(u[u > 0].tolist()) == {1.} for _, _, u in spy.seen)
    r = learn.probe.stats[0]
    assert r['trained'] < r['bs'] and r['norm_ratio'] < 1.5   # a part of the batch's summed gradient, not k/B times inflated

def test_train_mode_beside_a_batch_filter_on_batchnorm_is_warned(digits):
    learn = Learner(make_dls(*digits, bs=32), bench_cnn(), loss_func=CrossEntropyLossFlat()).batch_loss_filter(min_loss_perc=.9, skip_epochs=0)
    learn.gradient_probe(every=100, train=True)
    with pytest.warns(UserWarning, match=r"train=True\) beside a batch filter on a model with BatchNorm"), learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)

def test_a_pooled_step_is_compared_with_random_twins_of_its_make_up_and_a_partial_batch_probes(digits):
    "`fill_batch`: the step's rows come from several batches; each random twin takes as many rows of each of them, so `rand_cos` is there"
    set_seed(0)
    dls = make_dls(*digits, bs=64, drop_last=False)
    learn = Learner(dls, bench_cnn(), loss_func=CrossEntropyLossFlat())
    learn.selective_backprop(keep=.6, start=0., end=1., interrupt=0, fill_batch=True)
    learn.gradient_probe(every=1)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    stats = learn.probe.stats
    pooled = [r for r in stats if r['sources'] > 1]
    assert pooled and all(math.isfinite(r['rand_cos']) and math.isfinite(r['rand_norm_ratio']) for r in stats)
    assert all(r['trained'] == 64 for r in stats[:-1]) and stats[-1]['iter'] == len(dls.train) - 1   # full steps; the partial last batch was probed
    assert learn.loss_filter.pool.sources.keys() <= set(learn.loss_filter.pool.src.tolist())   # only the batches of rows still waiting are held

class PooledSpy:
    "At each probed step: its rows, weights and groups, the columns compared, the pooled batch the model trains, and brute-force per-example gradients"
    def __init__(self, probe):
        self.seen, rows, cols = [], probe._step_rows, probe._columns
        def step_rows():
            xb, yb, u, groups = rows()
            m = probe.learn.model
            self.seen.append(dict(u=u.clone(), groups=groups, x=xb[0], trained=probe.learn.xb[0].clone(),
                                  J=brute_jacobian(m, xb[0], yb[0], list(m.parameters())).double()))
            return xb, yb, u, groups
        def columns(u, groups):
            W = cols(u, groups); self.seen[-1]['W'] = W; return W
        probe._step_rows, probe._columns = step_rows, columns

def test_a_pooled_steps_cosines_match_real_backward_passes_over_its_source_batches(digits):
    "The pooled step's gradient against each source batch's mean in the step's shares, and its random twins, from one backward pass per example"
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=48), mlp(), loss_func=CrossEntropyLossFlat())
    learn.selective_backprop(keep=.4, start=0., end=1., interrupt=0, fill_batch=True)
    learn.gradient_probe(every=2, n_random=3, alpha=False)
    spy = PooledSpy(learn.probe)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    seen = [s for s in spy.seen if len(s['groups']) > 1]
    assert seen and len(spy.seen) == len(learn.probe.stats)
    for s, r in zip(spy.seen, learn.probe.stats):
        u, groups, J, W = s['u'], s['groups'], s['J'], s['W']
        n = sum(t for *_, t in groups)
        in_pool_order = groups[1:] + groups[:1]   # the probed batch is the pool's newest source, put first for α
        assert torch.equal(torch.cat([s['x'][o:o + size][u[o:o + size] > 0] for o, size, _ in in_pool_order]), s['trained'])   # the rows the model trains
        v = torch.cat([torch.full((size,), t / (n * size), dtype=torch.float64) for _, size, t in groups])
        g, ref = J.T @ u, J.T @ v
        cos = lambda a: (a @ ref / (a.norm() * ref.norm())).item()
        assert r['grad_cos'] == pytest.approx(cos(g), abs=1e-5) and r['norm_ratio'] == pytest.approx((g.norm() / ref.norm()).item(), rel=1e-5)
        assert r['rand_cos'] == pytest.approx(sum(cos(J.T @ W[:, i]) for i in range(2, W.shape[1])) / (W.shape[1] - 2), abs=1e-5)
        for i in range(2, W.shape[1]):   # each twin: as many rows of each source batch as the step took, with the step's weights
            assert all(int((W[o:o + size, i] > 0).sum()) == t and W[o:o + size, i].sum() == pytest.approx(u[o:o + size].sum()) for o, size, t in groups)

def test_the_alpha_column_holds_the_alphas_known_in_its_epoch(digits):
    "One batch an epoch: a step's α is known at the next batch, in the next epoch, and its column is that epoch's; the fit's last step is marked"
    set_seed(0)
    learn = Learner(make_dls(digits[0][:128], digits[1][:128], bs=96, drop_last=True), mlp(), loss_func=CrossEntropyLossFlat(), opt_func=SGD)
    learn.gradient_probe(every=1)
    with learn.no_bar(): learn.fit(3, 1e-2)
    rs, names = learn.probe.stats, list(learn.recorder.metric_names[1:-1])
    col = [v[names.index('alpha')] for v in learn.recorder.values]
    assert len(rs) == 3 and rs[0]['alpha'] is not None and rs[1]['alpha'] is not None
    assert math.isnan(col[0]) and col[1] == pytest.approx(rs[0]['alpha']) and col[2] == pytest.approx(rs[1]['alpha'])
    assert rs[-1]['alpha'] is None and rs[-1]['alpha_note'] == 'the fit ended before a next batch'

class _Snapshots(Callback):
    "Before the probe sees a batch: the whole batch and the parameters the step starts from"
    order = GradientProbeCallback.order - 1
    def before_fit(self): self.seen = []
    def before_batch(self):
        if self.training: self.seen.append((self.xb, self.yb, {k: p.detach().clone() for k, p in self.learn.model.named_parameters()}))

def test_alpha_under_a_filter_measures_both_points_on_whole_batches(digits):
    "Selective Backprop trains 30% of each batch; α's start is the whole batch at the step's start, its end the next whole batch after it (forward mode as the reference)"
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=64), mlp(), loss_func=CrossEntropyLossFlat(), opt_func=SGD)   # no running statistics: the parameters are the whole state
    learn.selective_backprop(keep=.3, start=0., end=1., interrupt=0)
    snaps = _Snapshots(); learn.add_cb(snaps)
    learn.gradient_probe(every=7)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 5e-2)
    checked = 0
    for r in learn.probe.stats:
        if r['alpha'] is None: continue
        (x0, y0, p0), (x1, y1, p1) = snaps.seen[r['iter']], snaps.seen[r['iter'] + 1]
        d = {k: p1[k] - p0[k] for k in p0}
        t = math.sqrt(sum(float(v.double().pow(2).sum()) for v in d.values()))
        unit = {k: v / t for k, v in d.items()}
        l0, d0 = directional_derivatives(learn.model, x0, y0, learn.loss_func, unit, params=p0, engine='jvp')
        l1, d1 = directional_derivatives(learn.model, x1, y1, learn.loss_func, unit, params=p1, engine='jvp')
        assert len(l0) == len(l1) == 64   # whole batches, though each step trained 19 of 64 rows
        want = step_alpha(t, (l0.mean(), l1.mean()), (l0.var(), l1.var()), (d0.mean(), d1.mean()), (d0.var(), d1.var()))
        assert r['trained'] < 64 and r['step_size'] == pytest.approx(t, rel=1e-6) and r['alpha'] == pytest.approx(want, rel=1e-4, abs=1e-5)
        checked += 1
    assert checked

def test_under_gradient_accumulation_alpha_is_undefined_and_said(digits):
    from fastai.callback.training import GradientAccumulation
    with pytest.warns(UserWarning, match='GradientAccumulation'):
        learn = _fit(lambda: make_dls(*digits, bs=32), mlp, GradientAccumulation(n_acc=64), GradientProbeCallback(every=4), epochs=1)
    rs = learn.probe.stats
    assert rs and all(r['alpha'] is None and r['alpha_note'] == 'no optimizer step' for r in rs[:-1])

class _Steps(Callback):
    def before_fit(self): self.n = 0
    def after_step(self): self.n += 1

def test_every_nth_step_is_probed_whatever_the_pool_holds_back(digits):
    "`fill_batch` with keep .5 steps on every other batch: an even `every` counted in batches could miss every step; counted in steps, none"
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=64), mlp(), loss_func=CrossEntropyLossFlat())
    learn.selective_backprop(keep=.5, start=0., end=1., interrupt=0, fill_batch=True)
    steps = _Steps(); learn.add_cb(steps)
    learn.gradient_probe(every=2)
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    assert steps.n < len(learn.dls.train) and len(learn.probe.stats) == math.ceil(steps.n / 2)

def test_a_sketch_holds_nothing_once_dropped():
    "Its factors (activations and their gradients) go with it: no cache outlives it"
    import gc, weakref
    torch.manual_seed(0)
    model = simple_cnn(1, 10, widths=(8, 16))
    sk = example_gradients(model, (torch.randn(8, 1, 12, 12),), (torch.randint(0, 10, (8,)),), nn.CrossEntropyLoss())
    sk.stats(torch.randn(8, 2)); sk.gramian()
    refs = [weakref.ref(l) for l in sk.layers]
    del sk; gc.collect()
    assert all(r() is None for r in refs)

_COLS = ('bs', 'trained', 'grad_cos', 'rand_cos', 'rand_cos_min', 'rand_cos_max', 'norm_ratio', 'rand_norm_ratio', 'rho')

@pytest.mark.parametrize('make', [mlp, bn_cnn])
def test_statistics_that_wait_for_the_step_are_those_taken_at_once(digits, make):
    "With α the statistics are taken after the step, with the derivatives along it: the same numbers as without α, and the same α as from a pass of its own at the parameters before the step (how a probe given `modules` measures it, here the whole model)"
    def run(alpha, whole):
        set_seed(0)
        learn = Learner(make_dls(*digits, bs=32), make(), loss_func=CrossEntropyLossFlat(), opt_func=Adam)
        learn.add_cbs([BatchLossFilterCallback(skip_epochs=0), GradientProbeCallback(every=3, alpha=alpha, modules=[learn.model] if whole else None)])
        with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(1, 1e-2)
        return learn.probe.table()
    runs = {'no_alpha': run(False, False), 'waits': run(True, False), 'at_once': run(True, True)}
    for name in ('waits', 'at_once'):
        for k in _COLS: np.testing.assert_allclose(runs[name][k], runs['no_alpha'][k], rtol=1e-9, err_msg=f'{name} {k}')
    a, b = runs['waits'].alpha.dropna().to_numpy(float), runs['at_once'].alpha.dropna().to_numpy(float)
    assert len(a) == len(b) >= len(runs['waits']) - 1 and np.allclose(a, b, rtol=1e-4, atol=1e-6)   # α from the formed gradients = α from a pass

class _Tied(nn.Module):
    "An embedding whose weight the output layer also uses directly (`h @ emb.weight.T`), as weight-tied language models do"
    def __init__(self): super().__init__(); self.emb, self.lin = nn.Embedding(10, 6), nn.Linear(6, 6)
    def forward(self, x): return torch.tanh(self.lin(self.emb(x).mean(1))) @ self.emb.weight.T

def test_a_parameter_used_outside_its_module_takes_the_whole_jacobian():
    "The factors and torchjd's engine see a parameter through its own module's calls only: another use of it drops part of its gradient, so the hooked path refuses and `auto` forms the losses' whole Jacobian"
    torch.manual_seed(0)
    model, x, y = _Tied(), torch.randint(0, 10, (12, 5)), torch.randint(0, 10, (12,))
    assert example_gradients(model, (x,), (y,), nn.CrossEntropyLoss()) is None
    J = brute_jacobian(model, x, y, list(model.parameters()))
    assert _rel(per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss()), J @ J.T) < 1e-5
    assert _rel(per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='torchjd'), J @ J.T) > 1e-2   # what torchjd's engine misses
    with pytest.raises(ValueError, match="engine='hooks'"): per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='hooks')
    assert example_gradients(model, (x,), (y,), nn.CrossEntropyLoss(), modules=[model.lin]) is not None   # the linear layer alone is seen whole

def test_a_jacobian_too_large_for_auto_leaves_torchjds_gramian_with_a_warning(monkeypatch):
    import loss_filters.geometry as G
    torch.manual_seed(0)
    model, x, y = _Tied(), torch.randint(0, 10, (12, 5)), torch.randint(0, 10, (12,))
    monkeypatch.setattr(G, 'JACOBIAN_FLOATS', 12 * 100)   # fewer floats than 12 examples' gradients
    with pytest.warns(UserWarning, match="used outside its own module.*engine='jacobian' is exact"):
        G_auto = per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss())
    assert torch.allclose(G_auto, per_example_gramian(model, (x,), (y,), nn.CrossEntropyLoss(), engine='torchjd'))

def test_a_pooled_step_without_its_sources_is_not_probed_as_if_it_trained_its_batch(digits):
    "A pool made without the probe's request keeps no source batches: the step is left out with a warning, never read as the whole batch"
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=64), mlp(), loss_func=CrossEntropyLossFlat())
    learn.selective_backprop(keep=.5, start=0., end=1., interrupt=0, fill_batch=True)
    learn.gradient_probe(every=1, alpha=False)
    real = learn.loss_filter._new_records
    def no_sources():
        real(); learn.loss_filter.pool.keep_sources = False
    learn.loss_filter._new_records = no_sources
    with pytest.warns(UserWarning, match='did not keep'), learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)
    assert len(learn.probe.stats) == 0   # every step was a pooled one (each batch filtered from the start): none read as its whole batch
