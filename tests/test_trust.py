"A printout a user can trust: seconds read only on a steady machine, what a method pays said, one interval in the headline, short names, resumes that reuse."
import copy, json, re
import pytest
from fastai.basics import Learner, CrossEntropyLossFlat
from fastai.metrics import accuracy
from loss_filters.verdicts import seconds_unread, speed_drift
from loss_filters.compare import compare_filters, load_comparison
from loss_filters.plan import Fit, near_saved, run_plan
from conftest import make_dls, mlp

def _plain(rates, sitting='s1') -> list:
    return [dict(method='baseline' if i % 2 else 'baseline:epochs=2', seed=i, repeat=0, work=2., train_s=2 * r, sitting=sitting, threads=1)
            for i, r in enumerate(rates)]

def test_seconds_are_not_read_where_the_machine_changed_speed():
    assert seconds_unread(_plain([.5, .52, .49, .51, .5, .53])) is None
    why = seconds_unread(_plain([.5, .52, .04, .05, .5, .04]))
    assert why.startswith("the machine's speed changed during the sitting (") and 's per epoch of work' in why
    assert speed_drift(_plain([.5] * 4 + [.7] * 4), bound=1.5) is None and speed_drift(_plain([.5] * 4 + [.8] * 4), bound=1.5) is not None

@pytest.fixture(scope='module')
def cmp_and_folder(digits, tmp_path_factory):
    dls = make_dls(*digits, bs=64)
    folder = tmp_path_factory.mktemp('cmp')
    make = lambda: Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    return compare_filters(make, 'baseline blf:skip_epochs=0', epochs=3, lr=1e-2, seeds=2, budgets='.67 1.33', folder=folder, show_progress=False), folder, make

def test_the_printout_says_what_the_method_paid_and_one_interval(cmp_and_folder):
    cmp, _, _ = cmp_and_folder
    text = repr(cmp)
    row = next(l for l in text.splitlines() if l.startswith('blf:skip_epochs=0 '))
    assert row.count('(') == 1   # the interval of the test at equal work; what an alternative needs without one
    assert "blf:skip_epochs=0: used " in text and "x the plain model's work" in text
    assert 'shown to end no more than' not in text   # the old wording a user could not follow

def test_summary_names_controls_by_short_names(cmp_and_folder):
    cmp, folder, _ = cmp_and_folder
    cmp.save(folder)
    table = (folder / 'summary.txt').read_text().split('\n\n')[0]
    assert 'random choice, keep' in table and 'random_batch:keep=' not in table.split('\n', 1)[1].split('blf:skip_epochs=0')[0]

def test_the_time_figure_is_drawn_only_where_seconds_are_read(cmp_and_folder):
    cmp, _, _ = cmp_and_folder
    names = [n for _, n in cmp._figures()]
    assert ('accuracy_vs_time.png' in names) == (seconds_unread(cmp.runs) is None)
    c2 = copy.copy(cmp); c2.runs = [r | dict(sitting='a' if i % 2 else 'b') for i, r in enumerate(cmp.runs)]
    assert 'accuracy_vs_time.png' not in [n for _, n in c2._figures()]

def test_a_control_at_a_share_that_moved_a_little_is_reused_on_resuming():
    saved = {('random_batch:keep=0.498,same_work=blf', 0, 0): dict(method='random_batch:keep=0.498,same_work=blf', final_metric=.9, sitting='old'),
             ('random_batch:keep=0.470,same_work=blf', 1, 0): dict(method='random_batch:keep=0.470,same_work=blf', final_metric=.8, sitting='old')}
    f0, f1 = Fit('random_batch:keep=0.495,same_work=blf', 0, 0, 'control'), Fit('random_batch:keep=0.495,same_work=blf', 1, 0, 'control')
    assert near_saved(f0, saved)['reused_from'] == 'random_batch:keep=0.498,same_work=blf'
    assert near_saved(f1, saved) is None   # 2.5 points of share apart: trained again
    assert near_saved(Fit('random_batch:keep=0.495,reach=blf', 0, 0, 'control'), saved) is None   # another role
    trained = []
    res = run_plan([f0, f1], lambda spec, seed: trained.append((spec, seed)) or dict(method=spec, final_metric=0.), done=saved,
                   reuse=lambda f: near_saved(f, saved))
    assert trained == [('random_batch:keep=0.495,same_work=blf', 1)] and res[f0.key]['final_metric'] == .9 and res[f0.key]['method'] == f0.spec

def test_orphan_controls_are_never_judged_as_methods(cmp_and_folder):
    cmp, folder, _ = cmp_and_folder
    runs = [json.loads(l) for l in (folder / 'runs.jsonl').read_text().splitlines()]
    ctl = next(r for r in runs if r['method'].startswith('random_batch'))
    orphan = ctl | dict(method=re.sub(r'keep=[0-9.]+', 'keep=0.111', ctl['method']))   # a share no method asks for now
    with open(folder / 'runs.jsonl', 'a') as fh: fh.write(json.dumps(orphan) + '\n')
    c = load_comparison(folder)
    assert orphan['method'] not in [r['method'] for r in c.rows]
    assert c.settings['orphans'] == [orphan['method']] and 'left out: 1 control(s)' in repr(c)

def test_inline_fits_pin_torch_threads_say_so_and_give_them_back(cmp_and_folder, capsys):
    import torch
    from loss_filters.plan import cores_each
    _, _, make = cmp_and_folder
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cmp = compare_filters(make, 'baseline', epochs=1, seeds=1, controls=False, show_progress=False)
        assert cmp.runs[0]['threads'] == cores_each(1) and torch.get_num_threads() == 1
        assert f"fits train here one after another on {cores_each(1)} torch thread(s)" in capsys.readouterr().out
        cmp = compare_filters(make, 'baseline', epochs=1, seeds=1, controls=False, show_progress=False, threads=1)
        assert cmp.runs[0]['threads'] == 1
    finally: torch.set_num_threads(before)
