"""One rank of a filtered fit under fastai's distributed data parallel training, on the CPU (gloo).

`test_distributed.py` starts it in 2 processes with `torch.multiprocessing`; it also runs under
`torchrun --nproc_per_node 2 tests/ddp_worker.py OUT_DIR`. Each rank fits a small model with BatchNorm on scikit-learn's
digits with every filter in turn and saves what the test compares to `OUT_DIR/rank{rank}.pt`. `SyncBatchNorm` runs on
CUDA only, so the fits here keep the model's own BatchNorm (`sync_bn=False`); DDP still wraps the model and broadcasts
rank 0's norm statistics at every forward pass.
"""
import os, sys
from pathlib import Path
import torch, torch.distributed as dist

METHODS = ('blf', 'sb', 'stale')

def _cpu_broadcast(self, t, rank):
    "fastai's `DistributedDL` broadcasts its index list as a CUDA tensor (NCCL); gloo works on CPU tensors"
    t = torch.tensor(t, dtype=torch.long)
    dist.broadcast(t, rank)
    return t.tolist()

def digits_items():
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.
    return list(zip((x - x.mean()) / x.std(), torch.tensor(d.target)))

def digits_dls(bs=64):
    from fastai.basics import DataLoaders
    from conftest import ItemList
    items = digits_items()
    return DataLoaders.from_dsets(ItemList(items[:1200]), ItemList(items[1200:]), bs=bs, device='cpu', num_workers=0)

def sorted_dls(bs=64):
    "The digits in a `SortedDL`, as text batches come: it orders its own batches"
    from fastai.basics import DataLoaders, DataLoader
    from fastai.text.data import SortedDL
    from conftest import ItemList
    items = digits_items()
    train = SortedDL(ItemList(items[:1200]), res=[i % 7 for i in range(1200)], bs=bs, shuffle=True, drop_last=True, device='cpu')
    return DataLoaders(train, DataLoader(ItemList(items[1200:]), bs=bs, device='cpu'))

def run(rank:int, world_size:int, port:int, out:str, epochs:int=2):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    from fastai.basics import Learner, Callback, CrossEntropyLossFlat, accuracy, set_seed
    import fastai.callback.all
    from fastai.distributed import DistributedDL
    from loss_filters.batch import BatchLossFilterCallback, SelectiveBackpropCallback
    from loss_filters.sampler import StaleLossPruningCallback
    from conftest import bn_mlp as mlp
    DistributedDL._broadcast = _cpu_broadcast
    ctx = lambda learn: learn.distrib_ctx(cpu=True, sync_bn=False)

    class Steps(Callback):
        "Training steps this rank took"
        order = 100
        def before_fit(self): self.n = 0
        def after_step(self): self.n += 1

    class Orders(Callback):
        "The positions this rank trained on in each epoch (stale pruning)"
        def before_fit(self): self.orders = []
        def after_train(self):
            cb = getattr(self.learn, 'loss_filter', None)
            if hasattr(cb, 'rank_order'): self.orders.append((cb.rank_order.tolist(), cb.epoch_order.tolist()))

    make = dict(blf=lambda: BatchLossFilterCallback(min_loss_perc=.8, skip_epochs=0),
                sb=lambda: SelectiveBackpropCallback(keep=.5, start=0., end=1., interrupt=0),
                stale=lambda: StaleLossPruningCallback(prune=.5))
    res = {}
    dls = digits_dls()
    for m in METHODS:
        set_seed(0)
        orders, steps = Orders(), Steps()
        learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), metrics=accuracy, cbs=[orders, steps]).add_cb(make[m]())
        with ctx(learn), learn.no_bar(), learn.no_logging(): learn.fit_one_cycle(epochs, 1e-2)
        cb = learn.loss_filter
        res[m] = dict(values=[list(v) for v in learn.recorder.values], names=list(learn.recorder.metric_names),
                      weights={k: v.detach().clone() for k, v in learn.model.state_dict().items()},
                      stats=list(cb.stats), epoch_stats=list(cb.epoch_stats), orders=orders.orders,
                      table=cb.table.clone() if hasattr(cb, 'table') else None, n_iter=learn.n_iter, steps=steps.n,
                      tracked=int(learn.model[2].num_batches_tracked),
                      pct_end=learn.pct_train if hasattr(learn, 'pct_train') else None)
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat()).batch_loss_filter(fill_batch=True)
    try:
        with ctx(learn), learn.no_bar(), learn.no_logging(): learn.fit(1)
    except ValueError as e: res['fill_batch_error'] = str(e)
    from fastai.callback.training import GradientAccumulation
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=GradientAccumulation(128)).batch_loss_filter()
    try:
        with ctx(learn), learn.no_bar(), learn.no_logging(): learn.fit(1)
    except ValueError as e: res['grad_acc_error'] = str(e)
    learn = Learner(sorted_dls(), mlp(), loss_func=CrossEntropyLossFlat()).stale_loss_pruning()
    try:   # the refusal must fire although `DistributedTrainer` wraps the loader only after the filter's `before_fit`
        with ctx(learn), learn.no_bar(), learn.no_logging(): learn.fit(1)
    except ValueError as e: res['sorted_error'] = str(e)
    sb = dict(start=0., end=1., interrupt=0)   # Selective Backprop keeps a fixed count: it may pool and accumulate
    for name, cbs, kw in (('sb_grad_acc', GradientAccumulation(128), {}), ('sb_fill_batch', [], dict(fill_batch=True))):
        set_seed(0)
        learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=cbs).selective_backprop(**sb, **kw)
        with ctx(learn), learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
        res[name] = {k: v.detach().clone() for k, v in learn.model.state_dict().items()}
        res[name + '_n_kept'] = [e['samp_perc'] for e in learn.loss_filter.epoch_stats]
    set_seed(0)   # stale pruning gives every rank equal batches: it may accumulate gradients
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=GradientAccumulation(128)).stale_loss_pruning()
    with ctx(learn), learn.no_bar(), learn.no_logging(): learn.fit(2, 1e-2)
    res['stale_grad_acc'] = {k: v.detach().clone() for k, v in learn.model.state_dict().items()}
    torch.save(res, Path(out) / f'rank{rank}.pt')
    dist.barrier()

if __name__ == '__main__':   # under torchrun
    run(int(os.environ['RANK']), int(os.environ['WORLD_SIZE']), int(os.environ['MASTER_PORT']), sys.argv[1])
