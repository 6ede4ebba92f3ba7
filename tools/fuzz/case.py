"""A generated test case: the graph, its parameters, how to make its inputs, and a second shape.

The families (``families/*.py``) build graphs through a :class:`Builder`, which hands
out unique names, records data inputs as *specs* (a shape template over named
dimensions, a dtype and a value kind) and parameters as arrays, and picks for every
named dimension a second value (another batch size, another sequence length) at
which the original graph also binds.  A dimension the graph hard-codes (a Reshape to
a literal size, a parameter of that size) is *pinned*: it keeps its value at the
second shape.

Value kinds of data inputs (drawn at either shape from the case's value seed):

=========  ================================================================
normal     standard normal float (default)
pos        uniform in [0.5, 2]
unit       uniform in [-1, 1]
large      8 × standard normal (attention scores in the hundreds: softmax must stay stable)
len        integers in [lo, hi] (hi: a dimension) — softmax lengths, 0 included
ids        integers in [0, hi) — token ids
mask01     0/1 (mostly 1)
addmask    0 or −1e9 (some masked)
neginf     0 or −inf (some masked; a fully masked row gives NaN in MXNet)
rowmask    0 or −1e9, whole rows of the last axis masked (queries that see no key)
rowmask01  the same as 0/1 (for where)
=========  ================================================================
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from .draw import Draw

Dim = Union[int, str]


class Invalid(Exception):
    """The generator made a graph MXNet refuses (not a finding: counted apart)."""


@dataclass
class InputSpec:
    name: str
    shape: Tuple[Dim, ...]
    dtype: str = "float32"
    kind: str = "normal"
    lo: int = 0
    hi: Optional[Dim] = None
    nan: bool = False          # one element set to NaN (and maybe one to ±inf)

    def concrete(self, dims: Dict[str, int]) -> Tuple[int, ...]:
        return tuple(_eval_dim(d, dims) for d in self.shape)


def _eval_dim(d: Dim, dims: Dict[str, int]) -> int:
    if isinstance(d, (int, np.integer)):
        return int(d)
    return int(eval(d, {"__builtins__": {}}, dict(dims)))     # "B*H", "3*E" ...


def make_value(spec: InputSpec, dims: Dict[str, int], rng: np.random.RandomState) -> np.ndarray:
    shape = spec.concrete(dims)
    k = spec.kind
    if k == "normal":
        v = rng.standard_normal(shape)
    elif k == "pos":
        v = rng.uniform(0.5, 2.0, shape)
    elif k == "large":
        v = 8.0 * rng.standard_normal(shape)
    elif k == "unit":
        v = rng.uniform(-1.0, 1.0, shape)
    elif k == "len":
        hi = _eval_dim(spec.hi, dims)
        v = rng.randint(min(spec.lo, hi), hi + 1, size=shape)
    elif k == "ids":
        v = rng.randint(0, max(1, _eval_dim(spec.hi, dims)), size=shape)
    elif k == "mask01":
        v = (rng.uniform(size=shape) < 0.75).astype(np.float64)
    elif k == "addmask":
        v = np.where(rng.uniform(size=shape) < 0.3, -1e9, 0.0)
    elif k == "neginf":
        v = np.where(rng.uniform(size=shape) < 0.3, -np.inf, 0.0)
    elif k in ("rowmask", "rowmask01"):      # whole rows (all keys of a query) masked, others partly
        rows = rng.uniform(size=shape[:-1] + (1,)) < 0.35 if len(shape) else np.zeros((), bool)
        part = rng.uniform(size=shape) < 0.2
        masked = rows | part
        v = np.where(masked, 0.0, 1.0) if k == "rowmask01" else np.where(masked, -1e9, 0.0)
    else:
        raise ValueError("unknown value kind %r" % k)
    v = np.asarray(v).astype(spec.dtype)
    if spec.nan and v.size and np.issubdtype(v.dtype, np.floating):
        flat = v.reshape(-1)
        flat[rng.randint(flat.size)] = np.nan
        if flat.size > 3 and rng.uniform() < 0.5:
            flat[rng.randint(flat.size)] = rng.choice([np.inf, -np.inf])
    return v


@dataclass
class Case:
    """Everything the oracle needs about one generated graph."""

    seed: int
    family: str
    choices: List[int]
    symbol: Any                                   # mx.sym.Symbol
    arg: Dict[str, np.ndarray]
    aux: Dict[str, np.ndarray]
    specs: List[InputSpec]
    dims: Dict[str, int]
    dims2: Dict[str, int]
    value_seed: int
    flags: Set[str] = field(default_factory=set)  # random, no_train, no_subgraph, nan, mc_dropout
    json_text: Optional[str] = None               # given to fuse() instead of the symbol (other spellings)
    notes: List[str] = field(default_factory=list)

    def inputs(self, second: bool = False) -> Dict[str, np.ndarray]:
        dims = self.dims2 if second else self.dims
        rng = np.random.RandomState((self.value_seed + (7919 if second else 0)) % (1 << 31))
        return {s.name: make_value(s, dims, rng) for s in self.specs}

    def shapes(self, second: bool = False) -> Dict[str, Tuple[int, ...]]:
        dims = self.dims2 if second else self.dims
        return {s.name: s.concrete(dims) for s in self.specs}

    def dtypes(self) -> Dict[str, str]:
        return {s.name: s.dtype for s in self.specs}

    @property
    def has_second(self) -> bool:
        return self.dims2 != self.dims

    def __getstate__(self):
        state = dict(self.__dict__)
        state["symbol"] = self.symbol.tojson()
        return state

    def __setstate__(self, state):
        import mxnet as mx

        state = dict(state)
        state["symbol"] = mx.sym.load_json(state["symbol"])
        self.__dict__.update(state)

    def op_count(self) -> int:
        return sum(1 for n in json.loads(self.symbol.tojson())["nodes"] if n["op"] != "null")


class Builder:
    """What a family uses to make a graph: names, dimensions, inputs, parameters, flags."""

    SECOND = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13)

    def __init__(self, d: Draw, family: str):
        self.d = d
        self.family = family
        self.np = np.random.RandomState(d.seed("param values"))
        self.value_seed = d.seed("input values")
        self.dims: Dict[str, int] = {}
        self.alt: Dict[str, int] = {}
        self.pinned: Set[str] = set()
        self.specs: List[InputSpec] = []
        self.params: Dict[str, np.ndarray] = {}
        self.flags: Set[str] = set()
        self.notes: List[str] = []
        self._used: Set[str] = set()
        self.float_dtype = "float32"          # of new float inputs and parameters
        # now and then sizes past the fused kernels' tiles and vector widths (tails, several blocks)
        self.big = d.maybe(0.05, label="large sizes")

    # ------------------------------------------------------------------ names and dimensions
    def name(self, prefix: str) -> str:
        i = 0
        while "%s%d" % (prefix, i) in self._used:
            i += 1
        n = "%s%d" % (prefix, i)
        self._used.add(n)
        return n

    def dim(self, name: str, options: Sequence[int], weights=None, vary: bool = True, big: Sequence[int] = ()) -> int:
        """A named dimension; unless ``vary`` is False (or it gets pinned) it takes another value at the second shape.

        ``big``: the sizes used instead in a large case (kernel tiles and vector tails).
        """
        if self.big and big:
            options, weights = big, None
        v = self.d.choice(options, weights, label="dim " + name)
        self.dims[name] = v
        alts = [a for a in self.SECOND if a != v] if v <= 13 else [v + 1, v - 1, 2 * v + 1, 3]
        self.alt[name] = self.d.choice(alts, label="second " + name)
        if not vary:
            self.pinned.add(name)
        return v

    def size(self, options: Sequence[int], big: Sequence[int], label: str, weights=None) -> int:
        """A literal size: from ``big`` in a large case."""
        if self.big:
            return self.d.choice(big, label=label)
        return self.d.choice(options, weights, label=label)

    def fixed(self, name: str) -> int:
        """The value of a dimension the graph is about to hard-code: it no longer varies."""
        self.pinned.add(name)
        return self.dims[name]

    def shape(self, template: Sequence[Dim], pin: bool = False) -> Tuple[int, ...]:
        if pin:
            for t in template:
                if isinstance(t, str):
                    self.pinned.update(n for n in re.findall(r"[A-Za-z_]\w*", t) if n in self.dims)
        return tuple(_eval_dim(t, self.dims) for t in template)

    # ------------------------------------------------------------------ inputs and parameters
    def input(self, prefix: str, shape: Sequence[Dim], kind: str = "normal", dtype: Optional[str] = None,
              lo: int = 0, hi: Optional[Dim] = None, declare_dtype: Optional[bool] = None):
        """A data input (its values are drawn when the case runs, at either shape)."""
        import mxnet as mx

        if dtype is None:
            dtype = "int32" if kind in ("len", "ids") else self.float_dtype
        name = self.name(prefix)
        self.specs.append(InputSpec(name, tuple(shape), dtype, kind, lo, hi))
        if declare_dtype is None:
            declare_dtype = dtype != "float32"
        return mx.sym.var(name, dtype=dtype) if declare_dtype else mx.sym.var(name)

    def param(self, prefix: str, shape: Sequence[Dim], kind: str = "normal", value=None, dtype: Optional[str] = None):
        """A parameter with a value (the graph's arg or aux params; a shape over dimensions pins them)."""
        import mxnet as mx

        dtype = dtype or self.float_dtype
        name = self.name(prefix)
        shp = self.shape(shape, pin=True)
        if value is None:
            value = self.param_value(shp, kind)
        self.params[name] = np.asarray(value).astype(dtype).reshape(shp)
        return mx.sym.var(name)

    def param_value(self, shape: Tuple[int, ...], kind: str) -> np.ndarray:
        r = self.np
        if kind == "normal":
            return r.normal(0, 0.5, shape)
        if kind == "weight":
            fan = int(np.prod(shape[1:])) or 1
            return r.standard_normal(shape) / np.sqrt(fan)
        if kind == "gamma":
            return r.uniform(0.5, 1.5, shape) * r.choice([-1.0, 1.0, 1.0, 1.0], shape)
        if kind == "var":
            return r.uniform(0.1, 2.0, shape)
        if kind == "pos":
            return r.uniform(0.5, 2.0, shape)
        if kind == "small":
            return r.normal(0, 0.1, shape)
        if kind == "addmask":
            return np.where(r.uniform(size=shape) < 0.3, -1e9, 0.0)
        raise ValueError("unknown parameter kind %r" % kind)

    def flag(self, *names: str) -> None:
        self.flags.update(names)

    def note(self, text: str) -> None:
        self.notes.append(text)

    # ------------------------------------------------------------------ the finished case
    def second_dims(self) -> Dict[str, int]:
        return {n: (v if n in self.pinned else self.alt[n]) for n, v in self.dims.items()}
