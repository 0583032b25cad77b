"""How much per-head work a checked bias expression does per (query, key) pair.

At explicit positions an expression of j - i alone can be evaluated per pair, or once
per distance the pairs reach and then read per pair by one gather of [H, N, M] entries
(the runtime's ``bias_read_per_distance``). The gather costs about two elementwise
passes over [H, N, M] on a CPU (a [8, 128, 2048] float32 chunk, 2-core x86: gather
1.4 ms, one product 0.7 ms), so it pays only for an expression that does more per
pair and head than that. A node's work counts where it reads a position (i or j) and
a head (h or a per-head parameter): its result is then [H, N, M]. Work of a position
alone ([N, M]) is shared by the heads and left out; so are names and numbers.
"""

from __future__ import annotations

import ast

#: a call of these costs about this many elementwise products (2-core x86, float32)
TRANSCENDENTAL_WORK = 4
TRANSCENDENTALS = frozenset({"log", "log1p", "exp", "sqrt", "sin", "cos"})
#: per-head work per pair from which the runtime reads the expression from a vector over
#: the distances at explicit positions (a gather of the pairs costs about 2)
DISTANCE_VECTOR_MIN_WORK = 3

_POSITIONS = frozenset({"i", "j"})


def per_head_pair_work(body: ast.AST, per_head_params: frozenset[str]) -> int:
    """The work per (head, query, key) of ``body``, in elementwise products: 1 per
    operation, ``TRANSCENDENTAL_WORK`` per transcendental call or power, counted where
    the operation's result reads a position and a head (``per_head_params``: the
    parameters read as NAME[h])."""
    work = 0

    def visit(node: ast.AST) -> tuple[bool, bool]:
        """Whether ``node`` reads a position, and a head."""
        nonlocal work
        if isinstance(node, ast.Name):
            return node.id in _POSITIONS, node.id == "h" or node.id in per_head_params
        if isinstance(node, ast.Subscript):  # NAME[h]: a per-head parameter
            return False, True
        children = [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.expr)]
        if isinstance(node, ast.Call):  # the callee's name is no operand
            children = list(node.args)
        reads = [visit(child) for child in children]
        position = any(p for p, _ in reads)
        head = any(h for _, h in reads)
        if position and head:
            heavy = isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                heavy = node.func.id in TRANSCENDENTALS
            work += TRANSCENDENTAL_WORK if heavy else 1
        return position, head

    visit(body)
    return work
