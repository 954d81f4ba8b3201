"""Where does the plain baseline stop gaining from longer schedules?

Trains the plain bench model with `fit_one_cycle` at several lengths and seeds and appends one JSON line per fit to
`--out`; `--plot` draws final accuracy against epochs from such files.  Accuracy does not depend on machine load, so
several of these can run side by side (`--threads 1`).

    python tools/plateau.py --n_train 5000 --epochs 10 20 30 45 --seeds 0 1 --lr 3e-3 --augment --out bench_out/plateau.jsonl
    python tools/plateau.py --plot bench_out/plateau.jsonl --png nbs/images/bench_preset_plateau.png
"""
import argparse, json, statistics, time
from collections import defaultdict
from pathlib import Path


def fit(args, epochs, seed):
    import torch
    from loss_filters.bench import run_method
    from loss_filters.data import load_dls, CropFlip
    dls, name = load_dls(args.data, bs=args.bs, n_train=args.n_train or None, n_valid=args.n_valid or None, seed=seed)
    if args.augment: dls.train.after_batch = CropFlip(pad=2)
    t = time.perf_counter()
    r = run_method(dls, 'baseline', epochs=epochs, lr=args.lr, seed=seed, model=args.model, show_progress=False)
    return dict(data=name, model=args.model, n_train=len(dls.train_ds), bs=args.bs, augment=args.augment, lr=args.lr,
                epochs=epochs, seed=seed, final_metric=r['final_metric'], wall_s=time.perf_counter() - t,
                threads=torch.get_num_threads())


def key(r): return (r['data'], r['model'], r['n_train'], r['bs'], r['augment'], r['lr'])


def plateau(rows, gain=.0015, more=1.5):
    "Per setting: mean final accuracy per length, and the plateau: the shortest length after which no schedule gains `gain`"
    out = {}
    for k, rs in group(rows).items():
        acc = {e: statistics.fmean(r['final_metric'] for r in v) for e, v in sorted(rs.items())}
        es = sorted(acc)   # flat from the shortest length that no longer one beats by `gain`, with one at least `more`x as long
        flat = next((e for e in es if es[-1] >= more * e - 1e-9 and max(acc[f] for f in es if f >= e) - acc[e] < gain), None)
        out[k] = (acc, flat)
    return out


def group(rows):
    g = defaultdict(lambda: defaultdict(list))
    for r in rows: g[key(r)][r['epochs']].append(r)
    return g


def plot(files, png):
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from loss_filters.compare import read_runs   # gzipped or not, lines saved under the earlier names (`final_accuracy`) read as today's
    rows = [r for f in files for r in read_runs(f)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    mean_range = lambda rs: (statistics.fmean(r['final_metric'] for r in rs),
                             (max(r['final_metric'] for r in rs) - min(r['final_metric'] for r in rs)) / 2)
    for k, rs in sorted(group(rows).items(), key=lambda kv: kv[0][5]):
        if len(rs) < 2: continue   # a single length is a point of the learning-rate sweep
        es = sorted(rs)
        m, e = zip(*(mean_range(rs[x]) for x in es))
        lab = f"{k[1]}, {k[2]} images, lr {k[5]:g}{', augmented' if k[4] else ''}"
        ax.errorbar(es, m, yerr=e, marker='o', capsize=3, label=lab)
    ax.set_xlabel('epochs of fit_one_cycle'); ax.set_ylabel('final validation accuracy (mean; bars: range over seeds)')
    ax.set_title('schedule length'); ax.grid(alpha=.3); ax.legend(fontsize=8)
    by_len = defaultdict(lambda: defaultdict(list))
    for r in rows: by_len[(r['data'], r['model'], r['n_train'], r['bs'], r['augment'], r['epochs'])][r['lr']].append(r)
    for k, rs in sorted(by_len.items(), key=lambda kv: kv[0][5]):
        if len(rs) < 2: continue   # one rate is no sweep
        lrs = sorted(rs)
        m, e = zip(*(mean_range(rs[x]) for x in lrs))
        ax2.errorbar(lrs, m, yerr=e, marker='o', capsize=3, label=f"{k[5]} epochs, {k[2]} images{', augmented' if k[4] else ''}")
    ax2.set_xscale('log', base=2); ax2.set_xlabel('maximum learning rate of fit_one_cycle')
    ax2.set_title('learning rate'); ax2.grid(alpha=.3); ax2.legend(fontsize=8)
    fig.tight_layout(); fig.savefig(png, dpi=100)
    for k, (acc, flat) in plateau(rows).items(): print(k, {e: round(a, 4) for e, a in acc.items()}, 'plateau from', flat)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--data', default='fashion_mnist'); p.add_argument('--model', default='cnn')
    p.add_argument('--n_train', type=int, default=5000); p.add_argument('--n_valid', type=int, default=5000)
    p.add_argument('--bs', type=int, default=128); p.add_argument('--lr', type=float, default=3e-3)
    p.add_argument('--augment', action='store_true'); p.add_argument('--epochs', type=int, nargs='*', default=[10, 20, 30])
    p.add_argument('--seeds', type=int, nargs='*', default=[0, 1]); p.add_argument('--threads', type=int, default=0)
    p.add_argument('--out', default='bench_out/plateau.jsonl')
    p.add_argument('--plot', nargs='*'); p.add_argument('--png', default='bench_out/plateau.png')
    a = p.parse_args()
    if a.plot: return plot(a.plot, a.png)
    import torch
    if a.threads: torch.set_num_threads(a.threads)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for s in a.seeds:
        for e in a.epochs:
            r = fit(a, e, s)
            print(json.dumps(r), flush=True)
            with open(a.out, 'a') as f: f.write(json.dumps(r) + '\n')


if __name__ == '__main__': main()
