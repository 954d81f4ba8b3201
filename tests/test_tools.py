"The experiments in `tools/`: the two combined filters train on what each of their parts would leave, and count their work."
import importlib.util, os, re, subprocess, sys
import pytest
from pathlib import Path
import torch
from fastai.basics import Callback, Learner, CrossEntropyLossFlat, accuracy, set_seed
from loss_filters.all import *
from conftest import make_dls, mlp, BatchSpy
from loss_filters.report import payoff_lines

pytestmark = pytest.mark.tooling   # run once, in the first pass (conftest.py)

TOOLS = Path(__file__).resolve().parent.parent / 'tools'

def _tool(name:str):
    "The module `tools/<name>.py`, loaded from its file"
    spec = importlib.util.spec_from_file_location(name, TOOLS / f'{name}.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

class DrawnSpy(Callback):
    "The examples the training loader draws each epoch, before any filter takes part of a batch"
    order = -100
    def before_fit(self): self.drawn = []
    def before_train(self): self.drawn.append(0)
    def before_batch(self):
        if self.training: self.drawn[-1] += self.yb[0].shape[0]

def _fit(digits, cb, epochs=4):
    set_seed(0)
    learn = Learner(make_dls(*digits, bs=64), mlp(), CrossEntropyLossFlat(), metrics=accuracy, lr=1e-2)
    learn.add_cb(cb)
    spies = BatchSpy(), DrawnSpy()
    with learn.no_bar(), learn.no_logging(): learn.fit(epochs, cbs=list(spies))
    return learn, *spies

def test_hide_and_blf_trains_part_of_each_shown_batch_and_counts_its_scoring(digits):
    mod = _tool('combined')
    assert mod.METHODS['hide_blf'][0] is mod.HideAndBatchLossCallback   # `lf_bench`'s method names reach the tool's classes
    cb = mod.HideAndBatchLossCallback(confidence=.5, anneal=0)
    learn, spy, drawn = _fit(digits, cb)
    trained = [sum(s for e, _, s in spy.sizes if e == k) for k in range(4)]
    assert trained[0] == drawn.drawn[0] == cb.n_seen   # the first epoch trains every example, as both parts do
    assert all(d < cb.n_seen for d in drawn.drawn[1:])   # later epochs hide some examples ...
    assert all(t < d for t, d in zip(trained[1:], drawn.drawn[1:]))   # ... and train only part of the rest
    assert cb.fit_scored == sum(drawn.drawn[1:])   # every example drawn after the first epoch is scored once
    assert torch.isfinite(cb.table).all()   # every example has a loss: trained, or scored in a later batch
    assert learn.loss_filter is cb and cb.mean_lr_mult > 1   # hiding's rate raise for the epoch's fewer steps

def test_hide_and_stale_leaves_out_more_than_hiding_alone(digits):
    mod = _tool('combined')
    hide, *_ = _fit(digits, HideLearnedCallback(confidence=.5, anneal=0))
    both, *_ = _fit(digits, mod.HideAndStaleCallback(confidence=.5, anneal=0))
    kept = lambda learn: [s['samp_perc'] for s in learn.loss_filter.epoch_stats[1:]]
    assert all(b < h for b, h in zip(kept(both), kept(hide)))
    assert both.loss_filter.weights is not None and (both.loss_filter.weights > 1).any()   # InfoBatch's up-weighting

def test_saved_runs_are_read_gzipped(tmp_path, capsys):
    "The run lines kept in `nbs/bench_runs/` are gzipped: the plateau plot and `load_comparison` read them as they are"
    path = Path(__file__).resolve().parent.parent / 'tools' / 'plateau.py'
    spec = importlib.util.spec_from_file_location('plateau', path)
    plateau = importlib.util.module_from_spec(spec); spec.loader.exec_module(plateau)
    runs_dir = Path(__file__).resolve().parent.parent / 'nbs' / 'bench_runs'
    plateau.plot([runs_dir / 'plateau_aug.jsonl.gz'], tmp_path / 'p.png')
    assert (tmp_path / 'p.png').stat().st_size > 1000 and 'plateau from' in capsys.readouterr().out
    cmp = load_comparison(runs_dir / 'long_preset_runs.jsonl.gz')
    assert cmp.settings['seeds'] == 3 and set(cmp.control_of) == {'blf', 'sb', 'stale', 'hide'}
    assert all(' (3 seeds)' in l or ' of 3 runs' in l for l in payoff_lines(cmp))

def _gradmatch():
    path = Path(__file__).resolve().parent.parent / 'tools' / 'gradmatch.py'
    spec = importlib.util.spec_from_file_location('gradmatch', path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

def test_gradient_matching_selection_by_hand():
    "Four gradients (1,0), (0,1), (1,1), (-1,0) with mean (.25,.5): one example matches best with (1,1) at weight .375; two match exactly with (1,1) and (0,1) at .25 each"
    gm = _gradmatch()
    g = torch.tensor([[1., 0.], [0., 1.], [1., 1.], [-1., 0.]])
    idx, w = gm.match_gradient(g @ g.T, 1)
    assert idx.tolist() == [2] and w.tolist() == [pytest.approx(.375)]
    idx, w = gm.match_gradient(g @ g.T, 2)
    assert idx.tolist() == [2, 1] and w.tolist() == [pytest.approx(.25, abs=1e-6), pytest.approx(.25, abs=1e-6)]
    assert torch.allclose((w[:, None] * g[idx]).sum(0), g.mean(0), atol=1e-6)   # the batch's mean gradient, exactly

def test_the_heads_gramian_in_closed_form_equals_autograd():
    gm = _gradmatch()
    torch.manual_seed(0)
    head, h, y = torch.nn.Linear(5, 3), torch.randn(6, 5), torch.randint(0, 3, (6,))
    rows = [torch.cat([t.flatten() for t in torch.autograd.grad(torch.nn.functional.cross_entropy(head(h[i:i + 1]), y[i:i + 1]), list(head.parameters()))])
            for i in range(6)]
    J = torch.stack(rows)
    assert torch.allclose(gm.head_gramian(h, head(h).detach(), y), J @ J.T, atol=1e-5)

def test_the_gradient_matching_filter_trains_a_weighted_subset(digits):
    gm = _gradmatch()
    learn, spy, _ = _fit(digits, gm.GradMatchCallback(keep=.25, skip_epochs=0), epochs=2)
    sizes = [s for _, _, s in spy.sizes]
    assert sizes and all(s == 16 for s in sizes)   # a quarter of each batch of 64
    assert 0 < learn.loss_filter.epoch_stats[-1]['samp_perc'] < .3

def test_cifar_dry_run_finds_its_generated_folder_without_downloading_and_leaves_nothing(tmp_path):
    "`tools/cifar_dry_run.py` at a tiny size: the notebook's loaders through `untar_data`, a table of every method, no download, no folder left"
    home, user = tmp_path / 'real_home', tmp_path / 'user'   # a user's fastai folder, and home: the dry run must never touch the first
    env = {**os.environ, 'FASTAI_HOME': str(home), 'HOME': str(user), 'HTTPS_PROXY': 'http://127.0.0.1:9', 'OMP_NUM_THREADS': '1'}
    out = tmp_path / 'dry.txt'
    r = subprocess.run([sys.executable, str(TOOLS / 'cifar_dry_run.py'), '--settings', 'smoke', '--n_per_class', '40',
                        '--n_test_per_class', '8', '--batches', '50', '--warmup', '1', '--valid_batches', '1', '--out', str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert '400 training and 80 validation images, 12 training batches an epoch' in text
    assert '11 training batches timed after 1, 1 validation batches' in text   # 50 asked: as many as one epoch has
    for m in ('baseline', 'blf', 'random at blf share', 'sb', 'random at sb share'): assert f'\n{m} ' in text
    m = re.search(r'([\d.]+) (h|min) at the shares kept here, at most ([\d.]+) (h|min)', text)
    low, high = (float(m.group(i)) * (60 if m.group(i + 1) == 'h' else 1) for i in (1, 3))
    assert 0 < low <= high
    assert not home.exists() and not (user / '.fastai').exists()   # the real fastai home was neither read nor created
    own = Path(re.search(r'under a new FASTAI_HOME, (\S+) \(removed', text).group(1))
    assert own.name.startswith('lf_dry_run_fastai_') and not own.exists()   # its own home is gone

def test_cifar_dry_run_refuses_bad_sizes(capsys):
    mod = _tool('cifar_dry_run')
    for opt, bad, msg in (('--batches', '0', 'at least 1'), ('--warmup', '-1', 'at least 0'), ('--settings', 'fast', 'invalid choice')):
        with pytest.raises(SystemExit): mod.parse_args([opt, bad])
        assert msg in capsys.readouterr().err

def test_share_torch_follows_cuda_requirements_only():
    mod = _tool('share_torch')
    assert mod.req_name('nvidia-cublas==13.1.1.3; platform_system == "Linux"') == 'nvidia-cublas'
    assert mod.req_name('Cuda_Bindings>=13') == 'cuda-bindings'
    dists = {'torch': dict(requires=['sympy>=1.13', 'nvidia-cublas==13; platform_system == "Linux"', 'triton==3.8']),
             'nvidia-cublas': dict(requires=['nvidia-nvjitlink']), 'nvidia-nvjitlink': dict(requires=[]),
             'triton': dict(requires=[]), 'sympy': dict(requires=['mpmath']), 'mpmath': dict(requires=[]),
             'nvidia-unused': dict(requires=[])}
    assert mod.to_share(dists) == ['nvidia-cublas', 'nvidia-nvjitlink', 'torch', 'triton']   # not sympy, nor what nothing needs
    assert mod.to_share(dists, roots=('torchvision',)) == []                                  # a root not installed

def test_share_torch_links_files_inside_site_packages_metadata_last(tmp_path, monkeypatch):
    mod = _tool('share_torch')
    src, dst = tmp_path/'src'/'site', tmp_path/'dst'/'site'
    for f in ['pkg/a.py', 'pkg/sub/b.so', 'pkg-1.0.dist-info/RECORD', 'pkg-1.0.dist-info/METADATA']:
        (src/f).parent.mkdir(parents=True, exist_ok=True); (src/f).write_text(f)
    (tmp_path/'src'/'bin').mkdir(); (tmp_path/'src'/'bin'/'tool').write_text('#!/src/python')
    (dst/'pkg').mkdir(parents=True); (dst/'pkg'/'a.py').write_text('mine')
    order, link = [], os.link
    monkeypatch.setattr(mod.os, 'link', lambda s, d: (order.append(Path(d).relative_to(dst).as_posix()), link(s, d)))
    files = ['pkg-1.0.dist-info/METADATA', 'pkg/a.py', '../bin/tool', 'pkg-1.0.dist-info/RECORD', 'pkg/sub/b.so', 'pkg/gone.py']
    assert mod.link_files(src, dst, files) == 3
    assert order == ['pkg/sub/b.so', 'pkg-1.0.dist-info/METADATA', 'pkg-1.0.dist-info/RECORD']   # metadata after the files
    assert (dst/'pkg'/'a.py').read_text() == 'mine'                                               # an existing file is kept
    assert os.path.samefile(src/'pkg'/'sub'/'b.so', dst/'pkg'/'sub'/'b.so')                      # a link, not a copy
    assert not (tmp_path/'dst'/'bin').exists()                                                    # nothing outside site-packages

@pytest.fixture
def venv_beside():
    "A folder beside this environment (`.venv-*`, ignored by git), where hard links into it can be made; removed after"
    import shutil, tempfile
    d = Path(tempfile.mkdtemp(prefix='.venv-share-test-', dir=Path(sys.prefix).parent))
    yield d
    shutil.rmtree(d)

def test_share_torch_into_a_new_environment(venv_beside):
    "A distribution linked into a fresh venv is installed there in pip's eyes, as the same files"
    mod = _tool('share_torch')
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv_beside/'env')], check=True)
    py = str(venv_beside/'env'/'bin'/'python')
    assert mod.share(sys.executable, py, roots=('torchvision',)) == ['torchvision']
    assert mod.share(sys.executable, py, roots=('torchvision',)) == []                # already there: nothing to do
    info = mod.env_info(py)
    assert 'torchvision' in info['dists'] and 'torch' not in info['dists']
    import torchvision
    init = Path(info['site'])/'torchvision'/'__init__.py'
    assert os.path.samefile(init, torchvision.__file__)
