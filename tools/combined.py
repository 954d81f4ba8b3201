"""Two filters in one, tried on the benchmark before either goes into the package.

`hide_stale`: each epoch hides the examples learned with confidence (`HideLearnedCallback`, its rate raise included), then
leaves out a share `prune` of the below-mean stale losses of the rest and up-weights the other easy ones
(`prune_by_stale_loss`, InfoBatch's rule).
`hide_blf`: hides as `HideLearnedCallback` does, then from the second epoch scores each batch of the rest in a no-grad
pass and trains on its examples that carry `min_loss_perc` of its loss (the Batch Loss Filter's rule); the scoring pass
gives every example of the batch a fresh loss for the next epoch's hiding.

Takes `lf_bench`'s options; the two names join its methods:

    python tools/combined.py --preset long --seeds 3 --methods "baseline hide blf hide_blf hide_stale" --quiet --out bench_out/combined_long
"""
import math
import torch
from loss_filters.all import *
from loss_filters.core import prune_by_stale_loss, score_examples, select_by_loss_share, at_least_two, take
from loss_filters.runs import METHODS
from loss_filters.bench import main


class HideAndStaleCallback(HideLearnedCallback):
    "Hide the examples learned with confidence, then leave out a share `prune` of the rest's below-mean stale losses"
    def __init__(self,
                 prune:float=.5, # share of the unhidden below-mean-loss examples left out of each epoch, in [0, 1)
                 **kwargs): # `HideLearnedCallback`'s
        super().__init__(**kwargs)
        self.prune = prune

    def epoch_keep(self):
        shown, _ = super().epoch_keep()
        keep, w = prune_by_stale_loss(self.table.masked_fill(~shown, math.nan), self.prune, generator=self.gen)
        return shown & keep, w


class HideAndBatchLossCallback(HideLearnedCallback):
    "Hide the examples learned with confidence, then train each batch of the rest on its examples carrying `min_loss_perc` of its loss"
    def __init__(self,
                 min_loss_perc:float=.9, # the Batch Loss Filter's share of each batch's loss kept, in [0, 1]
                 **kwargs): # `HideLearnedCallback`'s
        super().__init__(**kwargs)
        self.min_loss_perc, self._kept = min_loss_perc, None

    def before_batch(self):
        self._kept = None
        if not self.training or self.epoch == 0: return   # the Batch Loss Filter's `skip_epochs=1`
        learn, idx = self.learn, super()._step_idx()
        losses, scores = score_examples(learn.model, learn.xb, learn.yb, self.score_func)
        self.fit_scored += len(idx)
        self.table[idx] = losses.to(self.table.device)   # a fresh loss for every example of the batch
        keep = at_least_two(select_by_loss_share(scores, self.min_loss_perc), scores).sort().values
        learn.xb, learn.yb = take(learn.xb, keep), take(learn.yb, keep)
        self._kept = idx[keep.to(idx.device)]

    def _step_idx(self): return super()._step_idx() if self._kept is None else self._kept


METHODS.update(hide_stale=(HideAndStaleCallback, {}), hide_blf=(HideAndBatchLossCallback, {}))

if __name__ == '__main__': main()
