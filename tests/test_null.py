"'pays' at its stated level end to end: simulated runs with no effect, judged through the same code a user calls (`judge`: `summarise`, `add_verdicts`)."
import math, random, statistics
from pathlib import Path
import pytest
from loss_filters.compare import read_runs, judge
from loss_filters.verdicts import payoff_word

RUNS = Path(__file__).parent.parent / 'nbs' / 'bench_runs' / 'long_preset_5seeds_runs.jsonl.gz'
PLAIN = {9: 'baseline', 5: 'baseline:epochs=5', 7: 'baseline:epochs=7', 8: 'baseline:epochs=8'}

def plain_shapes():
    "The long preset's plain runs: each schedule's mean curve over the seeds, the seeds' spread, and the checks' own noise around their seed's curve"
    runs = read_runs(RUNS)
    by = {e: [r for r in runs if r['method'] == m] for e, m in PLAIN.items()}
    curve = {e: [statistics.fmean(c) for c in zip(*([h['accuracy'] for h in r['history']] for r in rs))] for e, rs in by.items()}
    works = {e: [h['work'] for h in rs[0]['history']] for e, rs in by.items()}
    finals = [r['final_accuracy'] for r in by[9]]
    resid = []   # late checks (the last half of each run) around the mean curve, less the run's own offset
    for e, rs in by.items():
        for r in rs:
            d = [h['accuracy'] - c for h, c in zip(r['history'], curve[e])][e:]
            resid += [x - statistics.fmean(d) for x in d]
    return curve, works, statistics.stdev(finals), statistics.stdev(resid)

@pytest.fixture(scope='module')
def shapes(): return plain_shapes()

def simulate(shapes, n_seeds:int, noise:float, method_epochs:int, rng:random.Random) -> list:
    "Runs of every plain schedule, and of a method that is the plain schedule of `method_epochs` under another name, for `n_seeds` seeds"
    curve, works, seed_sd, eval_sd = shapes
    runs = []
    for seed in range(n_seeds):
        off = rng.gauss(0, seed_sd)
        for e, name in [*PLAIN.items(), (method_epochs, 'blf')]:
            acc = [c + off + rng.gauss(0, noise * eval_sd) for c in curve[e]]
            hist = [dict(accuracy=a, work=w, train_s=w, samp_perc=1.) for a, w in zip(acc, works[e])]
            runs.append(dict(method=name, epochs=e, seed=seed, repeat=0, train_s=works[e][-1], wall_s=works[e][-1], work=works[e][-1],
                             final_accuracy=acc[-1], mean_samp_perc=.9, history=hist))
    return runs

@pytest.mark.parametrize('n_seeds', [3, 5])
@pytest.mark.parametrize('noise', [1., 2.5])
def test_pays_at_most_at_its_level_for_a_method_equal_to_training_less(shapes, n_seeds, noise):
    rng, draws, alpha = random.Random(n_seeds * 10 + int(noise * 2)), 400, .05
    budgets = [m for e, m in PLAIN.items() if e != 9]
    pays = 0
    for i in range(draws):
        cmp = judge(simulate(shapes, n_seeds, noise, 7 + i % 2, rng), budgets, {'blf': []}, dict(alpha=alpha))
        pays += payoff_word(next(r for r in cmp.rows if r['method'] == 'blf'), True) == 'pays'
    assert pays / draws <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / draws), (pays, draws)

def test_the_simulation_can_find_a_real_saving(shapes):
    "The same machinery says 'pays' for a method that gets the full schedule's curve, half a point higher, with 60% of its work: the test has power"
    rng, pays = random.Random(1), 0
    for _ in range(40):
        runs = simulate(shapes, 5, 1., 9, rng)
        for r in runs:
            if r['method'] == 'blf':
                r['work'] = r['train_s'] = r['work'] * .6
                for h in r['history']: h['work'], h['train_s'], h['accuracy'] = h['work'] * .6, h['work'] * .6, h['accuracy'] + .005
                r['final_accuracy'] = r['history'][-1]['accuracy']
        cmp = judge(runs, [m for e, m in PLAIN.items() if e != 9], {'blf': []}, dict(alpha=.05))
        pays += payoff_word(next(r for r in cmp.rows if r['method'] == 'blf'), True) == 'pays'
    assert pays >= 30

def test_work_to_target_counts_from_where_the_run_stays_above_it():
    from loss_filters.runs import time_to_target
    h = lambda *accs: [dict(accuracy=a, work=float(i + 1)) for i, a in enumerate(accs)]
    assert time_to_target(h(.80, .91, .85, .92, .93), .90, 'work') == pytest.approx(3 + (.90 - .85) / (.92 - .85))   # the dip resets it
    assert time_to_target(h(.80, .91, .89), .90, 'work') is None          # ends below: never reached, whatever it touched on the way
    assert time_to_target(h(.95, .96), .90, 'work') == 1.                 # above from the first check

def test_a_run_without_its_own_seeds_baseline_is_not_paired_with_another(shapes):
    runs = [r for r in simulate(shapes, 3, 1., 8, random.Random(0)) if not (r['method'] == 'baseline' and r['seed'] == 2)]
    cmp = judge(runs, [m for e, m in PLAIN.items() if e != 9], {'blf': []}, dict(alpha=.05))
    row = next(r for r in cmp.rows if r['method'] == 'blf')
    assert row['unpaired'] == 1 and payoff_word(row, True) == 'unpaired'
    assert [r['work_x'] for r in runs if r['method'] == 'blf' and r['seed'] == 2] == [None]
    assert 'no plain run of their own seed' in '\n'.join(cmp.payoffs())
