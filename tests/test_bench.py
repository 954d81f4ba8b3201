"`lf_bench` end to end on a CI-sized run, and its pieces on hand-made histories."
import json, math, subprocess, sys
from pathlib import Path
import pytest, torch
from fastai.basics import Callback
from loss_filters.bench import lf_bench; from loss_filters.verdicts import summarise; from loss_filters.report import format_table; from loss_filters.runs import time_to_target, parse_method
from loss_filters.report import _cols; from loss_filters.plan import budget_specs


@pytest.fixture(scope='module')
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench')
    res = lf_bench(data='digits', preset='quick', epochs=1, bs=64, out=str(out), quiet=True, profile=True,
                   methods='baseline blf:skip_epochs=0 sb:start=0 sb:start=0,fill_batch=1 stale:prune=.9 blf_gn:skip_epochs=0')
    return out, res

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_results_json_keys_and_types(small_run):
    out, res = small_run
    saved = json.loads((out / 'results.json').read_text())
    assert saved['data'] == 'digits' and isinstance(saved['target'], float) and saved['epochs'] == 1
    assert [r['method'] for r in saved['summary']] == ['baseline', 'blf:skip_epochs=0', 'sb:start=0', 'sb:start=0,fill_batch=1',
                                                       'stale:prune=.9', 'blf_gn:skip_epochs=0']
    for r in saved['summary']:
        for k in ('train_s', 'wall_s', 'final_metric', 'mean_samp_perc', 'total_x'): assert isinstance(r[k], float), k
        assert 0 < r['final_metric'] <= 1 and 0 < r['mean_samp_perc'] <= 1 and r['wall_s'] >= r['train_s'] > 0
    base = saved['summary'][0]
    assert base['mean_samp_perc'] == 1. and base['total_x'] == 1. and base['target_x'] == 1.
    assert all(r['mean_samp_perc'] < 1 for r in saved['summary'][1:4])
    assert saved['summary'][4]['mean_samp_perc'] == 1.              # one epoch: stale pruning has no losses yet
    assert saved['summary'][5]['mean_samp_perc'] < 1
    assert len(saved['runs']) == 6 and all(isinstance(r['history'], list) and r['history'] for r in saved['runs'])
    assert saved['runs'][0]['kept'] == [] and all(len(r['kept']) > 0 for r in saved['runs'][1:4])
    assert 'stale:prune=.9' not in saved['profile']                    # no scoring pass to profile
    prof = saved['profile']['blf:skip_epochs=0']
    assert set(prof) >= {'forward', 'score', 'select', 'record', 'take', 'train_kept', 'train_full', 'overhead', 'overhead_share'}
    assert math.isclose(sum(prof[f'{k}_share'] for k in ('forward', 'score', 'select', 'record', 'take', 'train_kept')), 1.)
    assert math.isclose(prof['overhead'], prof['batch'] + prof['record']) and math.isclose(prof['overhead_share'], prof['overhead'] / prof['plain_step'])
    assert 0 < prof['plain_step'] and 0 < prof['forward']
    assert saved['model'] == 'cnn'
    assert 'blf_gn:skip_epochs=0' in saved['profile']

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_pngs_written_and_nonempty(small_run):
    out, res = small_run
    from loss_filters.verdicts import seconds_unread
    diags = ['diag_blf_skip_epochs_0.png', 'diag_sb_start_0.png', 'diag_sb_start_0_fill_batch_1.png', 'diag_stale_prune_.9.png',
             'diag_blf_gn_skip_epochs_0.png']
    assert sorted(p.name for p in out.glob('diag_*.png')) == sorted(diags)
    timed = seconds_unread(res['runs']) is None   # the time figure only where its seconds are read
    assert (out / 'accuracy_vs_time.png').exists() == timed
    for name in ['kept_per_batch.png'] + diags + (['accuracy_vs_time.png'] if timed else []):
        p = out / name
        assert p.exists() and p.stat().st_size > 1000 and p.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_table_has_the_columns(small_run):
    _, res = small_run
    lines = format_table(res['summary']).splitlines()
    assert lines[0].split() == [k + '90' if k.endswith('_ci') else 'final_accuracy' if k == 'final_metric' else k for k, _ in _cols]   # the intervals' level in their name
    assert len(lines) == 7 and lines[1].split()[0] == 'baseline'

def test_time_to_target_and_speedups():
    h = lambda *pairs: [dict(train_s=t, metric=a) for t, a in pairs]
    runs = [dict(method='baseline', epochs=3, train_s=30., wall_s=33., final_metric=.9, mean_samp_perc=1., history=h((10, .8), (20, .89), (30, .9))),
            dict(method='blf', epochs=3, train_s=20., wall_s=23., final_metric=.899, mean_samp_perc=.5, history=h((8, .85), (15, .898), (20, .899))),
            dict(method='sb', epochs=3, train_s=25., wall_s=28., final_metric=.85, mean_samp_perc=.6, history=h((8, .8), (16, .84), (25, .85)))]
    rows, target = summarise(runs)
    assert target == pytest.approx(.898)
    by = {r['method']: r for r in rows}
    # read between checks: the baseline crosses .898 at 80% of the way from its check at 20 s (.89) to the one at 30 s (.90)
    assert by['baseline']['target_s'] == pytest.approx(28.) and by['blf']['target_s'] == pytest.approx(15.) and by['sb']['target_s'] is None
    assert by['blf']['target_x'] == pytest.approx(28 / 15) and by['blf']['total_x'] == pytest.approx(1.5)
    assert by['sb']['target_x'] is None and '-' in format_table(rows).splitlines()[3].split()

def test_repeats_report_median_and_spread():
    h = lambda t, a: [dict(train_s=t, metric=a)]
    runs = [dict(method='baseline', epochs=1, train_s=t, wall_s=t, final_metric=.9, mean_samp_perc=1., history=h(t, .9)) for t in (10., 12., 20.)]
    rows, _ = summarise(runs, target=.5)
    assert rows[0]['train_s'] == 12. and rows[0]['train_s_spread'] == 10. and rows[0]['repeats'] == 3
    assert '±' in format_table(rows)

def test_table_counts_the_repeats_that_reached_the_target():
    h = lambda a: [dict(train_s=10., metric=a)]
    runs = [dict(method='baseline', epochs=1, train_s=10., wall_s=10., final_metric=.9, mean_samp_perc=1., history=h(.9))] * 2
    runs += [dict(method='blf', epochs=1, train_s=8., wall_s=8., final_metric=a, mean_samp_perc=.5, history=h(a)) for a in (.9, .8)]
    rows, _ = summarise(runs)
    assert [r['reached'] for r in rows] == [2, 1]
    lines = format_table(rows).splitlines()
    col = lines[0].split().index('reached')
    assert [l.split()[col] for l in lines[1:]] == ['2/2', '1/2']

def test_bad_methods_fail_before_training():
    with pytest.raises(ValueError, match="unknown method 'nope'"): lf_bench(methods='baseline nope', data='digits', preset='quick')
    with pytest.raises(ValueError, match='`keep`'): parse_method('sb:keep=0')
    with pytest.raises(TypeError, match='`follow_lr` must be True or False'): parse_method('hide:follow_lr=yes')
    with pytest.raises(ValueError, match='target'): summarise([dict(method='sb', history=[])])

def test_method_settings_parse_numbers_and_booleans():
    m = parse_method('hide:follow_lr=True,max_hide=.5,lr_scale=False,epochs=4')
    assert m.kw == dict(follow_lr=True, max_hide=.5, lr_scale=False) and m.run == dict(epochs=4)
    assert m.cls(**m.kw).follow_lr is True

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_console_script_help():
    script = Path(sys.executable).parent / 'lf_bench'             # the installed console script
    out = subprocess.run([str(script), '--help'], capture_output=True, text=True, check=True, timeout=120).stdout
    for opt in ('--data', '--epochs', '--bs', '--lr', '--methods', '--seed', '--out', '--repeats', '--target'): assert opt in out

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_console_script_exits_zero(tmp_path):
    "The installed script runs a tiny bench and exits 0 (a returned value would become exit status 1)"
    script = Path(sys.executable).parent / 'lf_bench'
    r = subprocess.run([str(script), '--data', 'digits', '--preset', 'quick', '--epochs', '1', '--bs', '128', '--methods', 'baseline blf', '--quiet',
                        '--out', str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'at equal work' in r.stdout and 'an alternative needs' in r.stdout and 'in seconds' in r.stdout and (tmp_path / 'results.json').exists()
    assert 'torch.jit' not in r.stdout + r.stderr   # a dependency's deprecation warning a user cannot act on stays out of its first lines
    assert 'counted in operations' in r.stdout
    assert 'final_accuracy' in (tmp_path / 'summary.txt').read_text() and str(tmp_path / 'summary.txt') in r.stdout   # the wide table in its file

@pytest.mark.parametrize('spec', ['blf:skip_epochs=0', 'sb:start=0,interrupt=0'])   # sb draws from the global RNG
def test_checks_inside_epochs_leave_training_untouched(spec):
    from loss_filters.bench import run_method
    from loss_filters.data import load_dls
    dls, _ = load_dls('digits', bs=64, seed=0)
    plain = run_method(dls, spec, epochs=2, show_progress=False)
    fine = run_method(dls, spec, epochs=2, show_progress=False, evals_per_epoch=3)
    assert [e['epoch'] for e in plain['history']] == [1, 2]
    eps = [e['epoch'] for e in fine['history']]
    assert len(eps) == 6 and eps[2] == 1 and eps[5] == 2 and 0 < eps[0] < eps[1] < 1 < eps[3] < eps[4] < 2
    ends = [e for e in fine['history'] if e['samp_perc'] is not None]
    assert [(e['metric'], e['samp_perc']) for e in ends] == [(e['metric'], e['samp_perc']) for e in plain['history']]
    assert fine['mean_samp_perc'] == plain['mean_samp_perc'] and fine['kept'] == plain['kept']   # the same training
    assert all(0 < e['metric'] <= 1 for e in fine['history'])
    assert [e['train_s'] for e in fine['history']] == sorted(e['train_s'] for e in fine['history'])

def test_epochs_setting_shortens_one_method():
    "`baseline:epochs=1` is the equal-compute control: it trains on its own schedule, and the plain baseline still sets the target"
    from loss_filters.bench import run_method
    from loss_filters.data import load_dls
    dls, _ = load_dls('digits', bs=64, seed=0)
    full = run_method(dls, 'baseline', epochs=3, show_progress=False)
    short = run_method(dls, 'baseline:epochs=1', epochs=3, show_progress=False)
    pruned = run_method(dls, 'stale:prune=.5,epochs=2', epochs=3, show_progress=False)
    assert (full['epochs'], short['epochs'], pruned['epochs']) == (3, 1, 2)
    assert [len(r['history']) for r in (full, short, pruned)] == [3, 1, 2]
    assert short['method'] == 'baseline:epochs=1' and short['final_metric'] != full['final_metric']
    rows, target = summarise([full, short, pruned])
    assert target == pytest.approx(full['final_metric'] - .002)           # not moved by the short baseline
    assert [(r['method'], r['epochs']) for r in rows] == [('baseline', 3), ('baseline:epochs=1', 1), ('stale:prune=.5,epochs=2', 2)]
    lines = format_table(rows).splitlines()
    assert [l.split()[1] for l in lines[1:]] == ['3', '1', '2']

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_models_option(tmp_path):
    res = lf_bench(data='digits', preset='quick', epochs=1, bs=64, out=str(tmp_path), quiet=True, profile=True, model='mlp', methods='baseline blf:skip_epochs=0')
    assert res['model'] == 'mlp' and 0 < res['profile']['blf:skip_epochs=0']['overhead_share'] < 10
    with pytest.raises(ValueError, match='`model` must be one of cnn, mlp, wrn'): lf_bench(data='digits', model='vit', out=str(tmp_path))

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_label_noise_and_augment_options(tmp_path):
    res = lf_bench(data='digits', preset='quick', epochs=1, bs=64, out=str(tmp_path), quiet=True, methods='baseline', label_noise=.2, score_cost=.3,
                   augment='yes')
    assert res['label_noise'] == .2 and res['augment'] is True
    with pytest.raises(ValueError, match="`augment` must be 'auto', 'yes' or 'no'"): lf_bench(data='digits', augment=True, out=str(tmp_path))
    with pytest.raises(ValueError, match=r'`label_noise` must be in \[0, 1\)'): lf_bench(data='digits', label_noise=1, out=str(tmp_path))

# ------------------------------------------------------------------ the long preset: seeds, controls, verdicts
@pytest.fixture(scope='module')
def long_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('long')
    res = lf_bench(data='digits', preset='long', epochs=4, seeds=2, bs=64, n_train=1000, out=str(out), quiet=True,
                   methods='baseline blf:skip_epochs=0 stale hide:confidence=.2')
    return out, res

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_long_preset_runs_the_controls_and_gives_verdicts(long_run):
    out, res = long_run
    saved = json.loads((out / 'results.json').read_text())
    assert saved['preset'] == 'long' and saved['seeds'] == 2 and saved['evals_per_epoch'] == 2 and saved['augment'] is False
    assert saved['controls']['budgets'] == ['baseline:epochs=2', 'baseline:epochs=3', 'baseline:epochs=5']   # .6, .75, .9 and 1.25 of 4 epochs
    ctl = saved['controls']['of']
    assert ctl['blf:skip_epochs=0'][0].startswith('random_batch:keep=') and all('same_work=stale' in c or 'reach=stale' in c for c in ctl['stale'][1:]) and any('reach=stale' in c for c in ctl['stale'])
    assert ctl['stale'][1] == 'baseline:same_work=stale'   # the plain model at its own work joins every method's controls
    assert ctl['stale'][0].startswith('random:keep=') and 'lr_scale' not in ctl['stale'][0]
    # hide raises the rate: its random control raises it too, and the plain baseline runs at its mean multiplier
    hide_rand, hide_rate = ctl['hide:confidence=.2'][:2]
    assert hide_rand.startswith('random:keep=') and hide_rand.endswith(',lr_scale=1') and hide_rate.startswith('baseline:lr_mult=')
    by = {r['method']: r for r in saved['summary']}
    assert set(by) == {'baseline', 'blf:skip_epochs=0', 'stale', 'hide:confidence=.2', 'baseline:epochs=2', 'baseline:epochs=3', 'baseline:epochs=5',
                       *(c for cs in ctl.values() for c in cs)}
    assert float(hide_rate.split('=')[1]) == pytest.approx(by['hide:confidence=.2']['lr_mult'], abs=1e-3) and by[hide_rate]['lr_mult'] == 1
    assert by[hide_rand]['lr_mult'] > 1
    for m in ('blf:skip_epochs=0', 'stale', 'hide:confidence=.2'):
        r = by[m]
        for k in ('train_s', 'target_x', 'total_x', 'work', 'work_x', 'work_total_x', 'vs_best_plain_x', 'vs_best_plain_work_x',
                  'final_metric', 'final_metric_spread', 'mean_samp_perc'): assert k in r, k
        assert r['repeats'] == 2                                           # one run per seed
        assert r['vs_random']['control'] == ctl[m][0] and r['vs_random']['verdict'] in ('beats', 'loses', 'no difference shown')
        mine = {x['seed']: x['final_metric'] for x in saved['runs'] if x['method'] == m}   # paired by seed: the mean difference
        rand = {x['seed']: x['final_metric'] for x in saved['runs'] if x['method'] == ctl[m][0]}
        assert math.isclose(r['vs_random']['diff'], sum(mine[s] - rand[s] for s in mine) / 2) and r['vs_random']['n'] == 2
        if 'at_work' in r: assert r['at_work']['verdict'] in ('beats', 'loses', 'no difference shown')
        assert r['alpha'] == .05 and r['seeds'] == 2
    # the random controls kept the share their method kept
    keep = float(ctl['stale'][0].split('keep=')[1].split(',')[0])
    assert by[ctl['stale'][0]]['mean_samp_perc'] < 1 and 0 < keep < 1
    assert by['baseline:epochs=2']['work'] == 2 and by['baseline']['work'] == 4 and saved['score_cost'] > 0
    assert {r['seed'] for r in saved['runs']} == {0, 1}
    assert (out / 'accuracy_vs_budget.png').stat().st_size > 10_000

def test_verdict_rule():
    "An accuracy verdict is a one-sided t test of the paired differences at its level; one seed gives none"
    from loss_filters.verdicts import _acc_test, _interp
    assert _acc_test([.004, .005, .003], .05)['verdict'] == 'beats' and _acc_test([-.004, -.005, -.003], .05)['verdict'] == 'loses'
    assert _acc_test([.004, -.002, .003], .05)['verdict'] == 'no difference shown'
    assert _acc_test([.01], .05)['verdict'] == 'no verdict (1 seed)' and _acc_test([None], .05) is None
    # mean .02, sd .015 over 3 seeds: t = 2.31 on 2 degrees of freedom, p = .074: shown at 10%, not at 5%
    v5, v10 = _acc_test([.005, .02, .035], .05), _acc_test([.005, .02, .035], .10)
    assert v5['verdict'] == 'no difference shown' and v10['verdict'] == 'beats'
    assert v5['level'] == pytest.approx(.9) and v10['level'] == pytest.approx(.8) and v5['lo'] < 0 < v10['lo']
    curve = [(10., .80, .01), (20., .90, .02)]
    assert _interp(curve, 5.) == (None, None) and _interp(curve, 15.) == (pytest.approx(.85), .02) and _interp(curve, 30.) == (None, None)   # no reading past the longest schedule

def test_crop_flip_keeps_shapes_and_moves_pixels():
    import torch
    from loss_filters.data import CropFlip
    torch.manual_seed(0)
    x, y = torch.rand(16, 1, 8, 8), torch.arange(16)
    ax, ay = CropFlip(pad=2)((x, y))
    assert ax.shape == x.shape and torch.equal(ay, y) and not torch.equal(ax, x)
    xp = torch.nn.functional.pad(x, (2, 2, 2, 2))
    def crops(i): return [v.flip(-1) if f else v for r in range(5) for c in range(5) for f in (0, 1) for v in [xp[i, :, r:r + 8, c:c + 8]]]
    assert all(any(torch.equal(ax[i], v) for v in crops(i)) for i in range(16))   # each image: one crop of its padded self

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_console_script_long_preset_runs_the_controls(tmp_path):
    "From the command line too, the long preset brings its controls (a `bool=None` option would parse as a False flag)"
    script = Path(sys.executable).parent / 'lf_bench'
    r = subprocess.run([str(script), '--data', 'digits', '--preset', 'long', '--epochs', '2', '--bs', '128',   # no `_` options:
                        '--methods', 'baseline stale', '--quiet', '--out', str(tmp_path)],     # fastcore 2 spells them with `-`
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.loads((tmp_path / 'results.json').read_text())
    assert saved['preset'] == 'long' and saved['controls']['budgets'] == ['baseline:epochs=1']
    with pytest.raises(ValueError, match="`controls` must be"): lf_bench(data='digits', controls='maybe', out=str(tmp_path))

# ------------------------------------------------------------------ work accounting, paired ratios, the cheapest plain schedule
@pytest.fixture(scope='module')
def digits64():
    from loss_filters.data import load_dls
    return load_dls('digits', bs=64, seed=0)[0]

class FirstEpoch(Callback):
    "The inputs of every training batch of the first epoch, as the loader made them, before any filter"
    order = -10
    def before_fit(self): self.batches = []
    def before_batch(self):
        if self.training and self.epoch == 0: self.batches.append(self.xb[0].detach().clone())

@pytest.mark.parametrize('spec', ['blf', 'sb', 'stale', 'hide', 'random:keep=.5', 'random:keep=.5,lr_scale=1',
                                  'random_batch:keep=.5,skip_epochs=1', 'baseline:lr_mult=1.3'])
def test_every_methods_first_epoch_trains_the_plain_models_batches(digits64, spec):
    "Paired ratios compare runs of one seed: every method's full first epoch is the plain model's, batch by batch"
    from loss_filters.bench import run_method
    plain, other = FirstEpoch(), FirstEpoch()
    run_method(digits64, 'baseline', epochs=2, model='mlp', show_progress=False, cbs=[plain])
    run_method(digits64, spec, epochs=2, model='mlp', show_progress=False, cbs=[other])
    assert len(plain.batches) == len(digits64.train) == len(other.batches)
    assert all(torch.equal(a, b) for a, b in zip(plain.batches, other.batches))

def test_work_counts_every_trained_example_exactly(digits64):
    "A plain epoch is one unit of work; a batch control keeping 32 of every 64 in its filtered epoch adds exactly that share"
    from loss_filters.bench import run_method; from loss_filters.runs import add_work
    from loss_filters.stale import plain_epoch_size
    dl = digits64.train
    n_b, plain = len(dl), plain_epoch_size(dl.n, dl.bs, dl.drop_last)
    assert plain == n_b * 64 and plain == dl.n // 64 * 64                 # `drop_last`: the part-batch is not trained
    base = add_work(run_method(digits64, 'baseline', epochs=2, show_progress=False), score_cost=.25)
    assert base['trained'] == 2 * plain and base['scored'] == 0 and base['work'] == 2.
    assert [e['work'] for e in base['history']] == [1., 2.]
    half = add_work(run_method(digits64, 'random_batch:keep=.5,skip_epochs=1', epochs=2, show_progress=False), score_cost=.25)
    assert half['trained'] == plain + 32 * n_b and half['scored'] == 0   # random choice runs no scoring pass
    assert half['work'] == pytest.approx((plain + 32 * n_b) / plain)
    scored = add_work(run_method(digits64, 'random_batch:keep=.5,skip_epochs=1,scored=1', epochs=2, show_progress=False), score_cost=.25)
    # asked to score (to see the losses it drops), every batch of the filtered epoch is scored, nothing else: the first-batch check runs no pass
    # of its own; random choice needs no score, so that pass is not charged
    assert scored['trained'] == half['trained'] and scored['scored'] == 64 * n_b and scored['work'] == half['work']

def test_a_pruned_epoch_s_work_is_its_kept_share(digits64):
    from loss_filters.bench import run_method; from loss_filters.runs import add_work
    r = add_work(run_method(digits64, 'random:keep=.5,anneal=0', epochs=3, show_progress=False), score_cost=.25)
    h = r['history']
    assert h[0]['work'] == 1. and r['scored'] == 0
    for prev, e in zip(h, h[1:]):
        assert e['work'] - prev['work'] == pytest.approx(e['samp_perc']) and e['samp_perc'] < .6

def test_paired_ratios_pair_each_run_with_its_own_seed_s_baseline():
    h = lambda t, w, a: [dict(train_s=t, work=w, metric=a)]
    mk = lambda m, sd, t, w: dict(method=m, seed=sd, repeat=0, epochs=1, train_s=t, wall_s=t, work=w, final_metric=.9,
                                  mean_samp_perc=1., history=h(t, w, .9))
    runs = [mk('baseline', 0, 10., 1.), mk('baseline', 1, 20., 1.), mk('baseline', 2, 30., 1.),
            mk('stale', 0, 5., .5), mk('stale', 1, 16., .8), mk('stale', 2, 15., .5)]
    rows, _ = summarise(runs, target=.85)
    st = rows[1]
    gm = (2 * 1.25 * 2) ** (1 / 3)   # the geometric mean of the paired ratios 2, 1.25, 2: not 20/15
    assert st['target_x'] == pytest.approx(gm) and st['target_x_spread'] == pytest.approx(.75)
    assert st['work_x'] == pytest.approx(gm) and st['work_x_spread'] == pytest.approx(.75)
    assert st['total_x'] == pytest.approx(gm) and st['work_x_test']['n'] == 3

def test_cheapest_plain_schedule_interpolates_the_budget_curve():
    from loss_filters.verdicts import best_plain, add_verdicts
    row = lambda m, w, t, a, wt=None, ts=None: dict(method=m, work=w, train_s=t, final_metric=a, work_to_target=wt, target_s=ts)
    rows = [row('baseline', 10., 100., .90, 9., 90.), row('baseline:epochs=5', 5., 50., .86), row('baseline:epochs=7', 7., 70., .89),
            row('hide', 8., 60., .90, 6., 45.)]
    best = best_plain(rows, ['baseline', 'baseline:epochs=5', 'baseline:epochs=7'], .895)
    # the curve crosses .895 between 7 epochs (.89) and 10 (.90): at 8.5 epochs, 85 s; the full baseline got there at 9 (90 s)
    assert best == dict(work=pytest.approx(8.5), train_s=pytest.approx(85.))
    add_verdicts(rows, ['baseline:epochs=5', 'baseline:epochs=7'], {}, 3, target=.895)
    assert rows[3]['vs_best_plain_work_x'] == pytest.approx(8.5 / 6) and rows[3]['vs_best_plain_x'] == pytest.approx(85 / 45)
    assert rows[3]['at_work']['diff'] == pytest.approx(.90 - .8933333, abs=1e-6)   # on the work axis: between 7 and 10
    assert rows[3]['at_work']['verdict'] == 'no verdict (no per-seed runs)'   # one row a method: nothing to test
    assert best_plain(rows, ['baseline:epochs=5'], .895) == dict(work=None, train_s=None)   # no plain schedule reaches it

def test_rate_changing_methods_get_rate_matched_controls():
    from loss_filters.plan import matched_control, rate_control
    runs = [dict(method='hide', lr_mult=1.3, history=[dict(samp_perc=1.), dict(samp_perc=.7), dict(samp_perc=.8)], kept=[]),
            dict(method='hide', lr_mult=1.2, history=[dict(samp_perc=1.), dict(samp_perc=.75)], kept=[])]
    assert matched_control('hide', runs) == 'random:keep=0.750,anneal=0.125,lr_scale=1'
    assert rate_control('hide', runs) == 'baseline:lr_mult=1.250'
    assert rate_control('stale', [dict(method='stale', lr_mult=1.)]) is None
    assert rate_control('baseline:lr_mult=2', [dict(method='baseline:lr_mult=2', lr_mult=1.)]) is None   # its own rate is no change
    assert matched_control('stale', [dict(method='stale', history=[dict(samp_perc=.5)], kept=[])]) == 'random:keep=0.500,anneal=0.125'

def test_lr_mult_setting_and_the_rate_a_method_used(digits64):
    from loss_filters.bench import run_method
    r = run_method(digits64, 'baseline:lr_mult=2', epochs=1, lr=1e-3, show_progress=False)
    assert r['lr'] == pytest.approx(2e-3) and r['lr_mult'] == 1.
    hide = run_method(digits64, 'random:keep=.5,anneal=0,lr_scale=1', epochs=2, lr=1e-3, show_progress=False)
    # the raise is n/kept in the pruned epoch, none in the first: the mean over the steps of both epochs
    n1, n2 = 22, round(22 * hide['history'][1]['samp_perc'])
    assert hide['lr_mult'] == pytest.approx((n1 + n2 / hide['history'][1]['samp_perc']) / (n1 + n2), rel=.02) and hide['lr_mult'] > 1.3
    with pytest.raises(ValueError, match='`lr_mult`'): parse_method('baseline:lr_mult=0')

def test_never_filtered_rows_are_marked():
    runs = [dict(method='baseline', epochs=1, train_s=1., wall_s=1., final_metric=.9, mean_samp_perc=1., history=[]),
            dict(method='blf', epochs=1, train_s=1., wall_s=1., final_metric=.9, mean_samp_perc=1., history=[])]
    rows, _ = summarise(runs, target=.5)
    assert [r['never_filtered'] for r in rows] == [False, True]
    assert '[never filtered]' in format_table(rows).splitlines()[2]

def _main(monkeypatch, *argv):
    "The console script's `main` in this process, as `lf_bench ARGV` runs it (the installed script is run in its own tests above)"
    from loss_filters.bench import main
    monkeypatch.setattr(sys, 'argv', ['lf_bench', *argv])
    main()

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
@pytest.mark.parametrize('spelling', ['--n_train', '--n-train'])
def test_console_script_takes_both_option_spellings(tmp_path, spelling, monkeypatch):
    "fastcore 1 spells options `--n_train`, fastcore 2 `--n-train`: the script takes both under either"
    opt = lambda o: o.replace('_', '-') if '-' in spelling[2:] else o
    _main(monkeypatch, '--data', 'digits', '--preset', 'quick', '--epochs', '1', spelling, '300', opt('--evals_per_epoch'), '2',
          opt('--score_cost') + '=.5', '--methods', 'baseline', '--quiet', '--out', str(tmp_path))
    saved = json.loads((tmp_path / 'results.json').read_text())
    assert saved['n_train'] == 300 and saved['evals_per_epoch'] == 2 and saved['score_cost'] == .5

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
@pytest.mark.parametrize('opt,bad', [('--preset', 'fast'), ('--model', 'vit'), ('--augment', 'maybe'), ('--data', 'cifar')])
def test_console_script_refuses_an_unknown_choice_before_any_work(opt, bad, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e: _main(monkeypatch, opt, bad)
    out = capsys.readouterr()
    assert e.value.code == 2 and f'argument {opt}: invalid choice: {bad!r}' in out.err and 'lf_bench:' not in out.out

# ------------------------------------------------------------------ the augmented preset: crop and flip on a long schedule
def test_aug_preset_settings_are_pinned():
    "The regime the recipes were published for: crop and flip, 68 epochs (the plain model's plateau), every control"
    from loss_filters.bench import PRESETS
    from loss_filters.bench import BenchData
    aug = PRESETS['aug']
    assert aug.data == BenchData(n_train=5_000, n_valid=5_000, bs=128, augment=True, model='cnn')
    assert (aug.methods, aug.lr, dict(aug.design), aug.judging.evals_per_epoch, aug.target) == (
        'baseline blf sb stale hide', 4.8e-2, dict(epochs=68, seeds=1, budgets='.6 .75 .9 1.25', controls=True), 1, .8029)
    assert PRESETS['long'].data.augment is False   # the clean, short-schedule regime stays beside it

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_a_shortened_aug_preset_runs_with_its_controls(tmp_path):
    res = lf_bench(data='digits', preset='aug', epochs=3, n_train=400, n_valid=200, bs=64, methods='baseline stale', score_cost=.3,
                   out=str(tmp_path), quiet=True)
    assert res['preset'] == 'aug' and res['augment'] is True and res['epochs'] == 3 and res['lr'] == 4.8e-2
    assert res['controls']['budgets'] == ['baseline:epochs=2', 'baseline:epochs=4'] and list(res['controls']['of']) == ['stale']
    methods = [r['method'] for r in res['summary']]
    assert methods[:4] == ['baseline', 'stale', 'baseline:epochs=2', 'baseline:epochs=4'] and methods[4].startswith('random:')
    assert (tmp_path / 'accuracy_vs_budget.png').stat().st_size > 0

def test_a_seed_whose_plain_schedules_miss_the_target_counts_their_longest_cost_as_a_lower_bound():
    "Paired by seed against the cheapest plain schedule: where none of a seed's plain runs gets there, the longest one's cost stands in"
    from loss_filters.verdicts import add_verdicts
    mk = lambda m, sd, accs, w: dict(method=m, seed=sd, repeat=0, epochs=len(accs), train_s=10. * len(accs), wall_s=10. * len(accs),
                                     final_metric=accs[-1], mean_samp_perc=.5, work=w * len(accs), lr_mult=1.,
                                     history=[dict(train_s=10. * (i + 1), metric=a, work=w * (i + 1)) for i, a in enumerate(accs)])
    runs = [mk('baseline', 0, [.8, .9], 1.), mk('baseline', 1, [.8, .85], 1.),        # seed 1's plain model never gets to .89
            mk('baseline:epochs=1', 0, [.85], 1.), mk('baseline:epochs=1', 1, [.84], 1.),
            mk('blf', 0, [.85, .9], .5), mk('blf', 1, [.85, .9], .5)]
    rows, target = summarise(runs, target=.89)
    add_verdicts(rows, ['baseline:epochs=1'], {}, 2, target, runs=runs)
    blf = next(r for r in rows if r['method'] == 'blf')
    # blf gets to .89 at 0.9 of work (interpolated between its checks); seed 0's cheapest plain schedule is where the budget curve
    # crosses .89, 1.8; seed 1's plain runs never get there, so its longest one's 2.0 stands in
    assert blf['vs_best_plain_work_x'] == pytest.approx((1.8 / .9 * 2 / .9) ** .5)   # the geometric mean over the two seeds
    lo, hi = blf['vs_best_plain_work_ci']   # a 90% t interval on 1 degree of freedom: far wider than the two ratios
    assert lo < 1.8 / .9 and hi > 2 / .9 and blf['vs_best_plain_work_test']['n'] == 2

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_resume_goes_on_from_a_cut_off_run(tmp_path, capsys):
    kw = dict(data='digits', preset='quick', epochs=1, bs=64, out=str(tmp_path), quiet=True, methods='baseline blf:skip_epochs=0', score_cost=.3, n_train=600)
    full = lf_bench(**kw)
    runs_f = tmp_path / 'runs.jsonl'
    runs_f.write_text(runs_f.read_text().splitlines(keepends=True)[0])   # cut off after the plain model's run
    capsys.readouterr()
    res = lf_bench(**kw, resume=True)
    said = capsys.readouterr().out
    assert '== blf:skip_epochs=0' in said and '== baseline ' not in said   # only the missing run trains
    assert res['runs'][0]['history'] == full['runs'][0]['history'] and len(res['runs']) == 2
    assert res['summary'][1]['final_metric'] == full['summary'][1]['final_metric']   # the same seed trains the same model again
    with pytest.raises(ValueError, match=r'`resume`: .* other data \(n_train=600, now 500\)'): lf_bench(**{**kw, 'n_train': 500}, resume=True)
    with pytest.raises(ValueError, match=r'other data \(seed=0, now 1\)'): lf_bench(**kw, seed=1, resume=True)   # the seed draws the data split
    assert len(lf_bench(**{**kw, 'n_train': 500})['runs']) == 2   # without `resume` it starts over

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_probe_cost_option(tmp_path):
    "`--probe_cost`: the probe's time per probe and by part, a plain step's, and its share of a real fit, written to probe_cost.json"
    res = lf_bench(data='digits', bs=64, out=str(tmp_path), model='mlp', probe_cost=True)
    saved = json.loads((tmp_path / 'probe_cost.json').read_text())
    assert saved['model'] == 'mlp' and saved['every'] == 50 and saved['probes'] == 1 and saved['steps'] == 22   # 22 steps of digits: the first is probed
    assert saved['probe_ms'] > 0 and saved['step_ms'] > 0 and 0 < saved['share'] < 1 and len(saved['runs']) == saved['repeats'] == 3
    for r in saved['runs']:   # each probed fit: a probe against a step of the same fit, the probe's parts adding up to it, a plain fit beside
        assert r['probe_steps'] == pytest.approx(r['probe_ms'] / r['step_ms']) and r['plain_step_ms'] > 0
        assert r['gramian_ms'] + r['alpha_start_ms'] + r['alpha_end_ms'] == pytest.approx(r['probe_ms'])
    for k in ('probe_ms', 'step_ms', 'probe_steps', 'share'): assert saved[k] == pytest.approx(sorted(r[k] for r in saved['runs'])[1])   # the medians
    assert res['data'] == 'digits' and not (tmp_path / 'results.json').exists()   # no comparison ran

def test_seed_loaders_repeats_the_data_order_of_shared_loaders(digits_dls):
    "Loaders made once and shared by fits: `set_seed` alone leaves each fit another data order (fastai's loaders keep an RNG of their own); `seed_loaders` gives them the same"
    from fastai.basics import Learner, CrossEntropyLossFlat, set_seed
    from loss_filters.runs import seed_loaders
    from conftest import mlp
    def fit(seed_order):
        set_seed(0)
        learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat())
        if seed_order: seed_loaders(learn, 0)
        with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-2)
        return torch.cat([p.detach().flatten() for p in learn.model.parameters()])
    assert not torch.equal(fit(False), fit(False))
    assert torch.equal(fit(True), fit(True))

# ------------------------------------------------------------------ the main job: an answer from every control, in minutes
def test_main_preset_settings_are_pinned():
    "`make bench`: the Batch Loss Filter with every control on 5 seeds of the cheap model, plain schedules on both sides of the full one"
    from loss_filters.bench import PRESETS
    pre = PRESETS['main']
    assert (pre.methods, pre.design['seeds'], pre.data.model, pre.design['controls'], pre.design['epochs']) == ('baseline blf', 5, 'mlp', True, 4)
    assert budget_specs(pre.design['epochs'], pre.design['budgets']) == [f'baseline:epochs={k}' for k in (2, 3, 5, 6)]

@pytest.mark.tooling   # the command line and presets: once, in the first pass (conftest.py)
def test_the_main_job_ends_with_an_answer(tmp_path):
    "The README's main job from the command line, two fits at a time on the digits: one table of verdicts and one line per method, no placeholder"
    script = Path(sys.executable).parent / 'lf_bench'
    r = subprocess.run([str(script), '--data', 'digits', '--jobs', '2', '--seeds', '3', '--out', str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout[r.stdout.index('method  verdict'):]
    row = out.splitlines()[1].split()
    assert row[0] == 'blf' and ' '.join(row[1:4]).startswith(('pays', 'no gain shown', 'does not pay')), out   # a reading, not "no verdict"
    assert out.count('method  verdict') == 1 and sum(l.startswith('blf:') for l in out.splitlines()) == 1 and ' - ' not in out
    assert '2 fits at a time' in r.stdout and len((tmp_path / 'runs.jsonl').read_text().splitlines()) == 3 * 8   # methods, 4 schedules, a control, the plain model at its work

@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a GPU')
def test_profile_on_a_gpu_moves_the_model_to_the_batches(tmp_path):
    "`--profile` times a step before any fit has moved the model: it must put the model on the loaders' device itself"
    res = lf_bench(data='digits', preset='quick', epochs=1, bs=64, out=str(tmp_path), quiet=True, profile=True, model='cnn',
                   methods='baseline blf:skip_epochs=0 topk:proxy=.5')
    assert {'blf:skip_epochs=0', 'topk:proxy=.5'} <= set(res['profile'])
