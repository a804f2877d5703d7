"""The wheel's tag, ``py3-none-<platform>``, and its library's name, ``keel/_C.so``.

Keel's native library (``keel/_C``) has no Python binding at all: torch loads it
with ``torch.ops.load_library`` and it calls only torch's stable C ABI. So one
build serves every CPython, free-threaded builds included, which an ``abi3`` tag
would shut out (pip offers ``abi3`` wheels to no free-threaded interpreter, and
torch ships wheels for CPython 3.14t), and so the library's file name carries no
interpreter's tag either. Everything else is in pyproject.toml.

``KEEL_WHEEL_PLATFORM`` (``manylinux_2_28_x86_64``, say) names the platform in
place of this machine's (``linux_x86_64``). ``build_wheel`` in
scripts/torch-env.sh sets it when it links the library against that glibc's
symbol versions, and ``test_abi`` checks that the library keeps the promise.
"""
import os
import sysconfig

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext


class PlatformOnlyWheel(bdist_wheel):
    """bdist_wheel whose tag names the platform alone: any Python 3, no ABI."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", os.environ.get("KEEL_WHEEL_PLATFORM") or platform


class PlainSuffix(build_ext):
    """Names the library ``_C.so``, not ``_C.cpython-311-x86_64-linux-gnu.so``:
    it is no extension module of one interpreter (setuptools-rust asks this name
    of build_ext)."""

    def get_ext_filename(self, fullname):
        return os.path.join(*fullname.split(".")) + sysconfig.get_config_var("SHLIB_SUFFIX")


setup(cmdclass={"bdist_wheel": PlatformOnlyWheel, "build_ext": PlainSuffix})
