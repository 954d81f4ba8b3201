"The random controls: the filters' own code paths, with the examples chosen blind."
import pytest, torch
from fastai.basics import Learner, CrossEntropyLossFlat, set_seed
import fastai.callback.all   # `no_bar`, `fit_one_cycle`
from loss_filters.core import prune_at_random, select_at_random
from loss_filters.controls import RandomPruningCallback, RandomBatchCallback
from conftest import mlp, col

def test_prune_at_random_keeps_the_share_and_follows_the_generator():
    m = prune_at_random(1000, .37, torch.Generator().manual_seed(0))
    assert m.dtype == torch.bool and int(m.sum()) == 370
    assert torch.equal(m, prune_at_random(1000, .37, torch.Generator().manual_seed(0)))
    assert not torch.equal(m, prune_at_random(1000, .37, torch.Generator().manual_seed(1)))
    assert int(prune_at_random(10, .01).sum()) == 1                       # at least one
    with pytest.raises(ValueError, match='`keep` must be in'): prune_at_random(10, 0.)

def test_select_at_random_draws_distinct_indices_blind_to_the_losses():
    losses = torch.rand(64)
    idx = select_at_random(losses, .25, torch.Generator().manual_seed(0))
    assert len(idx) == 16 and len(set(idx.tolist())) == 16 and idx.max() < 64
    picks = torch.stack([torch.bincount(select_at_random(losses, .25), minlength=64) for _ in range(400)]).sum(0).float()
    assert picks.min() > 50 and picks.max() < 150                        # uniform: 100 expected per example
    with pytest.raises(ValueError, match='`keep` must be in'): select_at_random(losses, 1.5)

def test_random_pruning_keeps_its_share_in_pruned_epochs(digits_dls):
    set_seed(0)
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=RandomPruningCallback(keep=.6, anneal=.25))
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(4, 1e-2)
    n = len(digits_dls.train_ds)
    plain, kept = n // 64 * 64, round(.6 * n) // 64 * 64                 # `drop_last`: whole batches of 64 only
    assert [e['samp_perc'] for e in learn.loss_filter.epoch_stats] == [1., kept / plain, kept / plain, 1.]
    assert col(learn, 'samp_perc')[1] == pytest.approx(kept / plain)
    assert digits_dls.train.n == n and 'get_idxs' not in digits_dls.train.__dict__

@pytest.mark.parametrize('fill', [False, True])
def test_random_batch_keeps_its_share_on_the_schedule(digits_dls, fill):
    set_seed(0)
    cb = RandomBatchCallback(keep=.25, skip_epochs=1, fill_batch=fill)
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=cb)
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
    samp = col(learn, 'samp_perc')
    assert samp[0] == 1 and samp[1] == pytest.approx(.25, abs=.02)
    assert cb.stats and all(b['kept'] == max(1, round(.25 * b['bs'])) for b in cb.stats)

class SlowForward(torch.nn.Module):
    "An MLP whose every forward pass sleeps `secs` and is counted: a pass's cost shows in the fit's time, whatever the machine"
    def __init__(self, secs=.01): super().__init__(); self.net, self.secs, self.calls = mlp(), secs, 0
    def forward(self, x):
        import time
        self.calls += 1; time.sleep(self.secs)
        return self.net(x)

def _random_fit(dls, **kw):
    from loss_filters.runs import EpochClock, seed_loaders
    set_seed(0)
    model, clock = SlowForward(), EpochClock(metric="valid_loss")
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), cbs=[RandomBatchCallback(keep=.5, **kw), clock])
    seed_loaders(learn, 0)   # both fits on the same data order
    with learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
    return learn, model.calls, clock.train_s

def test_the_random_control_runs_no_scoring_pass(digits_dls):
    blind, calls, secs = _random_fit(digits_dls)
    scored, calls_scored, secs_scored = _random_fit(digits_dls, scored=True)
    n_batches, n_valid = 2 * len(digits_dls.train), 2 * len(digits_dls.valid)
    assert blind.loss_filter.fit_scored == 0 and scored.loss_filter.fit_scored == 2 * len(digits_dls.train) * 64
    assert calls == n_batches + n_valid and calls_scored == 2 * n_batches + n_valid   # one forward a step, not two
    assert secs_scored - secs > .5 * n_batches * .01   # the scoring passes' sleeps, at least half of them, are its extra time
    # the same rows trained: scoring draws nothing from the filter's random source
    assert [s['kept'] for s in blind.loss_filter.stats] == [s['kept'] for s in scored.loss_filter.stats]
    assert all(torch.equal(a, b) for a, b in zip(blind.model.parameters(), scored.model.parameters()))
    e = blind.loss_filter.epoch_stats[-1]
    assert e['samp_perc'] == pytest.approx(.5, abs=.02) and e['loss_perc'] != e['loss_perc']   # its losses are unknown: NaN
    assert 0 < scored.loss_filter.epoch_stats[-1]['loss_perc'] < 1
