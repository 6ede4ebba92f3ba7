"""Dtypes and the reduced-precision policy.

* ``policy`` — dtype names (MXNet's bfloat16 included), bfloat16 rounding, the one table of what
  runs in bfloat16 under ``precision="bf16"``, the tolerances of each precision, reading an
  AMP-converted graph and converting convolutions with MXNet's AMP.
* ``half`` — float16 graphs (MXNet's AMP float16) fused for the GPU: read as their float32 model
  for the rules, then given back the dtypes AMP gave them; float16 products computed on the CPU
  as a GPU computes them (for verification).

It sits under the engine: the rewriter applies the policy as it builds each replacement.

May import: ``fusion.ir``, ``fusion.native``.
"""
