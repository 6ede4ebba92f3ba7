"""Write tests/data/torch_tiny_bert*.onnx with torch.onnx.export: files written by current exporters.

Run it where torch is installed (the test suite does not need torch):

    python tests/data/make_onnx_fixtures.py

One BERT encoder layer (hidden 32, 4 heads, FFN 64) with an int64 padding mask
(batch, seq) turned into the additive mask inside the graph, exported at
dynamic batch and sequence axes, twice:

* ``torch_tiny_bert.onnx``: the TorchScript exporter (``dynamo=False``), opset 17:
  Shape/Gather/Unsqueeze/Concat head-split reshapes, LayerNormalization,
  Erf-based GELU, initializers not listed as graph inputs;
* ``torch_tiny_bert_dynamo.onnx``: the torch.export-based exporter (the default
  since torch 2.9; needs onnxscript), at its default opset.

Weights come from a fixed seed.  The committed files were written with torch 2.13.0+cpu
and onnxscript 0.7.2.
"""
import math
import os

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))


class TinyBertLayer(nn.Module):
    def __init__(self, hidden=32, heads=4, ffn=64):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
        self.inter = nn.Linear(hidden, ffn)
        self.out = nn.Linear(ffn, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-12)

    def split(self, x):
        b, s, _ = x.size()
        return x.view(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, attention_mask):
        b, s, h = hidden_states.size()
        q, k, v = (self.split(f(hidden_states)) for f in (self.query, self.key, self.value))
        mask = (1.0 - attention_mask[:, None, None, :].to(hidden_states.dtype)) * -10000.0
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim) + mask
        ctx = torch.matmul(scores.softmax(dim=-1), v).transpose(1, 2).reshape(b, s, h)
        x = self.ln1(self.attn_out(ctx) + hidden_states)
        return self.ln2(self.out(nn.functional.gelu(self.inter(x))) + x)


def main():
    torch.manual_seed(0)
    model = TinyBertLayer().eval()
    with torch.no_grad():
        for ln in (model.ln1, model.ln2):   # non-trivial LayerNorm parameters
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.normal_(0, 0.1)
    args = (torch.randn(2, 8, 32), torch.ones(2, 8, dtype=torch.int64))
    path = os.path.join(HERE, "torch_tiny_bert.onnx")
    torch.onnx.export(model, args, path, input_names=["hidden_states", "attention_mask"],
                      output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                      dynamic_axes={"hidden_states": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
                                    "last_hidden_state": {0: "batch", 1: "seq"}})
    print("wrote", path, os.path.getsize(path), "bytes")

    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=512)
    path = os.path.join(HERE, "torch_tiny_bert_dynamo.onnx")
    program = torch.onnx.export(model, args, input_names=["hidden_states", "attention_mask"],
                                output_names=["last_hidden_state"], dynamo=True,
                                dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    program.save(path)
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main()
