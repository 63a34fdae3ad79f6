"""One unit's backward in two halves, as a zero-bubble stage runs it: ``B`` (input gradient), then ``W``.

A zero-bubble schedule (:mod:`paci_tune.schedule.synchronous`) sends the previous stage its input
gradient as soon as it is known (``B``) and computes the weight gradients later (``W``), in what
would otherwise be the bubble. Calibration times the two halves (:mod:`.pattern`, :mod:`.units`)
so the simulator can time ZB-H1 from measured costs rather than a stated guess.

**How the backward is split** (the scheme torch.distributed.pipelining's ``stage_backward_input`` /
``stage_backward_weight`` use, written here from the autograd graph's structure):

- ``B``: ``torch.autograd.grad`` of the unit's output with respect to its *input only*, keeping
  the graph. Autograd then runs only the nodes on a path from the output to the input, and each of
  them computes only the gradients that lead there: a linear layer's node computes the gradient of
  its input, not of its weight. Before it runs, a pre-hook is placed on every *junction*: a node on
  the input path that also has an edge into a branch leading to a trainable parameter (the linear
  layer's node; a layer norm's). The hook keeps the gradient that arrives at the junction.
- ``W``: for each group of junctions (those that reach a common parameter), ``torch.autograd.grad``
  starting at the junctions with the kept gradients, with respect to the group's parameters only.
  Autograd now runs each junction again for its weight gradient and the branches behind it, never
  the input path again. Where a group has two junctions one behind the other (a parameter used
  twice), the front one's gradient would also flow into the back one: the back junction's hook then
  replaces whatever arrives with the gradient it kept in ``B``, so nothing is counted twice.

So ``B + W`` does the arithmetic of one whole backward, plus what the split costs: the graph walk
that finds the junctions (in ``B``, where a zero-bubble runtime pays it too) and a second autograd
pass. Calibration measures both halves with that overhead in, and reports ``backward_s`` (one
whole backward) beside them. A unit whose input needs no gradient (the first unit, or one behind
frozen units only) has ``B`` = nothing to run; a unit with nothing to train has ``W`` = nothing.
May import: torch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


def _successors(root: Node) -> dict[Node, list[Node]]:
    """Every node of the graph under ``root`` -> the nodes its backward sends gradients to."""
    out: dict[Node, list[Node]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node in out:
            continue
        out[node] = [m for m, _ in node.next_functions if m is not None]
        stack.extend(out[node])
    return out


def _reaching(succ: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """The nodes from which one of ``targets`` can be reached (``targets`` themselves included)."""
    preds: dict[Node, list[Node]] = defaultdict(list)
    for node, nexts in succ.items():
        for m in nexts:
            preds[m].append(node)
    return _closure(preds, [t for t in targets if t in succ])


def _successors_many(succ: dict[Node, list[Node]], starts: list[Node]) -> set[Node]:
    """Every node reachable from ``starts`` (themselves included), in the graph ``succ``."""
    return _closure(succ, starts)


def _closure(edges: dict[Node, list[Node]], starts: list[Node]) -> set[Node]:
    """``starts`` and every node reachable from them along ``edges`` (one traversal for both directions)."""
    seen = set(starts)
    stack = list(seen)
    while stack:
        for m in edges.get(stack.pop(), ()):
            if m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


def _leaf_nodes(succ: dict[Node, list[Node]], tensors: Sequence[torch.Tensor]) -> dict[Node, torch.Tensor]:
    """The gradient accumulators in the graph that belong to ``tensors`` (leaves), each with its tensor."""
    wanted = {id(t): t for t in tensors}
    out = {}
    for node in succ:
        var = getattr(node, "variable", None)  # only an accumulator of a leaf has one
        if var is not None and id(var) in wanted:
            out[node] = wanted[id(var)]
    return out


class SplitBackward:
    """The backward of ``output`` (a unit's output, or its loss) in two halves (module docstring).

    ``inp``: the unit's input as a leaf (a stage boundary), or None when it needs no gradient;
    ``params``: the unit's trainable parameters. Call :meth:`input_half` once, then
    :meth:`weight_half` once; the weight gradients are added to each parameter's ``.grad`` as
    ``backward()`` would.
    """

    def __init__(
        self,
        output: torch.Tensor,
        inp: torch.Tensor | None,
        params: Sequence[torch.Tensor],
        grad_output: torch.Tensor | None = None,
    ) -> None:
        self.output, self.grad_output = output, grad_output
        self.inp = inp if inp is not None and inp.requires_grad else None
        if self.inp is not None and self.inp.grad_fn is not None:
            raise ValueError("the split needs the unit's input as a leaf (detached at the stage boundary)")
        self.params = [p for p in params if p.requires_grad]
        self._kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
        self._groups: list[tuple[list[Node], list[torch.Tensor]]] = []
        self._whole = False  # W is the whole backward (nothing on the output's path reaches the input)

    @property
    def has_input_half(self) -> bool:
        return self.output.requires_grad and self.inp is not None

    @property
    def has_weight_half(self) -> bool:
        return self.output.requires_grad and bool(self.params)

    def _plan(self) -> None:
        """Find the junctions and group them by the parameters they reach."""
        root = self.output.grad_fn
        assert root is not None and self.inp is not None
        succ = _successors(root)
        to_input = _reaching(succ, set(_leaf_nodes(succ, [self.inp])))
        if root not in to_input:  # the output does not depend on the input: all of it is W
            self._whole = True
            return
        param_of = _leaf_nodes(succ, self.params)
        to_param = _reaching(succ, set(param_of))
        # Per junction, the parameters reached through its branches (never through the input path).
        reached: dict[Node, set[Node]] = {}
        for node in to_input:
            branches = [m for m in succ[node] if m not in to_input and m in to_param]
            if branches:
                below = _successors_many(succ, branches)
                reached[node] = {n for n in below if n in param_of}
        # Junctions that reach a common parameter form one group (union-find): one W call per group.
        junctions = list(reached)
        parent = list(range(len(junctions)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[Node, int] = {}
        for i, junction in enumerate(junctions):
            for leaf in reached[junction]:
                if leaf in owner:
                    parent[find(i)] = find(owner[leaf])
                else:
                    owner[leaf] = i
        groups: dict[int, tuple[list[Node], set[Node]]] = defaultdict(lambda: ([], set()))
        for i, junction in enumerate(junctions):
            joints, leaves = groups[find(i)]
            joints.append(junction)
            leaves.update(reached[junction])
        self._groups = [(joints, [param_of[leaf] for leaf in leaves]) for joints, leaves in groups.values()]

    def input_half(self) -> torch.Tensor | None:
        """``B``: the gradient of the unit's input (None without one), keeping what ``W`` starts from."""
        if not self.has_input_half:
            return None
        assert self.inp is not None
        if not self.params:  # nothing to train: B is the whole backward
            (grad,) = torch.autograd.grad(self.output, self.inp, self.grad_output)
            return grad
        self._plan()
        if self._whole:
            return torch.zeros_like(self.inp)
        handles = []
        for joints, _ in self._groups:
            for node in joints:
                handles.append(node.register_prehook(self._keeper(node)))
        try:
            (grad,) = torch.autograd.grad(self.output, self.inp, self.grad_output, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        return grad

    def _keeper(self, node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        """A pre-hook that keeps the gradients arriving at ``node`` during ``B``."""

        def keep(grads: tuple[torch.Tensor | None, ...]) -> None:
            self._kept[node] = grads

        return keep

    def weight_half(self) -> None:
        """``W``: the weight gradients, added to the parameters' ``.grad`` (after :meth:`input_half`)."""
        if not self.has_weight_half:
            return
        if self.inp is None or self._whole:  # no B ran: W is the whole backward, from the output
            grads = torch.autograd.grad(self.output, self.params, self.grad_output, allow_unused=True)
            _accumulate(self.params, grads)
            return
        for joints, params in self._groups:
            edges, seeds, handles = [], [], []
            for node in joints:
                kept = self._kept.get(node, ())
                for k, g in enumerate(kept):
                    if g is not None:
                        edges.append(GradientEdge(node, k))
                        seeds.append(g)
                if len(joints) > 1:  # a junction behind another gets exactly what B gave it
                    handles.append(node.register_prehook(lambda _, kept=kept: kept))
            try:
                if edges:
                    grads = torch.autograd.grad(edges, params, seeds, retain_graph=True, allow_unused=True)
                    _accumulate(params, grads)
            finally:
                for h in handles:
                    h.remove()
        self._kept.clear()


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Add each gradient to its parameter's ``.grad``, as ``backward()`` does."""
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.detach().clone() if g.requires_grad else g
            else:
                p.grad.add_(g)
