"""What the padding proof knows about a value it cannot compute: a small lattice of value classes.

The proof tracks, for every element of a tensor it cannot evaluate (hidden states, scores, anything
computed from user data), one class saying what the value is known to be. Classes matter only where
padding must be hidden: a padded key must weigh exactly 0 in a softmax (its score is masked), and a
padded element multiplied by a zero weight must be finite (``0 * inf`` is NaN). Everywhere else the
proof reasons about exactness, not values.

Assumption, stated once: values computed from finite inputs by the model's own functions (activations,
attention scores) stay finite and below 1e3 in magnitude (``SMALL``); only the constants models use for
masking, -1e4 or lower (``-10000.0``, ``-1e9``, ``finfo.min``, ``-inf``), are tracked as such. A masked score
is then at least 4e3 below an unmasked one in its row, so its softmax weight is exactly 0 in float32 and
float16. The same assumption holds for the unpadded computation the proof compares with.
"""

from __future__ import annotations

import numpy as np

# Numeric classes.
ZERO = 0  # exactly 0
ONE = 1  # exactly 1
SMALL = 2  # finite, |x| < 1e4 (computed values: below 1e3)
NEG = 3  # finite and <= -1e4 (an ordinary value added: <= -9e3): a masking constant
MAYBE_NEG = 4  # ordinary or NEG, depending on data (a user's mask)
NEGINF = 5  # <= -1e4 or -inf: masked, but maybe not finite
ANY = 6  # possibly NaN, +inf or huge and positive
# Boolean classes.
FALSE = 7
TRUE = 8
BOOL = 9
# More numeric classes.
Z01 = 10  # 0 or 1 (a user's attention mask; the runtime checks it holds nothing else before it pads)
MAYBE_NEGINF = 11  # ordinary or NEGINF, depending on data

COUNT = 12

#: At or below minus this a float is a masking constant.
HUGE = 1e4

#: Ordinary values: certainly not masked, finite.
ORDINARY = frozenset({ZERO, ONE, Z01, SMALL})
#: Certainly masked: exp(x - max) is exactly 0 next to an ordinary value.
MASKED = frozenset({NEG, NEGINF})
#: Masked or not, depending on user data.
MAYBE = frozenset({MAYBE_NEG, MAYBE_NEGINF})
#: Ordinary, masked or maybe masked: never NaN and never huge and positive.
MASKABLE = ORDINARY | MASKED | MAYBE
BOOLS = frozenset({FALSE, TRUE, BOOL})
FINITE = ORDINARY | BOOLS | {NEG, MAYBE_NEG}
#: Elements that are certainly not masked.
UNMASKED = ORDINARY


def classify(values: np.ndarray) -> np.ndarray:
    """The class of every element of a concrete array (int8, same shape)."""
    values = np.asarray(values)
    if values.dtype == np.bool_:
        return np.where(values, TRUE, FALSE).astype(np.int8)
    if np.issubdtype(values.dtype, np.integer):
        return np.where(values == 0, ZERO, np.where(values == 1, ONE, SMALL)).astype(np.int8)
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(values)
        result = np.where(
            values == 0,
            ZERO,
            np.where(
                values == 1,
                ONE,
                np.where(
                    finite & (np.abs(values) < HUGE),
                    SMALL,
                    np.where(finite & (values <= -HUGE), NEG, np.where(values == -np.inf, NEGINF, ANY)),
                ),
            ),
        )
    return result.astype(np.int8)


def _join(a: int, b: int) -> int:
    """The least class holding both."""
    if a == b:
        return a
    pair = {a, b}
    if pair <= BOOLS:
        return BOOL
    if pair & BOOLS or ANY in pair:
        return ANY
    if pair <= {ZERO, ONE, Z01}:
        return Z01
    if pair <= ORDINARY:
        return SMALL
    if pair <= MASKED:
        return NEGINF
    if pair <= ORDINARY | {NEG, MAYBE_NEG}:
        return MAYBE_NEG
    return MAYBE_NEGINF  # ordinary or masked, some masks maybe -inf


def _negate(a: int) -> int:
    return SMALL if a in ORDINARY and a != ZERO else (ZERO if a == ZERO else ANY)


def _unit_or_unknown(a: int, b: int, unit: int) -> int | None:
    """The class of ``a op b`` for an arithmetic ``op`` whose identity element is ``unit``, where it
    follows from that alone (ANY for booleans or ANY); None otherwise."""
    if {a, b} & BOOLS or ANY in (a, b):
        return ANY
    if a == unit:
        return b
    if b == unit:
        return a
    return None


def _add(a: int, b: int) -> int:
    if (known := _unit_or_unknown(a, b, ZERO)) is not None:
        return known
    pair = {a, b}
    if pair <= ORDINARY:
        return SMALL
    if pair <= ORDINARY | {NEG}:
        return NEG  # an ordinary value plus finfo.min is finfo.min (absorbed)
    if pair <= ORDINARY | MASKED:
        return NEGINF  # finfo.min + finfo.min overflows to -inf
    return MAYBE_NEGINF if pair <= MASKABLE else ANY


def _sub(a: int, b: int) -> int:
    if (a, b) in ((ZERO, ZERO), (ONE, ONE)):
        return ZERO
    if a == ONE and b in (ZERO, Z01):
        return ONE if b == ZERO else Z01  # 1 - mask
    return _add(a, _negate(b))


def _mul(a: int, b: int) -> int:
    if (known := _unit_or_unknown(a, b, ONE)) is not None:
        return known
    pair = {a, b}
    if ZERO in pair:
        other = b if a == ZERO else a
        return ZERO if other in FINITE else ANY  # 0 * inf is NaN
    if pair <= ORDINARY:
        return Z01 if a == b == Z01 else SMALL
    if Z01 in pair and pair & {NEG, MAYBE_NEG}:
        return MAYBE_NEG  # mask * finfo.min
    return ANY


def _div(a: int, b: int) -> int:
    if {a, b} & BOOLS or ANY in (a, b) or b == ZERO:
        return ANY
    if b == ONE:
        return a
    if b == SMALL and a in ORDINARY:
        # Division by a value that is not 0 (the finite-activation assumption): 0 / x stays 0.
        return ZERO if a == ZERO else SMALL
    return ANY


def _min(a: int, b: int) -> int:
    pair = {a, b}
    if pair & BOOLS or ANY in pair:
        return ANY
    if pair <= ORDINARY:
        return _join(a, b)
    if pair & MASKED:
        return NEG if pair <= ORDINARY | {NEG, MAYBE_NEG} else NEGINF
    return MAYBE_NEG if pair <= ORDINARY | {MAYBE_NEG} else MAYBE_NEGINF


def _max(a: int, b: int) -> int:
    pair = {a, b}
    if pair & BOOLS or ANY in pair:
        return ANY
    if pair <= ORDINARY:
        return _join(a, b)
    ordinary = pair & ORDINARY
    if ordinary:
        (value,) = ordinary
        other = (pair - ordinary).pop()
        return value if other in MASKED else _join(value, SMALL)
    if pair <= MASKED:
        return NEG if NEG in pair else NEGINF
    if pair & {NEG, MAYBE_NEG}:
        return MAYBE_NEG
    return MAYBE_NEGINF


def _less(a: int, b: int) -> int:
    """a < b"""
    if {a, b} & BOOLS or ANY in (a, b):
        return BOOL
    if a in MASKED and b in ORDINARY:
        return TRUE
    if b in MASKED and a in ORDINARY:
        return FALSE
    if (a, b) == (ZERO, ONE):
        return TRUE
    if (a, b) in ((ONE, ZERO), (ZERO, ZERO), (ONE, ONE)):
        return FALSE
    return BOOL


def _equal(a: int, b: int) -> int:
    if a in BOOLS and b in BOOLS:
        if BOOL in (a, b):
            return BOOL
        return TRUE if a == b else FALSE
    if {a, b} & BOOLS or ANY in (a, b):
        return BOOL
    if a == b and a in (ZERO, ONE):
        return TRUE
    if {a, b} == {ZERO, ONE}:
        return FALSE
    if (a in MASKED and b in ORDINARY) or (b in MASKED and a in ORDINARY):
        return FALSE
    return BOOL


def _not(a: int) -> int:
    return {TRUE: FALSE, FALSE: TRUE}.get(a, BOOL)


def _and(a: int, b: int) -> int:
    return _logical(a, b, absorbing=FALSE, neutral=TRUE)


def _or(a: int, b: int) -> int:
    return _logical(a, b, absorbing=TRUE, neutral=FALSE)


def _logical(a: int, b: int, absorbing: int, neutral: int) -> int:
    """And (absorbing FALSE, neutral TRUE) or Or (absorbing TRUE, neutral FALSE) of two classes."""
    if absorbing in (a, b):
        return absorbing
    if a == neutral:
        return b if b in BOOLS else BOOL
    if b == neutral:
        return a if a in BOOLS else BOOL
    return BOOL


def _xor(a: int, b: int) -> int:
    if a in (TRUE, FALSE) and b in (TRUE, FALSE):
        return TRUE if a != b else FALSE
    return BOOL


def _to_bool(a: int) -> int:
    return {ZERO: FALSE, ONE: TRUE, NEG: TRUE, NEGINF: TRUE, FALSE: FALSE, TRUE: TRUE}.get(a, BOOL)


def _to_number(a: int) -> int:
    return {FALSE: ZERO, TRUE: ONE, BOOL: Z01}.get(a, a)


def _to_integer(a: int) -> int:
    # Integers are never NaN; a huge float cast to an integer is some integer.
    return {FALSE: ZERO, TRUE: ONE, BOOL: Z01, ZERO: ZERO, ONE: ONE, Z01: Z01}.get(a, SMALL)


def _table(function, arity: int) -> np.ndarray:
    shape = (COUNT,) * arity
    table = np.empty(shape, dtype=np.int8)
    for index in np.ndindex(*shape):
        table[index] = function(*index)
    return table


def _bounded(a: int) -> int:
    """erf, tanh, sigmoid, sin, cos: bounded for every finite or infinite input."""
    return ANY if a == ANY or a in BOOLS else SMALL


def _smooth(a: int) -> int:
    """A continuous function that maps ordinary values to ordinary values, and 0 to 0."""
    return ZERO if a == ZERO else (SMALL if a in ORDINARY else ANY)


def _relu(a: int) -> int:
    if a in ORDINARY:
        return a
    return {NEG: ZERO, NEGINF: ZERO, MAYBE_NEG: SMALL, MAYBE_NEGINF: SMALL}.get(a, ANY)


def _exp(a: int) -> int:
    if a == ZERO:
        return ONE
    if a in ORDINARY or a in MAYBE:
        return SMALL
    return ZERO if a in MASKED else ANY


def _same(a: int) -> int:
    return a


def _abs_like(a: int) -> int:
    """abs, sqrt: ordinary values stay as they are."""
    return a if a in ORDINARY else ANY


def _is_nan(a: int) -> int:
    return BOOL if a == ANY else FALSE


def _is_inf(a: int) -> int:
    return BOOL if a in (ANY, NEGINF, MAYBE_NEGINF) else FALSE


def _rounding(a: int) -> int:
    return a if a in ORDINARY or a in MASKED else ANY


def _flip(function):
    return lambda a, b: function(b, a)


def _less_or_equal(a: int, b: int) -> int:
    return _not(_less(b, a))


def _greater_or_equal(a: int, b: int) -> int:
    return _not(_less(a, b))


def _pow(a: int, b: int) -> int:
    if a == ONE or b == ZERO:
        return ONE
    if a in ORDINARY and b in ORDINARY:
        return ZERO if a == ZERO else SMALL
    return ANY


JOIN = _table(_join, 2)

#: Elementwise binary operators: class of the result from the classes of the operands.
BINARY = {
    "Add": _table(_add, 2),
    "Sub": _table(_sub, 2),
    "Mul": _table(_mul, 2),
    "Div": _table(_div, 2),
    "Min": _table(_min, 2),
    "Max": _table(_max, 2),
    "Pow": _table(_pow, 2),
    "Mod": _table(lambda a, b: SMALL if a in FINITE and b in FINITE else ANY, 2),
    "Equal": _table(_equal, 2),
    "Less": _table(_less, 2),
    "Greater": _table(_flip(_less), 2),
    "LessOrEqual": _table(_less_or_equal, 2),
    "GreaterOrEqual": _table(_greater_or_equal, 2),
    "And": _table(_and, 2),
    "Or": _table(_or, 2),
    "Xor": _table(_xor, 2),
    "PRelu": _table(lambda a, b: _relu(a) if b in ORDINARY else ANY, 2),
    "BitShift": _table(lambda a, b: SMALL, 2),
}

#: Elementwise unary operators.
UNARY = {
    "Identity": _table(_same, 1),
    "Neg": _table(_negate, 1),
    "Abs": _table(_abs_like, 1),
    "Relu": _table(_relu, 1),
    "Exp": _table(_exp, 1),
    "Sqrt": _table(_abs_like, 1),
    "Log": _table(lambda a: ZERO if a == ONE else ANY, 1),
    "Reciprocal": _table(lambda a: {ONE: ONE, SMALL: SMALL}.get(a, ANY), 1),
    "Erf": _table(_bounded, 1),
    "Tanh": _table(_bounded, 1),
    "Sigmoid": _table(_bounded, 1),
    "Sin": _table(_bounded, 1),
    "Cos": _table(_bounded, 1),
    "Softsign": _table(_bounded, 1),
    "HardSigmoid": _table(_bounded, 1),
    "Gelu": _table(_smooth, 1),
    "Softplus": _table(lambda a: ZERO if a in MASKED else _smooth(a), 1),
    "LeakyRelu": _table(_smooth, 1),
    "Elu": _table(_smooth, 1),
    "Selu": _table(_smooth, 1),
    "Celu": _table(_smooth, 1),
    "ThresholdedRelu": _table(_relu, 1),
    "HardSwish": _table(_smooth, 1),
    "Mish": _table(_smooth, 1),
    "Floor": _table(_rounding, 1),
    "Ceil": _table(_rounding, 1),
    "Round": _table(_rounding, 1),
    "Sign": _table(lambda a: SMALL if a in FINITE else ANY, 1),
    "Not": _table(_not, 1),
    "IsNaN": _table(_is_nan, 1),
    "IsInf": _table(_is_inf, 1),
    "Dropout": _table(_same, 1),
}

CAST_TO_BOOL = _table(_to_bool, 1)
CAST_TO_FLOAT = _table(_to_number, 1)
CAST_TO_INTEGER = _table(_to_integer, 1)


def _member_table(members: frozenset[int]) -> np.ndarray:
    table = np.zeros(COUNT, bool)
    table[list(members)] = True
    return table


#: ``IS_X[classes]``: a boolean array saying which elements are of a class of the set X.
IS_UNMASKED = _member_table(UNMASKED)
IS_MASKED = _member_table(MASKED)
IS_MAYBE = _member_table(MAYBE)
IS_FINITE = _member_table(FINITE)


def where(condition: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Classes of ``Where(condition, x, y)``."""
    return np.where(condition == TRUE, x, np.where(condition == FALSE, y, JOIN[x, y])).astype(np.int8)
