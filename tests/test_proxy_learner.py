"The proxy scorer follows the Learner as fastai does: its optimizer made and driven like the Learner's, its steps only where the model steps, its random streams on every device, the rows it learns, what it is refused."
from collections import Counter
from functools import partial
from unittest import mock
import pytest, torch, torch.nn as nn
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, set_seed, DataLoaders
from fastai.callback.core import CancelStepException
from fastai.callback.training import GradientAccumulation
from fastai.optimizer import OptimWrapper, Adam, SGD
from fastai.tabular.all import TabularDataLoaders, tabular_learner, Categorify, Normalize, TabularModel, get_emb_sz
from loss_filters.proxy import ProxyScorer
from loss_filters.batch import LossFilterBase, _pool_refusal
from conftest import make_dls, ItemList, tabular_df, col

HYPERS = ('lr', 'mom', 'sqr_mom', 'wd', 'eps')

def fit(learn, n=1, lr=1e-2, **kw):
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(n, lr, **kw)
    return learn

def net(width=32, n_out=10, p=.2):
    "A small CNN with BatchNorm, biases and dropout"
    return nn.Sequential(nn.Conv2d(1, width // 4, 3, padding=1), nn.BatchNorm2d(width // 4), nn.ReLU(), nn.Dropout(p),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(width, n_out))

def learner(digits, bs=64, **kw):
    set_seed(0)
    return Learner(make_dls(*digits, bs=bs), net(), loss_func=CrossEntropyLossFlat(), **kw)

class Hypers(Callback):
    "After each training batch (after the filter's own `after_batch`): the Learner's last group's hyper-parameters and the proxy's"
    order = 100
    def before_fit(self): self.seen = []
    def after_batch(self):
        if not self.training: return
        px = self.learn.loss_filter.proxy
        self.seen.append((dict(self.learn.opt.hypers[-1]), dict(px.opt.hypers[0])))   # copies: fastai's `Optimizer` keeps its dicts

class Steps(Callback):
    "The model optimizer's real steps (a cancelled step runs `after_step` too, after `after_cancel_step`)"
    order = 100
    def before_fit(self): self.n, self.cancelled, self.batches = 0, 0, 0
    def after_cancel_step(self): self.cancelled += 1
    def after_step(self): self.n += 1
    def after_batch(self): self.batches += self.training
    @property
    def stepped(self): return self.n - self.cancelled

# ------------------------------------------------------------------ 1. the optimizer, made as `Learner.create_opt` makes it
def _follows(seen, keys=HYPERS):
    for mine, px in seen:
        for k in keys: assert px[k] == pytest.approx(mine[k]), (k, mine[k], px[k])

def test_an_optimwrapper_proxy_follows_every_hyper_of_the_learner_after_every_batch(digits):
    spy = Hypers()
    learn = learner(digits, opt_func=partial(OptimWrapper, opt=torch.optim.AdamW), cbs=spy)
    fit(learn.top_loss(keep=.5, score_model=net(16), train_every=4), 2, 1e-2, wd=.05)
    px = learn.loss_filter.proxy
    assert isinstance(px.opt, OptimWrapper) and isinstance(px.opt.opt, torch.optim.AdamW)
    assert len(spy.seen) == 2 * len(learn.dls.train)
    _follows(spy.seen)
    lrs, moms = [m['lr'] for m, _ in spy.seen], [m['mom'] for m, _ in spy.seen]
    assert max(lrs) > 10 * min(lrs) and max(moms) > min(moms)   # the one-cycle schedule moved both: the proxy followed a moving target
    assert px.opt.opt.param_groups[0]['betas'] == learn.opt.opt.param_groups[-1]['betas']

def test_a_fastai_optimizer_proxy_follows_every_hyper_of_the_learner_after_every_batch(digits):
    spy = Hypers()
    learn = learner(digits, opt_func=partial(Adam, eps=1e-6), cbs=spy)
    fit(learn.batch_loss_filter(skip_epochs=0, score_model=net(16)), 1, 1e-2, wd=.1)
    _follows(spy.seen)

def test_an_optimwrapper_instance_as_opt_func_trains_with_a_proxy_of_the_same_kind(digits):
    set_seed(0)
    model = net()
    inst = OptimWrapper(opt=torch.optim.SGD(model.parameters(), lr=.1, momentum=.9, weight_decay=1e-4, nesterov=True))
    learn = Learner(make_dls(*digits, bs=64), model, loss_func=CrossEntropyLossFlat(), opt_func=inst)
    fit(learn, 1)   # a plain Learner trains with it
    proxy = net(16)
    w0 = [p.detach().clone() for p in proxy.parameters()]
    fit(learn.top_loss(keep=.5, score_model=proxy, train_every=1), 1)
    popt = learn.loss_filter.proxy.opt
    assert isinstance(popt, OptimWrapper) and type(popt.opt) is torch.optim.SGD and popt.opt is not inst.opt
    pg = popt.opt.param_groups[0]
    assert pg['nesterov'] and pg['weight_decay'] == 1e-4 and pg['lr'] == inst.opt.param_groups[-1]['lr']
    assert {id(p) for p in pg['params']} == {id(p) for p in proxy.parameters()}
    assert any(not torch.equal(a, b) for a, b in zip(w0, proxy.parameters()))   # the proxy learned

def test_no_weight_decay_on_the_proxys_norm_and_bias_parameters_unless_wd_bn_bias(digits):
    proxy = net(16)
    learn = learner(digits).top_loss(keep=.5, score_model=proxy)
    fit(learn, 1)
    st = learn.loss_filter.proxy.opt.state
    norm_bias = [proxy[1].weight, proxy[1].bias, proxy[0].bias, proxy[6].bias]
    assert all(st[p].get('do_wd', True) is False for p in norm_bias)
    assert st[proxy[0].weight].get('do_wd', True) and st[proxy[6].weight].get('do_wd', True)
    assert st[proxy[1].weight].get('force_train') and st[proxy[1].bias].get('force_train')   # `train_bn`
    # with `wd_bn_bias=True`, as for the Learner, every parameter decays
    proxy = net(16)
    learn = learner(digits, wd_bn_bias=True, train_bn=False).top_loss(keep=.5, score_model=proxy)
    fit(learn, 1)
    st = learn.loss_filter.proxy.opt.state
    assert all(st[p].get('do_wd', True) for p in proxy.parameters()) and not any(st[p].get('force_train') for p in proxy.parameters())

# ------------------------------------------------------------------ 2. the proxy steps only where the model steps
def test_under_gradient_accumulation_the_proxy_steps_where_the_model_steps(digits):
    steps = Steps()
    learn = learner(digits, cbs=[GradientAccumulation(n_acc=96), steps]).top_loss(keep=.5, score_model=net(16), train_every=1)
    fit(learn, 2)
    px = learn.loss_filter.proxy
    assert 0 < steps.stepped < steps.batches - 5           # 32 kept examples a batch: a step every third batch
    assert px.n_steps == steps.stepped

def test_after_a_cancelled_step_the_proxy_does_not_step(digits):
    class CancelOdd(Callback):
        order = 5
        def before_step(self):
            if self.iter % 2: raise CancelStepException()
    steps, proxy = Steps(), net(16)
    learn = learner(digits, cbs=[CancelOdd(), steps]).top_loss(keep=.5, score_model=proxy, train_every=1)
    fit(learn, 1)
    assert steps.cancelled > 0 and learn.loss_filter.proxy.n_steps == steps.stepped

def test_when_every_step_is_cancelled_the_proxy_never_moves(digits):
    class CancelAll(Callback):
        order = 5
        def before_step(self): raise CancelStepException()
    proxy = net(16)
    learn = learner(digits, cbs=CancelAll()).top_loss(keep=.5, score_model=proxy, train_every=1)
    w0 = [p.detach().clone() for p in proxy.parameters()]
    fit(learn, 1)
    assert learn.loss_filter.proxy.n_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(w0, proxy.parameters()))
    assert all(p.grad is None or not p.grad.any() for p in proxy.parameters())   # nothing left to leak into a later step

def test_an_accumulated_step_is_the_mean_over_every_row_learned():
    torch.manual_seed(0)
    a = nn.Linear(6, 3); b = nn.Linear(6, 3); b.load_state_dict(a.state_dict())
    x, y = torch.randn(20, 6), torch.randint(0, 3, (20,))
    pa = ProxyScorer(a, nn.CrossEntropyLoss(), opt=torch.optim.SGD(a.parameters(), lr=.5), train_every=1)
    pb = ProxyScorer(b, nn.CrossEntropyLoss(), opt=torch.optim.SGD(b.parameters(), lr=.5), train_every=1)
    pa.score((x[:8],), (y[:8],)); assert pa.backward(pa.pop_graph()[:5])
    pa.score((x[8:],), (y[8:],)); assert pa.backward(pa.pop_graph())
    assert pa.step() and not pa.step()                      # a second step has nothing to take
    pb.score((torch.cat([x[:5], x[8:]]),), (torch.cat([y[:5], y[8:]]),)); assert pb.learn()
    assert pa.n_steps == pb.n_steps == 1
    assert torch.allclose(a.weight, b.weight, atol=1e-6) and torch.allclose(a.bias, b.bias, atol=1e-6)

# ------------------------------------------------------------------ 3. random streams: the run's seed, every device
def test_the_proxys_seed_comes_from_the_run_without_moving_the_global_stream(digits):
    def seed_of(s):
        learn = learner(digits).top_loss(keep=.5, score_model=net(16))
        torch.manual_seed(s)
        state = torch.get_rng_state()
        learn.loss_filter.learn = learn
        learn('before_fit')   # the filter makes its proxy here
        assert torch.equal(torch.get_rng_state(), state)   # the draw left the global stream where it was
        learn('after_fit')
        return learn.loss_filter.proxy.seed
    a, b = seed_of(1), seed_of(2)
    assert a != b and seed_of(1) == a

def _fake_streams(module):
    "Mocks of a device's `get_rng_state`/`set_rng_state`: a global state that tells apart what was set, and a log of the calls"
    log, state = [], [torch.tensor([0])]
    def get(*a): return state[0].clone()
    def put(s, *a):
        log.append(s)
        if s is None: raise TypeError('set_rng_state(None)')
        state[0] = s.clone()
    return log, state, get, put

def _draw(px):
    "What the proxy's block does on a device stream: draw from it (moves the mocked state)"
    x, y = torch.ones(4, 4), torch.zeros(4, dtype=torch.long)
    return px.score((x,), (y,))

def test_own_rng_forks_and_restores_the_cuda_stream_on_the_cpu_by_mocks():
    px = ProxyScorer(nn.Sequential(nn.Dropout(.5), nn.Linear(4, 2)), nn.CrossEntropyLoss(), train_every=100, seed=11)
    _draw(px)   # on the CPU first: a proxy that then moves to CUDA has no CUDA stream yet
    log, state, get, put = _fake_streams(torch.cuda)
    gen = mock.MagicMock()
    gen.manual_seed.side_effect = lambda n: state.__setitem__(0, torch.tensor([1000 + n]))
    with mock.patch.object(ProxyScorer, 'device', new_callable=mock.PropertyMock, return_value=torch.device('cuda', 0)), \
         mock.patch('torch.cuda.get_rng_state', side_effect=get), mock.patch('torch.cuda.set_rng_state', side_effect=put), \
         mock.patch('torch.cuda.default_generators', [gen]), mock.patch('torch.cuda.current_device', return_value=0):
        cpu = torch.get_rng_state()
        _draw(px)
        gen.manual_seed.assert_called_once_with(11)          # its CUDA stream starts from its seed
        assert log == [torch.tensor([0])]                    # only the global state put back, never None
        assert torch.equal(state[0], torch.tensor([0])) and torch.equal(torch.get_rng_state(), cpu)
        state[0] = torch.tensor([5])                         # the global CUDA stream moves on outside the proxy
        _draw(px)
        assert gen.manual_seed.call_count == 1               # the second block resumes the proxy's stream...
        assert torch.equal(log[1], torch.tensor([1011])) and torch.equal(state[0], torch.tensor([5]))   # ...and gives the global one back
    assert all(s is not None for s in log)

def test_own_rng_forks_and_restores_the_mps_stream_on_the_cpu_by_mocks():
    px = ProxyScorer(nn.Sequential(nn.Dropout(.5), nn.Linear(4, 2)), nn.CrossEntropyLoss(), train_every=100, seed=5)
    log, state, get, put = _fake_streams(torch.mps)
    seeded = []
    def seed(n): seeded.append(n); state[0] = torch.tensor([2000 + n])
    with mock.patch.object(ProxyScorer, 'device', new_callable=mock.PropertyMock, return_value=torch.device('mps')), \
         mock.patch('torch.mps.get_rng_state', side_effect=get), mock.patch('torch.mps.set_rng_state', side_effect=put), \
         mock.patch('torch.mps.manual_seed', side_effect=seed):
        cpu = torch.get_rng_state()
        _draw(px)
        assert seeded == [5] and torch.equal(state[0], torch.tensor([0])) and torch.equal(torch.get_rng_state(), cpu)
        _draw(px)
        assert seeded == [5] and torch.equal(log[-2], torch.tensor([2005])) and torch.equal(state[0], torch.tensor([0]))

@pytest.mark.parametrize('make_opt', [lambda ps: torch.optim.Adam(ps, lr=1e-2), lambda ps: OptimWrapper(ps, opt=torch.optim.AdamW, lr=1e-2),
                                      lambda ps: Adam(ps, lr=1e-2)], ids=['torch', 'wrapper', 'fastai'])
def test_a_proxy_moved_to_another_device_takes_its_optimizer_state(make_opt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    px = ProxyScorer(model, nn.CrossEntropyLoss(), opt=make_opt(list(model.parameters())), train_every=1)
    px.score((torch.randn(8, 4),), (torch.randint(0, 2, (8,)),)); assert px.learn()
    px.to(torch.device('meta'))   # a device of its own on any machine: what moving to CUDA does, checked on the CPU
    assert all(p.device.type == 'meta' for p in model.parameters())
    opt = getattr(px.opt, 'opt', px.opt)
    states = [v for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and k != 'step']
    assert states and all(v.device.type == 'meta' for v in states)
    assert all(p in opt.state for p in model.parameters()) or isinstance(opt, torch.optim.Optimizer)

# ------------------------------------------------------------------ 4. `fill_batch`: the proxy learns the rows the model trains on
def id_dls(n=128, bs=32):
    "96 training examples (3 batches of 32) whose last input column is their index"
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(n, 4, generator=g), torch.arange(n, dtype=torch.float32)[:, None]], 1)
    items = list(zip(x, torch.randint(0, 4, (n,), generator=g)))
    return DataLoaders.from_dsets(ItemList(items[:96]), ItemList(items[96:]), bs=bs, device='cpu')

class IdNet(nn.Module):
    "Logits from every column but the last; the ids of the rows of each forward with gradients (a training forward)"
    def __init__(self, width=4):
        super().__init__(); self.net, self.ids = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 4)), []
    def forward(self, x):
        if torch.is_grad_enabled() and self.training: self.ids += x[:, -1].long().tolist()
        return self.net(x[:, :-1])

def test_with_fill_batch_the_proxy_learns_only_the_rows_the_model_trains_on():
    set_seed(0)
    model, proxy = IdNet(), IdNet(2)
    learn = Learner(id_dls(), model, loss_func=CrossEntropyLossFlat())
    # 9 of each filtered batch pooled; the third, unfiltered (`interrupt=3`), joins the pool of 18: a step of 32, 18 left at the fit's end
    learn.selective_backprop(keep=.3, start=0., end=1., interrupt=3, fill_batch=True, score_model=proxy, train_every=1)
    learned = []
    proxy.register_forward_hook(lambda m, i, o: learned.extend(proxy.ids) or proxy.ids.clear())
    with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
    left = [int(i) for part in learn.loss_filter.pool.parts for i in part[0][:, -1]]
    assert len(left) == 18 and len(model.ids) == 32
    assert learned and not set(learned) & set(left)                    # nothing the model never trained on
    assert not Counter(learned) - Counter(model.ids)                   # only rows of the model's steps
    assert learn.loss_filter.proxy.n_steps == 1

# ------------------------------------------------------------------ 5. what is refused, and what is not
def test_a_proxy_with_more_outputs_than_the_model_is_refused_before_any_step(digits):
    learn = learner(digits)
    w0 = [p.detach().clone() for p in learn.model.parameters()]
    learn.top_loss(keep=.5, score_model=net(16, n_out=12))   # 12 outputs where the model has 10: the loss takes it silently
    with pytest.raises(ValueError, match=r'`score_model`.*\(12,\).*\(10,\)'): fit(learn)
    assert all(torch.equal(p, q) for p, q in zip(w0, learn.model.parameters()))

def tab_learner(df, **kw):
    "A `tabular_learner` on the first 450 rows, validated on the rest (as `test_apps`)"
    dls = TabularDataLoaders.from_df(df, procs=[Categorify, Normalize], cat_names=['c'], cont_names=['a', 'b'],
                                     y_names='y', valid_idx=list(range(450, len(df))), bs=64, device='cpu', **kw)
    return tabular_learner(dls, layers=[32], n_out=2)

class StepSizes(Callback):
    order = 100
    def before_fit(self): self.sizes = []
    def after_pred(self):
        if self.training: self.sizes.append(self.yb[0].shape[0])

def test_tabular_fill_batch_pools_full_batches_with_a_proxy():
    set_seed(0)
    learn = tab_learner(tabular_df())
    sizes = StepSizes()
    proxy = TabularModel(get_emb_sz(learn.dls.train_ds), 2, 2, layers=[8])
    learn.selective_backprop(keep=.5, start=0., end=1., interrupt=0, fill_batch=True, score_model=proxy, train_every=1)
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(3, 1e-2, cbs=sizes)
    assert sizes.sizes and sum(n == 64 for n in sizes.sizes) >= len(sizes.sizes) - 3 and max(sizes.sizes) == 64
    assert len(sizes.sizes) < 3 * len(learn.dls.train)   # pooled: fewer steps than batches
    assert learn.loss_filter.proxy.n_steps == len(sizes.sizes)

def test_fill_batch_refuses_only_loaders_that_pad_their_batches():
    from fastai.data.core import TfmdDL
    from fastai.text.all import Pad_Chunk
    why = _pool_refusal(TfmdDL(list(range(8)), bs=2, before_batch=Pad_Chunk(seq_len=4)))
    assert 'Pad_Chunk' in why and 'pads each batch' in why
    assert _pool_refusal(TfmdDL(list(range(8)), bs=2)) is None
    assert _pool_refusal(tab_learner(tabular_df()).dls.train) is None   # tabular's weighted loader only picks its order

@pytest.mark.parametrize('how', ['fastai', 'wrapper'])
def test_the_timed_proxy_cost_steps_both_models_with_the_learners_optimizer(digits, how):
    "The proxy's timed step cost is charged with the optimizer the proxy trains with (and the model's with the Learner's), not a stand-in"
    from loss_filters.costs import learner_proxy_cost
    made = []
    base = Adam if how == 'fastai' else partial(OptimWrapper, opt=torch.optim.AdamW)
    def opt_func(params, **kw):
        params = list(params); made.append(sum(p.numel() for p in params)); return base(params, **kw)
    learn, proxy = learner(digits, opt_func=opt_func), net(width=8)
    before = {k: p.detach().clone() for k, p in learn.model.named_parameters()}
    cost = learner_proxy_cost(learn, proxy, n=1)
    assert sorted(made) == sorted([sum(p.numel() for p in m.parameters()) for m in (learn.model, proxy)])
    assert cost['score'] > 0 and cost['step'] > 0 and learn.opt is None   # the Learner's own optimizer is not made
    assert all(torch.allclose(before[k], p, atol=1e-4) for k, p in learn.model.named_parameters())   # its weights moved at a rate of 1e-6

def _two_part(width=32):
    "A body and a head, as `vision_learner` splits its models"
    return nn.Sequential(nn.Sequential(nn.Conv2d(1, width // 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten()), nn.Linear(width, 10))

def _split(m): return [list(m[0].parameters()), list(m[1].parameters())]

class GroupRates(Callback):
    order = 100
    def before_fit(self): self.seen = []
    def after_batch(self):
        if self.training: self.seen.append(([h['lr'] for h in self.learn.opt.hypers], [h['lr'] for h in self.learn.loss_filter.proxy.opt.hypers]))

@pytest.mark.parametrize('how', ['fastai', 'wrapper'])
def test_the_proxy_takes_the_learners_parameter_groups_where_its_splitter_splits_it_and_follows_each(digits, how):
    "Discriminative rates (`lr=slice(...)`, as `fine_tune` gives): a proxy the Learner's `splitter` splits as it splits the model follows each group's rate"
    opt_func = Adam if how == 'fastai' else partial(OptimWrapper, opt=torch.optim.AdamW)
    def run(proxy):
        set_seed(0)
        spy = GroupRates()
        learn = Learner(make_dls(*digits, bs=64), _two_part(), loss_func=CrossEntropyLossFlat(), splitter=_split, opt_func=opt_func, cbs=spy)
        fit(learn.batch_loss_filter(skip_epochs=0, score_model=proxy), 1, slice(1e-4, 1e-2))
        return learn, spy.seen
    learn, seen = run(_two_part(16))
    assert len(learn.loss_filter.proxy.opt.hypers) == 2 and seen
    for mine, px in seen: assert px == pytest.approx(mine) and mine[0] < mine[1] / 10   # two rates, a hundredfold apart
    learn, seen = run(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)))   # the splitter's first group would be empty: one group, at the head's rate
    assert len(learn.loss_filter.proxy.opt.hypers) == 1 and all(px == pytest.approx(mine[-1:]) for mine, px in seen)

class AfterFits(Callback):
    "The model's and the proxy's body parameters at the end of each fit"
    order = 100
    def __init__(self): self.bodies = []
    def after_fit(self):
        self.bodies.append(([p.detach().clone() for p in self.learn.model[0].parameters()],
                            [p.detach().clone() for p in self.learn.loss_filter.proxy.model[0].parameters()]))

def test_under_fine_tune_the_proxy_follows_each_groups_rate_and_trains_its_body_while_the_model_is_frozen(digits):
    "fastai's `fine_tune`: a frozen epoch (the model's body fixed), then an unfrozen one at discriminative rates; freezing stays the Learner's"
    set_seed(0)
    spy, ends = GroupRates(), AfterFits()
    learn = Learner(make_dls(*digits, bs=64), _two_part(), loss_func=CrossEntropyLossFlat(), splitter=_split, cbs=[spy, ends])
    proxy = _two_part(16)
    learn.batch_loss_filter(skip_epochs=0, score_model=proxy, train_every=1)
    body, px_body = [p.detach().clone() for p in learn.model[0].parameters()], [p.detach().clone() for p in proxy[0].parameters()]
    with learn.no_bar(), learn.no_logging(): learn.fine_tune(1, 1e-2, freeze_epochs=1)
    assert len(learn.loss_filter.proxy.opt.hypers) == 2 and len(spy.seen) == len(learn.dls.train) and len(ends.bodies) == 2
    for mine, px in spy.seen: assert px == pytest.approx(mine)
    assert spy.seen[-1][0][0] < spy.seen[-1][0][1] / 10   # the unfrozen epoch's discriminative rates, followed
    (model_frozen, px_frozen), (model_end, _) = ends.bodies
    assert all(torch.equal(a, b) for a, b in zip(body, model_frozen))   # the frozen fit left the model's body as it was
    assert not all(torch.equal(a, b) for a, b in zip(px_body, px_frozen))   # while the proxy's body learned
    assert not all(torch.equal(a, b) for a, b in zip(body, model_end))   # the model's body learned once unfrozen
