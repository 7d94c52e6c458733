"""Bytes and FLOPs of a graph's fake tensors as sympy expressions over its symbols: what
the memory walk of compiler/problem.py adds up, with what a node allocates inside itself
(the fused loss's chunk of logits, a token chunk's intermediates) and the CUDA caching
allocator's rounding."""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from ..plan.problem import Problem
from . import token_chunks
from .op_costs import FUSED_LOSS as _FUSED_LOSS
from .sizes import tensor_nbytes

# The CUDA caching allocator's smallest block (kMinBlockSize): every allocation is rounded up
# to a multiple of it.
_CUDA_MIN_BLOCK = 512


class GraphSizes:
    """Bytes and FLOPs of fake tensors as sympy expressions over the graph's symbols."""

    def __init__(self, device: torch.device):
        self.device = device
        self.env = None  # the ShapeEnv of the first symbolic size seen
        # Weight gradients that leave the GPU from an fp32 snapshot (runtime/streamer.py:
        # the upcast copy outlives the gradient, to the next hand-off): counted at 4 bytes
        # per element over the gradient's whole life, which errs on the side of more.
        self.fp32_snapshots: set[fx.Node] = set()

    def _itemsize(self, n: fx.Node, x: torch.Tensor) -> int:
        return max(x.element_size(), 4) if n in self.fp32_snapshots else x.element_size()

    def expr(self, v):
        if isinstance(v, (torch.SymInt, torch.SymFloat)):
            self.env = self.env or v.node.shape_env
            return v.node.expr
        return sympy.Integer(int(v))

    def _tensors(self, n: fx.Node):
        v = n.meta.get("val")
        vals = v if isinstance(v, (list, tuple)) else [v]
        return [x for x in vals if isinstance(x, torch.Tensor) and x.device.type == self.device.type]

    @property
    def _rounding(self) -> int:
        """Bytes the allocator may add to one tensor: CUDA's caching allocator rounds every
        allocation up to a multiple of 512 bytes (kMinBlockSize), ceil(b/512)*512 <= b + 511.
        Nothing at 1B parameters; 3% of a toy model's peak (phi3 of the zoo test)."""
        return _CUDA_MIN_BLOCK - 1 if self.device.type == "cuda" else 0

    def bytes(self, n: fx.Node):
        total = sympy.Integer(0)
        for x in self._tensors(n):
            total += self._numel(x.shape) * self._itemsize(n, x) + self._rounding
        return total

    def hint(self, n: fx.Node) -> int:
        return sum(tensor_nbytes(x) * self._itemsize(n, x) // x.element_size() + self._rounding
                   for x in self._tensors(n))

    def scratch(self, n: fx.Node):
        """Bytes `n` allocates and frees inside itself, invisible in the graph: the fused
        linear-cross-entropy's chunk of logits ([min(chunk, tokens), vocab] in the hidden
        states' dtype) and its per-token fp32 losses (kernels/fused_linear_cross_entropy.py);
        a token_chunks subgraph's intermediates for one chunk (runtime/token_chunks.py)."""
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return sympy.Integer(0)
        chunked = token_chunks.profile_of(n)
        if chunked is not None:
            return self._chunk_scratch(n, *chunked)
        if n.target.name() != _FUSED_LOSS:
            return sympy.Integer(0)
        hidden, weight, chunk = n.args[0].meta["val"], n.args[1].meta["val"], n.args[5]
        if hidden.device.type != self.device.type:
            return sympy.Integer(0)
        tokens, vocab = self.expr(hidden.shape[0]), self.expr(weight.shape[0])
        return sympy.Min(int(chunk), tokens) * vocab * hidden.element_size() + tokens * 4

    def _chunk_scratch(self, n: fx.Node, profile, tokens, chunk: int):
        """One chunk's intermediates in the forward; in the backward, those recomputed with
        autograd's saved copies and their gradients (twice), the parameters' fp32 running
        sums and one chunk's parameter gradients."""
        rows = sympy.Min(chunk, self.expr(tokens)) * profile.bytes_per_token
        if n.target.name() != token_chunks.BACKWARD_OP:
            return rows
        params = [p.meta["val"] for p in n.args[2]]
        sums = sum(self._numel(p.shape) * (4 + p.element_size()) for p in params)
        return 2 * rows + sums

    def _numel(self, shape):
        out = sympy.Integer(1)
        for s in shape:
            out *= self.expr(s)
        return out

    def scratch_hint(self, n: fx.Node) -> int:
        v = self.scratch(n)
        return int(v) if v.is_number else int(v.subs(self._values(v.free_symbols)))

    def _values(self, syms) -> dict:
        """The symbols' values for the shapes being compiled."""
        hints = getattr(self.env, "backed_var_to_val", None) or self.env.var_to_val  # torch 2.13 / 2.11
        return {s: int(hints[s]) if s in hints else int(self.env.size_hint(s)) for s in syms}

    def total(self, nodes) -> object:
        return sympy.expand(sum((self.bytes(n) for n in nodes), sympy.Integer(0)))

    def dims(self, problem: Problem) -> dict:
        syms = problem.free_symbols
        return self._values(syms) if syms else {}
