"The CIFAR wide ResNet: output shape, size of the original configuration, and a training step on CPU."
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from loss_filters.models import WideResNet, WideBlock, wrn_channels, wrn_n_params

ORIGINAL = dict(num_groups=3, N=4, num_classes=10, k=2, start_nf=32)  # fastai v1 Batch Loss Filter experiment

def n_params(m): return sum(p.numel() for p in m.parameters() if p.requires_grad)

def by_hand():
    "Parameters of the original configuration, layer by layer; channels 32 (stem), 64, 128, 256"
    stem = 3*32*9
    def first(ni, nf): return 2*ni + ni*nf*9 + 2*nf + nf*nf*9 + ni*nf   # BN, conv, BN, conv, 1x1 shortcut
    def other(nf): return 2*nf + nf*nf*9 + 2*nf + nf*nf*9               # BN, conv, BN, conv
    groups = sum(first(ni, nf) + 3*other(nf) for ni, nf in [(32, 64), (64, 128), (128, 256)])
    head = 2*256 + 256*10 + 10                                           # BN, linear
    return stem + groups + head

@pytest.fixture(scope='module')
def model():
    torch.manual_seed(0)
    return WideResNet(**ORIGINAL)

def test_defaults_are_the_original(): assert wrn_n_params() == wrn_n_params(**ORIGINAL) == n_params(WideResNet())

def test_output_shape(model):
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert WideResNet(N=1, k=1, start_nf=8, num_classes=4, n_in=1)(torch.randn(2, 1, 28, 28)).shape == (2, 4)

def test_channels(): assert wrn_channels(3, k=2, start_nf=32) == [32, 64, 128, 256]

def test_param_count(model):
    assert by_hand() == 5_859_754
    assert n_params(model) == by_hand() == wrn_n_params(**ORIGINAL)

@pytest.mark.parametrize('cfg', [dict(N=1, k=1, start_nf=8), dict(N=2, k=1, start_nf=16), dict(num_groups=2, N=3, k=3, start_nf=8, num_classes=7),
                                 dict(N=1, k=2, start_nf=8, n_in=1)])
def test_param_formula(cfg): assert n_params(WideResNet(**cfg)) == wrn_n_params(**cfg)

def test_block_shortcut():
    assert isinstance(WideBlock(16, 16).shortcut, nn.Identity)
    assert isinstance(WideBlock(16, 32).shortcut, nn.Conv2d) and isinstance(WideBlock(16, 16, stride=2).shortcut, nn.Conv2d)
    assert WideBlock(16, 16, stride=2)(torch.randn(2, 16, 8, 8)).shape == (2, 16, 4, 4)

def test_trains_one_step_on_cpu(model):
    torch.manual_seed(1)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    opt.step(); opt.zero_grad()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with torch.no_grad(): assert F.cross_entropy(model(x), y) < loss
