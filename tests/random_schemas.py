"""Random small JSON schemas that a grammar can always close: nested objects, arrays with bounds,
enums, numbers with ranges, string patterns and lengths, ``additionalProperties: false``.

Every string, array and number is bounded, so a model that writes noise inside the grammar still
reaches the end within a few hundred tokens; tests give max_tokens enough for that.
"""

from __future__ import annotations

import random
import string


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 6)))


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["integer", "number", "string", "pattern", "enum", "boolean", "null", "const"])
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 200)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 20)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,4}$", "^[0-9]{2}-[A-Z]{2}$", "^(yes|no)$"])}
    if kind == "enum":
        return {"enum": sorted({_word(rng) for _ in range(rng.randint(1, 4))})}
    if kind == "const":
        return {"const": _word(rng)}
    return {"type": kind}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 properties, some nested (objects, arrays of 0-3 items), some required."""
    props = {}
    for _ in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            value = random_schema(rng, depth + 1)
        elif roll < 0.4:
            lo = rng.randint(0, 2)
            value = {"type": "array", "items": _leaf(rng), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
        else:
            value = _leaf(rng)
        props[_word(rng)] = value
    required = sorted(k for k in props if rng.random() < 0.7)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
