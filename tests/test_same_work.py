"The simple alternatives at a method's own work, trained: the plain model on one schedule cut to a run's work, random choice at equal work, and seconds read only where the runs shared one sitting."
import pytest
from fastai.basics import Learner, CrossEntropyLossFlat
from fastai.metrics import accuracy
from loss_filters.runs import run_fit
from loss_filters.compare import compare_filters, judge
from loss_filters.plan import same_work_controls, same_work_of; from loss_filters.verdicts import seconds_unread
from conftest import make_dls, mlp

@pytest.fixture(scope='module')
def make(digits):
    "A Learner factory on the digits: 1,347 training images at bs 64 (`drop_last`: 21 batches, 1,344 examples an epoch)"
    dls = make_dls(*digits, bs=64)
    return lambda: Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)

def test_a_schedule_cut_to_a_runs_work_trains_that_work_on_one_cycle(make):
    full = run_fit(make, 'baseline', epochs=3, lr=1e-2, seed=1)
    pe = full['plain_epoch']
    cut = run_fit(make, 'baseline:same_work=blf', epochs=3, lr=1e-2, seed=1, examples=round(2.5 * pe))
    assert cut['trained'] == round(2.5 * pe / 64) * 64 and cut['epochs'] == 3   # whole batches, the third epoch cut short
    assert [h['epoch'] for h in cut['history']] == [1, 2, 3] and cut['history'][-1]['trained'] == cut['trained']   # the cut epoch validated too
    same = run_fit(make, 'baseline:same_work=blf', epochs=3, lr=1e-2, seed=1, examples=3 * pe)   # a plain run's whole work: that run again
    assert same['final_metric'] == full['final_metric'] and same['trained'] == full['trained']

def test_a_cut_schedule_ends_its_one_cycle_at_its_last_batch(make):
    from loss_filters.runs import CutSchedule
    learn = make()
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2, cbs=CutSchedule(30))
    lrs = learn.recorder.lrs
    assert learn.train_iter == 30 and len(lrs) == 30 and len(learn.recorder.values) == 2
    assert max(lrs) == pytest.approx(1e-2, rel=.02) and lrs[-1] < 1e-2 / 100   # warmed up to the peak and annealed, over 30 batches, not 42

def test_the_alternatives_at_a_methods_work_are_named_from_its_runs():
    runs = [dict(method='topk:keep=.3,epochs=4', work=w, epochs=4) for w in (2.0, 2.4)]
    plain, rand = same_work_controls('topk:keep=.3,epochs=4', runs)
    assert plain == 'baseline:same_work=topk/keep=.3+epochs=4' and rand == 'random_batch:keep=0.550,epochs=4,same_work=topk/keep=.3+epochs=4'
    assert same_work_of('topk:keep=.3,epochs=4', ['x', rand, plain]) == (plain, rand)
    assert same_work_controls('blf', [dict(method='blf', work=5.2, epochs=5)]) == ['baseline:same_work=blf']   # more work than its steps' full batches
    assert same_work_controls('random_batch:keep=.5', [dict(method='random_batch:keep=.5', work=2., epochs=4)]) == []   # random choice is the alternative

def test_the_plan_trains_each_methods_alternatives_at_its_own_work(make):
    cmp = compare_filters(make, 'baseline topk:keep=.3', epochs=3, lr=1e-2, seeds=2, budgets='.67 1.33', show_progress=False, warmup=False)
    plain, rand = same_work_of('topk:keep=.3', cmp.control_of['topk:keep=.3'])
    assert plain == 'baseline:same_work=topk/keep=.3' and rand.startswith('random_batch:keep=0.')
    by = {(r['method'], r['seed']): r for r in cmp.runs}
    for sd in (0, 1):   # each seed's plain run spends that seed's work of the method, to a batch
        assert abs(by[plain, sd]['work'] - by['topk:keep=.3', sd]['work']) <= 64 / by[plain, sd]['plain_epoch'] / 2 + 1e-9
        assert by[rand, sd]['epochs'] == 3 and by[rand, sd]['scored'] == 0   # random choice at equal work: no scoring pass, its steps
    row = next(r for r in cmp.rows if r['method'] == 'topk:keep=.3')
    assert row['at_work']['how'] == 'same work' and row['at_work']['bend'] == 0 and row['vs_random_work']['control'] == rand
    why = seconds_unread(cmp.runs)   # one sitting: its seconds can be read, unless the machine's load changed under it (other tests share the cores)
    assert (why is None or why.startswith("the machine's speed changed during the sitting")) and 'in seconds' in repr(cmp)

def _made_up(method, seed, final, work, secs, sitting='a'):
    return dict(method=method, seed=seed, repeat=0, epochs=3, train_s=secs, wall_s=secs, work=work, final_metric=final, mean_samp_perc=.7,
                lr_mult=1., sitting=sitting, threads=1, history=[dict(metric=final, work=work, train_s=secs, samp_perc=1.)])

def test_the_first_reading_in_seconds_reads_each_fits_own_seconds():
    "A method level with the plain curve in work but faster per unit of work: at equal seconds it is above the plain curve, and training less needs more seconds than it took"
    runs = []
    for s, e in enumerate((-.001, 0., .001)):
        runs += [_made_up('baseline', s, .9 + e, 3., 30.), _made_up('baseline:epochs=2', s, .85 + e, 2., 20.), _made_up('baseline:epochs=4', s, .92 + e, 4., 40.),
                 _made_up('blf', s, .875 + e, 2.5, 20.)]   # the plain curve's value at its work, in the seconds of 2 plain epochs
    row = next(r for r in judge(runs, ['baseline:epochs=2', 'baseline:epochs=4'], {}, dict(alpha=.05)).rows if r['method'] == 'blf')
    assert row['at_work']['diff'] == pytest.approx(0, abs=1e-9) and row['at_work']['x'] == pytest.approx(1.)
    assert row['at_work_s']['diff'] == pytest.approx(.025) and row['at_work_s']['x'] == pytest.approx(25 / 20)
    mixed = [dict(r, sitting='b') if r['method'] == 'blf' else r for r in runs]   # the method trained in another sitting: not read in seconds
    row = next(r for r in judge(mixed, ['baseline:epochs=2', 'baseline:epochs=4'], {}, dict(alpha=.05)).rows if r['method'] == 'blf')
    assert 'at_work_s' not in row and 'sittings' in row['seconds_unread']

def test_seconds_are_read_only_from_one_sitting_on_one_thread_count():
    run = lambda **kw: dict(method='baseline', seed=0, sitting='a', threads=1) | kw
    assert seconds_unread([run(), run(seed=1)]) is None
    assert 'sittings' in seconds_unread([run(), run(sitting='b')]) and 'thread counts' in seconds_unread([run(), run(threads=2)])
    assert 'saved without' in seconds_unread([run(), dict(method='blf', seed=0)])

def test_two_sittings_of_one_command_read_alike_in_seconds():
    "The compute preset's two saved sittings of one command (the proxy changed between them, the rest did not): the unchanged methods' work readings are the same, and their readings in seconds agree within their intervals"
    from pathlib import Path
    from loss_filters.compare import load_comparison
    runs = Path(__file__).parent.parent / 'nbs' / 'bench_runs'
    a, b = (load_comparison(runs / f) for f in ('compute_alternatives_runs.jsonl.gz', 'compute_alternatives_graph_runs.jsonl.gz'))
    for m in ('blf', 'blf:epochs=7'):
        ra, rb = (next(r for r in c.rows if r['method'] == m) for c in (a, b))
        assert ra['at_work']['diff'] == rb['at_work']['diff'] and ra['at_work']['best_x'] == rb['at_work']['best_x']
        sa, sb = ra['at_work_s'], rb['at_work_s']
        assert sa['best_x_lo'] <= sb['best_x'] <= sa['best_x_hi'] and sb['best_x_lo'] <= sa['best_x'] <= sb['best_x_hi'], (m, sa['best_x'], sb['best_x'])
        assert sa['lo'] <= sb['diff'] <= sa['hi'] and sb['lo'] <= sa['diff'] <= sb['hi']

def test_two_methods_of_one_work_share_the_fits_of_their_alternatives(make):
    "The same filter spelled twice spends the same work: the plain model at that work and random choice at it and past it train once for both"
    import re
    handed, a, b = [], 'topk:keep=.5', 'topk:keep=.5,score_precision=full'
    cmp = compare_filters(make, f'baseline {a} {b}', epochs=2, lr=1e-2, seeds=1, budgets='.5 1.5', show_progress=False, warmup=False,
                          on_run=lambda spec, seed, rep, kind: handed.append(spec))
    by, untag = {r['method']: r for r in cmp.runs}, lambda c: re.sub(r',?(same_work|reach)=[^,]*', '', c)
    at = {m: [c for c in cmp.control_of[m] if c != untag(c)] for m in (a, b)}
    twins = [(x, y) for x in at[a] for y in at[b] if untag(x) == untag(y)]
    assert len(twins) == 3 and all(x != y for x, y in twins)   # the plain model at their work, random choice at it and over 3 epochs
    for x, y in twins:
        assert (x in handed) != (y in handed)                   # one of each pair trained, the other was never handed to the executor
        assert (by[x]['method'], by[y]['method']) == (x, y)     # each run under its own name, the same fit
        assert {k: v for k, v in by[x].items() if k != 'method'} == {k: v for k, v in by[y].items() if k != 'method'}
    assert len(handed) == len(set(handed)) == len(cmp.runs) - len(twins)
    assert by[a]['final_metric'] == by[b]['final_metric']       # (the methods themselves train apart)
