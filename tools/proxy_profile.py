"""Where a proxy's time goes: the pieces of one filtered step (`profile_step`), and whole one-epoch fits side by side.

For the bench CNN and the MLP, each scored by a quarter-width proxy of either family, and scored by the model itself:
`profile_step` times the pieces of one batch, each repeated (the fastest of five rounds, in a warm loop), the proxy's scoring
forward and its learning of the kept rows (forward, backward, optimizer step) among them. Then one-epoch fits of the plain
model, a random half of each batch and the proxies' top halves, interleaved, the fastest of `--rounds` each, give what the
same work costs inside a fit, where the model's own step runs between the proxy's pieces. Writes a JSON file:

    OMP_NUM_THREADS=1 python tools/proxy_profile.py --out nbs/bench_runs/proxy_profile.json
"""
import argparse, json, math, warnings
import torch
from loss_filters.bench import BenchLearners
from loss_filters.compare import machine_info
from loss_filters.profiler import profile_step, profile_line
from loss_filters.runs import run_fit

STEPS = [('cnn', 'mlp', 'topk:proxy=.25'), ('cnn', 'cnn', 'topk:proxy=.25'), ('cnn', None, 'topk'),
         ('mlp', 'mlp', 'topk:proxy=.25'), ('mlp', None, 'topk')]
FITS = [('baseline', None), ('random_batch:keep=.5', None), ('topk:proxy=.25', 'mlp'), ('topk:proxy=.25', 'cnn')]

def learners(model, proxy_model, n_train): return BenchLearners('fashion_mnist', 256, n_train, 2000, 0, model=model, proxy_model=proxy_model)

def steps(n_train:int, n:int) -> dict:
    "`profile_step` of each setting of `STEPS`, by name"
    res = {}
    for model, pm, spec in STEPS:
        p = profile_step(learners(model, None, n_train).dls, spec, n=n, model=model, proxy_model=pm)
        res[f"{model} {spec}" + (f" ({pm} proxy)" if pm else '')] = dict(model=model, proxy_model=pm, spec=spec, **p)
        print(profile_line(spec, p), flush=True)
    return res

def fits(n_train:int, rounds:int) -> dict:
    "Training seconds of one-epoch fits of the bench CNN, `FITS` in turn, `rounds` times (after one round not kept): the fastest of each"
    bls = {pm: learners('cnn', pm, n_train) for _, pm in FITS}
    secs = {f"{s} ({pm} proxy)" if pm else s: [] for s, pm in FITS}
    for r in range(rounds + 1):
        for (s, pm), k in zip(FITS, secs):
            t = run_fit(bls[pm], s, epochs=1, make_proxy=bls[pm].proxy)['train_s']
            if r: secs[k].append(t)
    plain = min(secs['baseline'])
    return {k: dict(seconds=min(v), share=min(v) / plain, all=v) for k, v in secs.items()}

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--n_train', type=int, default=30_000); p.add_argument('--n', type=int, default=30)
    p.add_argument('--rounds', type=int, default=3); p.add_argument('--out', default='proxy_profile.json')
    a = p.parse_args()
    warnings.simplefilter('ignore')   # a dependency's import warnings
    res = dict(steps=steps(a.n_train, a.n), fits=fits(a.n_train, a.rounds), threads=torch.get_num_threads(),
               n_train=a.n_train, bs=256, machine=machine_info())
    for k, v in res['fits'].items(): print(f"{k:36s} {v['seconds']:.3f} s  {v['share']:.3f} of plain")
    json.dump(res, open(a.out, 'w'), indent=1)
