"""The graph IR and the pattern language over it.

* ``graph`` — Symbol JSON as ``Graph`` / ``Node`` / ``Entry``, lossless both ways; ``attrs`` (typed
  attributes in MXNet's spelling), ``opdefs`` (what MXNet says about its ops), ``names`` (keeping
  output names through a rewrite), ``expr`` (fused_elemwise's expression program).
* ``pattern`` — the DSL rules are written in; ``matcher`` — matches a pattern at an anchor node.
* ``errors`` — ``FusionError`` and its kinds.

May import: nothing of mxnet-fusion outside this package.
"""
