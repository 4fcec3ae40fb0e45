"""Each argument's rule, machine-readable: its type, default, choices and range (`Rule`).

`ServerArgs.rules()` and `SamplingParams.rules()` give one table of them, {name: Rule}, built
from the class's own fields (type and default) and its ranges. The class checks its arguments
with that table (`Rule.accepts`, `check_argument`), and what others derive from the engine's
rules reads the same table: the flows' config sections take their JSON-schema constraints and
pydantic types from `Rule.json_schema()`, so a form cannot offer what the engine refuses, nor
refuse what it takes.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass
from typing import Any

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}
_JSON_TYPES.update({list: "array", tuple: "array", dict: "object"})
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


@dataclass(frozen=True)
class Rule:
    """What one argument accepts beyond its type, and the words its message uses; a table fills
    in the field's own name, types, whether it may be None and its default (`table`)."""

    allowed: tuple[str, ...] = ()  # the alternatives, e.g. ("-1 (no chunks)", "a positive integer")
    choices: tuple[str, ...] = ()  # an enum's values (also for did-you-mean)
    fold_case: bool = False  # a choice in any case
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    also: tuple[int, ...] = ()  # accepted below the minimum, e.g. -1: "no chunks"
    finite: bool = False
    non_empty: bool = False
    pattern: str | None = None  # a string's whole value matches it
    items: Rule | None = None  # a list's: each item's rule
    settled: Any = None  # what None (left to the engine) settles to, where that is a constant
    # the field's own, filled in by `table`
    name: str = ""
    types: tuple[type, ...] = ()  # float also takes int; bool is no int
    optional: bool = False  # None accepted: left to the engine
    required: bool = False  # no default
    default: Any = None

    def accepts(self, value: Any) -> bool:
        """Whether `value` (already of the rule's type) is within the rule."""
        if self.items is not None:
            return all(self.items.accepts(item) for item in value)
        if value in self.also:
            return True
        if self.choices:
            return (value.lower() if self.fold_case else value) in self.choices
        if self.pattern is not None:
            return re.fullmatch(self.pattern, value) is not None
        if self.non_empty and not value:
            return False
        # NOTE: each bound as what must hold, so a NaN fails it
        low, high = self.minimum, self.maximum
        if low is not None and not (value > low if self.exclusive_minimum else value >= low):
            return False
        if high is not None and not (value < high if self.exclusive_maximum else value <= high):
            return False
        return not self.finite or math.isfinite(value)

    def words(self) -> str:
        """What is allowed, in a message's words: "-1 (disable) or at least 1"."""
        return alternatives(self.allowed)

    def json_schema(self) -> dict[str, Any]:
        """The rule as JSON-schema keywords: type, enum, bounds, "not" (the integers between
        `also` and the minimum), pattern, minLength, items. None is not among them, nor is
        `finite` (JSON has no infinities), nor `fold_case` (the enum offers the spellings)."""
        kinds = [_JSON_TYPES[t] for t in self.types if not (t is int and float in self.types)]
        schema: dict[str, Any] = {"type": kinds[0] if len(kinds) == 1 else kinds}
        if self.choices:
            schema["enum"] = list(self.choices)
        if self.pattern is not None:
            schema["pattern"] = f"^(?:{self.pattern})$"
        if self.non_empty:
            schema["minLength"] = 1
        low = self.minimum
        if self.also:  # below the minimum: the least of them is the bound, the gap is refused
            assert low is not None and self.types == (int,) and max(self.also) < low, self
            gap = [n for n in range(min(self.also) + 1, int(low)) if n not in self.also]
            low = min(self.also)
            if gap:
                schema["not"] = {"const": gap[0]} if len(gap) == 1 else {"enum": gap}
        if low is not None:
            schema["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = low
        if self.maximum is not None:
            schema["exclusiveMaximum" if self.exclusive_maximum else "maximum"] = self.maximum
        if self.items is not None:
            schema["items"] = self.items.json_schema()
        return schema


def one_of(choices: tuple[str, ...], fold_case: bool = False) -> Rule:
    return Rule((f"one of {', '.join(map(repr, choices))}",), choices, fold_case, types=(str,))


def table(cls: type, rules: dict[str, Rule], types: dict[str, tuple[type, ...]]) -> dict[str, Rule]:
    """{name: Rule} for each field of the dataclass `cls` named in `types` (its accepted types,
    NoneType among them where None is), in field order: its rule from `rules` (none: its type
    alone), with the field's name, types, optionality and default."""
    return {
        field.name: dataclasses.replace(
            rules.get(field.name, Rule()),
            name=field.name,
            types=tuple(t for t in types[field.name] if t is not type(None)),
            optional=type(None) in types[field.name],
            required=field.default is dataclasses.MISSING,
            default=None if field.default is dataclasses.MISSING else field.default,
        )
        for field in dataclasses.fields(cls)
        if field.name in types
    }


def annotated_types(cls: type) -> dict[str, tuple[type, ...]]:
    """Each field's types from its annotation, `T` or `T | U | None`."""
    return {
        name: typing.get_args(hint) or (hint,) for name, hint in typing.get_type_hints(cls).items()
    }


# ---------------------------------------------------------------------- an engine argument's check
_TYPE_WORDS = {
    bool: ("True", "False"),
    int: ("an integer",),
    float: ("a number",),
    str: ("a string",),
}


def check_argument(rule: Rule, value: Any) -> None:
    """ValueError naming the argument unless `value` is of its type and within its rule, in
    the words of ServerArgs: "X must be A, B or None, got V (type)", with a did-you-mean."""
    if value is None and rule.optional:
        return
    if is_a(value, rule.types) and rule.accepts(value):
        return
    (kind,) = rule.types  # NOTE: every argument checked here is one bool, int, float or str
    allowed = (rule.allowed or _TYPE_WORDS[kind]) + (("None",) if rule.optional else ())
    message = f"{rule.name} must be {alternatives(allowed)}, got {value!r} ({type(value).__name__})"
    close = (
        difflib.get_close_matches(value.lower(), rule.choices, n=1)
        if isinstance(value, str)
        else []
    )
    raise ValueError(message + (f"; did you mean {close[0]!r}?" if close else "."))


def is_a(value: Any, types: tuple[type, ...]) -> bool:
    """Strict: True is no int, 1 no bool, "8" no int; an int is a float (as Python's typing has it)."""
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, (int, *types) if float in types else types)


def alternatives(words: tuple[str, ...]) -> str:
    return " or ".join(words) if len(words) <= 2 else f"{', '.join(words[:-1])} or {words[-1]}"
