"""Dimension expressions: the ``dim_param`` strings of an exported graph, parsed without ``eval``.

A ``dim_param`` is a dimension name (``"batch_size"``) or a small arithmetic expression over names
(``"past_sequence_length + sequence_length"``, ``"batch_size * num_heads"``, ``"past_sequence_length + 1"``).
An expression that is a sum of names and constants is also a *layout*: the attention mask of a decoder with
a cache holds the past positions, then the new ones, in the order written.

A ``dim_param`` that is a bare number (``"1"``) is a *name*, not a size: ``dim_param`` is a label in ONNX,
onnxruntime accepts any size there, and exporters write ``"1"`` where they expect one new token (optimum
declares a decoder-with-past's ``logits`` as ``['batch_size', '1', vocab]``). Its size comes from the feed
like any other name's, so a feed that onnxruntime accepts is never refused for it.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

SymbolicDim = str | int | None


class DimExpressionError(ValueError):
    """A ``dim_param`` string is not an expression of names, integers, ``+``, ``-``, ``*`` and parentheses."""


_BARE_NUMBER = re.compile(r"\s*[0-9]+\s*")
_TOKEN = re.compile(r"\s*(?:(?P<int>\d+)|(?P<name>[A-Za-z_][A-Za-z0-9_.]*)|(?P<op>[-+*()]))")

# A polynomial: monomial (sorted tuple of names, repeated for powers) -> integer coefficient.
_Polynomial = dict[tuple[str, ...], int]


def _poly_add(left: _Polynomial, right: _Polynomial, sign: int = 1) -> _Polynomial:
    result = dict(left)
    for monomial, coefficient in right.items():
        result[monomial] = result.get(monomial, 0) + sign * coefficient
    return {monomial: coefficient for monomial, coefficient in result.items() if coefficient}


def _poly_mul(left: _Polynomial, right: _Polynomial) -> _Polynomial:
    result: _Polynomial = {}
    for (m1, c1), (m2, c2) in itertools.product(left.items(), right.items()):
        monomial = tuple(sorted(m1 + m2))
        result[monomial] = result.get(monomial, 0) + c1 * c2
    return {monomial: coefficient for monomial, coefficient in result.items() if coefficient}


class _Parser:
    """Recursive descent over ``expr := term (('+'|'-') term)*``, ``term := factor ('*' factor)*``,
    ``factor := INT | NAME | '(' expr ')' | '-' factor``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str]] = []
        position = 0
        stripped = text.rstrip()
        while position < len(stripped):
            match = _TOKEN.match(stripped, position)
            if match is None:
                raise DimExpressionError(f"cannot parse dimension {text!r} at {stripped[position:]!r}")
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind)))
            position = match.end()
        self.index = 0

    def parse(self) -> tuple[_Polynomial, list[_Polynomial]]:
        """The whole expression and its top-level additive terms in written order (signs folded in)."""
        if not self.tokens:
            raise DimExpressionError(f"empty dimension expression {self.text!r}")
        terms = self._terms()
        if self.index != len(self.tokens):
            raise DimExpressionError(f"unexpected {self.tokens[self.index][1]!r} in dimension {self.text!r}")
        return functools.reduce(_poly_add, terms, {}), terms

    def _peek(self) -> str | None:
        return self.tokens[self.index][1] if self.index < len(self.tokens) else None

    def _next(self) -> str:
        if self.index >= len(self.tokens):
            raise DimExpressionError(f"dimension {self.text!r} ends too early")
        value = self.tokens[self.index][1]
        self.index += 1
        return value

    def _terms(self) -> list[_Polynomial]:
        terms = [self._term()]
        while self._peek() in ("+", "-"):
            sign = 1 if self._next() == "+" else -1
            terms.append(_poly_mul({(): sign}, self._term()))
        return terms

    def _term(self) -> _Polynomial:
        result = self._factor()
        while self._peek() == "*":
            self._next()
            result = _poly_mul(result, self._factor())
        return result

    def _factor(self) -> _Polynomial:
        if self.index >= len(self.tokens):
            raise DimExpressionError(f"dimension {self.text!r} ends too early")
        kind, value = self.tokens[self.index]
        self.index += 1
        if kind == "int":
            return {(): int(value)} if int(value) else {}
        if kind == "name":
            return {(value,): 1}
        if value == "(":
            inner = functools.reduce(_poly_add, self._terms(), {})
            if self._next() != ")":
                raise DimExpressionError(f"unbalanced parentheses in dimension {self.text!r}")
            return inner
        if value == "-":
            return _poly_mul({(): -1}, self._factor())
        raise DimExpressionError(f"unexpected {value!r} in dimension {self.text!r}")


@dataclass(frozen=True)
class DimExpression:
    """A parsed ``dim_param``: evaluate it with dimension sizes, solve it for one unknown, or split it
    into concatenated segments."""

    text: str
    polynomial: tuple[tuple[tuple[str, ...], int], ...]
    # Top-level terms in written order, each a single name (coefficient 1) or a constant; None when the
    # expression is anything else and therefore has no segment layout.
    segments: tuple[str | int, ...] | None

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def parse(text: str) -> DimExpression:
        if _BARE_NUMBER.fullmatch(text):
            label = text.strip()  # a name that reads as a number (see the module docstring)
            return DimExpression(text, (((label,), 1),), (label,))
        total, terms = _Parser(text).parse()
        segments: list[str | int] | None = []
        for term in terms:
            if not term:
                continue  # a literal 0
            if len(term) == 1 and () in term and term[()] > 0:
                segments.append(term[()])
            elif len(term) == 1 and next(iter(term.values())) == 1 and len(next(iter(term))) == 1:
                segments.append(next(iter(term))[0])
            else:
                segments = None
                break
        return DimExpression(
            text, tuple(sorted(total.items())), None if segments is None else tuple(segments)
        )

    @property
    def symbols(self) -> frozenset[str]:
        return frozenset(name for monomial, _ in self.polynomial for name in monomial)

    @property
    def is_single_name(self) -> bool:
        return self.segments is not None and len(self.segments) == 1 and isinstance(self.segments[0], str)

    def evaluate(self, sizes: Mapping[str, int]) -> int:
        """The value with ``sizes``; ``KeyError`` naming the first missing dimension."""
        total = 0
        for monomial, coefficient in self.polynomial:
            value = coefficient
            for name in monomial:
                if name not in sizes:
                    raise KeyError(name)
                value *= sizes[name]
            total += value
        return total

    def solve_for(self, unknown: str, value: int, sizes: Mapping[str, int]) -> int | None:
        """The size of ``unknown`` that makes the expression equal ``value`` given the other ``sizes``,
        or None when the expression is not linear in it or the answer is not a non-negative integer."""
        if any(monomial.count(unknown) > 1 for monomial, _ in self.polynomial):
            return None
        base = self.evaluate({**sizes, unknown: 0})
        slope = self.evaluate({**sizes, unknown: 1}) - base
        if slope == 0 or (value - base) % slope:
            return None
        solution = (value - base) // slope
        return solution if solution >= 0 else None


def parse_dim(dim: SymbolicDim) -> DimExpression | None:
    """The parsed dimension, or None for fixed and unknown ones; a ``dim_param`` outside the grammar
    (``floor(n / 2)``) counts as unknown, so such an axis is never padded or sliced."""
    if not isinstance(dim, str):
        return None
    try:
        return DimExpression.parse(dim)
    except DimExpressionError:
        return None


def dim_name(dim: SymbolicDim) -> str | None:
    """The name ``dim`` is when it is one name alone (``batch_size``, not ``2 * batch_size``), else None."""
    expression = parse_dim(dim)
    if expression is None or not expression.is_single_name:
        return None
    return str(expression.segments[0])  # type: ignore[index]
