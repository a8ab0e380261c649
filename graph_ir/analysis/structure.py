"""What a transformer block and an attention core are, found from module paths and op semantics.

The one place that says so; recompute's policies (``full``, ``every_n_layers``,
``selective``) and anything else that reasons about a model's structure ask here.

Blocks: the repeated module stacks of the model, at any depth and in any number
(an encoder and a decoder, a vision and a text tower, cross-attention layers):

- indexed stacks: modules ``<prefix>.<N>`` (``nn.ModuleList`` / ``nn.Sequential``
  children) that each run at least two matmul-class ops (so ``mlp.0`` of a
  ``Sequential(Linear, GELU, Linear)`` is not a block, a transformer layer is);
- named stacks: sibling modules with other names (``block_a``, ``block_b``)
  whose forward ops are the same sequence, each with at least two matmuls;
- only the outermost stacks: a stack inside a block of another is part of it;
- or, where detection needs help, the module-path globs the plan gives
  (``model_blocks: ["encoder.block.*", "decoder.block.*"]``).

Attention cores: per explicit softmax attention, the forward nodes from the
score matmul to the attention x V matmul; per fused attention op (every SDPA
variant, or an op the plan names), the op, its outputs, and the mask it is given
where that mask is computed from no parameter (a few cheap elementwise ops).
"""
from __future__ import annotations

import fnmatch
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx

from ..meta import Region, module_path_of, region_of
from .cost import is_matmul as _is_matmul

_SOFTMAX = {"_softmax", "softmax", "_safe_softmax"}
# Fused attention: every spelling of SDPA a captured step may hold (CPU, CUDA, NPU kernels).
FUSED_ATTENTION = frozenset({
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math",
    "scaled_dot_product_attention", "_flash_attention_forward", "_efficient_attention_forward",
    "npu_fusion_attention",
})
_INDEXED = re.compile(r"^(.*)\.(\d+)$")
MIN_BLOCK_MATMULS = 2


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


@dataclass
class Structure:
    """The blocks of a model, grouped in stacks, in forward order."""

    stacks: dict[str, list[str]] = field(default_factory=dict)   # stack prefix -> block paths
    source: str = "detected"                                      # "detected" or "plan"
    _block_of: dict[str, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    _blocks_seen: int = field(default=-1, init=False, repr=False, compare=False)

    @property
    def blocks(self) -> list[str]:
        return [b for blocks in self.stacks.values() for b in blocks]

    def block_of(self, path: str) -> str:
        """The block a module path lies in ("" outside every block).

        Asked once per node by the passes: answered per path from the set of blocks (its
        prefixes looked up, shortest first, as the stacks are outermost), not by a scan of
        every block (quadratic in depth).
        """
        known = self._block_of.get(path)
        if known is None:
            blocks = set(self.blocks)
            if self._blocks_seen != len(blocks):
                self._block_of.clear()
                self._blocks_seen = len(blocks)
            known, prefix = "", ""
            for part in path.split(".") if path else []:
                prefix = f"{prefix}.{part}" if prefix else part
                if prefix in blocks:
                    known = prefix
                    break
            self._block_of[path] = known
        return known


def _forward_paths(graph: torch.fx.Graph) -> dict[str, list[torch.fx.Node]]:
    """Every module path (and each of its prefixes) -> its forward nodes in graph order."""
    out: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or region_of(node) != Region.FORWARD:
            continue
        path = module_path_of(node)
        parts = path.split(".") if path else []
        for i in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:i]), []).append(node)
    return out


def _signature(nodes: list[torch.fx.Node]) -> tuple[str, ...]:
    return tuple(_op_name(n) for n in nodes)


def find_blocks(graph: torch.fx.Graph, globs: tuple[str, ...] | list[str] = ()) -> Structure:
    """The model's repeated blocks (see the module docstring); ``globs`` replace detection."""
    paths = _forward_paths(graph)
    order = {p: nodes[0] for p, nodes in paths.items()}
    position = {n: i for i, n in enumerate(graph.nodes)}
    if globs:
        matched = [p for p in paths if any(fnmatch.fnmatchcase(p, g) for g in globs)]
        outer = [p for p in matched if not any(p != q and p.startswith(q + ".") for q in matched)]
        stacks: dict[str, list[str]] = {}
        for p in sorted(outer, key=lambda p: position[order[p]]):
            stacks.setdefault(p.rpartition(".")[0], []).append(p)
        return Structure(stacks, "plan")

    is_matmul: dict[torch.fx.Node, bool] = {}     # a node lies under every prefix of its path

    def matmuls(p: str) -> int:
        count = 0
        for n in paths[p]:
            if n not in is_matmul:
                is_matmul[n] = _is_matmul(n)
            count += is_matmul[n]
        return count

    def by_position(blocks):
        return sorted(set(blocks), key=lambda b: position[order[b]])

    def outermost(blocks, among):
        return [b for b in blocks if not any(b != q and b.startswith(q + ".") for q in among)]

    indexed: dict[str, list[str]] = {}
    named: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for p in paths:
        if matmuls(p) < MIN_BLOCK_MATMULS:
            continue
        parent, _, name = p.rpartition(".")
        if name.isdigit():
            indexed.setdefault(parent, []).append(p)
        else:
            named.setdefault((parent, _signature(paths[p])), []).append(p)
    indexed_members = [b for blocks in indexed.values() for b in blocks]
    stacks: dict[str, list[str]] = {}
    for prefix, blocks in indexed.items():
        kept = outermost(blocks, indexed_members)
        if kept:
            stacks.setdefault(prefix, []).extend(kept)
    # Named siblings with one op sequence: a stack unless it holds, or lies in, an indexed one.
    named = {k: v for k, v in named.items() if len(v) >= 2 and not any(
        b.startswith(q + ".") or q.startswith(b + ".") for b in v for q in indexed_members)}
    named_members = [b for blocks in named.values() for b in blocks]
    for (parent, _), blocks in named.items():
        kept = outermost(blocks, named_members)
        if len(kept) >= 2:
            stacks.setdefault(parent, []).extend(kept)
    stacks = {prefix: by_position(blocks) for prefix, blocks in stacks.items()}
    ordered = dict(sorted(stacks.items(), key=lambda kv: position[order[kv[1][0]]]))
    return Structure(ordered, "detected")


# -- attention cores --------------------------------------------------------------------------------

def _softmax_core(sm: torch.fx.Node) -> set[torch.fx.Node]:
    core = {sm}
    # Walk out from the softmax both ways, stopping at (and including) the matmuls
    # on either side: score = q @ k^T before it, probs @ v after it.
    for neighbours in (lambda n: n.all_input_nodes, lambda n: n.users):
        stack = list(neighbours(sm))
        while stack:
            n = stack.pop()
            if n in core or n.op != "call_function" or region_of(n) != Region.FORWARD:
                continue
            core.add(n)
            if not _is_matmul(n):
                stack.extend(neighbours(n))
    for n in [n for n in core if _is_matmul(n)]:
        for operand in n.all_input_nodes:
            core |= _head_repeat(operand, core)
    return core


def _head_repeat(operand: torch.fx.Node, core: set) -> set[torch.fx.Node]:
    """GQA's repeat of K / V over the query heads (``expand`` of a broadcast dim, then copies and
    views) feeding the core's matmul: part of the core, as in Megatron's core attention, so the
    kv heads are kept rather than their copies per query head. Empty where no broadcast is met."""
    path, n = [], operand
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and n not in core and len(path) < 12 \
            and region_of(n) == Region.FORWARD and len(n.all_input_nodes) == 1 and not _is_matmul(n):
        path.append(n)
        source = n.all_input_nodes[0]
        if n.target is torch.ops.aten.expand.default and n.meta["val"].numel() > source.meta["val"].numel():
            return set(path)
        n = source
    return set()


def _parameter_free_mask(mask: torch.fx.Node, limit: int = 64) -> set[torch.fx.Node]:
    """The forward nodes that compute an attention mask from no parameter (bounded walk)."""
    out: set[torch.fx.Node] = set()
    stack = [mask]
    while stack and len(out) < limit:
        n = stack.pop()
        if n in out or n.op != "call_function" or region_of(n) != Region.FORWARD:
            if n.op == "placeholder" and n.name.startswith("param"):
                return set()
            continue
        if _is_matmul(n):
            return set()
        out.add(n)
        stack.extend(n.all_input_nodes)
    return out if not stack else set()


def _fused_core(node: torch.fx.Node) -> set[torch.fx.Node]:
    core = {node} | {u for u in node.users if u.target is operator.getitem}
    for operand in node.args[:3]:   # q, k, v
        if isinstance(operand, torch.fx.Node):
            core |= _head_repeat(operand, core)
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    for key in ("attn_mask", "attn_bias"):
        mask = node.kwargs.get(key)
        if mask is None and key in names and names.index(key) < len(node.args):
            mask = node.args[names.index(key)]
        if isinstance(mask, torch.fx.Node):
            core |= _parameter_free_mask(mask)
    return core


def attention_cores(graph: torch.fx.Graph, extra_ops: tuple[str, ...] | list[str] = ()) -> list[set[torch.fx.Node]]:
    """Per attention in the forward (explicit softmax attention or a fused op): its core's nodes.

    ``extra_ops`` names more fused attention ops (``aten.my_attention`` or ``my_attention``).
    """
    fused = FUSED_ATTENTION | {op.removeprefix("aten.").split(".")[0] for op in extra_ops}
    cores = []
    for node in graph.nodes:
        if node.op != "call_function" or region_of(node) != Region.FORWARD:
            continue
        name = _op_name(node)
        if name in _SOFTMAX and _explicit_attention(node):
            cores.append(_softmax_core(node))
        elif name in fused:
            cores.append(_fused_core(node))
    return cores


def _explicit_attention(sm: torch.fx.Node) -> bool:
    """A softmax between two matmuls (scores before, probabilities x V after): attention.

    A softmax with no matmul after it (the loss's, a router's) is not an attention core.
    """
    def reaches_matmul(start, neighbours, depth=12):
        frontier, seen = list(neighbours(start)), set()
        while frontier and depth:
            depth -= 1
            nxt = []
            for n in frontier:
                if n in seen or n.op != "call_function" or region_of(n) != Region.FORWARD:
                    continue
                seen.add(n)
                if _is_matmul(n):
                    return True
                nxt.extend(neighbours(n))
            frontier = nxt
        return False
    return reaches_matmul(sm, lambda n: n.all_input_nodes) and reaches_matmul(sm, lambda n: list(n.users))
