"""Kubernetes resource quantities, parsed as apimachinery parses them.

A port of k8s.io/apimachinery/pkg/api/resource's ``ParseQuantity`` (its scanner
``parseQuantityString``, its suffixes and its two representations), so that the operator
accepts exactly the quantities the API server accepts, the CEL quantity library's
``isQuantity``/``quantity()`` included, and reads them with the same value:

* the text is taken whole: no surrounding space, and no byte after the suffix (``"8\\n"``,
  what kubectl sends for a YAML block scalar, is no quantity);
* the value is an arbitrary-precision decimal: ``1e19`` and ``20E`` are quantities beyond
  int64, kept as written (``DecimalExponent`` and ``DecimalSI`` are not capped); only a
  binary-suffixed value above 2^63-1 (``16Ei``) is capped to it, and any value is rounded up
  to a whole nano (``0.1n`` is ``1n``);
* the exponent of ``e``/``E`` is read as Go's int64 and kept as an int32, as apimachinery
  keeps it; a longer one is no quantity. Nothing builds the number digit by digit:
  ``1e999999999`` is one decimal with that exponent.

:class:`Quantity` also keeps whether apimachinery holds it as an ``int64Amount`` (its fast
path) or as an ``inf.Dec``, which is what ``AsInt64`` (CEL's ``isInteger``/``asInteger``)
depends on. :func:`canonical_quantity` is ``Quantity.String()``, the form the API server writes
back, so "1000m" and "1" compare equal and the apply path does not rewrite an object whose
quantity only changed spelling.
"""
from __future__ import annotations

import decimal
from dataclasses import dataclass
from decimal import Decimal

MAX_INT64 = 2**63 - 1
DECIMAL_SI, BINARY_SI, DECIMAL_EXPONENT = "DecimalSI", "BinarySI", "DecimalExponent"
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL_SUFFIX_OF = {exponent: suffix for suffix, exponent in _DECIMAL_SUFFIXES.items()}
_BINARY_SUFFIX_OF = {exponent // 10: suffix for suffix, exponent in _BINARY_SUFFIXES.items()}
_SUFFIX_CHARS = frozenset("eEinumkKMGTP")
_DIGITS = frozenset("0123456789")
_MAX_INT64_FACTORS = 18  # digits an int64 always holds (apimachinery's maxInt64Factors)
_NANO = -9
#: Exact decimal arithmetic at any exponent an int32 holds (Go's inf.Dec and big.Int).
_EXACT = decimal.Context(prec=decimal.MAX_PREC, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN,
                         traps=[decimal.InvalidOperation, decimal.Overflow, decimal.DivisionByZero])
#: Upstream's error texts.
FORMAT_WRONG = "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
NUMERIC = "unable to parse numeric part of quantity"
SUFFIX = "unable to parse quantity's suffix"


class QuantityError(ValueError):
    """Not a quantity: ParseQuantity's error."""


@dataclass(frozen=True)
class Quantity:
    """A parsed quantity: its exact value, its format (what ``String()`` writes it in), and
    ``(value, scale)`` when apimachinery holds it as an int64Amount (value * 10^scale)."""
    value: Decimal
    format: str
    int64_amount: tuple[int, int] | None = None

    def sign(self) -> int:
        return (self.value > 0) - (self.value < 0)

    def as_int64(self) -> int | None:
        """``Quantity.AsInt64()``: the value when the fast conversion holds, else None (always
        None for an inf.Dec, and for an int64Amount with a negative scale: ``1500m``)."""
        if self.int64_amount is None:
            return None
        value, scale = self.int64_amount
        if scale < 0:
            return None
        if value == 0:
            return 0
        if scale > 19:
            return None
        result = value * 10**scale
        return result if -MAX_INT64 - 1 <= result <= MAX_INT64 else None


def _scan(text: str) -> tuple[bool, str, str, str, str]:
    """``parseQuantityString``: (positive, the number as written, the numerator's digits
    without leading zeros, the fraction's digits, the suffix)."""
    positive, pos, end = True, 0, len(text)
    if pos < end and text[0] in "+-":
        positive = text[0] == "+"
        pos += 1
    while pos < end and text[pos] == "0":  # leading zeros
        pos += 1
    if pos >= end:
        return positive, "0", "0", "", ""
    start = pos
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    num = text[start:pos] or "0"
    if pos >= end:
        return positive, text, num, "", ""
    denom = ""
    if text[pos] == ".":
        pos += 1
        start = pos
        while pos < end and text[pos] in _DIGITS:
            pos += 1
        denom = text[start:pos]
        if pos >= end:
            return positive, text, num, denom, ""
    value = text[:pos]
    suffix_start = pos
    while pos < end and text[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos >= end:
        return positive, value, num, denom, text[suffix_start:]
    if text[pos] in "+-":
        pos += 1
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    if pos < end:
        raise QuantityError(FORMAT_WRONG)
    return positive, value, num, denom, text[suffix_start:]


def _go_int64(text: str) -> int | None:
    """``strconv.ParseInt(text, 10, 64)``."""
    digits = text[1:] if text[:1] in "+-" else text
    if not digits or not all(c in _DIGITS for c in digits):
        return None
    value = int(text)
    return value if -MAX_INT64 - 1 <= value <= MAX_INT64 else None


def _interpret(suffix: str) -> tuple[int, int, str]:
    """``suffixHandler.interpret``: (base, exponent, format)."""
    if suffix in _DECIMAL_SUFFIXES:
        return 10, _DECIMAL_SUFFIXES[suffix], DECIMAL_SI
    if suffix in _BINARY_SUFFIXES:
        return 2, _BINARY_SUFFIXES[suffix], BINARY_SI
    if len(suffix) > 1 and suffix[0] in "eE":
        parsed = _go_int64(suffix[1:])
        if parsed is not None:
            return 10, (parsed + 2**31) % 2**32 - 2**31, DECIMAL_EXPONENT  # Go's int32(parsed)
    raise QuantityError(SUFFIX)


def _decimal(digits: str) -> Decimal | None:
    """``inf.Dec.SetString``: a sign, digits with at most one '.', at least one digit."""
    body = digits[1:] if digits[:1] in "+-" else digits
    if not any(c in _DIGITS for c in body):
        return None
    return Decimal(digits)


def parse(text: str) -> Quantity:
    """``resource.ParseQuantity(text)``; QuantityError with upstream's message otherwise."""
    if not isinstance(text, str):
        raise QuantityError(f"not a quantity: {text!r}")
    if not text:
        raise QuantityError(FORMAT_WRONG)
    if text == "0":
        return Quantity(Decimal(0), DECIMAL_SI, (0, 0))
    positive, value, num, denom, suffix = _scan(text)
    base, exponent, fmt = _interpret(suffix)
    precision, scale, mantissa = 0, 0, 1
    if fmt in (DECIMAL_EXPONENT, DECIMAL_SI):
        scale = exponent
        precision = _MAX_INT64_FACTORS - (len(num) + len(denom))
    elif exponent >= 0 and not denom:
        mantissa = 1 << exponent
        precision = 15 - len(num) - int(exponent * 3 / 10) - 1
    else:
        precision = -1
    if precision >= 0:
        scale -= len(denom)
        if scale >= _NANO:
            result = int(num + denom) * mantissa
            if result <= MAX_INT64:  # int64Multiply did not overflow
                result = result if positive else -result
                return Quantity(Decimal(result).scaleb(scale, _EXACT), fmt, (result, scale))
    amount = _decimal(value)
    if amount is None:
        raise QuantityError(NUMERIC)
    amount = abs(amount)
    amount = amount.scaleb(exponent, _EXACT) if base == 10 else _EXACT.multiply(amount, Decimal(1 << exponent))
    if amount.as_tuple().exponent < _NANO:  # rounded up to a whole nano: some resources, never none
        amount = amount.quantize(Decimal(1).scaleb(_NANO), rounding=decimal.ROUND_UP, context=_EXACT)
    if fmt == BINARY_SI and amount > MAX_INT64:
        amount = Decimal(MAX_INT64)
    if fmt == BINARY_SI and 0 < amount < 1:
        fmt = DECIMAL_SI
    return Quantity(amount if positive else -amount, fmt)


def parse_value(value: object) -> Quantity:
    """A quantity field's value parsed: a string as ParseQuantity reads it, or a JSON number
    (an int-or-string field's integer) as Quantity's JSON decoding reads its text;
    QuantityError (a ValueError) when it is not one."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise QuantityError(f"not a quantity: {value!r}")
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise QuantityError(f"not a quantity: {value!r}")
        return parse(repr(value))
    return parse(value if isinstance(value, str) else str(value))


def parse_quantity(value: object) -> Decimal:
    """The exact value of a quantity (:func:`parse_value`)."""
    return parse_value(value).value


def is_quantity(value: object) -> bool:
    try:
        parse_quantity(value)
    except QuantityError:
        return False
    return True


def quantities_equal(a: object, b: object) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except ValueError:
        return a == b


def canonical_quantity(value: object) -> str:
    """A quantity as the API server writes it back (``Quantity.String()``): a binary value
    of at least 1024 that is whole in its largest power of 1024 (``1024Ki`` is ``1Mi``),
    otherwise the mantissa without trailing zeros and an exponent that is a multiple of three,
    with its SI suffix (``1000m`` is ``1``, ``1500`` is ``1500``, ``12000`` is ``12k``) or, in
    the exponent format or beyond ``E``, as ``e``N (``1e3`` stays ``1e3``). QuantityError when
    not a quantity."""
    quantity = parse_value(value)
    number, fmt = quantity.value, quantity.format
    if number == 0:
        return "0"
    if fmt == BINARY_SI and (abs(number) < 1024 or number != number.to_integral_value()):
        fmt = DECIMAL_SI
    if fmt == BINARY_SI:
        mantissa, power = int(number), 0
        while mantissa % 1024 == 0 and power < max(_BINARY_SUFFIX_OF):
            mantissa //= 1024
            power += 1
        return f"{mantissa}{_BINARY_SUFFIX_OF.get(power, '')}"
    sign, digits, exponent = number.normalize(_EXACT).as_tuple()
    mantissa = int("".join(map(str, digits)))
    exponent = int(exponent)
    while exponent % 3:
        mantissa, exponent = mantissa * 10, exponent - 1
    text = f"{'-' if sign else ''}{mantissa}"
    if fmt == DECIMAL_SI and exponent in _DECIMAL_SUFFIX_OF:
        return text + _DECIMAL_SUFFIX_OF[exponent]
    return text + (f"e{exponent}" if exponent else "")
