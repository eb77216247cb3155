"""Kubernetes resource quantities: parsing, so that "1000m" and "1" compare equal.

The API server stores quantities in canonical form; comparing them as numbers keeps the
apply path from rewriting an object whose quantity only changed spelling.

Parsing is as strict as the Kubernetes CEL library's `isQuantity()` (and so the CRD): no
surrounding whitespace, and a magnitude Kubernetes can represent (at most 2^63-1 of the
base unit; it caps larger values). A huge exponent ("1e999999999") is refused without ever
building the number.
"""
from __future__ import annotations

import re
from decimal import Decimal, DecimalException

_SUFFIXES = {
    "": Decimal(1),
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
    "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}
_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?$")
MAX_QUANTITY = Decimal(2**63 - 1)
_MAX_DIGITS = 64  # of the mantissa, and of the exponent's magnitude: far beyond any real value


def parse_quantity(value: object) -> Decimal:
    """Parse a quantity ("2Gi", "500m", 4) into a Decimal; ValueError when it is not one."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        if abs(value) > MAX_QUANTITY:
            raise ValueError("larger than Kubernetes can represent (2^63-1)")
        return Decimal(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"not a quantity: {value!r}")
        value = repr(value)
    if not isinstance(value, str):
        raise ValueError(f"not a quantity: {value!r}")
    match = _QUANTITY.match(value) if len(value) <= 2 * _MAX_DIGITS else None
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    number, exponent, suffix = match.groups()
    if exponent and abs(int(exponent[1:])) > _MAX_DIGITS:
        raise ValueError(f"exponent out of range in {value!r}")
    try:
        result = Decimal(number).scaleb(int(exponent[1:]) if exponent else 0) * _SUFFIXES[suffix or ""]
    except DecimalException as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"not a quantity: {value!r}") from exc
    if abs(result) > MAX_QUANTITY:
        raise ValueError(f"{value!r} is larger than Kubernetes can represent (2^63-1)")
    return result


def quantities_equal(a: object, b: object) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except ValueError:
        return a == b


_DECIMAL_SUFFIXES = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
_BINARY_SUFFIXES = {0: "", 1: "Ki", 2: "Mi", 3: "Gi", 4: "Ti", 5: "Pi", 6: "Ei"}


def canonical_quantity(value: object) -> str:
    """A quantity as the API server writes it back (apimachinery's Quantity.String(): the
    format of its suffix kept, the mantissa without trailing zeros, the exponent a multiple of
    three): "1000m" is "1", "1024Ki" is "1Mi", "1e3" stays "1e3". ValueError when not a
    quantity."""
    number = parse_quantity(value)
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    suffix, exponent_form = (match.group(3), bool(match.group(2))) if match else (None, False)
    # Values finer than a nano are rounded up to it, as ParseQuantity does.
    nanos = number.scaleb(9)
    if nanos != nanos.to_integral_value():
        number = (nanos.to_integral_value(rounding="ROUND_CEILING") if number > 0
                  else nanos.to_integral_value(rounding="ROUND_FLOOR")).scaleb(-9)
    if number == 0:
        return "0"
    binary = suffix in ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")
    if binary and abs(number) >= 1024 and number == number.to_integral_value():
        mantissa, power = int(number), 0
        while mantissa % 1024 == 0 and power < 6:
            mantissa //= 1024
            power += 1
        return f"{mantissa}{_BINARY_SUFFIXES[power]}"
    sign, digits, exponent = number.normalize().as_tuple()
    mantissa = int("".join(map(str, digits)))
    exponent = int(exponent)
    shift = exponent % 3  # down to a multiple of three
    mantissa, exponent = mantissa * 10**shift, exponent - shift
    text = f"{'-' if sign else ''}{mantissa}"
    if exponent_form:
        return text + (f"e{exponent}" if exponent else "")
    return text + _DECIMAL_SUFFIXES.get(exponent, f"e{exponent}")
