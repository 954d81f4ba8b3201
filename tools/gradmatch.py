"""Gradient matching, tried on the benchmark before it goes into the package.

`gm`: a batch filter that keeps, from the second epoch on, the subset of each batch (and its weights) whose gradient best
matches the whole batch's mean gradient, as CRAIG and GradMatch do for the last layer. It reads the head's per-example
Gramian in closed form during the scoring pass the batch filters already run: for a linear head `z = W h + b` under
cross-entropy, example i's gradient of `(W, b)` is `eᵢ (hᵢ, 1)ᵀ` with `eᵢ = softmax(zᵢ) - onehot(yᵢ)`, so
`G[i, j] = (eᵢ·eⱼ)(hᵢ·hⱼ + 1)`. A greedy matching pursuit then adds, `k = ceil(keep·B)` times, the example whose gradient
points most along what is still missing, and refits non-negative weights on the chosen ones by least squares in `G`; the
step trains the chosen examples with those weights (`Σ wᵢℓᵢ`, whose gradient approximates the batch's mean gradient).

Takes `lf_bench`'s options; `gm` joins its methods:

    python tools/gradmatch.py --preset long --seeds 3 --methods "baseline blf gm" --quiet --out bench_out/gm_long
"""
import math
import torch
import torch.nn.functional as F
from torch import nn, Tensor
from loss_filters.all import *
from loss_filters.core import check_range, per_sample_loss, plain, reweighted_loss
from loss_filters.runs import METHODS
from loss_filters.bench import main


def head_gramian(h:Tensor, # the head's inputs, `[B, d]`
                 z:Tensor, # the head's outputs (logits), `[B, c]`
                 y:Tensor # the class of each example, `[B]`
                ) -> Tensor:
    "The Gramian of the per-example cross-entropy gradients of a linear head's weight and bias, in closed form"
    e = F.softmax(z.float(), -1) - F.one_hot(y, z.shape[-1]).float()
    h = h.float().flatten(1)
    return (e @ e.T) * (h @ h.T + 1)


def match_gradient(G:Tensor, # the per-example Gramian, `[B, B]`
                   k:int # how many examples to keep, in [1, B]
                  ) -> tuple:
    "Greedy matching pursuit of the batch's mean gradient in the Gramian's terms: `(indices, weights)`, non-negative weights"
    B = G.shape[0]
    G = G.double()
    b = G.mean(1)                       # gᵢ·ḡ
    chosen, w = [], G.new_zeros(0)
    for _ in range(min(k, B)):
        corr = b - (G[:, chosen] @ w if chosen else 0.)   # gᵢ·(ḡ - Σ wⱼgⱼ)
        if chosen: corr[chosen] = -math.inf
        chosen.append(int(corr.argmax()))
        S = torch.tensor(chosen)
        w = torch.linalg.lstsq(G[S][:, S] + 1e-10 * torch.eye(len(S), dtype=G.dtype), b[S].unsqueeze(1)).solution.squeeze(1).clamp_min(0)
    return torch.tensor(chosen), w.float()


class GradMatchCallback(LossFilterCallback):
    "Train each batch on the weighted subset whose last-layer gradient best matches the whole batch's (greedy matching pursuit on the head's Gramian)"
    def __init__(self,
                 keep:float=.5, # share of each batch kept, in (0, 1]
                 skip_epochs:int=1, # leave the first epochs of each fit unfiltered, as the Batch Loss Filter does
                 **kwargs): # `start`, `end`, `interrupt` of `LossFilterCallback`
        check_range('keep', keep, 0, 1, lo_open=True)
        if kwargs.get('fill_batch'): raise ValueError("GradMatchCallback weights the examples it keeps: it cannot pool them (`fill_batch`)")
        super().__init__(skip_epochs=skip_epochs, **kwargs)
        self.keep, self._gm_w = keep, None

    def before_fit(self):
        super().before_fit()
        heads = [m for m in self.learn.model.modules() if isinstance(m, nn.Linear)]
        if not heads: raise ValueError("GradMatchCallback needs a model whose last layer is an `nn.Linear` head")
        self.head = heads[-1]

    def score_batch(self):
        seen = {}
        hook = self.head.register_forward_hook(lambda m, i, o: seen.update(h=i[0].detach(), z=o.detach()))
        try: losses, scores = super().score_batch()
        finally: hook.remove()
        self._gm_seen = seen
        return losses, scores

    def select(self, scores):
        y = plain(self.learn.yb[0])
        G = head_gramian(self._gm_seen['h'], self._gm_seen['z'], y)
        idxs, w = match_gradient(G, max(1, math.ceil(self.keep * len(scores))))
        self._gm_w = torch.zeros(len(scores), device=scores.device)
        self._gm_w[idxs.to(scores.device)] = w.to(scores.device)
        return idxs.to(scores.device)

    def step_weights(self):
        "The loss weights of the examples this step trains, in their order (the step's loss is `Σwᵢℓᵢ / k`); None for an unfiltered step"
        if self.step_idxs is None or self._gm_w is None: return None
        w = self._gm_w[self.step_idxs]
        return w * len(w)

    def after_loss(self):
        w = self.step_weights()
        if w is not None:
            losses = per_sample_loss(self.score_func, plain(self.learn.pred), *plain(self.learn.yb))
            self.learn.loss_grad = reweighted_loss(self.learn.loss_grad, losses, w)   # `Σ wᵢℓᵢ / k` with a mean loss: the matched gradient
        super().after_loss()


METHODS.update(gm=(GradMatchCallback, {}))

if __name__ == '__main__': main()
