"""Time the CIFAR10 comparison notebook at full size, without the network.

Writes a generated folder at CIFAR10's size (50,000 training and 10,000 test 32x32 PNGs, fastai's layout) into a new
temporary fastai home, where `untar_data(URLs.CIFAR)` finds it without downloading (a real `~/.fastai` is never read
or written), builds the notebook's DataLoaders with `cifar10_dls()` as the notebook does, times the loader alone, trains a few batches
of each setting's model plainly, with each filter and with each filter's random control (every timed batch filtered), times
a few validation batches, and prints the time per epoch of each and the estimated time of the whole comparison on
this machine.  The images are a class tint on noise: the timings mean something, the accuracies and kept shares do not.

    python tools/cifar_dry_run.py                                  # both settings, 200 timed batches each
    python tools/cifar_dry_run.py --batches 5 --out dry_run.txt   # a CPU: a few batches are minutes
"""
import argparse, os, platform, shutil, statistics, tempfile, time
from pathlib import Path
import torch, fastai
from fastdownload import FastDownload
from fastai.data.external import fastai_cfg
from fastai.callback.core import Callback, CancelFitException
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.torch_core import find_bs
from loss_filters.batch import BatchLossFilterCallback, SelectiveBackpropCallback, RandomBatchCallback
from loss_filters.core import should_select
from loss_filters.data import cifar10_dls, cifar10_setting, make_cifar_like
from loss_filters.runs import learner_score_cost, parse_method, sync_device
from loss_filters.verdicts import budget_specs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--settings', nargs='+', default=['quick', 'original'], choices=['quick', 'original', 'smoke'])
    p.add_argument('--batches', type=int, default=200, help='timed training batches of each model and method')
    p.add_argument('--warmup', type=int, default=2, help='untimed batches first (worker start-up, allocation)')
    p.add_argument('--valid_batches', type=int, default=10, help='timed validation batches of each setting')
    p.add_argument('--n_per_class', type=int, default=5000, help='training images per class (CIFAR10: 5,000)')
    p.add_argument('--n_test_per_class', type=int, default=1000, help='test images per class (CIFAR10: 1,000)')
    p.add_argument('--keep_folder', action='store_true', help='keep the generated fastai home (it is about 250 MB)')
    p.add_argument('--out', help='also write the report to this file')
    a = p.parse_args(argv)
    for k in ('batches', 'valid_batches', 'n_per_class', 'n_test_per_class'):
        if getattr(a, k) < 1: p.error(f'--{k} must be at least 1, got {getattr(a, k)}')
    if a.warmup < 0: p.error(f'--warmup must be at least 0, got {a.warmup}')
    return a


def fastai_home() -> Path:
    "A new, empty fastai home for this process: `untar_data` reads `FASTAI_HOME` when it first needs its config"
    home = Path(tempfile.mkdtemp(prefix='lf_dry_run_fastai_'))
    os.environ['FASTAI_HOME'] = str(home)
    fastai_cfg.cache_clear()
    return home


def no_download():
    "Make any download fail loudly: the dry run must find the folder, never fetch it"
    def refuse(self, url, force=False): raise RuntimeError(f'the dry run tried to download {url}')
    FastDownload.download = refuse


class BatchClock(Callback):
    "Seconds between consecutive batches' ends (loading, scoring, forward, backward, step) and the rows each trained on, then stop"
    order = 100   # after the filters and the Recorder
    def __init__(self, n:int, warmup:int): self.n, self.warmup = n, warmup
    def before_train(self): self.times, self.kept, self.bs, self.t = [], [], self.learn.dls.train.bs, time.perf_counter()
    def after_batch(self):
        sync_device(); t = time.perf_counter()
        self.times.append(t - self.t); self.kept.append(find_bs(self.learn.yb)); self.t = t
        if len(self.times) >= self.warmup + self.n: raise CancelFitException()
    @property
    def secs(self): return statistics.fmean(self.times[self.warmup:])
    @property
    def share(self): return statistics.fmean(self.kept[self.warmup:]) / self.bs


def time_method(dls, setting, cb, args):
    "Seconds per training batch and the share kept, with `cb` (or plainly) acting on every timed batch"
    clock = BatchClock(args.batches, args.warmup)
    learn = Learner(dls, setting['make_model'](), loss_func=CrossEntropyLossFlat())
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(1, setting['lr'], cbs=[clock] + ([cb] if cb else []))
    return clock.secs, clock.share


def time_valid(dls, setting, n):
    "Seconds per validation batch (loading and a no-grad forward), the first batch untimed"
    model, times = setting['make_model']().to(dls.device).eval(), []
    with torch.no_grad():
        t = time.perf_counter()
        for i, (xb, _) in enumerate(dls.valid):
            model(xb); sync_device(); times.append(time.perf_counter() - t); t = time.perf_counter()
            if i >= n: break
    return sum(times[1:]) / len(times[1:])


def time_loading(dl, n, warmup):
    "Seconds per training batch of the loader alone: reading and decoding the PNGs, item and batch transforms, no model"
    times, t = [], time.perf_counter()
    for i, _ in zip(range(warmup + n), dl):
        sync_device(); times.append(time.perf_counter() - t); t = time.perf_counter()
    return statistics.fmean(times[warmup:])


def filtered_share(cb, epochs, n_batches):
    "The share of a fit's batches that `cb`'s schedule filters"
    n = epochs * n_batches
    return sum(e >= getattr(cb, 'skip_epochs', 0) and should_select((e * n_batches + i) / n, i, cb.start, cb.end, cb.interrupt)
               for e in range(epochs) for i in range(n_batches)) / n


def dry_run(name, args, say) -> tuple:
    "Time one setting; say its table and return the whole comparison's estimated seconds: at the shares kept here, and at most"
    s = cifar10_setting(name)
    t = time.perf_counter(); dls = cifar10_dls(None, bs=s['bs']); t_dls = time.perf_counter() - t   # as the notebook: `untar_data(URLs.CIFAR)`
    nb, E, seeds = len(dls.train), s['epochs'], s['seeds']
    say(f"\n## {name}: {s['model']}, batches of {s['bs']}, {E} epochs, {seeds} seeds; device {dls.device}")
    say(f"DataLoaders from `untar_data(URLs.CIFAR)`: {len(dls.train_ds):,} training and {len(dls.valid_ds):,} validation images, "
        f"{nb} training batches an epoch, built in {t_dls:.1f} s")
    v = time_valid(dls, s, args.valid_batches) * len(dls.valid)
    load = time_loading(dls.train, args.batches, args.warmup)
    plain, _ = time_method(dls, s, None, args)
    cost = learner_score_cost(Learner(dls, s['make_model'](), loss_func=CrossEntropyLossFlat()))   # a scored example, in training steps
    epoch = lambda per_batch: nb * per_batch + v
    budgets = sum(parse_method(b)[3]['epochs'] for b in budget_specs(E, s['budgets']))   # epochs of the shorter plain schedules
    low = high = seeds * (E + budgets) * epoch(plain)
    rows = [('baseline', plain, 1., None, epoch(plain))]
    for k, cb in dict(blf=BatchLossFilterCallback(), sb=SelectiveBackpropCallback()).items():   # the notebook's filters, at their defaults
        phi = filtered_share(cb, E, nb)   # every batch is filtered here; in the notebook's fit, this share of them
        every = dict(blf=dict(skip_epochs=0), sb=dict(start=0., end=1., interrupt=0))[k]
        secs, share = time_method(dls, s, type(cb)(**every), args)
        rsecs, _ = time_method(dls, s, RandomBatchCallback(keep=max(share, 1 / s['bs'])), args)
        for m, per, most in ((k, secs, plain * (1 + cost)), (f'random at {k} share', rsecs, plain)):
            rows.append((m, per, share, phi, epoch(phi * per + (1 - phi) * plain)))
            low += seeds * E * rows[-1][-1]; high += seeds * E * epoch(phi * most + (1 - phi) * plain)   # most: the whole batch, and the scoring
    say(f"loading alone (the PNGs read, decoded, augmented; no model): {load:.2f} s a training batch; validation: {v:.0f} s an epoch "
        f"({len(dls.valid)} batches); scoring an example costs {cost:.2f} of a training step on it")
    say(f"{'method':<20} {'s/batch':>8} {'kept':>6} {'filtered':>9} {'s/epoch':>8}")
    for m, per, share, phi, ep in rows: say(f"{m:<20} {per:>8.2f} {share:>6.0%} {'-' if phi is None else f'{phi:.0%}':>9} {ep:>8.0f}")
    say(f"s/batch: a filtered batch (the plain model: every batch); kept: its share of the batch, on these generated images; "
        f"filtered: the share of the notebook's batches the method filters; s/epoch: an epoch of the notebook's fit, validation included")
    say(f"the whole comparison ({seeds} seeds: the plain model, 2 filters, their random controls, {len(budget_specs(E, s['budgets']))} "
        f"shorter plain schedules): {_h(low)} at the shares kept here, at most {_h(high)} (every filtered batch trained whole, and scored)")
    return low, high


def _h(secs): return f"{secs / 3600:.1f} h" if secs >= 5400 else f"{secs / 60:.0f} min"


def main(argv=None):
    args = parse_args(argv)
    home = fastai_home(); no_download()
    lines, t0 = [], time.perf_counter()
    def say(s=''): print(s, flush=True); lines.append(s)
    try:
        say(f"# CIFAR10 dry run: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, fastai {fastai.__version__}; {args.batches} timed batches after {args.warmup} untimed")
        t = time.perf_counter()
        make_cifar_like(home / 'data' / 'cifar10', n_per_class=args.n_per_class, n_test_per_class=args.n_test_per_class)
        say(f"wrote {10 * args.n_per_class:,} + {10 * args.n_test_per_class:,} generated PNGs in {time.perf_counter() - t:.0f} s, "
            f"under a new FASTAI_HOME, {home} (removed at the end)")
        for name in args.settings: dry_run(name, args, say)
        say(f"\nthe dry run took {(time.perf_counter() - t0) / 60:.1f} min")
    finally:
        if not args.keep_folder: shutil.rmtree(home, ignore_errors=True)
    if args.out: Path(args.out).write_text('\n'.join(lines) + '\n')


if __name__ == '__main__': main()
