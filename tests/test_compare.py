"`compare_filters` end to end on tiny vision, tabular and text Learners: data order, exact work, metrics, resuming, bad input."
import inspect, json, random
import numpy as np, pandas as pd, pytest, torch
from PIL import Image
from torch import nn
from fastai.basics import Callback, CrossEntropyLossFlat
from fastai.metrics import accuracy, error_rate
from fastai.tabular.all import TabularDataLoaders, tabular_learner, Categorify, Normalize
from fastai.vision.all import (ImageDataLoaders, Learner, DataBlock, ImageBlock, MaskBlock, MultiCategoryBlock, BCEWithLogitsLossFlat,
                                accuracy_multi, foreground_acc)
from fastai.text.all import TextDataLoaders, text_classifier_learner, AWD_LSTM
from loss_filters.compare import compare_filters, Comparison
from loss_filters.comparison import Judging
from conftest import tabular_df
from loss_filters.sampler import plain_epoch_size
from loss_filters.report import payoff_lines

DF = tabular_df()

def tab_learner(metrics=accuracy):
    "450 training rows at bs 64 (`drop_last`: 7 batches, 448 examples an epoch), 150 validation rows"
    dls = TabularDataLoaders.from_df(DF, procs=[Categorify, Normalize], cat_names=['c'], cont_names=['a', 'b'], y_names='y',
                                     valid_idx=list(range(450, 600)), bs=64, device='cpu')
    return tabular_learner(dls, layers=[32], n_out=2, metrics=metrics)

class FirstEpochBatches(Callback):
    "The inputs of every training batch of each fit's first epoch, as they come from the loader (before any filter)"
    order = -50
    def __init__(self): self.fits = []
    def before_fit(self): self.fits.append([])
    def before_batch(self):
        if self.training and self.epoch == 0: self.fits[-1].append([x.detach().clone() for x in self.learn.xb])

def same_batches(a, b): return len(a) == len(b) and all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q))

def test_every_method_and_control_of_a_seed_trains_the_same_first_epoch():
    spy = FirstEpochBatches()
    cmp = compare_filters(tab_learner, 'baseline blf:skip_epochs=0 stale hide', epochs=3, lr=1e-2, seeds=1, cbs=[spy], show_progress=False)
    methods = [r['method'] for r in cmp.runs]
    assert len(spy.fits) == len(methods) and any(m.startswith('random') for m in methods) and 'baseline:epochs=2' in methods
    assert all(same_batches(spy.fits[0], f) for f in spy.fits[1:])
    assert isinstance(cmp, Comparison) and len(payoff_lines(cmp)) == 3

def test_exact_work_on_a_tiny_run():
    cmp = compare_filters(tab_learner, 'baseline random_batch:keep=.5,skip_epochs=1', epochs=2, lr=1e-2, seeds=1, controls=False,
                          score_cost=.25, show_progress=False)
    base, half = cmp.runs
    plain = plain_epoch_size(450, 64, True)
    assert plain == 448 and base['trained'] == 2 * plain and base['work'] == 2.
    assert half['trained'] == plain + 7 * 32 and half['scored'] == 0   # half of every batch of its filtered epoch kept, none scored
    assert half['work'] == pytest.approx((plain + 7 * 32) / plain)   # random choice runs no scoring pass, and none is charged
    assert cmp.table.loc['random_batch:keep=.5,skip_epochs=1', 'work'] == pytest.approx(1.5)
    blf = compare_filters(tab_learner, 'baseline blf', epochs=2, lr=1e-2, seeds=1, controls=False, score_cost=.25, show_progress=False).runs[1]
    assert blf['scored'] > 0 and blf['work'] == pytest.approx((blf['trained'] + .25 * blf['scored']) / plain)   # a filter's is

def test_each_method_spec_is_parsed_once_and_passed_along(monkeypatch):
    "A comparison with its controls and verdicts: every spec (methods, shorter schedules, random controls) parsed and checked once, a `Method` after"
    import collections, functools
    import loss_filters.methods as runs_mod   # the spec language's module
    seen, inner = collections.Counter(), runs_mod._parse.__wrapped__
    def counted(spec): seen[spec] += 1; return inner(spec)
    monkeypatch.setattr(runs_mod, '_parse', functools.lru_cache(maxsize=None)(counted))
    cmp = compare_filters(tab_learner, 'baseline blf:skip_epochs=0', epochs=2, lr=1e-2, seeds=2, show_progress=False)
    methods = {r['method'] for r in cmp.runs}
    assert 5 <= len(methods) <= 6 and methods <= set(seen) and set(seen.values()) == {1}   # the plain model at the method's work, and random choice there where its batch is smaller
    m = runs_mod.parse_method('blf:skip_epochs=0')
    assert m.name == 'blf' and m.filters and m.epochs(7) == 7 and runs_mod.parse_method(m) is m and str(m) == 'blf:skip_epochs=0'
    with pytest.raises(TypeError): m.kw['skip_epochs'] = 1   # read-only: one parsed value shared by every reader

def test_a_lower_is_better_metric():
    cmp = compare_filters(lambda: tab_learner(error_rate), 'baseline blf:skip_epochs=0', epochs=2, lr=1e-2, seeds=2, controls=False,
                          show_progress=False)
    assert cmp.metric == 'error_rate' and cmp.sign == -1
    t = cmp.table
    base = t.loc['baseline', 'final_error_rate']
    assert 0 <= base < .5 and cmp.target_value == pytest.approx(base + .002)   # the target is worse by the drop: a higher error
    for r in cmp.runs:   # the runs hold the error negated; a run reaches the target when its error falls to it
        errs = [-e['metric'] for e in r['history']]
        assert all(0 <= e <= 1 for e in errs) and (r['target_s'] is not None) == (min(errs) <= cmp.target_value + 1e-9)
    assert t.loc['baseline', 'reached'] >= 1
    declared = compare_filters(lambda: tab_learner(error_rate), 'baseline', epochs=1, seeds=1, controls=False, lower_is_better=False,
                               show_progress=False)
    assert declared.sign == 1 and declared.target_value == pytest.approx(declared.table.loc['baseline', 'final_error_rate'] - .002)

def test_resumes_from_saved_runs(tmp_path):
    calls = []
    def on_run(spec, seed, rep, kind):
        calls.append((spec, seed))
        if len(calls) == 3: raise KeyboardInterrupt   # stopped by hand on its third run
    kw = dict(methods='baseline blf:skip_epochs=0', epochs=2, lr=1e-2, seeds=2, controls=False, folder=tmp_path, show_progress=False)
    with pytest.raises(KeyboardInterrupt): compare_filters(tab_learner, on_run=on_run, **kw)
    assert len((tmp_path / 'runs.jsonl').read_text().splitlines()) == 2
    calls.clear()
    cmp = compare_filters(tab_learner, on_run=lambda *a: calls.append(a[:2]), **kw)
    assert calls == [('baseline', 1), ('blf:skip_epochs=0', 1)]              # only the runs it had not finished
    assert len(cmp.runs) == 4 and len((tmp_path / 'runs.jsonl').read_text().splitlines()) == 4
    calls.clear()
    again = compare_filters(tab_learner, on_run=lambda *a: calls.append(a[:2]), **kw)
    assert calls == [] and again.table['work'].tolist() == cmp.table['work'].tolist()
    with pytest.raises(ValueError, match='other settings'): compare_filters(tab_learner, **(kw | dict(epochs=3)))
    paths = cmp.save(tmp_path / 'out')
    saved = json.loads((tmp_path / 'out' / 'results.json').read_text())
    assert saved['metric'] == 'accuracy' and len(saved['runs']) == 4 and all(p.stat().st_size > 0 for p in paths)

def test_clear_errors_before_anything_trains():
    shared = tab_learner()
    with pytest.raises(ValueError, match='same Learner'): compare_filters(lambda: shared, show_progress=False)
    with pytest.raises(ValueError, match="`metric` 'dice' is not recorded by the Learner; it records valid_loss, accuracy"):
        compare_filters(tab_learner, metric='dice', show_progress=False)
    with pytest.raises(ValueError, match='`seeds` must be an integer >= 1'): compare_filters(tab_learner, seeds=0)
    with pytest.raises(TypeError, match='`epochs` must be an integer >= 1, got 2.5'): compare_filters(tab_learner, epochs=2.5)   # as the callbacks' own
    with pytest.raises(TypeError, match='`evals_per_epoch` must be an integer'): compare_filters(tab_learner, evals_per_epoch=True)
    with pytest.raises(ValueError, match='`reference_seeds` must be an integer >= 0'): compare_filters(tab_learner, reference_seeds=-1)
    with pytest.raises(ValueError, match='`budgets`'): compare_filters(tab_learner, budgets='.5 1')
    with pytest.raises(ValueError, match='`budgets`'): compare_filters(tab_learner, budgets=[.5, 'x'])
    with pytest.raises(ValueError, match='`work`'): compare_filters(tab_learner, work='seconds')
    with pytest.raises(ValueError, match='`reference_seeds`'): compare_filters(tab_learner, reference_seeds=2)
    with pytest.raises(ValueError, match='unknown method'): compare_filters(tab_learner, methods='baseline nope')
    with pytest.raises(TypeError, match='`make_learner`'): compare_filters(shared)
    with pytest.raises(TypeError, match="unexpected keyword argument 'epoch'"): compare_filters(tab_learner, epoch=3)   # a misspelt design argument
    sig = inspect.signature(compare_filters).parameters   # a thin entry point: the code that trains, and three objects' fields by name
    assert len(sig) <= 12 and {'judging', 'running', 'settings'} <= set(sig)
    with pytest.raises(ValueError, match='`alpha` must be in'): compare_filters(tab_learner, judging=Judging(), alpha=.7)   # checked by its owner
    with pytest.raises(ValueError, match='`threads` must be an integer >= 1'): compare_filters(tab_learner, threads=0)

@pytest.fixture(scope='module')
def image_folder(tmp_path_factory):
    "48 RGB 16x16 images with a bright square in one or two channels: the label is the first one, the labels all of them; masks of the squares"
    root, rng = tmp_path_factory.mktemp('cmp_imgs'), random.Random(0)
    (root / 'masks').mkdir()
    fnames, labels, multi = [], [], {}
    for i in range(48):
        img, mask, c = np.random.RandomState(i).randint(0, 40, (16, 16, 3)).astype(np.uint8), np.zeros((16, 16), np.uint8), i % 3
        chans = [c] + ([(c + 1) % 3] if i % 2 else [])
        r, q = rng.randrange(10), rng.randrange(10)
        for ch in chans: img[r:r + 6, q:q + 6, ch] = 255
        mask[r:r + 6, q:q + 6] = 1
        Image.fromarray(img).save(root / f'{i}.png'); Image.fromarray(mask).save(root / 'masks' / f'{i}.png')
        fnames.append(root / f'{i}.png'); labels.append('rgb'[c]); multi[f'{i}.png'] = ' '.join('rgb'[ch] for ch in chans)
    return fnames, labels, multi

def small_cnn(n_out, seg=False):
    body = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
    head = [nn.Conv2d(8, n_out, 1)] if seg else [nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(8, n_out)]
    return nn.Sequential(*body, *head)

def block_dls(fnames, blocks, get_y):
    return DataBlock(blocks=blocks, get_y=get_y, splitter=lambda items: (list(range(36)), list(range(36, len(items))))
                    ).dataloaders(fnames, bs=8, device='cpu', num_workers=0)

def test_vision_learner(image_folder):
    fnames, labels, _ = image_folder
    def make():
        dls = ImageDataLoaders.from_lists(fnames[0].parent, fnames, labels, valid_pct=.25, seed=0, bs=8, device='cpu', num_workers=0)
        return Learner(dls, small_cnn(3), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    spy = FirstEpochBatches()
    cmp = compare_filters(make, 'baseline sb:start=0,keep=.5', epochs=2, lr=1e-2, seeds=1, controls=False, cbs=[spy], show_progress=False)
    assert same_batches(*spy.fits) and cmp.table.loc['sb:start=0,keep=.5', 'samp_perc'] < 1

def test_segmentation_learner(image_folder):
    fnames = image_folder[0]
    make = lambda: Learner(block_dls(fnames, (ImageBlock, MaskBlock(codes=['bg', 'sq'])), lambda p: p.parent / 'masks' / p.name),
                           small_cnn(2, seg=True), loss_func=CrossEntropyLossFlat(axis=1), metrics=foreground_acc)
    cmp = compare_filters(make, 'baseline sb:start=0,keep=.5 stale', epochs=2, lr=1e-2, seeds=1, controls=False, show_progress=False)
    assert cmp.metric == 'foreground_acc' and cmp.sign == 1
    assert cmp.table.loc['sb:start=0,keep=.5', 'samp_perc'] < 1 and cmp.table.loc['stale', 'work'] < 2

def test_multi_label_learner(image_folder):
    fnames, _, multi = image_folder
    make = lambda: Learner(block_dls(fnames, (ImageBlock, MultiCategoryBlock), lambda p: multi[p.name].split()), small_cnn(3),
                           loss_func=BCEWithLogitsLossFlat(), metrics=accuracy_multi)
    cmp = compare_filters(make, 'baseline blf:skip_epochs=0', epochs=2, lr=1e-2, seeds=1, controls=False, show_progress=False)
    assert cmp.metric == 'accuracy_multi' and cmp.table.loc['blf:skip_epochs=0', 'samp_perc'] < 1

def text_df():
    rng, words, rows = random.Random(0), 'the a film plot actor scene music story long short'.split(), []
    for i in range(120):
        toks = [rng.choice(words) for _ in range(rng.choice([3, 8, 20, 40]))]
        for _ in range(3): toks.insert(rng.randrange(len(toks) + 1), 'good' if i % 2 else 'bad')
        rows.append((' '.join(toks), 'pos' if i % 2 else 'neg'))
    return pd.DataFrame(rows, columns=['text', 'label'])

def test_text_classifier_with_its_sorted_loader():
    df = text_df()
    dls = TextDataLoaders.from_df(df, text_col='text', label_col='label', valid_pct=.25, seed=0, bs=16, device='cpu')
    def make():
        return text_classifier_learner(dls, AWD_LSTM, pretrained=False, config=dict(emb_sz=16, n_hid=24, n_layers=1), drop_mult=.1,
                                       metrics=accuracy)
    spy = FirstEpochBatches()
    cmp = compare_filters(make, 'baseline blf:skip_epochs=0', epochs=2, lr=1e-2, seeds=1, controls=False, cbs=[spy], show_progress=False)
    assert same_batches(*spy.fits)
    assert type(dls.train).__name__ == 'SortedDL' and cmp.table.loc['blf:skip_epochs=0', 'samp_perc'] < 1

def test_a_target_fixed_from_reference_seeds_it_does_not_judge(tmp_path):
    "`reference_seeds` trains the plain model on further seeds first and sets the target at the knee of their curve; those runs are saved, flagged, and never judged"
    from loss_filters.verdicts import knee_target
    from loss_filters.compare import read_runs, load_comparison
    cmp = compare_filters(tab_learner, 'baseline blf', epochs=3, lr=1e-2, seeds=2, controls=False, reference_seeds=3, folder=tmp_path,
                          show_progress=False)
    saved = read_runs(tmp_path)
    refs = [r for r in saved if r.get('reference')]
    assert sorted(r['seed'] for r in refs) == [2, 3, 4] and {r['seed'] for r in cmp.runs} == {0, 1}   # seeds the comparison does not judge
    assert cmp.settings['target_from'] == 'reference' and cmp.target == pytest.approx(knee_target(refs)['target'])
    assert 'fixed from 3 seeds of the plain model' in ' '.join(str(cmp).split())
    again = load_comparison(tmp_path)   # judged again: the same target, from the same reference runs
    assert again.target == pytest.approx(cmp.target) and {r['seed'] for r in again.runs} == {0, 1}
    resumed = compare_filters(tab_learner, 'baseline blf', epochs=3, lr=1e-2, seeds=2, controls=False, reference_seeds=3, folder=tmp_path,
                              show_progress=False)
    assert resumed.target == pytest.approx(cmp.target) and len(read_runs(tmp_path)) == len(saved)   # every run reused, none trained again

def test_work_is_counted_in_operations_by_default():
    cmp = compare_filters(tab_learner, 'baseline blf', epochs=2, lr=1e-2, seeds=1, controls=False, show_progress=False)
    from loss_filters.costs import learner_flop_costs
    assert cmp.settings['work'] == 'flops' and cmp.settings['score_cost'] == pytest.approx(learner_flop_costs(tab_learner())['score'])
    assert cmp.settings['score_cost_timed'] > 0   # the measured timing ratio, kept beside
    timed = compare_filters(tab_learner, 'baseline blf', epochs=2, lr=1e-2, seeds=1, controls=False, show_progress=False, work='time')
    assert timed.settings['work'] == 'time' and timed.settings['score_cost'] == timed.settings['score_cost_timed']
