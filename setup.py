"""The one thing pyproject.toml cannot declare: the optional native Kineto scanner.

``optional=True``: without a C compiler the build goes on without it, and the Kineto reader uses its
pure-Python paths (same results, slower on small traces).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shardline.profiling.readers._kscan", ["profiling/readers/_kscan.c"],
                             extra_compile_args=["-O2"], optional=True)])
