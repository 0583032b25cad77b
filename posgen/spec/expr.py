"""The safe expression language of ``kind: expr`` biases.

A bias that no built-in kind covers is written as one Python-syntax expression of the
query position ``i``, the key position ``j``, the head index ``h`` and declared
parameters, e.g. KERPLE-log (Chi et al. 2022)::

    expr: "-r1[h] * log1p(r2[h] * abs(i - j))"

The text is parsed with ``ast.parse(mode="eval")`` and walked against a whitelist;
anything outside it is refused with the character offset of the offending token (the
loader turns it into ``file:line:col``). The grammar:

- names: ``i``, ``j`` (float positions), ``h`` (the head index, a float), and the
  declared parameters; a parameter of shape ``[heads]`` is read only as ``name[h]``,
  a scalar parameter (shape ``[]``) only as ``name``;
- numbers: int and float literals (finite, at most ``MAX_NUMBER_CHARS`` characters;
  a nonzero one that float64 rounds to 0, such as ``1e-400``, is refused);
- operators: ``+ - * / ** %`` (binary), ``-`` and ``+`` (unary), comparisons
  ``< <= > >= == !=`` (one operator per comparison, giving a boolean for ``where``);
  no boolean operators (``and or not & | ~``);
- functions (positional arguments only, fixed arity): ``abs log log1p exp sqrt sin cos
  sign floor`` (1), ``minimum maximum`` (2), ``clamp(x, lo, hi)`` and
  ``where(condition, a, b)`` (3); a call needs at least one argument that depends on
  ``i``, ``j``, ``h`` or a parameter (write a constant as a number);
- limits: ``MAX_EXPR_CHARS`` characters of printable ASCII on one line,
  ``MAX_EXPR_NODES`` syntax nodes (names, numbers, operators and calls, as
  ``count_nodes`` counts them: ``-abs(i - j)`` is 5), nesting at most ``MAX_EXPR_DEPTH``
  deep.

Every node is then typed (``check_types``) as a number or a boolean: a comparison takes
two numbers and gives a boolean, which only ``where``'s first argument takes; every
other operator, function and argument takes numbers and gives a number, and the whole
expression must be a number. A refusal names the offending sub-expression.

Rendering (``render_steps``) never copies text from the spec: each node becomes one
assignment ``tK = ...`` built from a fixed table of torch calls, the temporaries of its
operands, ``repr`` of finite floats, and parameter locals ``p_NAME`` whose names were
checked as identifiers. Every value is a tensor (numbers become 0-d tensors of the
bias dtype), so every torch call receives tensors. The lines are as ruff formats them
(``binary_code``: ``t0**t1``); the templates assign only the names the steps read.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .expr_shift import reads_difference_only

MAX_EXPR_CHARS = 500
"""Longest expression text (KERPLE-log is 34 characters)."""
MAX_EXPR_NODES = 64
"""Most syntax nodes in one expression: names, numbers, operators and calls
(``count_nodes``), each at most one rendered step."""
MAX_EXPR_DEPTH = 16
"""Deepest nesting of operators and calls."""
MAX_NUMBER_CHARS = 32
"""Longest number literal inside an expression."""
MAX_LITERAL = 1e6
"""Largest magnitude of a number literal."""

PARAM_NAME = re.compile(r"^[a-z][a-z0-9_]{0,30}$")
POSITION_NAMES = ("i", "j", "h", "heads")  # heads: the module's head count, a constant
FREQUENCY_NAMES = ("k", "d", "base")  # pair index, rotated features, the spec's base

# function name -> (arity, torch call); the call is written with its operands by
# ``_render_call`` from this fixed table only.
FUNCTIONS: dict[str, tuple[int, str]] = {
    "abs": (1, "torch.abs"),
    "log": (1, "torch.log"),
    "log1p": (1, "torch.log1p"),
    "exp": (1, "torch.exp"),
    "sqrt": (1, "torch.sqrt"),
    "sin": (1, "torch.sin"),
    "cos": (1, "torch.cos"),
    "sign": (1, "torch.sign"),
    "floor": (1, "torch.floor"),
    "minimum": (2, "torch.minimum"),
    "maximum": (2, "torch.maximum"),
    "clamp": (3, "torch.clamp"),
    "where": (3, "torch.where"),
}
BINARY_OPERATORS: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.Pow: "**",
    ast.Mod: "%",
}
UNARY_OPERATORS: dict[type[ast.unaryop], str] = {ast.USub: "-", ast.UAdd: "+"}
COMPARISONS: dict[type[ast.cmpop], str] = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
}
RESERVED_PARAM_NAMES = frozenset(POSITION_NAMES) | frozenset(FUNCTIONS)

_REFUSED: dict[type[ast.AST], str] = {
    ast.Attribute: "attribute access",
    ast.Lambda: "a lambda",
    ast.ListComp: "a comprehension",
    ast.SetComp: "a comprehension",
    ast.DictComp: "a comprehension",
    ast.GeneratorExp: "a comprehension",
    ast.Starred: "a starred argument",
    ast.BoolOp: "'and' / 'or' (use where)",
    ast.IfExp: "a conditional expression (use where)",
    ast.List: "a list",
    ast.Tuple: "a tuple",
    ast.Dict: "a dict",
    ast.Set: "a set",
    ast.JoinedStr: "an f-string",
    ast.NamedExpr: "an assignment expression",
    ast.Await: "await",
    ast.Yield: "yield",
    ast.Slice: "a slice",
}


class ExprError(ValueError):
    """A refused expression: ``offset`` is the 0-based character of the offending token."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset


@dataclass(frozen=True)
class ParamInfo:
    """What the parser needs of a declared parameter."""

    per_head: bool  # shape [heads]: read as name[h]


@dataclass(frozen=True)
class Parsed:
    """A checked expression: its tree and what it reads."""

    tree: ast.Expression
    params: tuple[str, ...]  # parameters read, in first-use order
    uses_i: bool
    uses_j: bool
    uses_h: bool
    reads: frozenset[str] = frozenset()  # every variable and parameter it reads
    uses_heads: bool = False  # reads the head count (ALiBi-like recipes of h / heads)
    # unchanged when i and j shift together: a function of j - i (expr_shift.py)
    of_difference: bool = False


def _offset(node: ast.AST) -> int:
    return int(getattr(node, "col_offset", 0))


_NONZERO_MANTISSA = re.compile(r"[1-9]")
"""A literal whose digits before the exponent include one of these is not zero."""
_PLAIN_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _check_number_spelling(text: str, nodes: list[ast.AST]) -> None:
    """Number literals in plain decimal, as the spec's YAML numbers: no 0x/0o/0b prefix
    and no _ separator (Python reads 0x10 and 1_000; the rest of a spec refuses them)."""
    for node in nodes:
        if isinstance(node, ast.Constant) and node.end_col_offset is not None:
            spelled = text[node.col_offset : node.end_col_offset]
            if not _PLAIN_DECIMAL.fullmatch(spelled):
                raise ExprError(
                    f"number {spelled}: write numbers in plain decimal (no 0x, 0o or 0b "
                    "prefix, no _ separator), as everywhere in a spec",
                    node.col_offset,
                )


def parse_expr(
    text: str, params: dict[str, ParamInfo], names: tuple[str, ...] = POSITION_NAMES
) -> Parsed:
    """Parse and check ``text`` against the whitelist; raises ExprError.

    ``names``: the variables it may read (a bias: i, j, h; a frequency schedule: k, d,
    base), beside the declared parameters.
    """
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(
            f"expression of {len(text)} characters, past the limit of {MAX_EXPR_CHARS}",
            MAX_EXPR_CHARS,
        )
    for index, char in enumerate(text):
        if not " " <= char <= "~":
            raise ExprError(
                f"character U+{ord(char):04X}: an expression is one line of printable ASCII",
                index,
            )
        if char == "#":  # Python would drop the rest as a comment
            raise ExprError("'#' would start a comment: an expression holds none", index)
    if not text.strip():
        raise ExprError("empty expression", 0)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as error:
        offset = max((error.offset or 1) - 1, 0)
        raise ExprError(f"invalid syntax: {error.msg}", min(offset, len(text))) from None
    nodes = list(ast.walk(tree.body))
    count = count_nodes(tree.body)
    if count > MAX_EXPR_NODES:
        raise ExprError(
            f"{count} syntax nodes, past the limit of {MAX_EXPR_NODES} (names, numbers, "
            "operators and calls): split the idea into a built-in kind or a shorter formula",
            0,
        )
    checker = _Checker(params, names, text)
    checker.check(tree.body, 1)
    _check_number_spelling(text, nodes)
    check_types(tree.body)
    if not checker.varying(tree.body):
        raise ExprError(
            f"the expression is a constant: it must use {', '.join(names)} or a parameter", 0
        )
    return Parsed(
        tree=tree,
        params=tuple(checker.used_params),
        uses_i="i" in checker.used_names,
        uses_j="j" in checker.used_names,
        uses_h="h" in checker.used_names,
        reads=frozenset(checker.used_names),
        uses_heads="heads" in checker.used_names,
        of_difference=reads_difference_only(tree.body),
    )


def count_nodes(body: ast.expr) -> int:
    """The syntax nodes ``MAX_EXPR_NODES`` bounds: every name, number, operator (binary,
    unary or comparison) and call, i.e. every ``ast.expr`` node, where a call's function
    name belongs to its call and a parameter read ``name[h]`` is one name. The tree's
    bookkeeping objects (Load contexts, operator tokens such as ``ast.Add``) are not
    counted: they add nothing to the rendered steps."""
    parts: set[int] = set()  # nodes that belong to the node above them
    for node in ast.walk(body):
        if isinstance(node, ast.Call):
            parts.add(id(node.func))
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and isinstance(node.slice, ast.Name)
        ):
            parts.update((id(node.value), id(node.slice)))
    return sum(1 for node in ast.walk(body) if isinstance(node, ast.expr) and id(node) not in parts)


class _Checker:
    def __init__(self, params: dict[str, ParamInfo], names: tuple[str, ...], text: str) -> None:
        self.params = params
        self.names = names
        self.text = text
        self.used_params: list[str] = []
        self.used_names: set[str] = set()

    def varying(self, node: ast.AST) -> bool:
        """The node depends on i, j, h or a parameter."""
        return any(isinstance(sub, ast.Name) for sub in ast.walk(node))

    def use_param(self, name: str) -> None:
        if name not in self.used_params:
            self.used_params.append(name)

    def check(self, node: ast.AST, depth: int) -> None:
        if depth > MAX_EXPR_DEPTH:
            raise ExprError(f"nested more than {MAX_EXPR_DEPTH} deep", _offset(node))
        if isinstance(node, ast.Constant):
            self._number(node)
        elif isinstance(node, ast.Name):
            self._name(node)
        elif isinstance(node, ast.Subscript):
            self._subscript(node)
        elif isinstance(node, ast.BinOp):
            if type(node.op) not in BINARY_OPERATORS:
                raise ExprError(
                    "operator not allowed; allowed: + - * / ** %", _operator_offset(node)
                )
            self.check(node.left, depth + 1)
            self.check(node.right, depth + 1)
        elif isinstance(node, ast.UnaryOp):
            if type(node.op) not in UNARY_OPERATORS:
                raise ExprError("unary operator not allowed; allowed: - +", _offset(node))
            self.check(node.operand, depth + 1)
        elif isinstance(node, ast.Compare):
            self._compare(node, depth)
        elif isinstance(node, ast.Call):
            self._call(node, depth)
        else:
            what = _REFUSED.get(type(node), f"{type(node).__name__} syntax")
            raise ExprError(f"{what} is not allowed in an expression", _offset(node))

    def _number(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, str):
            raise ExprError("a string literal is not allowed in an expression", _offset(node))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ExprError(
                f"literal {value!r} is not allowed: only int and float numbers", _offset(node)
            )
        if isinstance(value, int) and len(str(abs(value))) > MAX_NUMBER_CHARS:
            raise ExprError(f"number literal longer than {MAX_NUMBER_CHARS} digits", _offset(node))
        if not math.isfinite(float(value)) or abs(float(value)) > MAX_LITERAL:
            raise ExprError(
                f"number literal out of range: at most {MAX_LITERAL:g} in magnitude",
                _offset(node),
            )
        spelled = self.text[node.col_offset : node.end_col_offset or node.col_offset]
        if value == 0 and _NONZERO_MANTISSA.search(re.split("[eE]", spelled)[0]):
            # a nonzero literal that float64 rounds to 0: the term would silently vanish
            raise ExprError(
                f"number {spelled!r} underflows to 0 (float64 reaches down to ~5e-324)",
                _offset(node),
            )

    def _name(self, node: ast.Name) -> None:
        name = node.id
        if name in self.names:
            self.used_names.add(name)
            return
        info = self.params.get(name)
        if info is None:
            known = ", ".join([*self.names, *sorted(self.params)])
            hint = " (a function must be called)" if name in FUNCTIONS else ""
            raise ExprError(f"unknown name {name!r}{hint}; allowed names: {known}", _offset(node))
        if info.per_head:
            raise ExprError(
                f"parameter {name!r} has shape [heads]: read it as {name}[h]", _offset(node)
            )
        self.use_param(name)
        self.used_names.add(name)

    def _subscript(self, node: ast.Subscript) -> None:
        target, index = node.value, node.slice
        if not isinstance(target, ast.Name) or target.id not in self.params:
            raise ExprError(
                "only a declared [heads] parameter may be indexed, as name[h]", _offset(node)
            )
        if not self.params[target.id].per_head:
            raise ExprError(
                f"parameter {target.id!r} is a scalar (shape []): write {target.id}, not an index",
                _offset(node),
            )
        if not isinstance(index, ast.Name) or index.id != "h" or "h" not in self.names:
            raise ExprError(
                f"a [heads] parameter is indexed by h only ({target.id}[h])", _offset(index)
            )
        self.use_param(target.id)
        self.used_names.add(target.id)

    def _compare(self, node: ast.Compare, depth: int) -> None:
        if len(node.ops) != 1:
            raise ExprError(
                "chained comparisons are not allowed: compare two values", _offset(node)
            )
        if type(node.ops[0]) not in COMPARISONS:
            raise ExprError(
                "comparison not allowed; allowed: < <= > >= == !=", _offset(node.comparators[0])
            )
        self.check(node.left, depth + 1)
        self.check(node.comparators[0], depth + 1)
        if not (self.varying(node.left) or self.varying(node.comparators[0])):
            raise ExprError("a comparison of two constants: write the result", _offset(node))

    def _call(self, node: ast.Call, depth: int) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            raise ExprError("attribute access is not allowed in an expression", _offset(func))
        if not isinstance(func, ast.Name):
            raise ExprError(
                f"only the listed functions may be called: {', '.join(FUNCTIONS)}",
                _offset(func),
            )
        if func.id not in FUNCTIONS:
            raise ExprError(
                f"unknown function {func.id!r}; allowed: {', '.join(FUNCTIONS)}", _offset(func)
            )
        if node.keywords:
            raise ExprError(
                f"{func.id}() takes positional arguments only", _offset(node.keywords[0].value)
            )
        arity = FUNCTIONS[func.id][0]
        for argument in node.args:
            if isinstance(argument, ast.Starred):
                raise ExprError("a starred argument is not allowed", _offset(argument))
        if len(node.args) != arity:
            raise ExprError(
                f"{func.id}() takes {arity} argument{'s' if arity > 1 else ''}, got "
                f"{len(node.args)}",
                _offset(func),
            )
        for argument in node.args:
            self.check(argument, depth + 1)
        if not any(self.varying(argument) for argument in node.args):
            raise ExprError(f"{func.id}() of constants: write the number instead", _offset(func))


def _operator_offset(node: ast.BinOp) -> int:
    return int(getattr(node.left, "end_col_offset", None) or _offset(node))


# --------------------------------------------------------------------------- types

ExprType = Literal["number", "bool"]
"""The static type of a node: comparisons give booleans, everything else numbers."""

_CONDITION_ONLY = (
    "a comparison (< <= > >= == !=) is a boolean, allowed only as where()'s condition "
    "(where(cond, 1.0, 0.0) is a number)"
)


def check_types(body: ast.expr) -> None:
    """Type every node of a whitelisted expression; raises ExprError at the offending
    sub-expression. The expression itself must be a number."""
    if type_of(body) == "bool":
        raise ExprError(f"the expression must be a number; {_CONDITION_ONLY}", _offset(body))


def type_of(node: ast.expr) -> ExprType:
    """The type of a whitelisted node, after checking its operands' types."""
    if isinstance(node, ast.Compare):
        _expect_numbers((node.left, *node.comparators), "a comparison")
        return "bool"
    if isinstance(node, ast.BinOp):
        _expect_numbers((node.left, node.right), f"operator {BINARY_OPERATORS[type(node.op)]}")
    elif isinstance(node, ast.UnaryOp):
        _expect_numbers((node.operand,), f"unary {UNARY_OPERATORS[type(node.op)]}")
    elif isinstance(node, ast.Call):
        _check_call_types(node)
    return "number"  # numbers, names, name[h], arithmetic and calls


def _check_call_types(node: ast.Call) -> None:
    """where(bool, number, number); every other function takes numbers."""
    assert isinstance(node.func, ast.Name)  # checked by _Checker
    user, arguments = f"{node.func.id}()", node.args
    if node.func.id == "where":
        condition, *arguments = arguments
        if type_of(condition) != "bool":
            raise ExprError(
                "where()'s first argument must be a comparison (< <= > >= == !=), not a number",
                _offset(condition),
            )
        user = "where() after its condition"
    _expect_numbers(arguments, user)


def _expect_numbers(operands: Sequence[ast.expr], user: str) -> None:
    """Each operand is a number; ``user`` names what takes them."""
    for operand in operands:
        if type_of(operand) == "bool":
            raise ExprError(f"{user} takes numbers only; {_CONDITION_ONLY}", _offset(operand))


# --------------------------------------------------------------------------- rendering


def render_steps(
    parsed: Parsed, names: tuple[str, ...] = POSITION_NAMES
) -> tuple[tuple[str, ...], str]:
    """The assignments that compute the expression, and the name of the result.

    Operands are the locals named by ``names`` (a bias: ``i`` [..., 1, N, 1], ``j``
    [..., 1, 1, M], ``h`` [H, 1, 1]; a frequency schedule: ``k`` [pairs], ``d`` and
    ``base`` 0-d), ``p_NAME`` (a parameter: [H, 1, 1] or 0-d) and ``dtype``/``device``.
    """
    lines: list[str] = []

    def emit(code: str) -> str:
        name = f"t{len(lines)}"
        lines.append(f"{name} = {code}")
        return name

    def visit(node: ast.AST) -> str:
        if isinstance(node, ast.Constant):
            assert isinstance(node.value, (int, float))  # checked by parse_expr
            value = float(node.value)
            return emit(f"torch.tensor({value!r}, dtype=dtype, device=device)")
        if isinstance(node, ast.Name):
            if node.id in names:
                return node.id
            return f"p_{_param(node.id)}"
        if isinstance(node, ast.Subscript):
            assert isinstance(node.value, ast.Name)
            return f"p_{_param(node.value.id)}"
        if isinstance(node, ast.BinOp):
            left, right = visit(node.left), visit(node.right)
            return emit(binary_code(left, BINARY_OPERATORS[type(node.op)], right))
        if isinstance(node, ast.UnaryOp):
            operand = visit(node.operand)
            return emit(f"{UNARY_OPERATORS[type(node.op)]}{operand}")
        if isinstance(node, ast.Compare):
            left, right = visit(node.left), visit(node.comparators[0])
            return emit(f"{left} {COMPARISONS[type(node.ops[0])]} {right}")
        if isinstance(node, ast.Call):
            assert isinstance(node.func, ast.Name)
            call = FUNCTIONS[node.func.id][1]
            arguments = [visit(argument) for argument in node.args]
            return emit(f"{call}({', '.join(arguments)})")
        raise ExprError(f"cannot render {type(node).__name__}", _offset(node))

    result = visit(parsed.tree.body)
    return tuple(lines), result


_SIMPLE_POWER_OPERAND = re.compile(
    r"[-+~]*"  # unary signs
    r"(?:[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*"  # a name or attribute chain
    r"|[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][-+]?[0-9_]+)?)"  # a decimal number
)
"""What ruff's formatter calls a simple power operand: a name, an attribute chain or a
number literal, perhaps under unary signs (``x**-y``, ``a.b**2``). The steps' operands
are names (``i``, ``p_NAME``, ``tK``)."""


def binary_code(left: str, operator: str, right: str) -> str:
    """``left operator right`` as ruff formats it: a power of two simple operands hugs
    its operator (``t0**t1``), every other binary operation is spaced."""
    if operator == "**" and all(
        _SIMPLE_POWER_OPERAND.fullmatch(operand) for operand in (left, right)
    ):
        return f"{left}**{right}"
    return f"{left} {operator} {right}"


def _param(name: str) -> str:
    if not PARAM_NAME.fullmatch(name) or name in RESERVED_PARAM_NAMES:
        raise ExprError(f"invalid parameter name {name!r}", 0)
    return name
