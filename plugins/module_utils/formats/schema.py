"""A small declarative schema: strict validation with JSON paths and fixes, and JSON Schema export.

Each format (request, artifact, receipt, ...) is declared once with these types;
the same declaration validates documents, fills defaults (normalization) and
generates the JSON Schema shipped under docs/schemas/.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import FormatError, FormatIssue
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import duplicates_of, is_text

MISSING: Any = object()

Check = Callable[[Any], "tuple[str, str] | None"]


# An issue names a bad value; it does not repeat all of it (an id of 100,000 characters, a key of a
# megabyte): a quoted value is cut to this many characters, and says how long it was.
MAX_QUOTED = 200


def _shown(value: Any) -> str:
    """A JSON value as a message shows it (``'text'``, ``4``, ``null``, ``true``, ``an object``), at most about
    MAX_QUOTED characters."""
    if isinstance(value, str) and len(value) > MAX_QUOTED:
        return f"{value[:MAX_QUOTED]!r}... ({len(value)} characters)"
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= MAX_QUOTED else f"{text[:MAX_QUOTED]}... ({len(text)} characters)"


# A str that cannot be written as UTF-8: a lone surrogate (U+D800..U+DFFF), as Python gives for a byte of a
# file name that is not UTF-8. strict_loads refuses the escape in a document; a decoded value (a module
# option, an API caller's dict) is refused here, before a digest or a write of it fails with a traceback.
NOT_TEXT = "holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair), which is not Unicode text"
NOT_TEXT_FIX = "give Unicode text (a name that is not UTF-8 decodes with errors='replace', not 'surrogateescape')"


_SURROGATE = re.compile("[\ud800-\udfff]")


def json_safe(value: Any) -> Any:
    """``value`` as JSON every ColdSnap loader takes back, for what a writer records but does not control (span
    attributes, error messages, task results): a non-finite number becomes null, an integer beyond 64 bits the
    double it rounds to, a lone surrogate U+FFFD, a tuple a list, a key and any other object its str()."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value if is_text(value) else _SURROGATE.sub("\ufffd", value)
    if isinstance(value, int):
        if abs(value) <= INT64_MAX:
            return int(value)
        try:
            return float(value)
        except OverflowError:
            return None
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {json_safe(k if isinstance(k, str) else str(k)): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return json_safe(str(value))


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


class Schema:
    """Base of all schema nodes."""

    description: str = ""

    def validate(self, value: Any, path: str, issues: list[FormatIssue]) -> Any:
        raise NotImplementedError

    def json_schema(self) -> dict:
        raise NotImplementedError

    def _with_desc(self, doc: dict) -> dict:
        if self.description:
            doc["description"] = self.description
        return doc

    def _wrong_type(self, value: Any, path: str, issues: list[FormatIssue], want: str) -> Any:
        issues.append(FormatIssue(path, f"expected {want}, got {_type_name(value)}", f"give {want} here"))
        return MISSING


@dataclass
class Const(Schema):
    value: Any
    description: str = ""

    def validate(self, value, path, issues):
        # the constant in its own type (a str subclass such as Ansible's passes): 4.0 is not the format 4,
        # nor True the 1
        if (not isinstance(value, type(self.value)) or isinstance(value, bool) != isinstance(self.value, bool)
                or value != self.value):
            issues.append(FormatIssue(path, f"must be {self.value!r}, got {_shown(value)}",
                                      f"set it to {self.value!r} (this ColdSnap speaks only that version)"))
            return MISSING
        return value

    def json_schema(self):
        return self._with_desc({"const": self.value})


@dataclass
class Str(Schema):
    description: str = ""
    pattern: str | None = None
    pattern_fix: str = ""
    enum: tuple[str, ...] | None = None
    min_len: int = 0
    max_len: int | None = None
    check: Check | None = None

    def validate(self, value, path, issues):
        if not isinstance(value, str):
            return self._wrong_type(value, path, issues, "a string")
        if not is_text(value):
            issues.append(FormatIssue(path, NOT_TEXT, NOT_TEXT_FIX))
            return MISSING
        if self.enum is not None and value not in self.enum:
            close = difflib.get_close_matches(value, self.enum, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            issues.append(FormatIssue(path, f"{_shown(value)} is not one of {', '.join(self.enum)}{hint}",
                                      f"use one of: {', '.join(self.enum)}"))
            return MISSING
        if len(value) < self.min_len:
            issues.append(FormatIssue(path, "must not be empty" if self.min_len == 1 else
                                      f"shorter than {self.min_len} characters", "give a non-empty value"))
            return MISSING
        if self.max_len is not None and len(value) > self.max_len:
            issues.append(FormatIssue(path, f"longer than {self.max_len} characters", "shorten it"))
            return MISSING
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            issues.append(FormatIssue(path, f"{_shown(value)} does not match the required form",
                                      self.pattern_fix or f"match the pattern {self.pattern}"))
            return MISSING
        if self.check is not None:
            problem = self.check(value)
            if problem:
                issues.append(FormatIssue(path, problem[0], problem[1]))
                return MISSING
        return value

    def json_schema(self):
        doc: dict = {"type": "string"}
        if self.enum is not None:
            doc["enum"] = list(self.enum)
        if self.pattern is not None:
            doc["pattern"] = "^(?:" + self.pattern + ")$"
        if self.min_len:
            doc["minLength"] = self.min_len
        if self.max_len is not None:
            doc["maxLength"] = self.max_len
        return self._with_desc(doc)


# I-JSON (RFC 7493): integers a JSON number holds exactly. Beyond them two documents could differ
# and still share a canonical digest (RFC 8785 writes numbers as doubles). Fields that need more say so.
MAX_SAFE_INT = (1 << 53) - 1
INT64_MAX, UINT64_MAX = (1 << 63) - 1, (1 << 64) - 1  # for fields that say so (clocks in ns, inode numbers)
# Opaque JSON (engine payloads, evidence, span attributes) may hold this many values at most, integers within
# 64 bits: it travels in every task's arguments. A document the controller writes of a whole fleet's run (a
# receipt's timing and result) sets its own, larger bound (AnyJSON.max_values).
MAX_OPAQUE_VALUES = 100_000
OPAQUE_TOO_BIG_FIX = "keep engine-owned data small (it travels in every task's arguments)"
MAX_OPAQUE_INT = INT64_MAX


@dataclass
class Int(Schema):
    description: str = ""
    minimum: int | None = None
    maximum: int | None = None

    def validate(self, value, path, issues):
        if isinstance(value, bool) or not isinstance(value, int):
            return self._wrong_type(value, path, issues, "an integer")
        if (self.maximum is None and abs(value) > MAX_SAFE_INT) or (
                self.minimum is None and value < -MAX_SAFE_INT):
            issues.append(FormatIssue(path, f"{value} is beyond the integers a JSON number holds exactly "
                                      f"(±{MAX_SAFE_INT})", "use a smaller value"))
            return MISSING
        if self.minimum is not None and value < self.minimum:
            issues.append(FormatIssue(path, f"{value} is below the minimum {self.minimum}",
                                      f"use a value >= {self.minimum}"))
            return MISSING
        if self.maximum is not None and value > self.maximum:
            issues.append(FormatIssue(path, f"{value} is above the maximum {self.maximum}",
                                      f"use a value <= {self.maximum}"))
            return MISSING
        return value

    def json_schema(self):
        doc: dict = {"type": "integer"}
        doc["minimum"] = self.minimum if self.minimum is not None else -MAX_SAFE_INT
        doc["maximum"] = self.maximum if self.maximum is not None else MAX_SAFE_INT
        return self._with_desc(doc)


@dataclass
class Num(Schema):
    description: str = ""
    minimum: float | None = None

    def validate(self, value, path, issues):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return self._wrong_type(value, path, issues, "a number")
        if not _finite_json_number(value):
            issues.append(FormatIssue(path, f"{value!r} is not a finite JSON number", "give a finite number"))
            return MISSING
        if self.minimum is not None and value < self.minimum:
            issues.append(FormatIssue(path, f"{value} is below the minimum {self.minimum}",
                                      f"use a value >= {self.minimum}"))
            return MISSING
        return value

    def json_schema(self):
        doc: dict = {"type": "number"}
        if self.minimum is not None:
            doc["minimum"] = self.minimum
        return self._with_desc(doc)


@dataclass
class Bool(Schema):
    description: str = ""

    def validate(self, value, path, issues):
        if not isinstance(value, bool):
            return self._wrong_type(value, path, issues, "true or false")
        return value

    def json_schema(self):
        return self._with_desc({"type": "boolean"})


@dataclass
class Nullable(Schema):
    inner: Schema
    description: str = ""

    def validate(self, value, path, issues):
        if value is None:
            return None
        return self.inner.validate(value, path, issues)

    def json_schema(self):
        inner = self.inner.json_schema()
        doc = {"anyOf": [inner, {"type": "null"}]}
        if self.description:
            doc["description"] = self.description
        return doc


@dataclass
class Arr(Schema):
    item: Schema
    description: str = ""
    min_items: int = 0
    max_items: int | None = None

    def validate(self, value, path, issues):
        if not isinstance(value, list):
            return self._wrong_type(value, path, issues, "an array")
        if len(value) < self.min_items:
            issues.append(FormatIssue(path, f"needs at least {self.min_items} item(s), got {len(value)}",
                                      "add the missing entries"))
        if self.max_items is not None and len(value) > self.max_items:
            issues.append(FormatIssue(path, f"allows at most {self.max_items} item(s), got {len(value)}",
                                      "remove the extra entries"))
        return [self.item.validate(v, f"{path}[{i}]", issues) for i, v in enumerate(value)]

    def json_schema(self):
        doc: dict = {"type": "array", "items": self.item.json_schema()}
        if self.min_items:
            doc["minItems"] = self.min_items
        if self.max_items is not None:
            doc["maxItems"] = self.max_items
        return self._with_desc(doc)


@dataclass
class Field:
    schema: Schema
    required: bool = True
    default: Any = MISSING
    description: str = ""

    def __post_init__(self) -> None:
        if self.description and not self.schema.description:
            self.schema.description = self.description


def _path_key(path: str, key: str) -> str:
    if len(key) <= MAX_QUOTED and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}"
    return f"{path}[{_shown(key)}]"


@dataclass
class Obj(Schema):
    fields: dict[str, Field]
    description: str = ""
    title: str = ""

    def validate(self, value, path, issues):
        if not isinstance(value, dict):
            return self._wrong_type(value, path, issues, "an object")
        for dup in duplicates_of(value):
            issues.append(FormatIssue(_path_key(path, dup), f"duplicate key {_shown(dup)}",
                                      f"keep exactly one {_shown(dup)} in this object"))
        out: dict = {}
        for key in value:
            if key not in self.fields:
                close = difflib.get_close_matches(key, list(self.fields), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                issues.append(FormatIssue(_path_key(path, key), f"unknown field {_shown(key)}{hint}",
                                          f"remove it; allowed here: {', '.join(self.fields)}"))
        for name, fld in self.fields.items():
            sub = _path_key(path, name)
            if name in value:
                res = fld.schema.validate(value[name], sub, issues)
                if res is not MISSING:
                    out[name] = res
            elif fld.required:
                what = fld.description or fld.schema.description
                issues.append(FormatIssue(sub, f"missing required field {name!r}",
                                          f"add {name!r}" + (f" ({what})" if what else "")))
            elif fld.default is not MISSING:
                out[name] = _copy_default(fld.default)
        return out

    def json_schema(self):
        doc: dict = {
            "type": "object",
            "additionalProperties": False,
            "properties": {},
        }
        if self.title:
            doc["title"] = self.title
        required = []
        for name, fld in self.fields.items():
            prop = fld.schema.json_schema()
            if fld.default is not MISSING and fld.default is not None:
                prop = {**prop, "default": fld.default}
            doc["properties"][name] = prop
            if fld.required:
                required.append(name)
        if required:
            doc["required"] = required
        return self._with_desc(doc)


def _copy_default(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


@dataclass
class Map(Schema):
    """An object with arbitrary keys (matching ``key_pattern``) and uniform values."""

    value: Schema
    description: str = ""
    key_pattern: str | None = None
    key_fix: str = ""

    def validate(self, value, path, issues):
        if not isinstance(value, dict):
            return self._wrong_type(value, path, issues, "an object")
        for dup in duplicates_of(value):
            issues.append(FormatIssue(_path_key(path, dup), f"duplicate key {_shown(dup)}",
                                      f"keep exactly one {_shown(dup)} in this object"))
        out = {}
        for key, item in value.items():
            sub = _path_key(path, key)
            if not is_text(key):
                issues.append(FormatIssue(sub, f"key {NOT_TEXT}", NOT_TEXT_FIX))
                continue
            if self.key_pattern is not None and not re.fullmatch(self.key_pattern, key):
                issues.append(FormatIssue(sub, f"key {_shown(key)} is not allowed",
                                          self.key_fix or f"keys must match {self.key_pattern}"))
                continue
            res = self.value.validate(item, sub, issues)
            if res is not MISSING:
                out[key] = res
        return out

    def json_schema(self):
        doc: dict = {"type": "object", "additionalProperties": self.value.json_schema()}
        if self.key_pattern is not None:
            doc["propertyNames"] = {"pattern": "^(?:" + self.key_pattern + ")$"}
        return self._with_desc(doc)


@dataclass
class AnyJSON(Schema):
    """Opaque JSON (engine-owned payloads); still checked for duplicate keys at any depth."""

    description: str = ""
    object_only: bool = False
    max_values: int = MAX_OPAQUE_VALUES
    too_big_fix: str = OPAQUE_TOO_BIG_FIX

    def validate(self, value, path, issues):
        if self.object_only and not isinstance(value, dict):
            return self._wrong_type(value, path, issues, "an object")
        _check_opaque(value, path, issues, [0], self)
        return value

    def json_schema(self):
        return self._with_desc({"type": "object"} if self.object_only else {})


def _finite_json_number(value: int | float, limit: int = MAX_SAFE_INT) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return abs(value) <= limit


def _check_opaque(value: Any, path: str, issues: list[FormatIssue], seen: list[int], bound: AnyJSON) -> bool:
    """Opaque JSON: JSON values only (finite numbers, string keys), no duplicate keys, at most
    ``bound.max_values`` values. False once it stopped looking (too many values)."""
    seen[0] += 1
    if seen[0] > bound.max_values:
        issues.append(FormatIssue(path, f"holds more than {bound.max_values} JSON values", bound.too_big_fix))
        return False
    if isinstance(value, dict):
        for dup in duplicates_of(value):
            issues.append(FormatIssue(_path_key(path, dup), f"duplicate key {_shown(dup)}",
                                      f"keep exactly one {_shown(dup)} in this object"))
        for k, v in value.items():
            if not isinstance(k, str):
                issues.append(FormatIssue(path, f"key {_shown(k)} is not a string", "JSON object keys are strings"))
            elif not is_text(k):
                issues.append(FormatIssue(_path_key(path, k), f"key {NOT_TEXT}", NOT_TEXT_FIX))
            elif not _check_opaque(v, _path_key(path, k), issues, seen, bound):
                return False
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if not _check_opaque(v, f"{path}[{i}]", issues, seen, bound):
                return False
    elif isinstance(value, str):
        if not is_text(value):
            issues.append(FormatIssue(path, NOT_TEXT, NOT_TEXT_FIX))
    elif isinstance(value, bool) or value is None:
        pass
    elif isinstance(value, int | float):
        if not _finite_json_number(value, MAX_OPAQUE_INT):  # nanosecond clocks need 64 bits
            issues.append(FormatIssue(path, f"{value!r} is not a finite JSON number within ±{MAX_OPAQUE_INT}",
                                      "give a finite number (integers within 64 bits)"))
    else:
        issues.append(FormatIssue(path, f"a {type(value).__name__} is not a JSON value",
                                  "give JSON values only (objects, arrays, strings, numbers, booleans, null)"))
    return True


@dataclass
class OneOfKind(Schema):
    """An object whose ``kind`` field selects one of several object schemas."""

    variants: dict[str, Obj]
    discriminator: str = "kind"
    description: str = ""
    _cache: dict = field(default_factory=dict, repr=False)

    def validate(self, value, path, issues):
        if not isinstance(value, dict):
            return self._wrong_type(value, path, issues, "an object")
        kind = value.get(self.discriminator)
        if not isinstance(kind, str) or kind not in self.variants:
            problem = (f"missing required field {self.discriminator!r}" if self.discriminator not in value
                       else f"{_shown(kind)} is not one of {', '.join(self.variants)}")
            issues.append(FormatIssue(_path_key(path, self.discriminator), problem,
                                      f"set {self.discriminator!r} to one of: {', '.join(self.variants)}"))
            return MISSING
        return self.variants[kind].validate(value, path, issues)

    def json_schema(self):
        return self._with_desc({"oneOf": [v.json_schema() for v in self.variants.values()]})


def validate_document(schema: Schema, value: Any, *, document: str) -> Any:
    """Validate and normalize; raise one FormatError listing every problem. Another ColdSnap document (its
    ``kind`` says which) is named as such instead of being dissected field by field."""
    kind_field = schema.fields.get("kind") if isinstance(schema, Obj) else None
    want = kind_field.schema.value if kind_field is not None and isinstance(kind_field.schema, Const) else None
    got = value.get("kind") if isinstance(value, dict) else None
    if isinstance(want, str) and isinstance(got, str) and got.startswith("coldsnap-") and got != want:
        raise FormatError([FormatIssue("$.kind", f"this is a {_shown(got)} document, not a {want!r} one",
                                       f"give the {document} here ({want}); `coldsnap validate` checks each kind "
                                       "with its own option")], document=document)
    issues: list[FormatIssue] = []
    out = schema.validate(value, "$", issues)
    if issues:
        raise FormatError(issues, document=document)
    return out


def json_schema_document(schema: Schema, *, schema_id: str, title: str) -> dict:
    """A complete JSON Schema (draft 2020-12) document for ``schema``."""
    body = schema.json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": schema_id,
        "title": title,
        **{k: v for k, v in body.items() if k != "title"},
    }
