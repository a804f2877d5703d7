"""``python -m keel``: the environment it prints, and a self-check that passes on
Keel's kernels and fails, naming the op, where a forward, a gradient or an
in-place op is wrong."""
import os
import subprocess
import sys

import pytest
import torch

import keel
from keel import _info


def _run(*args, **env):
    return subprocess.run([sys.executable, "-m", "keel", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_prints_the_environment_and_every_op_passes():
    p = _run()
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert f"keel {keel.__version__}: " in out and keel.LIBRARY_PATH in out
    assert f"torch {torch.__version__} " in out
    assert f"Keel's CPU kernels: {keel.cpu_capability()}" in out
    if torch.cuda.is_available():
        assert f"CUDA device 0: {torch.cuda.get_device_name(0)}" in out
    else:
        assert "CUDA: not used (torch.cuda.is_available() is False)" in out
    for device in _info.devices():
        for dtype in ("float32", "float16", "bfloat16"):
            for case in _info.CASES:
                assert f"ok   {device} {dtype} {case.name}: error " in out, (device, dtype, case.name, out)
            for name in ("fused_add_rms_norm_", "rotary_embedding_"):
                assert f"ok   {device} {dtype} {name}: the out-of-place bits" in out, out
    assert "FAIL" not in out
    assert out.rstrip().endswith("all checks passed")


def test_says_whether_cross_entropy_checks_cuda_targets():
    assert "cross_entropy's CUDA target check: on\n" in _run("--no-check", KEEL_CUDA_TARGET_CHECKS="").stdout
    p = _run("--no-check", KEEL_CUDA_TARGET_CHECKS="0")
    assert "cross_entropy's CUDA target check: off (KEEL_CUDA_TARGET_CHECKS=0)\n" in p.stdout, p.stdout


def test_no_check_prints_the_environment_only_and_names_a_lowered_simd_level():
    p = _run("--no-check", KEEL_CPU_CAPABILITY="default")
    assert p.returncode == 0, p.stderr
    assert "Keel's CPU kernels: default (KEEL_CPU_CAPABILITY=default)" in p.stdout
    assert "self-check" not in p.stdout and "ok " not in p.stdout


def test_names_a_free_threaded_python_and_its_gil():
    """Free-threaded CPython can install the wheel (py3-none): the environment line
    says which build runs, and whether its GIL is off."""
    assert _info.python_build("3.11.7", False, True) == "Python 3.11.7"
    assert _info.python_build("3.14.0", True, False) == "Python 3.14.0 free-threaded (GIL disabled)"
    assert _info.python_build("3.14.0", True, True) == "Python 3.14.0 free-threaded (GIL enabled)"
    p = _run("--no-check")
    assert p.returncode == 0, p.stderr
    assert f"{_info._python()}, " in p.stdout


def _case(name):
    return next(c for c in _info.CASES if c.name == name)


def _wrong_forward(x):
    return keel.softmax(x, 0.125) * 1.05


def _wrong_gradient(x):
    # The same values; the gradient gains 0.01 of the cotangent.
    return keel.softmax(x, 0.125) + 0.01 * (x - x.detach())


def _raising(x):
    raise RuntimeError("keel::softmax: a made-up failure\nsecond line")


@pytest.mark.parametrize("keel_fn, says", [
    (_wrong_forward, "FAIL cpu float32 softmax: error "),
    (_wrong_gradient, "FAIL cpu float32 softmax: error "),
    (_raising, "FAIL cpu float32 softmax: RuntimeError: keel::softmax: a made-up failure"),
])
def test_a_wrong_op_fails_naming_it(monkeypatch, capsys, keel_fn, says):
    monkeypatch.setattr(_info, "CASES", (_case("rms_norm"), _case("softmax")._replace(keel=keel_fn)))
    monkeypatch.setattr(_info, "devices", lambda: ["cpu"])
    assert _info.main([]) == 1
    out = capsys.readouterr().out
    assert says in out, out
    assert "ok   cpu float32 rms_norm: error " in out  # the others are still checked
    assert "FAIL cpu bfloat16 softmax" in out
    assert out.rstrip().endswith("SOME CHECKS FAILED")


def test_an_inplace_op_that_differs_from_its_out_of_place_form_fails(monkeypatch, capsys):
    monkeypatch.setattr(_info, "CASES", ())
    monkeypatch.setattr(_info, "devices", lambda: ["cpu"])
    monkeypatch.setattr(keel, "rotary_embedding_", lambda q, cos, sin: None)  # leaves q as it was
    assert _info.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL cpu float32 rotary_embedding_: differs from the out-of-place op" in out, out
    assert "ok   cpu float32 fused_add_rms_norm_: the out-of-place bits" in out
