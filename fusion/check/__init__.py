"""Checking a whole model: the fused against the original, and the time each takes.

* ``verify`` — both models run on the same inputs (drawn in the domain the model reads them in,
  or given), every output compared; ``VerifyResult``.
* ``bench`` — interleaved timing, medians with their spread, like for like.

May import: ``fusion.ir``, ``fusion.precision``, ``fusion.engine``, ``fusion.files``, ``fusion.native``.
"""
