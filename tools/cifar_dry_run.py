"""Time the CIFAR10 comparison notebook at full size, without the network.

Writes a generated folder at CIFAR10's size (50,000 training and 10,000 test 32x32 PNGs, fastai's layout) into a new
temporary fastai home, where `untar_data(URLs.CIFAR)` finds it without downloading (a real `~/.fastai` is never read
or written), builds the notebook's DataLoaders with `cifar10_dls()` as the notebook does, times the loader alone, trains a few batches
of each setting's model plainly, with each filter and with each filter's random control (every timed batch filtered), times
a few validation batches, and prints the time per epoch of each and the estimated time of the whole comparison on
this machine.  The images are a class tint on noise: the timings mean something, the accuracies and kept shares do not.

    python tools/cifar_dry_run.py                                  # both settings, up to 200 timed batches (one epoch)
    python tools/cifar_dry_run.py --batches 5 --out dry_run.txt   # a CPU: a few batches are minutes
"""
import argparse, itertools, os, platform, shutil, statistics, tempfile, time
from pathlib import Path
import torch, fastai
from fastdownload import FastDownload
from fastai.data.external import fastai_cfg
from fastai.callback.core import Callback, CancelFitException
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.torch_core import find_bs
from loss_filters.batch import RandomBatchCallback
from loss_filters.core import should_select
from loss_filters.data import cifar10_dls, cifar10_setting, make_cifar_like
from loss_filters.costs import learner_score_cost
from loss_filters.runs import parse_method, sync_device
from loss_filters.plan import budget_specs


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--settings', nargs='+', default=['quick', 'original'], choices=['quick', 'original', 'smoke'])
    p.add_argument('--batches', type=int, default=200, help='timed training batches of each model and method')
    p.add_argument('--warmup', type=int, default=2, help='untimed batches first (worker start-up, allocation)')
    p.add_argument('--valid_batches', type=int, default=10, help='timed validation batches of each setting')
    p.add_argument('--n_per_class', type=int, default=5000, help='training images per class (CIFAR10: 5,000)')
    p.add_argument('--n_test_per_class', type=int, default=1000, help='test images per class (CIFAR10: 1,000)')
    p.add_argument('--keep_folder', action='store_true', help='keep the generated fastai home (60,000 small PNGs) and say where')
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
    "Seconds between consecutive training batches' ends (loading, scoring, forward, backward, step) and the rows each trained on, then stop"
    order, run_valid = 100, False   # after the filters and the Recorder; training batches only
    def __init__(self, n:int, warmup:int): self.n, self.warmup = n, warmup
    def before_train(self): self.times, self.kept, self.bs, self.t = [], [], self.learn.dls.train.bs, time.perf_counter()
    def after_batch(self):
        sync_device(); t = time.perf_counter()
        self.times.append(t - self.t); self.kept.append(find_bs(self.learn.yb)); self.t = t
        if len(self.times) >= self.warmup + self.n: raise CancelFitException()   # `dry_run` asks for no more than an epoch has
    @property
    def secs(self): return statistics.fmean(self.times[self.warmup:])
    @property
    def share(self): return statistics.fmean(self.kept[self.warmup:]) / self.bs


def time_method(dls, setting, cb, n, warmup):
    "Seconds per training batch and the share kept, with `cb` (or plainly) acting on every timed batch"
    clock = BatchClock(n, warmup)
    learn = Learner(dls, setting['make_model'](), loss_func=CrossEntropyLossFlat())
    with learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(1, setting['lr'], cbs=[clock] + ([cb] if cb else []))
    return clock.secs, clock.share


def time_loader(dl, n, warmup=1, model=None) -> tuple:
    "Seconds to the first batch (the workers' start, paid every epoch) and per later batch of `dl` alone, or through `model` without gradients"
    times, t = [], time.perf_counter()
    with torch.no_grad():
        for xb, *_ in itertools.islice(dl, warmup + n):
            if model is not None: model(xb)
            sync_device(); times.append(time.perf_counter() - t); t = time.perf_counter()
    return times[0], statistics.fmean(times[warmup:])


def filtered_share(cb, epochs, n_batches):
    "The share of a fit's batches that `cb`'s schedule filters: its epochs after `skip_epochs`, in its `start`-`end` window, but every `interrupt`-th"
    n = epochs * n_batches
    return sum(e >= getattr(cb, 'skip_epochs', 0) and should_select((e * n_batches + i) / n, i, cb.start, cb.end, cb.interrupt)
               for e in range(epochs) for i in range(n_batches)) / n


def callback(spec:str, **every):
    "The callback `compare_filters` builds for `spec`, with the settings in `every` changed"
    m = parse_method(spec)
    return m.cls(**{**m.kw, **every})


def dry_run(name, args, say) -> tuple:
    "Time one setting; say its table and return the whole comparison's estimated seconds: at the shares kept here, and at most"
    s = cifar10_setting(name)
    t = time.perf_counter(); dls = cifar10_dls(None, bs=s['bs']); t_dls = time.perf_counter() - t   # as the notebook: `untar_data(URLs.CIFAR)`
    nb, E, seeds = len(dls.train), s['epochs'], s['seeds']
    n, nv = min(args.batches, nb - args.warmup), min(args.valid_batches, len(dls.valid) - 1)   # within one epoch
    if n < 1 or nv < 1: raise ValueError(f"{nb} training and {len(dls.valid)} validation batches of {s['bs']}: too few to time "
                                          f"after {args.warmup} untimed (raise --n_per_class or --n_test_per_class, or lower --warmup)")
    say(f"\n## {name}: {s['model']}, batches of {s['bs']}, {E} epochs, {seeds} seeds; device {dls.device}")
    say(f"DataLoaders from `untar_data(URLs.CIFAR)`: {len(dls.train_ds):,} training and {len(dls.valid_ds):,} validation images, "
        f"{nb} training batches an epoch, built in {t_dls:.1f} s; {n} training batches timed after {args.warmup}, {nv} validation batches")
    start_v, per_v = time_loader(dls.valid, nv, model=s['make_model']().to(dls.device).eval())
    start_t, load = time_loader(dls.train, n, max(args.warmup, 1))
    v = start_v + per_v * (len(dls.valid) - 1) + start_t   # validation, and the training loader's start: every epoch pays both
    plain, _ = time_method(dls, s, None, n, args.warmup)
    cost = learner_score_cost(Learner(dls, s['make_model'](), loss_func=CrossEntropyLossFlat()), n=min(10, n))   # a scored example, in steps
    epoch = lambda per_batch: nb * per_batch + v
    budgets = sum(parse_method(b)[3]['epochs'] for b in budget_specs(E, s['budgets']))   # epochs of the shorter plain schedules
    low = high = seeds * (E + budgets) * epoch(plain)
    rows = [('baseline', plain, 1., None, epoch(plain))]
    for k, every in dict(blf=dict(skip_epochs=0), sb=dict(start=0., end=1., interrupt=0)).items():   # the notebook's filters, on every batch
        phi = filtered_share(callback(k), E, nb)   # the share of the notebook's batches the filter acts on, at its defaults
        secs, share = time_method(dls, s, callback(k, **every), n, args.warmup)
        rsecs, _ = time_method(dls, s, RandomBatchCallback(keep=max(share, 2 / s['bs'])), n, args.warmup)   # it scores too
        for m, per in ((k, secs), (f'random at {k} share', rsecs)):
            rows.append((m, per, share, phi, epoch(phi * per + (1 - phi) * plain)))
            low += seeds * E * rows[-1][-1]
            high += seeds * E * epoch(phi * max(per, plain * (1 + cost)) + (1 - phi) * plain)   # at most: the whole batch trained, and scored
    say(f"loading alone (the PNGs read, decoded, augmented; no model): {load:.2f} s a training batch; an epoch's loaders start in "
        f"{start_t + start_v:.1f} s; validation: {v - start_t:.0f} s an epoch; scoring an example costs {cost:.2f} of a training step")
    say(f"{'method':<20} {'s/batch':>8} {'kept':>6} {'filtered':>9} {'s/epoch':>8}")
    for m, per, share, phi, ep in rows: say(f"{m:<20} {per:>8.2f} {share:>6.0%} {'-' if phi is None else f'{phi:.0%}':>9} {ep:>8.0f}")
    say(f"s/batch: a filtered batch (the plain model: every batch); kept: its share of the batch, on these generated images; "
        f"filtered: the share of the notebook's batches the method filters; s/epoch: an epoch of the notebook's fit, validation included")
    say(f"the whole comparison ({seeds} seeds: the plain model, 2 filters, their random controls, {len(budget_specs(E, s['budgets']))} "
        f"shorter plain schedules): {hours(low)} at the shares kept here, at most {hours(high)} (every filtered batch trained whole, and scored)")
    return low, high


def hours(secs:float) -> str: return f"{secs / 3600:.1f} h" if secs >= 3600 else f"{secs / 60:.1f} min"


def main(argv=None):
    args = parse_args(argv)
    home = fastai_home(); no_download()
    lines, t0 = [], time.perf_counter()
    def say(s=''): print(s, flush=True); lines.append(s)
    try:
        say(f"# CIFAR10 dry run: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
            f"torch {torch.__version__}, fastai {fastai.__version__}; up to {args.batches} timed batches after {args.warmup} untimed")
        t = time.perf_counter()
        make_cifar_like(home / 'data' / 'cifar10', n_per_class=args.n_per_class, n_test_per_class=args.n_test_per_class)
        say(f"wrote {10 * args.n_per_class:,} + {10 * args.n_test_per_class:,} generated PNGs in {time.perf_counter() - t:.0f} s, "
            f"under a new FASTAI_HOME, {home}" + ('' if args.keep_folder else ' (removed at the end)'))
        for name in args.settings: dry_run(name, args, say)
        say(f"\nthe dry run took {(time.perf_counter() - t0) / 60:.1f} min")
    finally:   # what was measured is written even when a later setting fails
        if not args.keep_folder: shutil.rmtree(home, ignore_errors=True)
        if args.out: Path(args.out).write_text('\n'.join(lines) + '\n')


if __name__ == '__main__': main()
