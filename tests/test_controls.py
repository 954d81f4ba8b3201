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
