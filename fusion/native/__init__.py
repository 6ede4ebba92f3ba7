"""The native side: building and loading the fused-op library, and MXNet's process settings.

* ``library`` — compiles ``cuda_kernels/`` into ``fusion/_lib/libmxfusion_ops.so`` (and the CUDA
  library beside it), loads it into MXNet, asks it which devices each op runs on.
* ``build`` — ``python -m fusion.native.build``: the command that compiles them.
* ``env`` — the thread settings MXNet needs before it is imported, and the switch that binds with
  MXNet's oneDNN subgraph backend on or off.

May import: nothing of mxnet-fusion.  ``setup.py`` and ``tools/gpu_check.py`` load
``library.py`` by its path, on machines where the package cannot be imported.
"""
