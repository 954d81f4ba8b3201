"Shared fixtures: small real and synthetic data as fastai DataLoaders, and spies that watch a fit."
import warnings
import numpy as np, pandas as pd, pytest, torch, torch.nn as nn
from fastai.basics import DataLoaders, Callback, set_seed, defaults

warnings.filterwarnings('ignore', message='.*torch.jit.script.*')

# Loader workers: fastai's loaders start one process per core for every pass over them, which on these tiny in-memory
# data sets costs far more than their batches (the whole test process is forked at each epoch). The tests run without
# them; the ones that check what workers change (each worker building its share of a pruned epoch) ask for them by name.
defaults.cpus = 0

class ItemList(list):
    "A list of (x..., y...) tuples that tells fastai how many items are inputs"
    def __init__(self, items, n_inp=1): super().__init__(items); self.n_inp = n_inp
    def new_empty(self): return ItemList([], self.n_inp)

def make_dls(xs, ys, bs=64, valid_pct=.25, seed=0, n_inp=None, **kw):
    "fastai DataLoaders from tensors; `xs`/`ys` may be tuples for several inputs/targets; `kw` to `from_dsets` (`drop_last`)"
    xs, ys = (xs if isinstance(xs, tuple) else (xs,)), (ys if isinstance(ys, tuple) else (ys,))
    n = len(ys[0]); perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)); cut = int(n * (1 - valid_pct))
    items = list(zip(*xs, *ys))
    ds = lambda idx: ItemList([items[i] for i in idx], n_inp=len(xs))
    return DataLoaders.from_dsets(ds(perm[:cut]), ds(perm[cut:]), bs=bs, device='cpu', **kw)

@pytest.fixture(scope='session')
def digits():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.
    return (x - x.mean()) / x.std(), torch.tensor(d.target)

@pytest.fixture
def digits_dls(digits): return make_dls(*digits, bs=64)

def mlp(n_in=64, n_out=10): return nn.Sequential(nn.Flatten(), nn.Linear(n_in, 32), nn.ReLU(), nn.Linear(32, n_out))

def bn_mlp(n_in=64, n_out=10):
    "An MLP with `BatchNorm1d`, which fails in training mode on a batch of one"
    return nn.Sequential(nn.Flatten(), nn.Linear(n_in, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, n_out))

def bn_cnn(n_out=10):
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, padding=1),
                         nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, n_out))

def col(learn, name:str) -> list:
    "The per-epoch values of the Recorder column `name` (values have no `epoch` column)"
    i = list(learn.recorder.metric_names).index(name) - 1
    return [v[i] for v in learn.recorder.values]

class BatchSpy(Callback):
    "Records what the training step really sees: the batch size at `after_pred` and the inputs"
    order = 100
    def __init__(self, keep_inputs=False): self.sizes, self.inputs, self.keep_inputs = [], [], keep_inputs
    def after_pred(self):
        filt = getattr(self.learn, 'loss_filter', None)
        if not self.training or getattr(filt, 'scoring', False): return   # the filter's scoring pass is not a training step
        self.sizes.append((self.epoch, self.iter, self.yb[0].shape[0]))
        if self.keep_inputs: self.inputs.append([x.detach().clone() for x in self.xb])

def tabular_df(n=600):
    "A table of two numbers and a category; the label is whether a weighted sum passes a threshold"
    rng = np.random.RandomState(0)
    df = pd.DataFrame(dict(a=rng.randn(n), b=rng.randn(n), c=rng.choice(list('xyz'), n)))
    df['y'] = ((df.a + df.b + (df.c == 'x')) > .5).map({True: 'hi', False: 'lo'})
    return df

# The slowest files first: `make test` runs a file at a time on each of two workers, so one long file started last
# would keep one worker busy while the other sits idle.
SLOWEST = ['test_bench.py', 'test_readme.py', 'test_parallel.py', 'test_stats.py', 'test_core.py', 'test_scores.py', 'test_tools.py', 'test_probe.py']

def pytest_configure(config):
    config.addinivalue_line('markers', "fastai_neutral: tests of the statistics and of the selection rules in plain torch, whose outcome fastai's "
                                       "version does not change (at most a callback is built to check a method's settings, as other tests do): "
                                       "`make test-latest`, the pass against the newest fastai, leaves them out")
    config.addinivalue_line('markers', "tooling: tests of this package's own tools (the benchmark's command line, the README's examples as written, "
                                       "the executors, the scripts in tools/), whose fastai calls the other tests make in both passes: "
                                       "`make test-latest` leaves them out")

def pytest_collection_modifyitems(items):
    rank = lambda item: SLOWEST.index(item.path.name) if item.path.name in SLOWEST else len(SLOWEST)
    items.sort(key=rank)   # stable: each file's tests keep their order
