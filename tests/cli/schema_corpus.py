"""A corpus of JSON schemas covering every keyword duet's structured outputs honour
(src/roles/json_schema_check.h), for tests/cli/structured_test.py and the benchmark.

Each schema bounds what it lets a model write (strings have a maxLength, a pattern
or a format; arrays a maxItems; numbers are integers with bounds or a few numbers),
so that a small model's output ends within a few hundred tokens. `corpus()` returns
(name, schema, prompt) triples, at least 50; `unsupported()` returns schemas with one
keyword that is not honoured each, and that keyword.

Run as a script, it prints the corpus as JSON lines.
"""
import json

NAME = {"type": "string", "maxLength": 16}
SHORT = {"type": "string", "maxLength": 8}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
COLOR = {"enum": ["red", "green", "blue"]}


def obj(props, required=None, extra=False):
    s = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if extra is not None:
        s["additionalProperties"] = extra
    return s


def corpus():
    out = []

    def add(name, schema, prompt):
        out.append((name, schema, prompt))

    # Scalars.
    add("string", SHORT, "Name a fruit.")
    add("integer-bounds", AGE, "How old is a typical student?")
    add("integer-exclusive", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}, "Pick a number.")
    add("integer-multiple", {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}, "Round to five.")
    add("number-bounds", {"type": "number", "minimum": -1, "maximum": 1}, "A correlation coefficient?")
    add("boolean", {"type": "boolean"}, "Is water wet?")
    add("null", {"type": "null"}, "Say nothing.")
    add("enum-strings", COLOR, "Name a primary colour of light.")
    add("enum-mixed", {"enum": [1, "two", None, True]}, "Pick one.")
    add("const", {"const": "ok"}, "Acknowledge.")
    add("type-list", {"type": ["integer", "null"], "minimum": 0, "maximum": 9}, "A digit, or null.")
    # Strings: length, pattern, formats.
    add("min-max-length", {"type": "string", "minLength": 3, "maxLength": 6}, "A short word.")
    add("pattern-code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}, "An airport code and a number.")
    add("pattern-hex", {"type": "string", "pattern": "^#[0-9a-f]{6}$"}, "A colour in hex.")
    # (A format bounds nothing by itself: the prompt gives an example to copy.)
    for fmt, example in (("date", "2024-05-01"), ("time", "12:30:00Z"), ("date-time", "2024-05-01T12:30:00Z"),
                         ("uuid", "123e4567-e89b-12d3-a456-426614174000"), ("email", "bob@example.com"),
                         ("ipv4", "192.168.0.1"), ("ipv6", "fe80::1"), ("hostname", "example.com"),
                         ("duration", "P3DT4H")):
        add("format-" + fmt, {"type": "string", "format": fmt}, f"Repeat exactly, with the quotes: \"{example}\"")
    # Objects.
    add("person", obj({"name": NAME, "age": AGE}), "Describe a person.")
    add("optional", obj({"name": NAME, "nick": SHORT, "age": AGE}, required=["name"]), "Describe someone.")
    add("extra-allowed", dict(obj({"id": AGE}, extra={"type": "integer", "minimum": 0, "maximum": 9}), maxProperties=3),
        "An id and some digit fields.")
    add("no-required", obj({"a": AGE, "b": COLOR}, required=[]), "Anything.")
    add("min-max-properties",
        {"type": "object", "properties": {"a": AGE, "b": AGE, "c": AGE}, "minProperties": 1, "maxProperties": 2,
         "additionalProperties": False}, "One or two numbers.")
    add("pattern-properties",
        {"type": "object", "patternProperties": {"^x[0-9]$": AGE}, "maxProperties": 3, "additionalProperties": False},
        "Some numbered fields.")
    add("nested", obj({"user": obj({"name": NAME, "age": AGE}), "active": {"type": "boolean"}}), "A user record.")
    add("deep", obj({"a": obj({"b": obj({"c": obj({"d": SHORT})})})}), "Nest four levels.")
    add("annotations", dict(obj({"title": {"type": "string", "maxLength": 20, "description": "the title",
                                           "examples": ["Dune"]}}), title="Book", description="a book",
                            **{"$schema": "https://json-schema.org/draft/2020-12/schema"}), "A book.")
    # Arrays.
    add("array-min-max", {"type": "array", "items": AGE, "minItems": 2, "maxItems": 4}, "Some ages.")
    add("array-of-enum", {"type": "array", "items": COLOR, "maxItems": 3}, "Some colours.")
    add("array-of-objects", {"type": "array", "items": obj({"name": NAME, "age": AGE}), "minItems": 1, "maxItems": 2},
        "A few people.")
    add("prefix-items", {"type": "array", "prefixItems": [SHORT, AGE, {"type": "boolean"}], "items": False},
        "A name, an age and a flag.")
    add("prefix-then-items", {"type": "array", "prefixItems": [SHORT], "items": AGE, "maxItems": 3},
        "A label and numbers.")
    add("empty-array", {"type": "array", "maxItems": 0}, "Nothing.")
    add("array-of-arrays", {"type": "array", "items": {"type": "array", "items": AGE, "maxItems": 2}, "maxItems": 2},
        "A small matrix.")
    # Combinators.
    add("any-of", {"anyOf": [AGE, COLOR]}, "An age or a colour.")
    add("any-of-objects", {"anyOf": [obj({"cat": NAME}), obj({"dog": NAME})]}, "A pet.")
    # (oneOf: branches the grammar engine proves disjoint, by type or by a tag;
    # others are refused, see unsupported().)
    add("one-of-types", {"oneOf": [{"type": "boolean"}, {"type": "null"}]}, "A truth value, or null.")
    add("one-of-tagged", {"oneOf": [obj({"kind": {"const": "cat"}, "name": NAME}),
                                    obj({"kind": {"const": "dog"}, "age": AGE})]}, "A pet, tagged with its kind.")
    add("all-of-one", {"allOf": [obj({"n": AGE})]}, "A number field.")
    # (Several object schemas: merged into one before the grammar is built,
    # roles/json_schema_check.h merge_object_all_of; the output is checked against
    # the allOf as written.)
    add("all-of-objects", {"allOf": [obj({"name": NAME}, extra=None),
                                     {"properties": {"age": AGE}, "required": ["age", "name"]}]},
        "A person: a name and an age.")
    add("all-of-ref", {"$defs": {"base": obj({"id": AGE}, extra=None)},
                       "allOf": [{"$ref": "#/$defs/base"}, obj({"id": AGE, "color": COLOR}, required=["color"])]},
        "An item with an id and a colour.")
    add("nullable-field", obj({"v": {"anyOf": [AGE, {"type": "null"}]}}), "A value or null.")
    # References.
    defs = {"$defs": {"pt": obj({"x": AGE, "y": AGE})}}
    add("ref", dict(obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}), **defs), "Two points.")
    add("ref-definitions", {"definitions": {"c": COLOR}, "type": "array", "items": {"$ref": "#/definitions/c"},
                            "maxItems": 2}, "Colours.")
    add("ref-recursive", {"$defs": {"node": {"type": "object", "properties": {
        "v": AGE, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"],
        "additionalProperties": False}}, "$ref": "#/$defs/node"},
        'Repeat exactly: {"v": 1, "next": {"v": 2, "next": null}}')
    add("ref-tree", {"$defs": {"t": {"type": "object", "properties": {
        "name": SHORT, "kids": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 2}},
        "required": ["name", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/t"},
        'Repeat exactly: {"name": "Ann", "kids": [{"name": "Bo", "kids": []}]}')
    # Shapes real clients send.
    add("weather", obj({"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7}}), "Weather query for Paris.")
    add("event", obj({"title": NAME, "date": {"type": "string", "format": "date"},
                      "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 2}}),
        "An invitation to Tea on 2024-05-01 for ann@example.com and bo@example.org, as JSON.")
    add("product", obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}, "price": {
        "type": "integer", "minimum": 1, "maximum": 999}, "tags": {"type": "array", "items": SHORT, "maxItems": 3},
        "stock": {"type": "boolean"}}), "A product in a catalogue.")
    add("classification", obj({"label": {"enum": ["positive", "negative", "neutral"]},
                               "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
        "Classify: I loved this film.")
    add("extraction", obj({"people": {"type": "array", "items": NAME, "maxItems": 3}, "place": NAME}),
        "Alice and Bob met in Rome. Extract people and place.")
    add("bool-schema-true", True, "Any JSON value.")
    add("id-uuid-record", obj({"id": {"type": "string", "format": "uuid"}, "ok": {"type": "boolean"}}),
        "A record with an id.")
    add("sql-like", obj({"table": {"enum": ["users", "orders"]}, "limit": {"type": "integer", "minimum": 1,
                                                                           "maximum": 50},
                         "columns": {"type": "array", "items": {"enum": ["id", "name", "date"]}, "minItems": 1,
                                     "maxItems": 3}}), "Query the users table.")
    add("key-escapes", obj({"a b": SHORT, "quote\"d": SHORT, "slash/ed": SHORT}), "Fields with odd names.")
    return out


def unsupported():
    """(schema, keyword named in the 400) pairs."""
    return [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"not": {"type": "string"}}, "not"),
        ({"if": {"type": "string"}, "then": {"maxLength": 3}}, "if"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "string", "contentMediaType": "text/html"}, "contentMediaType"),
        ({"type": "string", "format": "color"}, "color"),
        ({"type": "string", "nullable": True}, "nullable"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "string", "enum": ["ok", "toolong"], "maxLength": 3}, "maxLength"),
        ({"type": "object", "required": ["a"]}, "required"),
        ({"properties": {"a": {"type": "string"}}}, "type"),
        ({"type": "string", "format": "email", "pattern": "^a"}, "pattern"),
    ]


if __name__ == "__main__":
    for name, schema, prompt in corpus():
        print(json.dumps({"name": name, "schema": schema, "prompt": prompt}))
