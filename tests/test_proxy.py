"Scoring by a proxy: the main model's fit is the one its indices give, the proxy learns and is charged, bad proxies fail early; the top-k rule."
import math, random
import pytest, torch, torch.nn as nn
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, accuracy, set_seed
from loss_filters.core import select_top_k, take
from loss_filters.proxy import ProxyScorer
from loss_filters.batch import TopLossCallback, BatchLossFilterCallback, SelectiveBackpropCallback, RandomBatchCallback, LossFilterBase
from loss_filters.runs import parse_method, run_fit, add_work, seeded_proxy
from loss_filters.plan import self_scored_control; from loss_filters.runs import control_specs
import loss_filters.batch as lf_batch
from conftest import make_dls, BatchSpy

def fit(learn, n=1, lr=1e-2):
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(n, lr)
    return learn

def net(width=32, p=.2):
    "A small CNN with BatchNorm (running statistics) and dropout (global random draws)"
    return nn.Sequential(nn.Conv2d(1, width // 4, 3, padding=1), nn.BatchNorm2d(width // 4), nn.ReLU(), nn.Dropout(p),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(width, 10))

# ------------------------------------------------------------------ the top-k rule
def test_top_k_keeps_the_highest_losses_by_hand():
    losses = torch.tensor([.1, .5, .3, .9, .2, .7])
    assert select_top_k(losses, .5).tolist() == [3, 5, 1]
    assert select_top_k(losses, .34).tolist() == [3, 5]          # round(.34 * 6) = 2
    assert select_top_k(losses, .01).tolist() == [3]             # at least one
    assert select_top_k(torch.tensor([.1, math.nan, .3]), .34).tolist() == [1]   # a broken example ranks hardest
    assert select_top_k(torch.tensor([.2, .2, .2, .2]), .5).tolist() == [0, 1]   # ties: the batch's own order, no draw
    with pytest.raises(ValueError, match='`keep`'): select_top_k(losses, 0.)

def test_top_loss_trains_on_the_top_half_of_every_batch(digits):
    set_seed(0)
    spy = BatchSpy()
    learn = Learner(make_dls(*digits, bs=64), net(), loss_func=CrossEntropyLossFlat(), cbs=spy).top_loss(keep=.5)
    fit(learn)
    sizes = [n for _, _, n in spy.sizes]
    assert sizes[:-1] == [32] * (len(sizes) - 1) and len(sizes) == len(learn.dls.train)

# ------------------------------------------------------------------ the proxy leaves the main fit as the same indices by hand give it
class KeptRows(Callback):
    "The rows of each training batch the step trains on, read after the filter"
    order = LossFilterBase.order + 1
    def before_fit(self): self.rows = []
    def before_batch(self):
        if self.training: self.rows.append(self.learn.loss_filter.step_idxs.clone())

class ByHand(Callback):
    "Train each batch on rows given in advance, as a filter would, but with no scorer at all"
    order = LossFilterBase.order
    def __init__(self, rows): self.rows = rows
    def before_fit(self): self.i = 0
    def before_batch(self):
        if not self.training: return
        self.learn.xb, self.learn.yb = take(self.learn.xb, self.rows[self.i]), take(self.learn.yb, self.rows[self.i])
        self.i += 1

def _fresh(digits, cbs):
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=64), net(), loss_func=CrossEntropyLossFlat(), cbs=cbs)
    for dl in learn.dls.loaders: dl.rng = random.Random(0)
    return learn

def test_the_proxy_leaves_the_main_fit_identical_to_the_same_indices_by_hand(digits):
    kept = KeptRows()
    a = _fresh(digits, [kept])
    proxy = seeded_proxy(lambda w: net(16), .5, seed=0)
    a.add_cb(TopLossCallback(keep=.5, score_model=proxy, train_every=2))
    fit(a, 2); state_a = torch.get_rng_state()
    b = _fresh(digits, [ByHand(kept.rows)])
    fit(b, 2); state_b = torch.get_rng_state()
    assert len(kept.rows) == 2 * len(a.dls.train)
    for (k, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):   # weights and norm statistics
        assert torch.equal(x, y), k
    assert torch.equal(state_a, state_b)   # torch's global random stream: the proxy's dropout drew from its own

def test_the_proxy_learns_and_the_model_runs_no_scoring_pass(digits):
    class Forwards(Callback):
        order = 100
        def before_fit(self): self.n = 0
        def after_pred(self): self.n += self.training
    spy, proxy = Forwards(), net(16)
    w0 = [p.detach().clone() for p in proxy.parameters()]
    learn = _fresh(digits, [spy]).batch_loss_filter(min_loss_perc=.9, score_model=proxy)
    calls = []
    learn.model.register_forward_hook(lambda m, i, o: calls.append(m.training))
    fit(learn, 2)
    n_train = 2 * len(learn.dls.train)
    assert sum(calls) == n_train == spy.n                 # one forward a training step: no scoring pass of the model's own
    assert learn.loss_filter.fit_scored == 0
    ps, pt = learn.loss_filter.proxy_work()
    n_epoch = len(learn.dls.train) * 64   # the first epoch unfiltered: the proxy learns each whole batch through its scoring forward;
    assert learn.loss_filter.proxy.n_steps == n_train and ps == n_epoch and n_epoch < pt < 2 * n_epoch   # then scored without a graph, the kept rows learned
    assert any(not torch.equal(p, q) for p, q in zip(w0, proxy.parameters()))
    assert all(p.device == q.device for p, q in zip(proxy.parameters(), learn.model.parameters()))

def test_the_proxy_follows_the_learners_rate(digits):
    learn = _fresh(digits, []).top_loss(keep=.5, score_model=net(16), train_every=1)
    fit(learn, 1)
    assert learn.loss_filter.proxy.opt.hypers[0]['lr'] == learn.opt.hypers[-1]['lr']

# ------------------------------------------------------------------ work: the proxy's cost, not the model's
def test_the_work_charges_the_proxys_measured_cost(digits):
    dls = make_dls(*digits, bs=64)
    make = lambda: Learner(dls, net(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    run = run_fit(make, 'topk:proxy=.5,train_every=3', epochs=2, lr=1e-2, make_proxy=lambda w: net(round(32 * w)))
    n_seen = 2 * len(dls.train) * 64
    assert run['scored'] == 0 and run['proxy_scored'] == n_seen   # every batch scored without a graph,
    assert run['proxy_trained'] == math.ceil(2 * len(dls.train) / 3) * 32   # and every third one's kept half learned by a forward of its own
    cost = dict(score=.1, step=.5)
    w = add_work(dict(run), score_cost=.3, proxy_cost=cost)['work']
    assert w == pytest.approx((run['trained'] + .1 * run['proxy_scored'] + .5 * run['proxy_trained']) / run['plain_epoch'])
    with pytest.raises(ValueError, match='proxy_cost'): add_work(dict(run), score_cost=.3)

def test_a_proxy_method_spec_is_checked_and_has_a_self_scored_twin():
    assert parse_method('blf:proxy=.25')[3] == dict(proxy=.25)
    for bad in ('baseline:proxy=.25', 'stale:proxy=.25', 'blf:proxy=0', 'topk:proxy=2'):
        with pytest.raises(ValueError, match='proxy'): parse_method(bad)
    assert self_scored_control('blf:proxy=.25,min_loss_perc=.95') == 'blf:min_loss_perc=.95'
    assert self_scored_control('topk:proxy=.25,train_every=1') == 'topk' and self_scored_control('blf') is None
    assert control_specs({'blf:proxy=.25': ['random_batch:keep=.4', 'blf'], 'blf': ['random_batch:keep=.45']}) == ['random_batch:keep=.4', 'random_batch:keep=.45']
    with pytest.raises(ValueError, match='make_proxy'): run_fit(lambda: None, 'blf:proxy=.25')

# ------------------------------------------------------------------ bad proxies fail before the first step
@pytest.mark.parametrize('cls', [TopLossCallback, BatchLossFilterCallback, SelectiveBackpropCallback, RandomBatchCallback])
def test_not_a_module_is_refused_at_construction(cls):
    with pytest.raises(TypeError, match='`score_model`'): cls(score_model='cnn')
    with pytest.raises(TypeError, match='`score_model`'): cls(score_model=nn.ReLU())   # nothing to train
    with pytest.raises(ValueError, match='train_every'): cls(score_model=net(), train_every=0)

def test_a_proxy_with_the_wrong_output_fails_before_any_step(digits):
    learn = _fresh(digits, [])
    w0 = [p.detach().clone() for p in learn.model.parameters()]
    learn.top_loss(score_model=nn.Sequential(nn.Flatten(), nn.Linear(64, 3)))   # 3 classes where the loss has 10
    with pytest.raises(ValueError, match='`score_model` cannot score'): fit(learn)
    assert all(torch.equal(p, q) for p, q in zip(w0, learn.model.parameters()))

def test_a_proxy_sharing_the_models_weights_is_refused(digits):
    learn = _fresh(digits, [])
    with pytest.raises(ValueError, match='shares parameters'): fit(learn.top_loss(score_model=learn.model))

def test_a_proxy_with_a_score_other_than_the_loss_is_refused():
    with pytest.raises(ValueError, match='grad_norm'): TopLossCallback(score='grad_norm', score_model=net())

def test_several_processes_are_refused_with_a_proxy(digits, monkeypatch):
    learn = _fresh(digits, []).top_loss(score_model=net(16))
    monkeypatch.setattr(lf_batch, 'dist_world', lambda: (0, 2))
    with pytest.raises(ValueError, match='several processes'): fit(learn)

def test_a_proxy_keeps_its_own_random_stream_across_scores():
    torch.manual_seed(0)
    px = ProxyScorer(nn.Sequential(nn.Dropout(.5), nn.Linear(4, 2)), nn.CrossEntropyLoss(), train_every=100)
    x, y = torch.ones(8, 4), torch.zeros(8, dtype=torch.long)
    a, b = px.score((x,), (y,)), px.score((x,), (y,))
    assert not torch.equal(a, b)   # two draws of its dropout, not the same one replayed

def test_the_readme_proxy_example_on_a_from_folder_pipeline(tmp_path):
    "The README's proxy example as written, on an ordinary `from_folder` pipeline, where PIL gives 3 channels"
    from fastai.vision.all import ImageDataLoaders, vision_learner, resnet18, accuracy
    from loss_filters.data import make_cifar_like
    from loss_filters.models import simple_cnn
    path = make_cifar_like(tmp_path / 'imgs', n_per_class=6, classes=['cat', 'dog', 'frog'])
    dls = ImageDataLoaders.from_folder(path, valid='test', bs=8, num_workers=0)
    learn = vision_learner(dls, resnet18, pretrained=False, metrics=accuracy)
    learn.top_loss(keep=.5, score_model=simple_cnn(n_in=3, n_out=dls.c, widths=(8, 16, 32)))   # a small proxy scores each batch
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(1)
    assert learn.loss_filter.proxy.n_trained > 0 and 0 < learn.recorder.values[-1][list(learn.recorder.metric_names).index('samp_perc') - 1] < 1
    learn = vision_learner(dls, resnet18, pretrained=False, metrics=accuracy)
    learn.top_loss(keep=.5, score_model=simple_cnn(n_in=1, n_out=dls.c, widths=(8, 16, 32)))   # built for one channel: the input is named
    with pytest.raises(ValueError, match=r"`score_model` cannot take this batch's input \(\[8, 3, 32, 32\]"), learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(1)
