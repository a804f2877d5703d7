"""The ops the report and the demo time: for each, Keel's call, the torch
expression it replaces (a function of the inputs, so that `torch.compile` can
compile it), how to drive either (forward, or forward + backward), and the
bytes it must move.

`make_cases(device, dtype, size)` builds them on fresh inputs; `size` is
"large" (the shapes of the speed targets), "decode" (one decoding step of a
batch of sequences) or "small" (for smoke tests).
"""
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

import keel


@dataclass
class Case:
    """One op on one input set."""

    name: str
    shape: str
    args: tuple
    keel: Callable  # (*args) -> output(s)
    torch: Callable  # (*args) -> output(s): the eager expression Keel replaces
    nbytes: int  # bytes read + written by one call (the least any kernel must move)
    bandwidth_bound: bool = True
    grad_args: Sequence[int] = ()  # when set: forward + backward, with gradients for these inputs
    clone_args: Sequence[int] = field(default_factory=lambda: (0,))  # inputs a `clone` floor copies
    # Writes its inputs (and returns them): errors are taken on fresh copies of
    # the inputs, timings on the inputs themselves, which each call rewrites.
    inplace: bool = False
    seed: int = 1
    # The typed API's call (`keel.rms_norm` ...), where it differs from `keel`
    # (a `torch.ops.keel` call): what users call, timed beside it at decode shapes.
    typed: Callable = None
    _grads: dict = field(default_factory=dict, repr=False)  # upstream gradients, made once

    def _upstream(self, i: int, out: torch.Tensor) -> torch.Tensor:
        """The upstream gradient of output `i`: made once (outside the timed calls), the same for every
        contender, in the output's dtype."""
        key = (i, tuple(out.shape), out.dtype, out.device)
        if key not in self._grads:
            g = torch.Generator(device="cpu").manual_seed(self.seed + i)
            self._grads[key] = torch.randn(out.shape, generator=g).to(out.dtype).to(out.device)
        return self._grads[key]

    @property
    def backward(self) -> bool:
        return bool(self.grad_args)

    def leaves(self, args: tuple = None) -> tuple:
        """`args` (the case's own by default), those in `grad_args` as fresh
        leaves that require a gradient: a forward + backward call's inputs."""
        args = self.args if args is None else args
        return tuple(a.detach().requires_grad_() if i in self.grad_args else a for i, a in enumerate(args))

    def backward_of(self, out) -> tuple:
        """Runs the backward of a forward's result `out` from the upstream
        gradients; returns the outputs as a tuple."""
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [self._upstream(i, o) for i, o in enumerate(outs)])
        return outs

    def run(self, fn: Callable, args: tuple = None) -> tuple:
        """Calls `fn` as this case is timed; returns its outputs (and, for a
        forward + backward case, the gradients) as a tuple."""
        if not self.backward:
            out = fn(*(self.args if args is None else args))
            return out if isinstance(out, tuple) else (out,)
        args = self.leaves(args)
        outs = self.backward_of(fn(*args))
        return tuple(o.detach() for o in outs) + tuple(args[i].grad for i in self.grad_args)

    def reference(self) -> tuple:
        """The torch expression in float64 (float inputs promoted)."""
        dbl = tuple(a.double() if a.is_floating_point() else a for a in self.args)
        return self.run(self.torch, dbl)


def max_rel_err(outs: tuple, refs: tuple) -> float:
    """max |out - ref| / (1 + max |ref|) over the outputs."""
    return max(((o.double() - r).abs().max() / (1 + r.abs().max())).item() for o, r in zip(outs, refs))


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]


def _rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def _layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def _fused_add_rms_norm(x, r, w):
    s = x + r
    return F.rms_norm(s, (x.shape[-1],), w, 1e-6), s


def _fused_add_rms_norm_inplace(x, r, w):
    """vLLM's in-place form written in torch: r <- x + r, x <- rms_norm(r)."""
    r.add_(x)
    x.copy_(F.rms_norm(r, (x.shape[-1],), w, 1e-6))
    return x, r


def _keel_fused_add_rms_norm_inplace(x, r, w):
    torch.ops.keel.fused_add_rms_norm_(x, r, w, 1e-6)
    return x, r


def _rope_neox_inplace(q, cos, sin):
    """vLLM's in-place rotary written in torch."""
    q.copy_(_rope_neox(q, cos, sin))
    return q


def _keel_rope_inplace(q, cos, sin):
    torch.ops.keel.rotary_embedding_(q, cos, sin, False)
    return q


def _typed_fused_add_rms_norm_inplace(x, r, w):
    keel.fused_add_rms_norm_(x, r, w, 1e-6)
    return x, r


def _typed_rope_inplace(q, cos, sin):
    keel.rotary_embedding_(q, cos, sin)
    return q


def _silu_and_mul(h):
    d = h.shape[-1] // 2
    return F.silu(h[..., :d]) * h[..., d:]


def _gelu_and_mul(h):
    d = h.shape[-1] // 2
    return F.gelu(h[..., :d]) * h[..., d:]


def _gelu_tanh_and_mul(h):
    d = h.shape[-1] // 2
    return F.gelu(h[..., :d], approximate="tanh") * h[..., d:]


def _softmax(x):
    return torch.softmax(x, -1)


def _cross_entropy_weight(x, t, w):
    return F.cross_entropy(x, t, weight=w)


def _keel_cross_entropy_weight(x, t, w):
    return keel.cross_entropy(x, t, weight=w)


def _cross_entropy_weight_ls(x, t, w):
    return F.cross_entropy(x, t, weight=w, label_smoothing=0.1)


def _keel_cross_entropy_weight_ls(x, t, w):
    return keel.cross_entropy(x, t, weight=w, label_smoothing=0.1)


def _cross_entropy_probs(x, p):
    return F.cross_entropy(x, p)


def _rope_neox(q, cos, sin):
    half = cos.shape[-1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    q1, q2 = q[..., :half], q[..., half : 2 * half]
    return torch.cat([q1 * c - q2 * s, q2 * c + q1 * s], -1)


SHAPES = {
    # rows x hidden for the row ops, the gated ops' input is [rows, 2 * hidden],
    # cross_entropy [rows, vocab], rotary [batch, seq, heads, head_dim].
    # qk: the QK-norm case, [tokens, heads, head_dim] viewed from a fused qkv.
    "large": dict(rows=4096, hidden=4096, vocab=32000, rope=(4, 1024, 32, 128), qk=(4096, 32, 128)),
    "small": dict(rows=64, hidden=256, vocab=1000, rope=(1, 16, 4, 64), qk=(64, 4, 64)),
    # One decoding step of a batch of 32 sequences: 32 tokens of hidden 4096.
    # Rotary takes the 32 tokens as one sequence, each row of cos and sin the
    # angles of that token's own position (as vLLM passes its positions).
    "decode": dict(rows=32, hidden=4096, vocab=32000, rope=(1, 32, 32, 128), qk=(32, 32, 128)),
}

DECODE_OPS = ("rms_norm", "layer_norm", "fused_add_rms_norm", "fused_add_rms_norm_ (in place)", "silu_and_mul",
              "gelu_and_mul", "softmax", "rotary_embedding", "rotary_embedding_ (in place)", "rms_norm (qkv view)")
"""The forward ops timed again at the ``decode`` shapes (inference: no backward,
no loss)."""


def make_cases(device: str, dtype: torch.dtype, size: str = "large", names: Sequence[str] = ()) -> list:
    """The report's cases on `device` in `dtype`; only those named in `names`
    (case names, as the report prints them) when given. An unknown name raises."""
    sh = SHAPES[size]
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    n, h, v = sh["rows"], sh["hidden"], sh["vocab"]
    es = torch.tensor([], dtype=dtype).element_size()
    x, r, w, b = rnd(n, h), rnd(n, h), rnd(h), rnd(h)
    gu = rnd(n, 2 * h)
    rs = f"{n}x{h}"
    gs = f"{n}x{2 * h}"
    mk = {}
    mk["rms_norm"] = lambda: Case("rms_norm", rs, (x, w), lambda x, w: torch.ops.keel.rms_norm(x, w, 1e-6),
                                  _rms_norm, 2 * n * h * es, typed=lambda x, w: keel.rms_norm(x, w, 1e-6))
    mk["layer_norm"] = lambda: Case("layer_norm", rs, (x, w, b),
                                    lambda x, w, b: torch.ops.keel.layer_norm(x, w, b, 1e-5),
                                    _layer_norm, 2 * n * h * es, typed=lambda x, w, b: keel.layer_norm(x, w, b, 1e-5))
    mk["fused_add_rms_norm"] = lambda: Case(
        "fused_add_rms_norm", rs, (x, r, w), lambda x, r, w: torch.ops.keel.fused_add_rms_norm(x, r, w, 1e-6),
        _fused_add_rms_norm, 4 * n * h * es, clone_args=(0, 1),
        typed=lambda x, r, w: keel.fused_add_rms_norm(x, r, w, 1e-6))
    # Its own copies of x and r: every call rewrites them (r grows by the
    # normalised x each call, which stays finite over any run's calls).
    mk["fused_add_rms_norm_ (in place)"] = lambda: Case(
        "fused_add_rms_norm_ (in place)", rs, (x.clone(), r.clone(), w), _keel_fused_add_rms_norm_inplace,
        _fused_add_rms_norm_inplace, 4 * n * h * es, clone_args=(0, 1), inplace=True,
        typed=_typed_fused_add_rms_norm_inplace)
    mk["silu_and_mul"] = lambda: Case("silu_and_mul", gs, (gu,), torch.ops.keel.silu_and_mul,
                                      _silu_and_mul, 3 * n * h * es, typed=keel.silu_and_mul)
    mk["gelu_and_mul"] = lambda: Case("gelu_and_mul", gs, (gu,), lambda h: torch.ops.keel.gelu_and_mul(h, "none"),
                                      _gelu_and_mul, 3 * n * h * es, typed=lambda h: keel.gelu_and_mul(h, "none"))
    mk["gelu_and_mul tanh"] = lambda: Case(
        "gelu_and_mul tanh", gs, (gu,), lambda h: torch.ops.keel.gelu_and_mul(h, "tanh"),
        _gelu_tanh_and_mul, 3 * n * h * es)
    mk["softmax"] = lambda: Case("softmax", rs, (x,), lambda x: torch.ops.keel.softmax(x, 1.0), _softmax,
                                 2 * n * h * es, typed=lambda x: keel.softmax(x, 1.0))

    def ce():
        logits = rnd(n, v)
        tgt = torch.randint(0, v, (n,), generator=g)
        tgt[::8] = -100  # every 8th row ignored
        # forward + backward: the forward reads the logits, the backward reads them and writes the gradient.
        return Case("cross_entropy fwd+bwd", f"{n}x{v}", (logits, tgt.to(device)), keel.cross_entropy,
                    F.cross_entropy, 3 * n * v * es, bandwidth_bound=False, grad_args=(0,))

    mk["cross_entropy fwd+bwd"] = ce

    # torch's other forms through the typed API: class weights (read by the
    # op's kernels, with or without label smoothing), and probability targets
    # (the op's fused kernel for these, which reads the target rows too).
    def weighted(c, name):
        # The same case with a class weight vector passed as weight=.
        wcls = (torch.rand(v, generator=g) + 0.5).to(dtype).to(device)
        c.name, c.args = name, c.args + (wcls,)
        c.keel, c.torch = _keel_cross_entropy_weight, _cross_entropy_weight
        return c

    mk["cross_entropy weight fwd+bwd"] = lambda: weighted(ce(), "cross_entropy weight fwd+bwd")

    def weighted_smoothed():
        # Class weights with label smoothing 0.1: each row's sum(w x) too, in the same read.
        c = weighted(ce(), "cross_entropy weight ls fwd+bwd")
        c.keel, c.torch = _keel_cross_entropy_weight_ls, _cross_entropy_weight_ls
        return c

    mk["cross_entropy weight ls fwd+bwd"] = weighted_smoothed

    def ce_probs():
        c = ce()
        probs = torch.softmax(torch.randn(n, v, generator=g), -1).to(dtype).to(device)
        c.name, c.args, c.nbytes = "cross_entropy probs fwd+bwd", (c.args[0], probs), 4 * n * v * es
        c.torch = _cross_entropy_probs
        return c

    mk["cross_entropy probs fwd+bwd"] = ce_probs

    # Class weights read by the fused kernels beside the target rows.
    mk["cross_entropy probs weight fwd+bwd"] = lambda: weighted(ce_probs(), "cross_entropy probs weight fwd+bwd")

    def rope():
        bq, s, heads, d = sh["rope"]
        q = rnd(bq, s, heads, d)
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
        cos, sin = ang.cos().to(dtype).to(device), ang.sin().to(dtype).to(device)
        return Case("rotary_embedding", "x".join(map(str, (bq, s, heads, d))), (q, cos, sin),
                    lambda q, c, s: torch.ops.keel.rotary_embedding(q, c, s, False), _rope_neox,
                    2 * q.numel() * es, typed=keel.rotary_embedding)

    mk["rotary_embedding"] = rope

    def rope_inplace():
        c = rope()  # its own q: every call rewrites it
        c.name, c.keel, c.torch, c.inplace = "rotary_embedding_ (in place)", _keel_rope_inplace, _rope_neox_inplace, True
        c.typed = _typed_rope_inplace
        return c

    mk["rotary_embedding_ (in place)"] = rope_inplace

    # Strided inputs, read in place by Keel (the same views go to torch):
    # Llama's q laid out [batch, heads, seq, head_dim], passed transposed; and
    # QK-norm on q of a fused qkv projection viewed [tokens, heads, head_dim].
    def rope_t():
        c = rope()
        bq, s, heads, d = sh["rope"]
        c.name, c.args = "rotary_embedding (x.T)", (rnd(bq, heads, s, d).transpose(1, 2),) + c.args[1:]
        return c

    mk["rotary_embedding (x.T)"] = rope_t

    def qk_norm():
        t, heads, d = sh["qk"]
        q = rnd(t, 3 * heads * d)[:, : heads * d].view(t, heads, d)
        return Case("rms_norm (qkv view)", f"{t}x{heads}x{d}", (q, rnd(d)),
                    lambda q, w: torch.ops.keel.rms_norm(q, w, 1e-6), _rms_norm, 2 * q.numel() * es,
                    typed=lambda q, w: keel.rms_norm(q, w, 1e-6))

    mk["rms_norm (qkv view)"] = qk_norm

    # Forward + backward (training): gradients for every differentiable input
    # but rotary's cos/sin; bytes are the forward's plus the backward's least
    # (read grad_out and what it needs, write each gradient).
    mk["rms_norm fwd+bwd"] = lambda: Case("rms_norm fwd+bwd", rs, (x, w), keel.rms_norm, _rms_norm, 5 * n * h * es,
                                          grad_args=(0, 1))
    mk["layer_norm fwd+bwd"] = lambda: Case("layer_norm fwd+bwd", rs, (x, w, b), keel.layer_norm, _layer_norm,
                                            5 * n * h * es, grad_args=(0, 1, 2))
    # fused_add: the forward reads x and r and writes y and s; the backward reads
    # both upstream gradients and s, and writes the gradients of x and of r: two
    # tensors, since both are leaves here and each gets its own .grad (as in torch).
    mk["fused_add_rms_norm fwd+bwd"] = lambda: Case(
        "fused_add_rms_norm fwd+bwd", rs, (x, r, w), keel.fused_add_rms_norm, _fused_add_rms_norm, 9 * n * h * es,
        grad_args=(0, 1, 2), clone_args=(0, 1))
    mk["silu_and_mul fwd+bwd"] = lambda: Case("silu_and_mul fwd+bwd", gs, (gu,), keel.silu_and_mul, _silu_and_mul,
                                              8 * n * h * es, grad_args=(0,))
    mk["softmax fwd+bwd"] = lambda: Case("softmax fwd+bwd", rs, (x,), keel.softmax, _softmax, 5 * n * h * es,
                                         grad_args=(0,))

    def rope_fb():
        c = rope()
        c.name, c.keel, c.nbytes, c.grad_args = "rotary_embedding fwd+bwd", keel.rotary_embedding, 2 * c.nbytes, (0,)
        c.typed = None  # `keel` is the typed call already
        return c

    mk["rotary_embedding fwd+bwd"] = rope_fb
    unknown = [n for n in names if n not in mk]
    if unknown:
        raise ValueError(f"make_cases: no case named {', '.join(map(repr, unknown))} (cases: {', '.join(mk)})")
    return [f() for k, f in mk.items() if not names or k in names]


# Per-call overhead is measured in each of these modes: torch's default (grad
# mode on, inputs that do not require grad), under torch.no_grad(), and with
# tensors made under torch.inference_mode(), which have no autograd keys.
OVERHEAD_MODES = {"grad mode": contextlib.nullcontext, "no_grad": torch.no_grad,
                  "inference_mode": torch.inference_mode}


def tiny_cases(device: str) -> list:
    """Per-call overhead: (name, keel op call, keel typed-API call, torch call) on
    tiny f32 tensors.

    Make them under the mode they are timed in (inference_mode tensors must be
    made inside it). The `torch.ops.aten` rows take the same Python path as a
    `torch.ops.keel` call, for a comparison of the ops' own cost; the typed API
    (`keel.softmax` ...) is what users call, and where no gradient can be needed
    it skips torch's Python autograd kernel.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, 64, generator=g).to(device)
    w = torch.ones(64, device=device)
    h = torch.randn(1, 128, generator=g).to(device)
    t = torch.tensor([3], device=device)
    softmax = (lambda: torch.ops.keel.softmax(x, 1.0), lambda: keel.softmax(x, 1.0))
    ce = (lambda: torch.ops.keel.cross_entropy(x, t, -100, 0.0, "mean"), lambda: keel.cross_entropy(x, t))
    return [
        ("rms_norm [1,64]", lambda: torch.ops.keel.rms_norm(x, w, 1e-6), lambda: keel.rms_norm(x, w, 1e-6),
         lambda: _rms_norm(x, w)),
        ("softmax [1,64]", *softmax, lambda: torch.softmax(x, -1)),
        ("softmax [1,64], torch through torch.ops.aten._softmax", *softmax,
         lambda: torch.ops.aten._softmax(x, -1, False)),
        ("silu_and_mul [1,128]", lambda: torch.ops.keel.silu_and_mul(h), lambda: keel.silu_and_mul(h),
         lambda: _silu_and_mul(h)),
        ("cross_entropy [1,64]", *ce, lambda: F.cross_entropy(x, t)),
        ("cross_entropy [1,64], torch through torch.ops.aten.cross_entropy_loss", *ce,
         lambda: torch.ops.aten.cross_entropy_loss(x, t, None, 1, -100, 0.0)),
        ("x + x [1,64] (any torch op)", None, None, lambda: x + x),
    ]
