"""Build hook only: `pip install .` compiles the fused-op library into the package.

Project metadata lives in pyproject.toml.
"""
import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        spec = importlib.util.spec_from_file_location(
            "_mxf_native", os.path.join(here, "fusion", "native", "library.py"))
        native = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native)
        native.build(verbose=True, lib_dir=os.path.join(self.build_lib, "fusion", "_lib"))


setup(cmdclass={"build_py": BuildWithKernels})
