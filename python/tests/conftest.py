import os

import pytest
import torch

import keel  # noqa: F401  (loads the ops and registers autograd before any test)

# torch.testing's defaults (vLLM / Liger use the same): (atol, rtol) per dtype.
TOL = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1.3e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}

CPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
CUDA_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def devices():
    """cpu always; cuda when a GPU is usable, else a skipped case that says why."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    elif os.environ.get("KEEL_REQUIRE_GPU") == "1":
        # scripts/gpu-run.sh on a GPU machine: a CUDA case that skips would hide a broken setup.
        raise RuntimeError("KEEL_REQUIRE_GPU=1 but torch.cuda.is_available() is False")
    else:
        out.append(pytest.param("cuda", marks=pytest.mark.skip(reason="no CUDA GPU on this machine (torch.cuda.is_available() is False)")))
    return out


def assert_close(actual, expected, dtype, scale=1.0, extra_rtol=0.0):
    """Compares with the dtype's tolerance; `scale` widens it for results
    that are sums over many rounded terms, `extra_rtol` adds to its rtol."""
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=atol * scale, rtol=rtol * scale + extra_rtol
    )


def dtypes_for(device):
    return CPU_DTYPES if device == "cpu" else CUDA_DTYPES


def widest(device):
    """The widest float dtype Keel takes on `device`: float64 on CPU, float32 on CUDA."""
    return torch.float64 if device == "cpu" else torch.float32


OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

# Leading dims of 0, 1 and several; odd and even widths (the gated ops need even).
LEADING = [(0,), (1,), (3,), (2, 3)]


def finite_max(t):
    """The largest magnitude among `t`'s finite values (0 where there are none)."""
    t = t.detach().double().cpu()
    t = t[t.isfinite()]
    return float(t.abs().max()) if t.numel() else 0.0


def rotary_ref(x, cos, sin, interleaved):
    """Rotary embedding by its definition, in `x`'s dtype: x ``[B, S, H, D]``, cos and
    sin ``[S, R/2]``; the pairs are halves of the first R dims (NeoX) or neighbours
    (GPT-J, `interleaved`); the dims past R pass through."""
    half = cos.shape[-1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    if interleaved:
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        rot = torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)
    else:
        a, b = x[..., :half], x[..., half : 2 * half]
        rot = torch.cat([a * c - b * s, b * c + a * s], -1)
    return torch.cat([rot, x[..., 2 * half :]], -1)


def make(shape, dtype, device, seed, scale=1.0):
    """Reproducible normal samples, rounded to dtype on the CPU then moved."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


class DispatchedOps:
    """A context that records the ops torch dispatches below autograd inside it
    (``calls.ops``: names such as ``"keel.rms_norm.default"``), and apart those
    with a tensor argument that is not a meta stand-in (``calls.on_data``):
    shows that a call made no copy (no ``aten.clone``) or ran a given kernel,
    or ran it only for its checks on meta tensors."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = []
        on_data = self.on_data = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(str(func))
                if any(isinstance(a, torch.Tensor) and not a.is_meta for a in args):
                    on_data.append(str(func))
                return func(*args, **(kwargs or {}))

        self._mode = Record()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def torchs_op_calls(monkeypatch, name):
    """A list that gets an entry (`name`) for each call of torch's own op where it
    serves Keel's op `name` (``keel._func.NATIVE``) from now on in the test."""
    from keel import _func

    monkeypatch.undo()
    calls = []
    native, least = _func.NATIVE[name]
    monkeypatch.setitem(_func.NATIVE, name, (lambda *a: calls.append(name) or native(*a), least))
    return calls
