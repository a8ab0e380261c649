"""Where stages meet besides the boundary: a weight tied across stages and optimizer values that
combine every stage's are rewritten into per-stage parts, summed by an all-reduce over the pipeline
ranks (the mesh's ``pp`` group, or a subgroup of just the ranks holding a tied weight)."""
from __future__ import annotations

import re

import torch
import torch.fx

from graph_ir.analysis.memory import aliases_input
from graph_ir.build import add_node
from graph_ir.meta import ACCUMULATOR_PREFIX, GraphAttr, Region, region_of
from graph_ir.signature import InputKind, OutputKind, Spec, split_state_name

from ...pass_manager import PassOptionError
from .errors import PipelineSplitError
from .nodes import _Nodes
from .partition import upstream_stages

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
TIED_SUFFIX = "@stage"   # accumulator of a tied weight's partial gradient on a stage other than its home
SUMMED_SUFFIX = "@summed"   # a tied weight's gradient summed over its ranks, handed to the rank's other applies
# "and": loss_scale's all-finite flag (a bool), all-reduced as 0/1 floats by their minimum.
_REDUCTIONS = {aten.add.Tensor: "sum", aten.maximum.default: "max", aten.logical_and.default: "and"}


class _Rewriter:
    """Adds nodes to the step being split, keeping the split's bookkeeping (stage, node lists) in step."""

    def __init__(self, nodes: _Nodes, stage: dict, group: str):
        self.nodes, self.stage, self.group = nodes, stage, group
        self.graph = nodes.graph.graph
        self.mode = nodes.graph.fake_mode()

    def emit(self, before: torch.fx.Node, s: int, region: Region, target, *args, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(before):
            node = add_node(self.graph, target, args, kwargs, region=region, module_path="",
                            origin="pipeline_split", mode=self.mode)
        self.stage[node] = s
        (self.nodes.backward if region == Region.BACKWARD else self.nodes.optimizer).append(node)
        return node

    def all_reduce(self, before: torch.fx.Node, s: int, value: torch.fx.Node, op: str,
                   group: str | None = None) -> torch.fx.Node:
        reduced = self.emit(before, s, Region.OPTIMIZER, c10d.all_reduce.default, value, op, group or self.group)
        return self.emit(before, s, Region.OPTIMIZER, c10d.wait_tensor.default, reduced)

    def copy(self, node: torch.fx.Node, s: int, env: dict) -> torch.fx.Node:
        with self.graph.inserting_before(node):
            new = self.graph.node_copy(node, lambda a: env.get(a, a))
        self.stage[new] = s
        self.nodes.optimizer.append(new)
        return new

    def drop(self, dead: set[torch.fx.Node]) -> None:
        """Nodes no stage graph computes any more (left in the source graph, which is replaced)."""
        self.nodes.backward = [n for n in self.nodes.backward if n not in dead]
        self.nodes.optimizer = [n for n in self.nodes.optimizer if n not in dead]
        for node in dead:
            self.stage.pop(node, None)


def _sum_tree(root: torch.fx.Node, op) -> tuple[list, set]:
    """The terms of ``root`` as a tree of ``op`` (add / maximum) nodes, each read only by the tree."""
    leaves, tree, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        inner = (node.op == "call_function" and node.target == op and not node.kwargs and len(node.args) == 2
                 and all(isinstance(a, torch.fx.Node) for a in node.args)
                 and (node is root or len(node.users) == 1))
        if inner:
            tree.add(node)
            todo.extend(reversed(node.args))
        else:
            leaves.append(node)
    return leaves, tree


# -- tied weights ---------------------------------------------------------------------------------

def _accumulation(acc: torch.fx.Node):
    """``acc = acc_in + grad * weight`` (grad_accumulation's update): (acc_in, the mul node, grad)."""
    if acc.target != aten.add.Tensor or len(acc.args) != 2:
        return None
    acc_in, scaled = acc.args
    if getattr(scaled, "op", None) == "placeholder":
        acc_in, scaled = scaled, acc_in
    if getattr(acc_in, "op", None) != "placeholder" or getattr(scaled, "target", None) != aten.mul.Tensor:
        return None
    grad = next((a for a in scaled.args if isinstance(a, torch.fx.Node) and a.op != "placeholder"), None)
    return (acc_in, scaled, grad) if grad is not None else None


def _state_owner(spec: Spec) -> str | None:
    if spec.kind == OutputKind.PARAM:
        return spec.name
    if spec.kind == OutputKind.OPT_STATE:
        return split_state_name(spec.name)[0]
    return None


def _tied_terms_by_stage(stage: dict, leaves: list, home: int, readers: list[int]) -> dict[int, list]:
    """The terms of a tied weight's gradient by the stage that computes each."""
    by_stage: dict[int, list] = {}
    for leaf in leaves:
        # A view of a term (the head's transposed weight gradient) was placed with its reader, the
        # sum: it goes back to the stage that made its base.
        views, base = [], leaf
        while aliases_input(base) and base.all_input_nodes and base.all_input_nodes[0] in stage:
            views.append(base)
            base = base.all_input_nodes[0]
        where = stage.get(base, home)
        if where not in readers and base in stage:
            # A term placed on a stage that does not read the weight (the embedding's backward
            # placed with the gradient it reads, when a stage holds the embedding alone) is
            # computed by the home, its input crossing to it as the untied weight's would.
            where = stage[base] = home
        for view in views:
            stage[view] = where
        by_stage.setdefault(where, []).append(leaf)
    return by_stage


def _tied_accumulator(name: str, s: int) -> str:
    """The step-state name of stage ``s``'s accumulator of its part of tied weight ``name``'s gradient."""
    return f"{ACCUMULATOR_PREFIX}{name}{TIED_SUFFIX}{s}"


def _stage_accumulator(rw: _Rewriter, name: str, s: int, acc_in: torch.fx.Node, partial, scaled: torch.fx.Node,
                       weight, step_state: dict) -> tuple[torch.fx.Node, torch.fx.Node]:
    """Stage ``s``'s own accumulator of its part of tied weight ``name``'s gradient: (input, update)."""
    nodes = rw.nodes
    state = _tied_accumulator(name, s)
    with rw.graph.inserting_after(acc_in):
        placeholder = rw.graph.placeholder(re.sub(r"\W", "_", f"step_state_{state}"))
    placeholder.meta = dict(acc_in.meta)
    nodes.spec_of[placeholder] = Spec(InputKind.STEP_STATE, state)
    nodes.owner[placeholder] = name
    step_state[state] = dict(step_state[ACCUMULATOR_PREFIX + name])
    if partial is None:   # nothing to add on this stage: the apply reads the zeros it starts from
        return placeholder, placeholder
    new = rw.emit(scaled, s, Region.BACKWARD, aten.add.Tensor, placeholder,
                  rw.emit(scaled, s, Region.BACKWARD, aten.mul.Tensor, partial, weight))
    nodes.outputs.append((Spec(OutputKind.STEP_STATE, state), new))
    return placeholder, new


def _split_tied(rw: _Rewriter, name: str, readers: list[int], home: int, acc: torch.fx.Node, opt: set,
                step_state: dict, group_of, ranks: list[int], cuts: dict) -> dict:
    """One tied weight's gradient split into per-stage accumulators; its update reads their sum.

    Holders on one pipeline rank (DualPipeV's first and last stage) update the weight once: the
    rank's updating stage (the home, or the rank's first holder) adds the other local holders'
    accumulators (cut into its apply graph as step state, ``cuts``) before the all-reduce over the
    holding ranks, which a single holding rank skips; the rank's other holders only read the weight."""
    found = _accumulation(acc)
    if found is None:
        raise PipelineSplitError(f"tied parameter '{name}': its accumulator update {acc.name} is not "
                                 "acc + grad * weight (rule: run grad_accumulation before pipeline_split)")
    acc_in, scaled, grad = found
    if len(grad.users) != 1:
        raise PipelineSplitError(f"tied parameter '{name}': its gradient {grad.name} is read by more than its "
                                 "accumulator (rule: a tied weight's gradient is split into per-stage parts)")
    weight = next(a for a in scaled.args if a is not grad)
    leaves, tree = _sum_tree(grad, aten.add.Tensor)
    by_stage = _tied_terms_by_stage(rw.stage, leaves, home, readers)
    holders = sorted(set(readers) | set(by_stage))
    if home not in by_stage:
        raise PipelineSplitError(f"tied parameter '{name}': no part of its gradient is computed by its "
                                 f"home stage {home}")
    accs = {home: (acc_in, acc)}
    for s in holders:
        terms = by_stage.get(s, [])
        partial = terms[0] if terms else None
        for term in terms[1:]:
            partial = rw.emit(scaled, s, Region.BACKWARD, aten.add.Tensor, partial, term)
        if s == home:
            scaled.replace_input_with(grad, partial)
            continue
        accs[s] = _stage_accumulator(rw, name, s, acc_in, partial, scaled, weight, step_state)
    rw.drop(tree - set(leaves))
    readers_of_acc = [u for u in acc.users if u in opt]
    if not readers_of_acc:
        raise PipelineSplitError(f"tied parameter '{name}': its update reads no accumulated gradient")
    first = min(readers_of_acc, key=lambda u: rw.nodes.order.get(u, 1 << 60))
    parts = {s: _rank_part(rw, name, s, [t for t in holders if ranks[t] == ranks[s]], accs, first, cuts)
             for s in _updating_holders(holders, home, ranks)}
    group = group_of(name, holders)
    summed = parts[home] if group is None else rw.all_reduce(first, home, parts[home], "sum", group)
    for user in readers_of_acc:
        user.replace_input_with(acc, summed)
    return {"holders": holders, "acc": accs, "parts": parts, "summed": None if group is None else summed}


def _updating_holders(holders: list[int], home: int, ranks: list[int]) -> list[int]:
    """The holders that update a tied weight: one per pipeline rank, the home on its own rank."""
    first: dict[int, int] = {}
    for s in holders:
        first.setdefault(ranks[s], s)
    first[ranks[home]] = home
    return sorted(first.values())


def _rank_part(rw: _Rewriter, name: str, s: int, local: list[int], accs: dict, before: torch.fx.Node,
               cuts: dict) -> torch.fx.Node:
    """Updating stage ``s``'s part of a tied weight's gradient: its own accumulator plus those of the
    other holders on its rank, which its apply graph reads as step state."""
    part = accs[s][1]
    for t in local:
        if t == s or accs[t][1] is accs[t][0]:   # a holder adding nothing keeps its zeros
            continue
        cuts.setdefault(s, []).append((Spec(InputKind.STEP_STATE, _tied_accumulator(name, t)), accs[t][1]))
        part = rw.emit(before, s, Region.OPTIMIZER, aten.add.Tensor, part, accs[t][1])
    return part


def _split_tied_gradients(rw: _Rewriter, homes: dict, shared: dict, group_of, ranks: list[int],
                          cuts: dict) -> dict[str, dict]:
    """Megatron's tied weights: every stage reading a weight holds it and accumulates its own partial
    gradient (its own accumulator); each updating holder's apply graph (one per pipeline rank) sums
    its rank's partials, all-reduces them over the ranks holding it (``group_of(name, holders)``: the
    pp group, the group of just their pipeline ranks, or None for one rank) and runs the same update.
    Returns parameter -> {holders, per-stage accumulators, the updating holders' parts}."""
    nodes = rw.nodes
    values = {(sp.kind, sp.name): v for sp, v in nodes.outputs}
    opt = set(nodes.optimizer)
    step_state = nodes.graph.attrs.setdefault(GraphAttr.STEP_STATE, {})
    tied = {}
    for name, readers in shared.items():
        home = homes[name]
        acc = values.get((OutputKind.STEP_STATE, ACCUMULATOR_PREFIX + name))
        if acc is None:   # frozen: read by each stage, updated by none
            tied[name] = {"holders": list(readers), "acc": {}}
            continue
        tied[name] = _split_tied(rw, name, readers, home, acc, opt, step_state, group_of, ranks, cuts)
    return tied


def _tied_update(rw: _Rewriter, home: int, own_values: set, opt: set, twin: dict) -> tuple[list, set]:
    """The update of one tied weight alone: optimizer nodes of its home reading only its values, what
    they make, free values and values reduced over the stages (which every stage has)."""
    nodes, stage = rw.nodes, rw.stage
    update, mine = [], set()
    for node in rw.graph.nodes:
        if node not in opt or stage.get(node) != home or node in twin:
            continue
        reads = node.all_input_nodes
        if any(a in own_values or a in mine for a in reads) and all(
                a in own_values or a in mine or a in twin or a in nodes.free
                or (a.op in ("placeholder", "get_attr") and a not in nodes.owner) for a in reads):
            update.append(node)
            mine.add(node)
    return update, mine


def _copy_tied_updates(rw: _Rewriter, homes: dict, tied: dict, replica: dict) -> None:
    """Each stage updating a tied weight (besides its home) gets the home's update of it, reading its
    own rank's part of the gradient (summed over the holding ranks) and its own copies of values
    reduced over the stages."""
    nodes, stage = rw.nodes, rw.stage
    opt = set(nodes.optimizer)
    twin = {copy: (orig, s) for (orig, s), copy in replica.items()}
    for name, info in tied.items():
        home = homes[name]
        if not info["acc"]:
            continue
        part = info["parts"][home]
        own_values = {part} | {ph for ph, owner in nodes.owner.items() if owner == name}
        update, mine = _tied_update(rw, home, own_values, opt, twin)
        for s in info["parts"]:
            if s == home:
                continue
            env = {part: info["parts"][s]}
            for node in update:
                for a in node.all_input_nodes:
                    if a in twin:
                        env[a] = replica[(twin[a][0], s)]
                env[node] = rw.copy(node, s, env)
            nodes.outputs += [(spec, env[v]) for spec, v in list(nodes.outputs)
                              if v in mine and _state_owner(spec) == name]
        missed = [spec.name for spec, v in nodes.outputs if _state_owner(spec) == name and v in opt and v not in mine
                  and stage.get(v) == home]
        if missed:
            raise PipelineSplitError(f"tied parameter '{name}': the update of {missed[0]} reads values of its "
                                     f"stage {home} other than its own (rule: a tied weight's update is copied to "
                                     "every stage holding it)")


# -- values combined over every stage -------------------------------------------------------------

def _combination(node: torch.fx.Node, mixed: set):
    """The combination starting at ``node``, where stages first meet: (kind, root, leaves, tree), or
    None for one the stages cannot each compute a part of."""
    if node.target == aten.stack.default and len(node.users) == 1:
        (root,) = node.users
        leaves, tree = list(node.args[0]), {node}
        if root.target == aten.mul.Tensor and root.args == (node, node) and len(root.users) == 1 \
                and next(iter(root.users)).target == aten.sum.default:
            # Sum of squares (of sharded gradients' norms, all-reduced over their axis next).
            tree.add(root)
            return "sumsq", next(iter(root.users)), leaves, tree
        if root.target == aten.linalg_vector_norm.default and list(root.args[1:2]) in ([], [2.0], [2]) \
                and not root.args[2:] and not root.kwargs:
            return "norm", root, leaves, tree
        if root.target == aten.sum.default and not root.args[1:] and not root.kwargs:
            return "stacked_sum", root, leaves, tree
        return None
    if node.target in _REDUCTIONS:
        root = node
        while (len(root.users) == 1 and next(iter(root.users)).target == node.target
               and next(iter(root.users)) in mixed):
            root = next(iter(root.users))
        leaves, tree = _sum_tree(root, node.target)
        return _REDUCTIONS[node.target], root, leaves, tree
    return None


class _OverStages:
    """Rewrites the optimizer values combining several stages' into per-stage copies (see
    ``_reduce_over_stages``)."""

    def __init__(self, rw: _Rewriter, up: dict, mixed: list, n_stages: int, ranks: list[int], totals: dict):
        self.rw, self.up, self.n_stages, self.ranks = rw, up, n_stages, ranks
        self.mixed = set(mixed)
        self.totals = totals        # a tied weight's all-reduced gradient -> its step-state name
        self.handed: set[torch.fx.Node] = set()      # those another local stage's apply reads
        # accumulator value -> its step-state name: what another stage's apply graph reads it as
        self.accumulators = {value: spec.name for spec, value in rw.nodes.outputs
                             if spec.kind == OutputKind.STEP_STATE and spec.name.startswith(ACCUMULATOR_PREFIX)}
        self.imports: dict = {}                      # (other stage's node, stage) -> that stage's copy
        self.extra_cuts: dict[int, list] = {}        # stage -> other stages' accumulators its apply reads
        self.replica: dict = {}                      # (original node, stage) -> that stage's copy
        self.replicated: set[torch.fx.Node] = set()  # values every stage has its own copy of
        self.own: dict[torch.fx.Node, int] = {}      # one stage's values that read a replicated one
        self.done: set[torch.fx.Node] = set()
        self.reduced: list[str] = []

    def refuse(self, node):
        raise PassOptionError("pipeline_split", "stages", f"optimizer node {node.name} ({node.target}) combines values of stages "
                              f"{sorted(self.up[node])} (rule: a value combining stages must be a sum, a maximum, "
                              "a logical and, a 2-norm or a sum of squares of values each stage has, such as "
                              "global gradient-norm clipping's total norm or loss scaling's overflow check)")

    def combine(self, node: torch.fx.Node) -> None:
        """Where stages first meet: each stage combines its own terms and all-reduces its part."""
        found = _combination(node, self.mixed)
        if found is None:
            self.refuse(node)
        kind, root, leaves, tree = found
        stage = self.rw.stage
        by_stage: dict[int, list] = {}
        for leaf in leaves:
            where = self.up.get(leaf) or ({stage[leaf]} if leaf in stage else {0})
            if len(where) > 1:
                self.refuse(node)
            by_stage.setdefault(min(where), []).append(leaf)
        like = root.meta["val"]
        for s in range(self.n_stages):
            # A rank holding several stages (interleaved 1F1B, DualPipeV) contributes the terms of
            # all of them: each of its stages' apply graphs computes the same local part (reading
            # the other local stages' accumulators, which the rank holds), so every all-reduce over
            # the pipeline ranks, one per local stage, sums every stage's terms once.
            local = [t for t in range(self.n_stages) if self.ranks[t] == self.ranks[s]]
            terms = [leaf if t == s else self._import(leaf, s) for t in local for leaf in by_stage.get(t, [])]
            self.replica[(root, s)] = self._total(s, root, kind, terms, like)
        self.reduced.append(f"{root.name} ({kind})")
        self.replicated.add(root)
        self.done |= tree | {root}

    def _import(self, node: torch.fx.Node, s: int) -> torch.fx.Node:
        """Stage ``s``'s copy of another stage's optimizer value (a term of a combination): its
        optimizer nodes copied, the accumulators it reads cut as step-state inputs of ``s``'s apply."""
        key = (node, s)
        if key in self.imports:
            return self.imports[key]
        if node in self.accumulators or node in self.totals:
            # A tied weight's summed gradient is read as its updating stage's apply left it: all-reducing
            # it again here would add an all-reduce the rank's peers do not issue.
            name = self.accumulators.get(node) or self.totals[node]
            self.extra_cuts.setdefault(s, []).append((Spec(InputKind.STEP_STATE, name), node))
            if node in self.totals:
                self.handed.add(node)
            out = node
        elif node not in self.rw.stage:   # a placeholder or a free value: extracted where it is read
            out = node
        elif region_of(node) != Region.OPTIMIZER:
            raise PipelineSplitError(f"optimizer node {node.name} of stage {self.rw.stage[node]} is read by the "
                                     f"combination of stages on pipeline rank {self.ranks[s]}, but depends on "
                                     "a backward value that is not a gradient accumulator")
        else:
            out = self.rw.copy(node, s, {a: self._import(a, s) for a in node.all_input_nodes})
        self.imports[key] = out
        return out

    def _total(self, s: int, root: torch.fx.Node, kind: str, terms: list, like) -> torch.fx.Node:
        """Stage ``s``'s copy of the combined value ``root``: its own terms' part, all-reduced."""
        rw, anchor, opt = self.rw, root, Region.OPTIMIZER   # anchor: after every term
        if kind in ("norm", "sumsq", "stacked_sum"):
            if terms:
                stacked = rw.emit(anchor, s, opt, aten.stack.default, terms)
                if kind != "stacked_sum":
                    stacked = rw.emit(anchor, s, opt, aten.mul.Tensor, stacked, stacked)
                part = rw.emit(anchor, s, opt, aten.sum.default, stacked)
            else:
                part = rw.emit(anchor, s, opt, aten.zeros.default, [], dtype=like.dtype, device=like.device)
            total = rw.all_reduce(anchor, s, part, "sum")
            return rw.emit(anchor, s, opt, aten.sqrt.default, total) if kind == "norm" else total
        part = terms[0] if terms else None
        for term in terms[1:]:
            part = rw.emit(anchor, s, opt, root.target, part, term)
        if kind == "and":
            if part is None:
                part = rw.emit(anchor, s, opt, aten.ones.default, [], dtype=torch.float32, device=like.device)
            else:
                part = rw.emit(anchor, s, opt, aten._to_copy.default, part, dtype=torch.float32)
            return rw.emit(anchor, s, opt, aten.gt.Scalar, rw.all_reduce(anchor, s, part, "min"), 0.5)
        if part is None:
            fill = 0.0 if kind == "sum" else float("-inf")
            part = rw.emit(anchor, s, opt, aten.full.default, [], fill, dtype=like.dtype, device=like.device)
        return rw.all_reduce(anchor, s, part, kind)

    def follow(self, node: torch.fx.Node) -> None:
        """After the combination: a value every stage computes from the total alone, or one stage's own
        value (a parameter's clipped gradient) that reads the total."""
        stage = self.rw.stage
        others = set()
        for a in node.all_input_nodes:
            if a in self.replicated:
                continue
            others |= {self.own[a]} if a in self.own else self.up.get(a) or ({stage[a]} if a in stage else set())
        if len(others) > 1:
            self.refuse(node)
        if others:
            (t,) = others
            for a in [a for a in node.all_input_nodes if a in self.replicated]:
                node.replace_input_with(a, self.replica[(a, t)])
            stage[node] = self.own[node] = t
        else:
            for s in range(self.n_stages):
                self.replica[(node, s)] = self.rw.copy(node, s, {a: self.replica[(a, s)] for a in node.all_input_nodes
                                                                 if a in self.replicated})
            self.replicated.add(node)
        self.done.add(node)

    def outputs(self, outputs: list) -> list:
        """Outputs of replicated values (the norm as a metric): every stage reports its own copy."""
        out = []
        for spec, value in outputs:
            if value in self.replicated:
                out += [(spec, self.replica[(value, s)]) for s in range(self.n_stages)]
            else:
                out.append((spec, value))
        return out


# What a partial sum may pass through on its way into a total: it stays a sum of its terms.
_SUM_PRESERVING = (aten.add.Tensor, c10d.all_reduce.default, c10d.wait_tensor.default)


def _partial_sums_joining(ordered: list, mixed: set, n_stages: int) -> set:
    """One stage's sum of squares (or stacked sum) added into a total over every stage, with the
    nodes between: clipping's squares of gradients sharded over another axis (experts over ``ep``)
    whose parameters all sit in one stage. The other stages' terms of it are zero, but every stage
    needs the total: it is combined over the stages like one spanning them (zeros elsewhere)."""
    joining: set = set()
    for node in ordered:
        if node in mixed or node.target != aten.stack.default:
            continue
        found = _combination(node, mixed)
        if found is None or found[0] not in ("sumsq", "stacked_sum"):
            continue
        kind, root, leaves, tree = found
        path, todo, reaches = set(tree) | {node, root}, [root], False
        while todo:
            current = todo.pop()
            for user in current.users:
                if user in mixed:
                    reaches = reaches or user.target == aten.add.Tensor
                elif user.target in _SUM_PRESERVING and (user.target != c10d.all_reduce.default
                                                         or user.args[1] == "sum"):
                    path.add(user)
                    todo.append(user)
        if reaches:
            joining |= path
    return joining


def _reduce_over_stages(rw: _Rewriter, homes: dict, n_stages: int, ranks: list[int],
                        part_home: dict | None = None, totals: dict | None = None
                        ) -> tuple[dict, list[str], dict, set]:
    """Optimizer values that combine every stage's (global gradient-norm clipping's total norm): each
    stage computes its part (with several stages per rank, its rank's part), an all-reduce over the
    pipeline ranks combines the parts, and every stage computes what follows from the total itself.
    Returns (original node, stage) -> that stage's copy, the combinations made, and per stage the
    other stages' accumulators its apply graph reads."""
    nodes, stage = rw.nodes, rw.stage
    opt = set(nodes.optimizer)
    ordered = [n for n in rw.graph.nodes if n in opt]
    part_home = part_home or {}
    up = upstream_stages(nodes, homes, ordered,
                         lambda a: (part_home[a],) if a in part_home else (stage[a],) if a in stage else ())
    mixed = [n for n in ordered if len(up[n]) > 1]
    if not mixed:
        return {}, [], {}, set()
    joining = _partial_sums_joining(ordered, set(mixed), n_stages)
    if joining:
        for node in joining:
            up[node] = set(range(n_stages))
        mixed = [n for n in ordered if n in joining or len(up[n]) > 1]
    over = _OverStages(rw, up, mixed, n_stages, ranks, totals or {})
    for node in mixed:
        if node in over.done:
            continue
        if not any(a in over.mixed for a in node.all_input_nodes):
            over.combine(node)
        else:
            over.follow(node)
    nodes.outputs = over.outputs(nodes.outputs)
    rw.drop({n for n in over.done if n not in over.own})
    return over.replica, over.reduced, over.extra_cuts, over.handed


# -- sharing across stages ------------------------------------------------------------------------

def _metrics_behind(nodes: _Nodes, node: torch.fx.Node) -> str:
    """' (behind metric 'loss_scale:found_inf')': the metrics computed from ``node``, to name what a
    user asked for (clipping's norm, loss scaling's overflow flag) rather than a node."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    names = sorted({spec.name for spec, value in nodes.outputs
                    if spec.kind == OutputKind.METRIC and value in seen})
    return f" (behind metric {', '.join(repr(n) for n in names)})" if names else ""


def pp_subgroup_name(pp_group: str, pp_ranks) -> str:
    """The name of the process group of the pipeline ranks ``pp_ranks`` within this rank's pp group
    (the runtime creates and registers it under this name: ``runtime.pipeline_parallel.make_pp_subgroups``)."""
    return f"{pp_group}.pp{'_'.join(str(r) for r in pp_ranks)}"


def _share_across_stages(nodes: _Nodes, stage: dict, homes: dict, shared: dict, mixed: list, ranks: list[int],
                         n_stages: int, pp: int, schedule: str, ctx, program
                         ) -> tuple[dict, list[str], dict, dict, list[int]]:
    """Tied weights and values combined over every stage, rewritten into per-stage parts whose
    all-reduce runs over the pipeline ranks (the mesh's ``pp`` group; a tied weight whose stages
    are some of them, over a group of just those: returned as name -> their pp ranks), and per
    stage the other stages' accumulators its apply graph reads."""
    if not shared and not mixed:
        return {}, [], {}, {}, list(range(n_stages))
    what = (f"parameter '{next(iter(shared))}' (read by the forward of stages {next(iter(shared.values()))})"
            if shared else f"optimizer node {mixed[0].name}{_metrics_behind(nodes, mixed[0])}, which combines "
                           "values of several stages")
    option = "schedule" if schedule in ("dualpipev", "zbv") else "stages"
    value = schedule if option == "schedule" else n_stages
    mesh = getattr(ctx, "mesh", None) or program.mesh
    if mesh is None or "pp" not in mesh.axes or mesh.size("pp") != pp:
        raise PipelineSplitError(f"{what} needs the mesh's pp axis of {pp} ranks to name its all-reduce's group")
    pp_group = mesh.group_name("pp")
    subgroups: dict[str, list[int]] = {}

    def group_of(name: str, holders) -> str:
        # GPT-2's embedding at pp > 2: the first and last ranks sum their parts; the ranks between
        # (which do not hold it) take no part, so the group is just the holders' (Megatron's
        # embedding group), made by the runtime under this name on every member. Interleaved
        # stages keep the first and the last stage on different ranks; DualPipeV puts both on rank 0.
        pp_ranks = sorted({ranks[s] for s in holders})
        if len(pp_ranks) == 1:     # every holder on one rank: its updating stage sums the parts locally
            return None
        if pp_ranks == list(range(pp)):
            return pp_group
        name = pp_subgroup_name(pp_group, pp_ranks)
        subgroups[name] = pp_ranks
        return name
    rw = _Rewriter(nodes, stage, pp_group)
    tied_cuts: dict[int, list] = {}
    tied = _split_tied_gradients(rw, homes, shared, group_of, ranks, tied_cuts)
    # A holder's part added into its rank's sum counts as the tied weight's home: the sum is that
    # weight's gradient, not a value combining stages.
    part_home = {acc: homes[name] for name, info in tied.items() for s, (_, acc) in info["acc"].items()}
    totals = {info["summed"]: f"{ACCUMULATOR_PREFIX}{name}{SUMMED_SUFFIX}" for name, info in tied.items()
              if info.get("summed") is not None}
    replica, reduced, extra_cuts, handed = _reduce_over_stages(rw, homes, n_stages, ranks, part_home, totals)
    for s, cuts in tied_cuts.items():
        extra_cuts.setdefault(s, []).extend(cuts)
    _hand_totals(rw, handed, totals)
    _copy_tied_updates(rw, homes, tied, replica)
    order = apply_order(tied, n_stages)
    unpaired = _unpaired_reductions(rw, order, ranks, pp, pp_group, subgroups)
    if unpaired:
        # The i-th all-reduce of one rank over a group pairs with the i-th of every other: a rank
        # issuing one its peers do not would combine unrelated values, or wait forever.
        raise PassOptionError("pipeline_split", option, f"{what} and schedule '{schedule}' puts stages "
                              f"{list(range(n_stages))} on pipeline ranks {ranks}: {unpaired} (rule: every rank of "
                              "a group issues the same all-reduces in the same order; untie the weight or run one "
                              "stage per rank)", value)
    return tied, reduced, subgroups, extra_cuts, order


def _hand_totals(rw: _Rewriter, handed: set, totals: dict) -> None:
    """A tied weight's summed gradient that another local stage's apply reads (its clip term, its
    overflow check) becomes step state its updating stage's apply outputs."""
    step_state = rw.nodes.graph.attrs.setdefault(GraphAttr.STEP_STATE, {})
    for node in sorted(handed, key=lambda n: rw.nodes.order.get(n, 1 << 60)):
        name = totals[node]
        step_state[name] = dict(step_state[name[:-len(SUMMED_SUFFIX)]])
        rw.nodes.outputs.append((Spec(OutputKind.STEP_STATE, name), node))


def apply_order(tied: dict, n_stages: int) -> list[int]:
    """The order a rank runs its stages' apply graphs in: a stage updating a weight tied across ranks
    first (by the weights it updates), then by index. So every holding rank all-reduces the weight
    before its other combinations, and hands the sum to its other local stages' applies."""
    updates: dict[int, list[str]] = {}
    for name, info in tied.items():
        if info.get("summed") is not None:
            for s in info["parts"]:
                updates.setdefault(s, []).append(name)
    return sorted(range(n_stages), key=lambda s: (0, sorted(updates[s]), s) if s in updates else (1, [], s))


def _unpaired_reductions(rw: _Rewriter, order: list[int], ranks: list[int], pp: int, pp_group: str,
                         subgroups: dict) -> str:
    """Where two ranks of a group would issue their all-reduces over it in different orders (the
    i-th of one pairing with the i-th of another): '' when every group's ranks agree."""
    opt = set(rw.nodes.optimizer)
    by_stage: dict[int, list] = {}
    for node in rw.graph.nodes:
        if node in opt and node.target == c10d.all_reduce.default:
            by_stage.setdefault(rw.stage[node], []).append(node)
    members = {pp_group: list(range(pp)), **subgroups}
    for group, pp_ranks in members.items():
        seen = {r: [_reduced_what(n) for s in order if ranks[s] == r for n in by_stage.get(s, [])
                    if n.args[2] == group] for r in pp_ranks}
        first = seen[pp_ranks[0]]
        for r in pp_ranks[1:]:
            if seen[r] != first:
                return (f"over group {group}, pipeline rank {pp_ranks[0]} would all-reduce {first} while rank {r} "
                        f"all-reduces {seen[r]}")
    return ""


def _reduced_what(node: torch.fx.Node) -> str:
    """An all-reduce as the ranks pairing it must agree on it: its reduction and its value's shape."""
    val = node.meta.get("val")
    return f"{node.args[1]} of {list(val.shape) if isinstance(val, torch.Tensor) else '?'}"
