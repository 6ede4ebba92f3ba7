"""Write the bundled example model: MobileNet-v2 0.25 with random weights and BatchNorm statistics.

    python examples/make_example_model.py      # -> examples/models/mobilenetv2_0.25-{symbol.json,0000.params}

The files are committed; this script documents how they were made.
"""
import os

import mxnet as mx

from fusion.testing import zoo_model

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
os.makedirs(here, exist_ok=True)
sym, arg, aux = zoo_model("mobilenetv2_0.25", seed=2026)
prefix = os.path.join(here, "mobilenetv2_0.25")
sym.save(prefix + "-symbol.json")
mx.nd.save(prefix + "-0000.params", {**{"arg:" + k: v for k, v in arg.items()},
                                    **{"aux:" + k: v for k, v in aux.items()}})
print("wrote", prefix + "-symbol.json", prefix + "-0000.params")
