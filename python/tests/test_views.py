"""Random views (slices, permutations of the leading dims, expands, a strided
last dim, zero-size dims) through the ops that read views in place
(rms_norm and rotary_embedding, forward and backward), against the same op on
a contiguous copy (bit for bit) and against torch; a layout the op cannot read
in place (the last dim strided) it copies first. Seeded, so a failure
reproduces."""
import random

import torch
import torch.nn.functional as F

import keel


def random_view(rng, shape, last_dim_may_stride=True):
    """A view of a larger random float64 tensor with sizes `shape`."""
    nd = len(shape)
    base = torch.randn(*[s + rng.randint(0, 2) for s in shape], dtype=torch.float64)
    x = base[tuple(slice(0, s) for s in shape)]
    if nd > 1 and rng.random() < 0.5:
        perm = list(range(nd - 1))
        rng.shuffle(perm)
        # A view whose leading dims are stored in another order.
        x = base.permute(*perm, nd - 1)[tuple(slice(0, shape[p]) for p in perm) + (slice(0, shape[-1]),)]
        x = x.permute(*[perm.index(i) for i in range(nd - 1)], nd - 1)
    if nd > 1 and x.shape[0] > 0 and rng.random() < 0.2:
        x = x[:1].expand(*x.shape)
    if last_dim_may_stride and nd > 1 and rng.random() < 0.15:
        x = x.transpose(0, -1).contiguous().transpose(0, -1)  # last dim not contiguous
    assert tuple(x.shape) == tuple(shape)
    return x


def test_rms_norm_on_random_views():
    rng = random.Random(0)
    torch.manual_seed(0)
    in_place = copied = 0
    for _ in range(300):
        shape = [rng.randint(0 if rng.random() < 0.05 else 1, 5) for _ in range(rng.randint(1, 5))]
        x = random_view(rng, shape)
        w = torch.randn(shape[-1], dtype=torch.float64)
        dy = torch.randn(shape, dtype=torch.float64)
        want = F.rms_norm(x, (shape[-1],), w, 1e-6)
        torch.testing.assert_close(keel.rms_norm(x, w), want)
        got = torch.ops.keel.rms_norm(x, w, 1e-6)
        if x.dim() > 1 and x.shape[-1] > 1 and x.stride(-1) != 1:
            copied += 1
        else:
            in_place += 1
        assert torch.equal(got, torch.ops.keel.rms_norm(x.contiguous(), w, 1e-6)), (x.shape, x.stride())
        torch.testing.assert_close(got, want)
        gx, gw = torch.ops.keel.rms_norm_backward(dy, x, w, 1e-6)
        cx, cw = torch.ops.keel.rms_norm_backward(dy, x.contiguous(), w, 1e-6)
        assert torch.equal(gx, cx), (x.shape, x.stride())
        torch.testing.assert_close(gw, cw, atol=1e-12, rtol=1e-12)  # summed per thread block
    assert in_place > 200 and copied > 10, (in_place, copied)


def test_rotary_on_random_views():
    rng = random.Random(1)
    torch.manual_seed(1)
    for _ in range(200):
        b, s, h, d = rng.randint(1, 3), rng.randint(1, 6), rng.randint(1, 4), 2 * rng.randint(0, 8)
        x = random_view(rng, [b, s, h, d])
        half = rng.randint(0, d // 2)
        a = torch.randn(s, half, dtype=torch.float64)
        cos, sin, il = a.cos(), a.sin(), rng.random() < 0.5
        got = torch.ops.keel.rotary_embedding(x, cos, sin, il)
        assert torch.equal(got, torch.ops.keel.rotary_embedding(x.contiguous(), cos, sin, il)), (x.shape, x.stride())
        back = torch.ops.keel.rotary_embedding_backward(x, cos, sin, il)
        assert torch.equal(back, torch.ops.keel.rotary_embedding_backward(x.contiguous(), cos, sin, il))
        assert torch.equal(keel.rotary_embedding(x, cos, sin, il), got)
