"The first reading where the plain curve bends: the line between two schedules runs under a concave curve, so a method with no effect of its own would 'beat' it. Tested by simulation on a concave curve fitted to saved plain means, and on every saved run by holding a plain schedule out and judging it as a method."
import glob, math, random, statistics
from pathlib import Path
import numpy as np
import pytest
from loss_filters.compare import read_runs, load_comparison
from loss_filters.bench import bench_work_costs
from loss_filters.verdicts import equal_work, bend_room

pytestmark = pytest.mark.fastai_neutral

RUNS = Path(__file__).parent.parent / 'nbs' / 'bench_runs'
COMPUTE = {2: 'baseline:epochs=2', 3: 'baseline:epochs=3', 4: 'baseline:epochs=4', 5: 'baseline', 6: 'baseline:epochs=6', 8: 'baseline:epochs=8'}
ALPHA = .05

def _curve(points): return dict(points=[(w, v, 1) for w, v in points], var=0., df=0)

def test_bend_room_is_what_the_neighbouring_chords_leave_above_the_line():
    f = lambda w: 1 - math.exp(-w / 2)   # concave
    c = _curve([(w, f(w)) for w in (1, 2, 4, 5)])
    line = f(2) + (f(4) - f(2)) / 2
    right = f(4) - (f(5) - f(4)) * 1   # the 4-5 chord carried back to 3
    left = f(2) + (f(2) - f(1)) * 1    # the 1-2 chord carried on to 3
    assert bend_room(c, 3.) == pytest.approx(min(left, right) - line) and bend_room(c, 3.) > 0
    assert f(3) - line <= bend_room(c, 3.)                                   # the true curve lies within it
    assert bend_room(c, 2.) == pytest.approx(0.) and bend_room(c, 4.) == pytest.approx(0.)   # on a schedule the line is exact
    assert bend_room(_curve([(1, .5), (2, .6)]), 1.5) is None                # two schedules: nothing bounds the bend
    assert bend_room(_curve([(1, .5), (2, .6), (3, .8)]), 1.5) == 0.         # a curve that rises faster: no room above the line
    assert bend_room(c, 6.) is None                                          # outside the schedules

def compute_shape():
    "The compute preset's saved plain runs: a concave curve `a - b exp(-k w)` fitted to each schedule's mean, the spread of a seed (shared by its schedules) and of a run"
    runs = read_runs(RUNS / 'compute_runs.jsonl.gz')
    fin = {(r['seed'], e): r['final_metric'] for e, m in COMPUTE.items() for r in runs if r['method'] == m}
    seeds = sorted({s for s, _ in fin})
    means = {e: statistics.fmean(fin[s, e] for s in seeds) for e in COMPUTE}
    w, y, best = np.array(sorted(COMPUTE), float), np.array([means[e] for e in sorted(COMPUTE)]), None
    for k in np.linspace(.05, 2, 400):
        X = np.stack([np.ones_like(w), -np.exp(-k * w)], 1)
        coef = np.linalg.lstsq(X, y, rcond=None)[0]
        sse = float(((X @ coef - y) ** 2).sum())
        if coef[1] > 0 and (best is None or sse < best[0]): best = (sse, float(k), *map(float, coef))
    sse, k, a, b = best
    within = statistics.fmean(statistics.variance([fin[s, e] - means[e] for s in seeds]) for e in COMPUTE)
    seed_var = max(0., statistics.variance([statistics.fmean(fin[s, e] - means[e] for e in COMPUTE) for s in seeds]) - within / len(COMPUTE))
    return (lambda x: a - b * math.exp(-k * x)), math.sqrt(sse / len(w)), math.sqrt(seed_var), math.sqrt(within - seed_var)

@pytest.fixture(scope='module')
def shape(): return compute_shape()

def test_the_fitted_curve_is_concave_and_close_to_the_saved_means(shape):
    f, rmse, seed_sd, run_sd = shape
    assert rmse < .001 and run_sd > 0                           # within a tenth of a point of every schedule's mean
    assert f(3) - f(2) > f(4) - f(3) > f(5) - f(4) > 0          # rises, by less and less

def _draw(f, scheds, work, n_seeds, rng, seed_sd, run_sd, effect=0.) -> list:
    "Runs of the plain schedules `scheds` (epochs, each its work) and of a method at `work` that is the plain curve there plus `effect`, seed by seed"
    runs = []
    for s in range(n_seeds):
        off = rng.gauss(0, seed_sd)
        runs += [dict(method=f'plain{e}', seed=s, repeat=0, work=float(e), final_metric=f(e) + off + rng.gauss(0, run_sd)) for e in scheds]
        runs.append(dict(method='m', seed=s, repeat=0, work=work, final_metric=f(work) + effect + off + rng.gauss(0, run_sd)))
    return runs

def _rates(shape, scheds, work, noise=1., effect=0., draws=600, seed=0):
    "How often the method is called 'beats' at equal work, by today's rule and by the line alone"
    f, _, seed_sd, run_sd = shape
    rng, new, line = random.Random(seed), 0, 0
    for _ in range(draws):
        v = equal_work(_draw(f, scheds, work, 6, rng, noise * seed_sd, noise * run_sd, effect), 'm', [f'plain{e}' for e in scheds], ALPHA)
        new += v['verdict'] == 'beats'; line += v['verdict'] in ('beats', 'within the bend')
    return new / draws, line / draws

LIMIT = lambda draws: ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / draws)   # the level plus three Monte-Carlo standard errors

@pytest.mark.parametrize('scheds,work', [((2, 4, 5, 6, 8), 3.),      # a two-epoch gap across the bend (3 held out)
                                         ((2, 3, 5, 6, 8), 4.),      # the same one epoch later
                                         ((2, 3, 4, 5, 6, 8), 4.16), # the schedules one epoch apart, at the Batch Loss Filter's work
                                         ((2, 3, 4, 5, 6, 8), 7.),   # the gap from 6 to 8
                                         ((2, 3, 4, 5, 6, 8), 2.5),  # the first segment: a neighbour on one side only
                                         ((2, 4), 3.)])              # two schedules: no bound, never 'pays'
@pytest.mark.parametrize('noise', [1., 2.5])
def test_a_null_method_between_two_schedules_pays_at_most_at_the_level(shape, scheds, work, noise):
    new, _ = _rates(shape, scheds, work, noise)
    assert new <= LIMIT(600), (scheds, work, noise, new)

def test_the_line_alone_would_call_the_null_method_across_a_gap(shape):
    "What the bound guards against: read on the line alone, the null method 'beats' training less most of the time across a two-epoch gap"
    _, line = _rates(shape, (2, 4, 5, 6, 8), 3.)
    assert line > .5

def test_a_real_gain_is_still_shown_where_the_schedules_are_dense(shape):
    "+0.3 points over the curve at the Batch Loss Filter's work, 6 seeds, the saved spread: shown nearly always"
    new, _ = _rates(shape, (2, 3, 4, 5, 6, 8), 4.16, effect=.003, draws=200)
    assert new >= .9

def _plain_schedules(runs) -> dict:
    "The plain schedules judged in a saved comparison, by epochs (reference runs and rate-changed plain runs left out)"
    out = {}
    for r in runs:
        m = r['method']
        if r.get('reference') or not m.startswith('baseline') or any(k != 'epochs' for k in (kv.split('=')[0] for kv in m.partition(':')[2].split(',') if kv)): continue
        out[r['epochs']] = m
    return dict(sorted(out.items()))

def held_out_verdicts() -> list:
    "Every saved comparison with four or more plain schedules: each inner schedule but the full one held out of the curve and judged as a method"
    costs = dict(cnn=bench_work_costs('cnn'), mlp=bench_work_costs('mlp'), digits=bench_work_costs('cnn', (1, 8, 8)))
    out = []
    for f in sorted(glob.glob(str(RUNS / '*runs.jsonl.gz'))):
        runs = read_runs(f)
        plain = _plain_schedules(runs)
        if len(plain) < 4: continue
        cost = costs['mlp' if 'mlp' in Path(f).name else 'digits' if 'digits' in Path(f).name else 'cnn']
        for e, m in list(plain.items())[1:-1]:
            if m == 'baseline': continue
            rs = [dict(r, method=f'baseline:lr_mult=1,epochs={e}') if r['method'] == m else r for r in runs]   # a setting that changes nothing
            c = load_comparison(rs, score_cost=cost[0], proxy_cost=cost[1])
            v = next(r for r in c.rows if r['method'].startswith('baseline:lr_mult=1,')).get('at_work')
            if v and v.get('lo') is not None and not any(e == e2 and v['diff'] == v2['diff'] for _, e2, v2 in out): out.append((Path(f).name, e, v))
    return out   # a reading once: two files that share their plain runs give the same one

def test_held_out_plain_schedules_pay_no_more_often_than_the_level():
    "A plain schedule judged as a method has no effect of its own: across the saved runs it 'beats' training less about as often as the level allows, where the line alone called it far more often"
    vs = held_out_verdicts()
    n, called, line = len(vs), sum(v['verdict'] == 'beats' for *_, v in vs), sum(v['verdict'] in ('beats', 'within the bend') for *_, v in vs)
    tail = lambda k: 1 - sum(math.comb(n, i) * ALPHA ** i * (1 - ALPHA) ** (n - i) for i in range(k))   # P(at least k of n at the level)
    assert n >= 15, n
    assert tail(called) >= ALPHA, (called, n, [(f, e) for f, e, v in vs if v['verdict'] == 'beats'])   # as many as chance gives at the level
    assert tail(line) < ALPHA, (line, n)   # the test has teeth: by the line alone these calls would be too many for chance
    compute = {e: v for f, e, v in vs if f == 'compute_runs.jsonl.gz'}
    assert compute[3]['verdict'] == compute[4]['verdict'] == 'within the bend' and compute[3]['lo'] > 0   # the bend the line misread
