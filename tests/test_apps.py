"Every filter on every fastai application (text, segmentation, multi-label, tabular, images), and a Learner never left changed."
import math, random
import numpy as np, pandas as pd, pytest, torch, torch.nn as nn, torch.nn.functional as F
from PIL import Image
from fastai.basics import Learner, Callback, set_seed, accuracy, accuracy_multi, CrossEntropyLossFlat, BCEWithLogitsLossFlat
from fastai.vision.all import (DataBlock, ImageBlock, MaskBlock, CategoryBlock, MultiCategoryBlock, TensorImage,
                               TensorMultiCategory)
from fastai.text.all import TextDataLoaders, text_classifier_learner, AWD_LSTM, SortedDL
from fastai.tabular.all import TabularDataLoaders, tabular_learner, Categorify, Normalize
from loss_filters.batch import *
from loss_filters.sampler import StaleLossPruningCallback
from conftest import make_dls, mlp, col, tabular_df

FILTERS = {'blf': lambda **kw: BatchLossFilterCallback(**kw),
           'sb': lambda **kw: SelectiveBackpropCallback(start=0., end=1., interrupt=0, **kw),
           'stale': lambda **kw: StaleLossPruningCallback(**kw)}

def fit(learn, n=3, lr=1e-2):
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(n, lr)
    return learn

def valid_loss(learn):
    with learn.no_bar(), learn.no_logging(): return learn.validate()[0]

class After(Callback):
    "What the training step is given, after the filter subset it: inputs' types and the batch itself"
    order = 5
    def before_fit(self): self.batches = []
    def before_batch(self):
        if self.training: self.batches.append((self.epoch, tuple(self.xb), tuple(self.yb)))

def check_fit(learn, name, n=3, lr=1e-2):
    "Fit with the filter `name`: it must learn and record shares in (0, 1], below 1 where it filtered"
    before = valid_loss(learn)
    learn.add_cb(After())
    fit(learn, n, lr)
    assert col(learn, 'valid_loss')[-1] < before                         # the fit learns
    samp, loss = col(learn, 'samp_perc'), col(learn, 'loss_perc')
    assert all(0 < v <= 1 for v in samp + loss), (samp, loss)
    assert min(samp) < 1                                                 # it did filter
    assert all(math.isfinite(v) for v in col(learn, 'full_train_loss'))
    return learn

# ------------------------------------------------------------------ data: small synthetic images on disk, text, a table
@pytest.fixture(scope='module')
def image_dir(tmp_path_factory):
    "RGB 16x16 images with a bright square in each of a random set of channels; masks of the squares"
    root, rng = tmp_path_factory.mktemp('imgs'), random.Random(0)
    (root / 'masks').mkdir()
    labels = {}
    for i in range(120):
        img, mask = np.random.RandomState(i).randint(0, 40, (16, 16, 3)).astype(np.uint8), np.zeros((16, 16), np.uint8)
        chans = [c for c in range(3) if rng.random() < .5] or [rng.randrange(3)]
        for c in chans:
            r, q = rng.randrange(10), rng.randrange(10)
            img[r:r + 6, q:q + 6, c] = 255; mask[r:r + 6, q:q + 6] = 1
        Image.fromarray(img).save(root / f'{i}.png'); Image.fromarray(mask).save(root / 'masks' / f'{i}.png')
        labels[f'{i}.png'] = ' '.join('rgb'[c] for c in chans)
    return root, labels

def small_cnn(n_out, seg=False):
    body = [nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()]
    head = [nn.Conv2d(16, n_out, 1)] if seg else [nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(16, n_out)]
    return nn.Sequential(*body, *head)

def image_dls(image_dir, blocks, get_y, bs=16, **kw):
    root, _ = image_dir
    files = sorted(root.glob('*.png'), key=lambda p: int(p.stem))
    return DataBlock(blocks=blocks, get_y=get_y, splitter=lambda items: (list(range(90)), list(range(90, len(items))))
                    ).dataloaders(files, bs=bs, device='cpu', num_workers=0, **kw)

@pytest.fixture(scope='module')
def text_df():
    "Sentences of very different lengths; the label is whether 'good' outnumbers 'bad'"
    rng, words, rows = random.Random(0), 'the a film plot actor scene music story long short'.split(), []
    for i in range(240):
        n = rng.choice([3, 5, 8, 20, 40, 70])
        toks = [rng.choice(words) for _ in range(n)]
        lab = i % 2
        for _ in range(3): toks.insert(rng.randrange(len(toks) + 1), 'good' if lab else 'bad')
        rows.append((' '.join(toks), 'pos' if lab else 'neg'))
    return pd.DataFrame(rows, columns=['text', 'label'])

def text_learner(df, **kw):
    dls = TextDataLoaders.from_df(df, text_col='text', label_col='label', valid_pct=.25, seed=0, bs=16, device='cpu', **kw)
    cfg = dict(emb_sz=32, n_hid=48, n_layers=2)   # small; `drop_mult=0` would hit a fastai bug (weight_p=0 breaks `WeightDropout`)
    return text_classifier_learner(dls, AWD_LSTM, pretrained=False, config=cfg, drop_mult=.1, metrics=accuracy)

def lengths(x, pad=1): return (x != pad).sum(1)

# ------------------------------------------------------------------ the matrix
@pytest.mark.parametrize('name', FILTERS)
def test_text_classifier(text_df, name):
    set_seed(0)
    learn = text_learner(text_df)
    assert isinstance(learn.dls.train, SortedDL)
    learn.add_cb(FILTERS[name]())
    check_fit(learn, name, n=4, lr=1e-2)
    check_text_batches(learn, name, 4)

def check_text_batches(learn, name, epochs):
    "Each batch sorted by length; a pruner's epoch trained every example it kept, once; the loader left as it was"
    n_train = len(learn.dls.train_ds)
    for e in range(epochs):
        xs = [b[1][0] for b in learn.after.batches if b[0] == e]
        for x in xs:   # each batch sorted by length, longest first: `SentenceEncoder` drops no real token
            ln = lengths(x)
            assert (ln[:-1] >= ln[1:]).all(), ln
        if name == 'stale':   # every example the epoch kept was trained on, once
            plain = n_train // 16 * 16                                     # `drop_last`: a plain epoch trains whole batches
            assert sum(len(x) for x in xs) == round(learn.loss_filter.epoch_stats[e]['samp_perc'] * plain)
    assert 'get_idxs' not in learn.dls.train.__dict__ and learn.dls.train.n == n_train

def test_text_pruning_with_loader_workers(text_df):
    "Two loader workers each build their own share of a pruned epoch's sorted batches, from the same order"
    set_seed(0)
    learn = text_learner(text_df, num_workers=2)
    assert learn.dls.train.fake_l.num_workers == 2   # a `SortedDL` has none unless asked
    learn.add_cb(FILTERS['stale']())
    check_fit(learn, 'stale', n=3, lr=1e-2)
    assert min(s['samp_perc'] for s in learn.loss_filter.epoch_stats) < 1
    check_text_batches(learn, 'stale', 3)

@pytest.mark.parametrize('name', FILTERS)
def test_segmentation(image_dir, name):
    set_seed(0)
    dls = image_dls(image_dir, (ImageBlock, MaskBlock(codes=['bg', 'sq'])), lambda p: p.parent / 'masks' / p.name)
    learn = Learner(dls, small_cnn(2, seg=True), loss_func=CrossEntropyLossFlat(axis=1)).add_cb(FILTERS[name]())
    check_fit(learn, name, n=3, lr=1e-2)
    assert all(r['loss_share'] <= 1 for r in getattr(learn.loss_filter, 'stats', []))

@pytest.mark.parametrize('score', ['loss', 'grad_norm'])
@pytest.mark.parametrize('name', FILTERS)
def test_multi_label(image_dir, name, score):
    set_seed(0)
    labels = image_dir[1]
    dls = image_dls(image_dir, (ImageBlock, MultiCategoryBlock), lambda p: labels[p.name].split())
    learn = Learner(dls, small_cnn(3), loss_func=BCEWithLogitsLossFlat(), metrics=accuracy_multi)
    learn.add_cb(FILTERS[name](score=score))
    types, select = set(), getattr(learn.loss_filter, 'select', None)   # a sampler-level pruner selects nothing per batch
    def spy(scores):
        idxs = select(scores); types.update((type(scores), type(idxs))); return idxs
    if select is not None: learn.loss_filter.select = spy
    check_fit(learn, name, n=3, lr=1e-2)
    assert types <= {torch.Tensor}                                       # scores and indices: plain tensors
    _, xb, yb = learn.after.batches[-1]
    assert type(xb[0]) is TensorImage and type(yb[0]) is TensorMultiCategory   # the trained batch keeps fastai's types

def tab_learner(df, **kw):
    "A `tabular_learner` on the first 450 rows, validated on the rest (a partial last batch of 2 at bs=64)"
    dls = TabularDataLoaders.from_df(df, procs=[Categorify, Normalize], cat_names=['c'], cont_names=['a', 'b'],
                                     y_names='y', valid_idx=list(range(450, len(df))), bs=64, device='cpu', **kw)
    return tabular_learner(dls, layers=[32], n_out=2, metrics=accuracy)   # n_out: fastai's guess fails on pandas 3

@pytest.mark.parametrize('name', FILTERS)
def test_tabular(name):
    df = tabular_df()
    set_seed(0)
    learn = tab_learner(df).add_cb(FILTERS[name]())
    check_fit(learn, name, n=4, lr=1e-2)

@pytest.mark.parametrize('name', FILTERS)
def test_image_classifier(image_dir, name):
    set_seed(0)
    labels = image_dir[1]
    dls = image_dls(image_dir, (ImageBlock, CategoryBlock), lambda p: 'r' in labels[p.name].split())
    learn = Learner(dls, small_cnn(2), loss_func=CrossEntropyLossFlat(), metrics=accuracy).add_cb(FILTERS[name]())
    check_fit(learn, name, n=3, lr=1e-2)

# ------------------------------------------------------------------ bad input: refused at the first training batch
class Steps(Callback):
    order = 100
    def before_fit(self): self.n = 0
    def after_step(self): self.n += 1

class Named(nn.Module):
    "A model whose second input is a list of names"
    def __init__(self): super().__init__(); self.net = mlp()
    def forward(self, x, names): return self.net(x)

def ignores_reduction(pred, targ, reduction='mean'): return F.cross_entropy(pred, targ)

@pytest.mark.parametrize('make', [lambda: BatchLossFilterCallback(), lambda: BatchLossFilterCallback(skip_epochs=0),
                                  lambda: SelectiveBackpropCallback(), lambda: SelectiveBackpropCallback(start=0.)])
def test_a_batch_it_cannot_subset_is_refused_before_any_step(digits, make):
    x, y = digits
    names = [f'ex{i}' for i in range(len(y))]
    dls = make_dls((x, names), y, bs=64)
    learn = Learner(dls, Named(), loss_func=CrossEntropyLossFlat(), cbs=[make(), Steps()])
    w = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(TypeError, match='batch of tensors'): fit(learn, 2)
    assert learn.steps.n == 0 and all(torch.equal(a, b) for a, b in zip(w, learn.model.parameters()))

@pytest.mark.parametrize('make', [lambda: BatchLossFilterCallback(), lambda: BatchLossFilterCallback(skip_epochs=3),
                                  lambda: SelectiveBackpropCallback(), lambda: StaleLossPruningCallback()])
def test_a_loss_ignoring_reduction_is_refused_before_any_step(digits_dls, make):
    learn = Learner(digits_dls, mlp(), loss_func=ignores_reduction, cbs=[make(), Steps()])
    with pytest.raises(TypeError, match='ignores_reduction'): fit(learn, 2)
    assert learn.steps.n == 0

# ------------------------------------------------------------------ any ending of a fit leaves the Learner as it was
class Stop(Callback):
    "Raise `exc` in the middle of the second epoch"
    def __init__(self, exc): self.exc = exc
    def after_batch(self):
        if self.training and self.epoch == 1 and self.iter == 3: raise self.exc

def _state(learn):
    dl = learn.dls.train
    return (list(learn.metrics), dl.n, len(dl), dl.get_idxs.__func__, dl.chunkify.__func__, getattr(learn.loss_func, 'reduction', None),
            sorted(k for k in dl.__dict__ if k in ('get_idxs', 'chunkify', 'sample')), [type(c) for c in learn.cbs])

@pytest.mark.parametrize('exc', [RuntimeError('boom'), KeyboardInterrupt()], ids=['exception', 'interrupt'])
@pytest.mark.parametrize('name', FILTERS)
def test_remove_cb_after_any_ending_restores_the_learner(digits_dls, name, exc):
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    before = _state(learn)
    learn.add_cb(FILTERS[name]())
    stop = Stop(exc)
    with pytest.raises(type(exc)): fit(learn.add_cb(stop), 4)
    learn.remove_cb(stop)
    learn.remove_cb(learn.loss_filter)
    assert _state(learn) == before
    fit(learn, 1)                                                        # a plain fit shows no frozen columns
    assert 'samp_perc' not in learn.recorder.metric_names and len(learn.recorder.values[-1]) == 3

@pytest.mark.parametrize('name', FILTERS)
def test_a_new_fit_after_an_interrupt_starts_clean(digits_dls, name):
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy).add_cb(FILTERS[name]())
    stop = Stop(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt): fit(learn.add_cb(stop), 4)
    learn.remove_cb(stop)
    dl = learn.dls.train
    fit(learn, 2)
    assert len(learn.loss_filter.epoch_stats) == 2 and learn.recorder.metric_names.count('samp_perc') == 1
    assert dl.n == len(learn.dls.train_ds) and 'get_idxs' not in dl.__dict__
    if name == 'stale': assert learn.loss_filter.epoch_stats[0]['samp_perc'] == 1   # a fresh table: nothing pruned in epoch 0

def test_one_column_each_with_train_metrics(digits_dls):
    from fastai.learner import Recorder
    learn = Learner(digits_dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy).batch_loss_filter(skip_epochs=0)
    learn.recorder.train_metrics = True
    fit(learn, 2)
    names = list(learn.recorder.metric_names)
    assert [n for n in names if 'perc' in n or 'full' in n] == ['samp_perc', 'loss_perc', 'full_train_loss']
    assert len(learn.recorder.values[-1]) == len(names) - 2               # no `epoch`, no `time`
