"""Dense PolyNorm MLP and the norm modules vs direct formulas (float64)."""

import torch

from llm_training.layers.ffn import FeedForward
from llm_training.layers.norms import RMSNorm
from llm_training.motif import get_flavor


def polynorm_by_hand(x, w, b, eps):
    def n(u):
        return u / torch.sqrt((u * u).mean(-1, keepdim=True) + eps)

    ws = torch.sigmoid(w)
    return ws[0] * n(x**3) + ws[1] * n(x**2) + ws[2] * n(x) + b[0]


def test_polynorm_mlp_matches_formula():
    args = get_flavor("motif3_debug")
    torch.manual_seed(0)
    ffn = FeedForward(16, 24, args).double()
    ffn.init_weights(0.3)
    with torch.no_grad():
        ffn.act_fn.weight.copy_(torch.tensor([0.2, -0.4, 0.9]))
        ffn.act_fn.bias.fill_(0.7)  # dense MLPs never clamp the bias (0.7 > polynorm_bias_clamp)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    g, u = x @ ffn.gate_proj.weight.T, x @ ffn.up_proj.weight.T
    h = polynorm_by_hand(g, ffn.act_fn.weight.double(), ffn.act_fn.bias.double(), args.polynorm_eps) * u
    want = (h * args.polynorm_output_scale) @ ffn.down_proj.weight.T
    torch.testing.assert_close(ffn(x), want, atol=1e-6, rtol=1e-6)
    assert ffn.act_fn.weight.dtype == torch.float64  # .double() above; fp32 by default:
    assert FeedForward(4, 8, args).act_fn.weight.dtype == torch.float32


def test_polynorm_init_and_rmsnorm():
    args = get_flavor("motif3_debug")
    ffn = FeedForward(4, 8, args)
    ffn.init_weights(0.02)
    assert torch.all(ffn.act_fn.weight == args.polynorm_init_weight) and torch.all(ffn.act_fn.bias == 0)
    norm = RMSNorm(6, 1e-5)
    norm.init_weights()
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 7.0))
    x = torch.randn(2, 6)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.arange(1.0, 7.0)
    torch.testing.assert_close(norm(x), want)
