"The statistics of the verdicts: t intervals with their coverage, one-sided tests at their level, seed planning, by simulation"
import math, statistics
import numpy as np
import pytest
from loss_filters.stats import paired_test, shown, power, seeds_needed, simulate, TYPICAL_LOG_SD
from loss_filters.verdicts import summarise, add_verdicts, payoff_word; from loss_filters.report import payoff_line, method_note

pytestmark = pytest.mark.fastai_neutral

DRAWS = 4000

def _mc_bound(p:float, draws:int=DRAWS) -> float: return p + 3 * math.sqrt(p * (1 - p) / draws)   # 3 Monte Carlo standard errors

# the spreads of the log work ratio to training less measured on the benchmark presets: the smallest, the typical, the largest
@pytest.mark.parametrize('sd', [.1, TYPICAL_LOG_SD, .2])
@pytest.mark.parametrize('n', [2, 3, 5, 8])
def test_no_effect_is_said_to_pay_at_most_at_the_stated_rate(n, sd):
    for alpha in (.05, .1):
        assert simulate(n, 0., sd, alpha, draws=DRAWS, seed=n) <= _mc_bound(alpha)

@pytest.mark.parametrize('n', [3, 5, 8])
def test_heavier_tails_than_normal_keep_the_rate(n):
    assert simulate(n, 0., TYPICAL_LOG_SD, .05, draws=DRAWS, seed=10 + n, dist='t3') <= _mc_bound(.05)

def test_the_rate_is_not_far_below_the_level_either():
    "The test is exact for normal figures: close to 5%, not a test that never speaks"
    share = simulate(5, 0., .15, .05, draws=DRAWS, seed=1)
    assert abs(share - .05) < 3 * math.sqrt(.05 * .95 / DRAWS)

@pytest.mark.parametrize('n', [2, 3, 5, 8])
def test_power_of_a_true_saving_matches_the_simulation(n):
    "A true 1.3x saving: how often it is found, by the noncentral t and by drawing"
    found, p = simulate(n, math.log(1.3), TYPICAL_LOG_SD, draws=DRAWS, seed=20 + n), power(n, math.log(1.3), TYPICAL_LOG_SD)
    assert abs(found - p) < 4 * math.sqrt(p * (1 - p) / DRAWS) + 1e-3
    assert power(n + 1, math.log(1.3), TYPICAL_LOG_SD) > p

def test_the_interval_has_its_coverage():
    "The 90% interval of 3 normal log ratios holds the true ratio in 90% of draws; the range of the three in only 75%"
    rng, true = np.random.default_rng(3), 1.2
    ys = rng.normal(math.log(true), .15, (DRAWS, 3))
    cover = [paired_test(list(np.exp(y)), ratio=True) for y in ys]
    share = sum(t['lo'] <= true <= t['hi'] for t in cover) / DRAWS
    in_range = sum(math.exp(y.min()) <= true <= math.exp(y.max()) for y in ys) / DRAWS
    assert abs(share - .9) < 3 * math.sqrt(.09 / DRAWS) and abs(in_range - .75) < .03

def test_interval_by_hand():
    "Student's t on the log ratios, at 1 - 2*alpha, about the geometric mean"
    xs = [1.1, 1.3, 1.2]
    ys = [math.log(x) for x in xs]
    m, s = statistics.fmean(ys), statistics.stdev(ys)
    t = paired_test(xs, alpha=.05, ratio=True)
    assert t['est'] == pytest.approx(math.exp(m)) and t['level'] == pytest.approx(.9)
    assert t['lo'] == pytest.approx(math.exp(m - 2.919986 * s / math.sqrt(3)), rel=1e-5)   # t(.95, 2 df) = 2.919986
    assert t['hi'] == pytest.approx(math.exp(m + 2.919986 * s / math.sqrt(3)), rel=1e-5)
    assert shown(t) == 'above' and t['p_above'] < .05

def test_one_seed_has_no_interval_and_no_verdict():
    t = paired_test([1.5], ratio=True)
    assert t['lo'] is None and t['p_above'] is None and shown(t) is None
    with pytest.raises(ValueError, match='ratios must be > 0'): paired_test([1., 0.], ratio=True)
    with pytest.raises(ValueError, match=r'`alpha` must be in \(0, 0.5\)'): paired_test([1., 2.], alpha=0)

def test_seeds_needed_is_the_first_count_with_the_power():
    k = seeds_needed(math.log(1.3), .15, .05, .8)
    assert power(k, math.log(1.3), .15) >= .8 > power(k - 1, math.log(1.3), .15)
    assert seeds_needed(0., .15) is None and seeds_needed(math.log(1.01), .3, max_n=20) is None
    assert seeds_needed(math.log(1.3), .15, alpha=.01) > k   # a stricter level needs more seeds

# ------------------------------------------------------------------ the verdict lines built on them
def _run(m, seed, accs, work_per_check=1.):
    hist = [dict(train_s=10. * (i + 1), metric=a, work=work_per_check * (i + 1)) for i, a in enumerate(accs)]
    return dict(method=m, seed=seed, repeat=0, epochs=len(accs), train_s=hist[-1]['train_s'], wall_s=hist[-1]['train_s'],
                final_metric=accs[-1], mean_samp_perc=1. if m.startswith('baseline') else .7, work=hist[-1]['work'], lr_mult=1., history=hist)

def _judged(ratios, alpha=.05, final=(.8, .85, .9), finals=None, longer=.95):
    "A method whose work is the full plain schedule's over `ratios`, seed by seed, ending at `final` (or at `finals[seed]`); plain schedules of 2, 3 and 4 epochs ending at .85, .9 and `longer` (None: no 4-epoch schedule; .95: a straight line)"
    runs, budgets = [], ['baseline:epochs=2'] + ['baseline:epochs=4'] * (longer is not None)
    for s, x in enumerate(ratios):
        last = final[-1] if finals is None else finals[s]
        runs += [_run('baseline', s, [.7, .8, .9]), _run('baseline:epochs=2', s, [.75, .85]), _run('stale', s, [*final[:-1], last], 1 / x),
                 _run('random:keep=.5', s, [.8, .85, last - .01], 1 / x)] + [_run('baseline:epochs=4', s, [.7, .8, .9, longer])] * (longer is not None)
    rows, target = summarise(runs, target=.9, alpha=alpha)
    add_verdicts(rows, budgets, {'stale': ['random:keep=.5']}, len(ratios), target, runs=runs, alpha=alpha)
    return next(r for r in rows if r['method'] == 'stale')

def test_payoff_line_states_level_and_seeds():
    r = _judged([1.3, 1.35, 1.28, 1.32, 1.31])
    line = payoff_line(r, True)
    assert line.startswith('stale: pays at 5% (5 seeds): +') and 'against training less at equal work, 90% CI' in line, line
    assert 'the cheapest plain schedule needed 1.31x its work, 90% CI' in line   # the second reading, beside
    assert 'and it ends above random choice at its share (the plain model at a smaller batch)' in line   # .9 against .89 in every seed
    assert payoff_line(_judged([1.3, 1.35, 1.28, 1.32, 1.31], alpha=.1), True).startswith('stale: pays at 10% (5 seeds)')

def test_a_gain_the_bend_could_explain_gives_no_verdict():
    "The plain curve at 2 and 3 epochs alone: nothing bounds how far it bends between them, so a gain over their line is no verdict; a 4-epoch schedule bounds it"
    r = _judged([1.3, 1.35, 1.28, 1.32, 1.31], longer=None)
    v = r['at_work']
    assert v['lo'] > 0 and v['bend'] is None and v['verdict'] == 'within the bend' and payoff_word(r) == 'no verdict (bend)'
    assert 'nothing bounds how far the curve bends above that line: add one (`budgets`)' in payoff_line(r, True)
    r = _judged([1.3, 1.35, 1.28, 1.32, 1.31], final=(.8, .85, .875), longer=.92)   # +1.0 points over the line, but the curve could lie 2.1 above it
    v = r['at_work']
    assert v['bend'] == pytest.approx(.9 - .02 * (3 - v['work']) - (.85 + .05 * (v['work'] - 2)))   # the 3-4 chord carried back, less the line
    assert 0 < v['lo'] <= v['bend'] and payoff_word(r) == 'no verdict (bend)'
    assert 'could lie up to +2.' in method_note(r) and 'add a plain schedule near its work' in method_note(r)

def test_a_method_random_choice_at_its_share_matches_does_not_pay():
    "Above training less at equal work, but level with random choice at its share (the plain model at a smaller batch, which needs no package): no gain shown, and said why"
    runs = []
    for s, last in enumerate([.9, .91, .9, .905, .9]):   # the method and its random control end alike, both above the plain curve at their work
        runs += [_run('baseline', s, [.7, .8, .9]), _run('baseline:epochs=2', s, [.75, .85]), _run('baseline:epochs=4', s, [.7, .8, .9, .95]),
                 _run('stale', s, [.8, .85, last], 1 / 1.3), _run('random:keep=.5', s, [.8, .85, last + (.002, 0.)[s % 2]], 1 / 1.3)]
    rows, target = summarise(runs, target=.9)
    add_verdicts(rows, ['baseline:epochs=2', 'baseline:epochs=4'], {'stale': ['random:keep=.5']}, 5, target, runs=runs)
    r = next(r for r in rows if r['method'] == 'stale')
    assert r['at_work']['verdict'] == 'beats' and r['vs_random']['verdict'] != 'beats' and payoff_word(r) == 'no gain shown'
    assert 'random choice at its share (the plain model at a smaller batch)' in payoff_line(r) and 'above training less' in method_note(r)
    assert r['at_work']['best_by'] == 'random:keep=.5' and r['at_work']['best_x'] == pytest.approx(1., abs=.02)   # the better alternative: level with it
    del r['vs_random']   # no random control run: the other alternative is missing, so no verdict, not "pays"
    assert payoff_word(r) == 'no verdict (no random control)' and 'random choice at its share, the other simple alternative, was not run' in payoff_line(r)

def test_too_few_seeds_say_how_many_would():
    r = _judged([1.2] * 3, finals=[.885, .871, .881])   # the curve at 2.5 plain epochs is .875: +0.4 points, spread 0.7
    v = r['at_work']
    k = seeds_needed(v['diff'], v['sd'])
    line = payoff_line(r, True)
    assert v['verdict'] == 'no difference shown' and k > 3
    assert line.startswith('stale: no gain shown at 5% (3 seeds)') and f'a gain of this size at this spread needs about {k} seeds' in line
    assert payoff_line(_judged([1.2], finals=[.885]), True).startswith('stale: no verdict from 1 seed')

def test_a_loss_is_said_at_its_level():
    line = payoff_line(_judged([1.2] * 3, finals=[.86, .861, .859]), True)
    assert line.startswith('stale: does not pay at 5% (3 seeds): -1.50 points against training less at equal work'), line

def test_a_method_beyond_the_longest_plain_schedule_gets_no_first_reading():
    line = payoff_line(_judged([.8, .82, .79], longer=None), True)   # more work than the full schedule, and no longer one was run
    assert line.startswith('stale: no verdict: its work lies outside the plain schedules') and 'add shorter or longer `budgets`' in line

def test_equal_work_verdict_does_not_use_the_target():
    "Seed by seed, the final value against the same seed's plain curve at the method's work: moving the target leaves it alone"
    ratios = [1.1, 1.45, 1.2]
    a, b = _judged(ratios), _judged(ratios, final=(.8, .85, .9))
    expected = statistics.fmean(.9 - (.85 + .05 * (3 / x - 2)) for x in ratios)
    assert a['at_work']['diff'] == pytest.approx(expected) and a['at_work']['verdict'] == 'beats'
    runs = []
    for s, x in enumerate(ratios):
        runs += [_run('baseline', s, [.7, .8, .9]), _run('baseline:epochs=2', s, [.75, .85]), _run('stale', s, [.8, .85, .9], 1 / x)]
    rows, target = summarise(runs, target=.95)   # a target nothing reaches
    add_verdicts(rows, ['baseline:epochs=2'], {}, 3, target, runs=runs)
    assert next(r for r in rows if r['method'] == 'stale')['at_work']['diff'] == pytest.approx(expected)

def test_holds_is_a_non_inferiority_test():
    "No worse than the plain model by more than the margin, shown at the level: equal accuracy in every seed holds, a spread one does not"
    assert _judged([1.3, 1.3, 1.3])['vs_plain']['holds'] is True
    r = _judged([1.3, 1.3, 1.3], final=(.8, .85, .897))   # 0.3 points below in every seed: beyond the 0.2 point margin
    assert r['vs_plain']['holds'] is False and r['vs_plain']['verdict'] == 'loses'
