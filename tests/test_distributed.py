"Every filter under fastai's distributed data parallel training: 2 CPU processes (gloo), started here with a time limit."
import math, socket, time
import pytest, torch
import torch.multiprocessing as mp

pytest.importorskip('accelerate', reason="fastai.distributed needs accelerate: pip install 'loss_filters[distributed]'")
import ddp_worker

TIMEOUT = 300   # seconds; a hang fails the test instead of blocking CI

def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp('ddp')
    ctx = mp.start_processes(ddp_worker.run, args=(2, free_port(), str(out)), nprocs=2, join=False, start_method='spawn')
    deadline = time.monotonic() + TIMEOUT
    try:
        while not ctx.join(timeout=max(1., deadline - time.monotonic())):
            if time.monotonic() > deadline: pytest.fail(f"the 2-process fit did not finish within {TIMEOUT} s (a hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive(): p.kill()
    return [torch.load(out / f'rank{r}.pt', weights_only=False) for r in range(2)]

@pytest.mark.parametrize('method', ddp_worker.METHODS)
def test_final_weights_are_identical_on_both_ranks(ranks, method):
    w0, w1 = ranks[0][method]['weights'], ranks[1][method]['weights']
    assert w0.keys() == w1.keys()
    for k in w0: assert torch.equal(w0[k], w1[k]), k

@pytest.mark.parametrize('method', ddp_worker.METHODS)
def test_both_ranks_report_the_same_shares(ranks, method):
    r0, r1 = ranks[0][method], ranks[1][method]
    i, j = r0['names'].index('samp_perc') - 1, r0['names'].index('loss_perc') - 1   # values have no `epoch` column
    assert len(r0['values']) == 2
    for v0, v1 in zip(r0['values'], r1['values']): assert (v0[i], v0[j]) == (v1[i], v1[j])

@pytest.mark.parametrize('method', ['blf', 'sb'])
def test_shares_are_the_global_ones(ranks, method):
    "samp_perc is the kept count of both ranks over the examples both saw; loss_perc their summed kept share"
    i = ranks[0][method]['names'].index('samp_perc') - 1
    for epoch in range(2):
        batches = [b for r in ranks for b in r[method]['stats'] if b['epoch'] == epoch]
        kept, seen = sum(b['kept'] for b in batches), sum(b['bs'] for b in batches)
        assert ranks[0][method]['values'][epoch][i] == pytest.approx(kept / seen)
    if method == 'blf':   # the ranks kept different numbers per batch: the global figure is a real combination
        assert [b['kept'] for b in ranks[0][method]['stats']] != [b['kept'] for b in ranks[1][method]['stats']]

def test_stale_pruning_shares_the_table_and_splits_the_epoch(ranks):
    r0, r1 = ranks[0]['stale'], ranks[1]['stale']
    t0, t1 = r0['table'], r1['table']
    assert torch.equal(t0.nan_to_num(-1), t1.nan_to_num(-1))                # the same table on both ranks
    assert t0.isfinite().sum() >= 1200 - 2 * 64                              # all but the dropped partial batches
    for (own0, order0), (own1, order1) in zip(r0['orders'], r1['orders']):
        assert order0 == order1                                  # the same global order on both ranks
        assert len(own0) == len(own1) and len(own0) % 64 == 0     # equal numbers of whole batches: no DDP hang
        assert not set(own0) & set(own1)                          # disjoint shares (no padding needed here)
        assert set(own0) | set(own1) <= set(order0) and len(own0) + len(own1) > len(order0) - 2 * 64
    (_, full), (_, pruned) = r0['orders']
    assert len(full) == 1200 and len(pruned) < 1200               # epoch 0 trains on all, epoch 1 is pruned
    i = r0['names'].index('samp_perc') - 1
    (own0, _), (own1, _) = r0['orders'][1], r1['orders'][1]
    plain = 2 * (600 // 64 * 64)                                  # both ranks' plain epochs: 600 each, cut to whole batches
    assert r0['values'][0][i] == 1. and r0['values'][1][i] == (len(own0) + len(own1)) / plain   # what trained, over a plain epoch
    assert r0['pct_end'] == pytest.approx(1., abs=1e-6)           # the schedule ends at 100% with fewer batches

@pytest.mark.parametrize('method', ddp_worker.METHODS)
def test_the_norm_statistics_count_training_steps_only(ranks, method):
    "DDP broadcasts rank 0's BatchNorm buffers: on both ranks they count rank 0's steps, never a scoring pass"
    for r in ranks: assert r[method]['tracked'] == ranks[0][method]['steps'] > 0

def test_a_sorted_loader_is_refused_under_several_processes(ranks):
    for r in ranks: assert 'cannot prune a SortedDL under several processes' in r['sorted_error']

def test_fill_batch_is_refused_before_training(ranks):
    for r in ranks: assert '`fill_batch=True` cannot run with several processes' in r['fill_batch_error']

def test_gradient_accumulation_is_refused_beside_a_per_rank_filter(ranks):
    for r in ranks: assert 'cannot run beside `GradientAccumulation` with several processes' in r['grad_acc_error']

@pytest.mark.parametrize('name', ['sb_grad_acc', 'sb_fill_batch'])
def test_selective_backprop_pools_and_accumulates_alike_on_both_ranks(ranks, name):
    w0, w1 = ranks[0][name], ranks[1][name]
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    assert ranks[0][name + '_n_kept'] == ranks[1][name + '_n_kept'] == [pytest.approx(.5, abs=.01)] * 2

def test_stale_pruning_accumulates_gradients_alike_on_both_ranks(ranks):
    w0, w1 = ranks[0]['stale_grad_acc'], ranks[1]['stale_grad_acc']
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
