"Data loading: idx files, finding Fashion-MNIST, batches cut from tensors, digits, and the CIFAR10 folder layout."
import gzip
import numpy as np, pytest, torch
from fastai.basics import Learner, CrossEntropyLossFlat, accuracy, set_seed
import fastai.callback.all  # patches fit_one_cycle, no_bar
import loss_filters.data as lfd
from loss_filters.data import (read_idx, write_idx, IdxFormatError, find_fashion_mnist, FASHION_FILES, tensor_dls, TensorDL,
                               digits_dls, load_dls, fashion_mnist_dls, make_cifar_like, cifar10_dls, simple_cnn)

# ------------------------------------------------------------------ idx files
@pytest.mark.parametrize('name', ['a.idx', 'a.idx.gz'])
@pytest.mark.parametrize('arr', [np.arange(7, dtype=np.uint8), np.arange(60, dtype=np.uint8).reshape(3, 4, 5),
                                 np.arange(-6, 6, dtype=np.int32).reshape(3, 4), np.linspace(0, 1, 5).astype(np.float32)])
def test_idx_round_trip(tmp_path, name, arr):
    write_idx(tmp_path / name, arr)
    out = read_idx(tmp_path / name)
    assert out.shape == arr.shape and np.array_equal(out, arr)

def test_write_idx_refuses_types_it_cannot_store(tmp_path):
    with pytest.raises(ValueError, match='no type for int64'): write_idx(tmp_path / 'x.idx', np.arange(3))

def test_truncated_file_names_the_file(tmp_path):
    write_idx(tmp_path / 'imgs.idx', np.zeros((4, 28, 28), np.uint8))
    data = (tmp_path / 'imgs.idx').read_bytes()
    (tmp_path / 'cut.idx').write_bytes(data[:-100])
    with pytest.raises(IdxFormatError, match=r'cut\.idx: truncated or corrupt.*\(4, 28, 28\)'): read_idx(tmp_path / 'cut.idx')
    (tmp_path / 'head.idx').write_bytes(data[:9])
    with pytest.raises(IdxFormatError, match=r'head\.idx: truncated header'): read_idx(tmp_path / 'head.idx')

def test_bad_magic_names_the_file(tmp_path):
    (tmp_path / 'x.idx').write_bytes(b'\x89PNG\r\n\x1a\n' + bytes(20))
    with pytest.raises(IdxFormatError, match=r'x\.idx: not an idx file \(magic number 89504e47\)'): read_idx(tmp_path / 'x.idx')
    (tmp_path / 'empty.idx').write_bytes(b'')
    with pytest.raises(IdxFormatError, match='empty.idx: not an idx file'): read_idx(tmp_path / 'empty.idx')

def test_corrupt_gzip_names_the_file(tmp_path):
    write_idx(tmp_path / 'l.gz', np.arange(1000, dtype=np.uint8))
    data = (tmp_path / 'l.gz').read_bytes()
    (tmp_path / 'cut.gz').write_bytes(data[:len(data) // 2])
    with pytest.raises(IdxFormatError, match=r'cut\.gz: cannot be read'): read_idx(tmp_path / 'cut.gz')
    (tmp_path / 'junk.gz').write_bytes(b'not gzip at all')
    with pytest.raises(IdxFormatError, match=r'junk\.gz: cannot be read'): read_idx(tmp_path / 'junk.gz')

# ------------------------------------------------------------------ finding Fashion-MNIST
def _fake_fashion(d, n=20, nv=10, seed=0):
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    write_idx(d / FASHION_FILES['x_train'], rng.integers(0, 256, (n, 28, 28)).astype(np.uint8))
    write_idx(d / FASHION_FILES['y_train'], (np.arange(n) % 10).astype(np.uint8))
    write_idx(d / FASHION_FILES['x_valid'], rng.integers(0, 256, (nv, 28, 28)).astype(np.uint8))
    write_idx(d / FASHION_FILES['y_valid'], (np.arange(nv) % 10).astype(np.uint8))
    return d

@pytest.fixture
def places(tmp_path, monkeypatch):
    "Every place Fashion-MNIST may be, redirected into tmp_path, with the network switched off"
    monkeypatch.setattr(lfd, 'DEBIAN_FASHION', tmp_path / 'debian')
    monkeypatch.setattr(lfd, 'fastai_data_dir', lambda: tmp_path / 'fastai')
    def no_network(*a, **k): raise OSError('network unreachable (test)')
    monkeypatch.setattr(lfd, 'download_fashion_mnist', no_network)
    monkeypatch.delenv('LF_FASHION_MNIST', raising=False)
    return tmp_path

def test_search_order(places, monkeypatch):
    explicit, env, debian, fastai = (_fake_fashion(places / n) for n in ('explicit', 'env', 'debian', 'fastai/fashion-mnist'))
    monkeypatch.setenv('LF_FASHION_MNIST', str(env))
    assert find_fashion_mnist(explicit) == explicit
    assert find_fashion_mnist() == env
    monkeypatch.delenv('LF_FASHION_MNIST')
    assert find_fashion_mnist() == debian
    import shutil; shutil.rmtree(debian)
    assert find_fashion_mnist() == fastai

def test_named_folder_without_files_is_an_error(places, monkeypatch):
    _fake_fashion(places / 'debian')
    with pytest.raises(FileNotFoundError, match='`path` is .*nowhere'): find_fashion_mnist(places / 'nowhere')
    monkeypatch.setenv('LF_FASHION_MNIST', str(places / 'nowhere'))
    with pytest.raises(FileNotFoundError, match='LF_FASHION_MNIST is'): find_fashion_mnist()

def test_not_found_lists_every_place(places):
    with pytest.raises(FileNotFoundError) as e: find_fashion_mnist()
    msg = str(e.value)
    for part in ("Debian's dataset-fashion-mnist", "fastai's data folder", 'download from', 'network unreachable',
                 'dataset-fashion-mnist', 'LF_FASHION_MNIST'): assert part in msg

def test_auto_falls_back_to_digits_and_says_so(places):
    with pytest.warns(UserWarning, match='Falling back to scikit-learn'): dls, name = load_dls('auto')
    assert name == 'digits' and dls.one_batch()[0].shape[1:] == (1, 8, 8)
    with pytest.raises(FileNotFoundError): load_dls('fashion_mnist')
    with pytest.raises(ValueError, match='`data`'): load_dls('mnist')

def test_fashion_mnist_dls_from_a_folder(places):
    d = _fake_fashion(places / 'fm', n=40, nv=12)
    dls = fashion_mnist_dls(d, bs=8, device='cpu')
    xb, yb = dls.one_batch()
    assert xb.shape == (8, 1, 28, 28) and xb.dtype == torch.float32 and yb.dtype == torch.int64
    assert len(dls.train) == 5 and len(dls.valid_ds) == 12 and dls.c == 10
    x = torch.cat([b[0] for b in dls.train]); assert abs(x.mean()) < .1 and abs(x.std() - 1) < .1

# ------------------------------------------------------------------ batches cut from tensors
def test_batches_follow_get_idxs_and_stay_aligned():
    n = 50
    x, y = torch.arange(n, dtype=torch.float32)[:, None] * 10, torch.arange(n)
    dls = tensor_dls(x, y, x[:7], y[:7], bs=8, device='cpu')
    seen = []
    for xb, yb in dls.train:
        assert len(yb) == 8 and torch.equal(xb[:, 0], yb.float() * 10)
        seen += yb.tolist()
    assert len(seen) == 48 and len(set(seen)) == 48                     # shuffled, the partial batch dropped
    assert [len(b[1]) for b in dls.valid] == [7]                         # validation keeps everything, in order
    order = list(range(n))[::-1][:20]
    dls.train.get_idxs = lambda: order                                   # a callback may set the order
    assert torch.cat([yb for _, yb in dls.train]).tolist() == order[:16]

def test_learner_fits_exports_and_predicts_on_digits(tmp_path):
    set_seed(0)
    dls = digits_dls(bs=64, device='cpu')
    learn = Learner(dls, simple_cnn(widths=(16, 32)), loss_func=CrossEntropyLossFlat(), metrics=accuracy, path=tmp_path)
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(2, 1e-2)
    assert learn.recorder.values[-1][-1] > .5                            # well above chance (0.1)
    preds, targs = learn.get_preds()
    assert preds.shape == (len(dls.valid_ds), 10)
    learn.export(tmp_path / 'e.pkl')
    assert (tmp_path / 'e.pkl').stat().st_size > 0

@pytest.mark.skipif(not lfd.DEBIAN_FASHION.exists(), reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_subset():
    dls = fashion_mnist_dls(lfd.DEBIAN_FASHION, bs=128, n_train=2048, n_valid=512, device='cpu')
    assert len(dls.train_ds) == 2048 and len(dls.valid_ds) == 512
    xb, yb = dls.one_batch()
    assert xb.shape == (128, 1, 28, 28) and set(yb.tolist()) <= set(range(10)) and len(set(yb.tolist())) > 5

# ------------------------------------------------------------------ CIFAR10 layout
def test_cifar_like_folder_and_dls(tmp_path):
    p = make_cifar_like(tmp_path / 'cifar', n_per_class=3)
    assert len(list(p.glob('train/*/*.png'))) == 30 and len(list(p.glob('test/*/*.png'))) == 30
    dls = cifar10_dls(p, bs=6, num_workers=0, device='cpu')
    xb, yb = dls.one_batch()
    assert xb.shape == (6, 3, 32, 32) and len(dls.vocab) == 10 and abs(float(xb.mean())) < 3

def test_cifar_bad_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match='is not a CIFAR10 folder'): cifar10_dls(tmp_path, num_workers=0)
    (tmp_path / 'train' / 'cat').mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r'expected PNG files in .*train'): cifar10_dls(tmp_path, num_workers=0)

# ------------------------------------------------------------------ label noise
def test_noisy_labels_change_exactly_the_share_to_a_wrong_class():
    y = torch.arange(1000) % 10
    for share in (0., .1, .37):
        z = lfd.noisy_labels(y, share, c=10, seed=3)
        changed = z != y
        assert changed.sum() == round(share * 1000) and z.min() >= 0 and z.max() <= 9
        assert torch.equal(z, lfd.noisy_labels(y, share, c=10, seed=3))   # the same seed, the same labels
    assert not torch.equal(lfd.noisy_labels(y, .2, 10, seed=0), lfd.noisy_labels(y, .2, 10, seed=1))
    assert torch.equal(y, torch.arange(1000) % 10)   # the input is not changed
    for bad in (-.1, 1., 1.5):
        with pytest.raises(ValueError, match=r'`label_noise` must be in \[0, 1\)'): lfd.noisy_labels(y, bad)

def test_label_noise_reaches_training_labels_only():
    clean, noisy = digits_dls(seed=1), digits_dls(seed=1, label_noise=.25)
    yt, yn = clean.train_ds.tensors[1], noisy.train_ds.tensors[1]
    assert (yt != yn).float().mean().item() == pytest.approx(.25, abs=1 / len(yt))
    assert torch.equal(clean.valid_ds.tensors[1], noisy.valid_ds.tensors[1])
    assert torch.equal(clean.train_ds.tensors[0], noisy.train_ds.tensors[0])

def test_the_digits_loaders_predict_and_show_results():
    import matplotlib; matplotlib.use('Agg')
    from fastai.basics import Learner, CrossEntropyLossFlat
    from fastai.callback.progress import ProgressCallback
    from loss_filters.models import simple_cnn
    dls = digits_dls()
    learn = Learner(dls, simple_cnn(), loss_func=CrossEntropyLossFlat())
    x, y = dls.valid_ds[0]
    with learn.no_bar():
        dec, idx, probs = learn.predict(x)
        assert probs.shape == (10,) and int(idx) == int(probs.argmax()) == int(dec)
        assert len(learn.get_preds(dl=dls.test_dl([dls.valid_ds[i][0] for i in range(5)]))[0]) == 5
        learn.show_results(max_n=4)
    import matplotlib.pyplot as plt
    assert [a.get_title().count('/') for a in plt.gcf().axes[:4]] == [1] * 4

# ------------------------------------------------------------------ bad sizes: refused before any data is read
@pytest.mark.parametrize('kw,err,msg', [
    (dict(n_valid=0), ValueError, '`n_valid` must be an integer >= 1, or None for every validation image; got 0'),
    (dict(n_train=-5), ValueError, '`n_train` must be an integer >= 1, or None for every training image; got -5'),
    (dict(n_train=2.5), TypeError, '`n_train` must be an integer >= 1'),
    (dict(n_valid=True), TypeError, '`n_valid` must be an integer >= 1'),
    (dict(bs=0), ValueError, '`bs` must be an integer >= 1, got 0'),
    (dict(bs=32.), TypeError, '`bs` must be an integer >= 1'),
    (dict(label_noise=1.), ValueError, r'`label_noise` must be in \[0, 1\)')])
def test_fashion_mnist_dls_refuses_bad_sizes_before_looking_for_files(places, kw, err, msg):
    with pytest.raises(err, match=msg): fashion_mnist_dls(places / 'nowhere', **kw)            # not FileNotFoundError: checked first
    with pytest.raises(err, match=msg): load_dls('auto', **kw)                                 # and no fallback to digits
    with pytest.raises(err, match=msg): digits_dls(**kw)

def test_small_subsets_still_work(places):
    d = _fake_fashion(places / 'fm', n=40, nv=12)
    dls = fashion_mnist_dls(d, bs=8, n_train=16, n_valid=1, device='cpu')
    assert len(dls.train_ds) == 16 and len(dls.valid_ds) == 1 and len(dls.train) == 2

@pytest.mark.parametrize('valid_pct,msg', [(0., r'`valid_pct` must be in \(0, 1\)'), (1., r'`valid_pct` must be in \(0, 1\)'),
                                           (.9999, r'`valid_pct=0.9999` leaves no training image of the 1797')])
def test_digits_refuses_a_split_with_an_empty_side(valid_pct, msg):
    with pytest.raises(ValueError, match=msg): digits_dls(valid_pct=valid_pct)

def test_tensor_dls_refuses_empty_or_ragged_splits():
    x, y = torch.zeros(8, 2), torch.zeros(8, dtype=torch.long)
    with pytest.raises(ValueError, match='`x_valid` and `y_valid` are empty'): tensor_dls(x, y, x[:0], y[:0], device='cpu')
    with pytest.raises(ValueError, match='`x_train` has 8 rows and `y_train` 7'): tensor_dls(x, y[:7], x, y, device='cpu')
    with pytest.raises(ValueError, match='`bs`'): tensor_dls(x, y, x, y, bs=0, device='cpu')
    with pytest.raises(ValueError, match='`val_bs`'): tensor_dls(x, y, x, y, val_bs=0, device='cpu')

def test_cifar_refuses_a_bad_batch_size_before_downloading(tmp_path):
    with pytest.raises(ValueError, match='`bs` must be an integer >= 1'): cifar10_dls(tmp_path / 'nowhere', bs=0)

def test_confusable_noise_changes_labels_only_within_their_group():
    import torch
    from loss_filters.data import noisy_labels, CONFUSABLE, digits_dls
    y = torch.arange(10).repeat(200)
    z = noisy_labels(y, .4, 10, seed=1, among=CONFUSABLE['fashion_mnist'])
    changed = z != y
    assert set(y[changed].tolist()) == set(z[changed].tolist()) == {0, 2, 6}   # from and to the group only, never a label kept by mistake
    assert int(changed.sum()) == round(.4 * 600)
    noisy, clean = digits_dls(label_noise=.4, confusable=True, seed=0), digits_dls(seed=0)
    ch = noisy.train.dataset.tensors[1] != clean.train.dataset.tensors[1]
    assert ch.any() and set(clean.train.dataset.tensors[1][ch].tolist()) <= {3, 5, 8}
    assert torch.equal(noisy.valid.dataset.tensors[1], clean.valid.dataset.tensors[1])   # validation stays clean

def test_lf_bench_refuses_confusable_without_label_noise(tmp_path):
    import pytest
    from loss_filters.bench import lf_bench
    with pytest.raises(ValueError, match='`confusable` says which labels `label_noise` changes'):
        lf_bench(data='digits', preset='quick', confusable=True, label_noise=0., out=str(tmp_path))
