"""A shared suite of JSON schemas for structured output: benchmarks and tests draw from it.

Each case holds a JSON schema, a chat prompt that asks SmolLM2 for such an object, one valid
instance and (where the schema has a constraint worth checking) instances it must refuse.
The schemas keep to the subset that llguidance, xgrammar and outlines-core all compile:
``type`` object/array/string/integer/number/boolean, ``properties`` with ``required`` (fields
left out of ``required`` are optional), ``additionalProperties: false``, ``items`` with
``minItems``/``maxItems``, ``enum``, ``minimum``/``maximum``, ``minLength``/``maxLength`` and
``pattern`` (anchored, plain character classes and counted repeats only). One gap, measured by
``benchmarks/structured/grammar_libs.py``: outlines-core 0.2 compiles ``minimum``/``maximum`` but drops them
(any integer or number passes), so it refuses only 12 of the 16 refused instances below.

Instances list their keys in the schema's ``properties`` order: outlines-core and xgrammar emit
properties in that order, so an instance in another order is a different (refused) text.

Pure data plus small helpers: no torch, no ray, nothing outside the standard library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

JsonSchema = dict[str, Any]


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: JsonSchema
    prompt: str  # the user turn of a chat that asks for one such object
    example: dict[str, Any]  # one valid instance, keys in ``properties`` order
    # instances the schema refuses, each for one constraint (bound, pattern, enum, required, ...)
    invalid: tuple[dict[str, Any], ...] = field(default=())
    features: tuple[str, ...] = field(default=())  # what the case exercises, for reports


def _obj(properties: dict[str, JsonSchema], required: list[str] | None = None) -> JsonSchema:
    """A closed object; every property is required unless ``required`` says otherwise."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


_STR: JsonSchema = {"type": "string"}
_BOOL: JsonSchema = {"type": "boolean"}


def _int(lo: int, hi: int) -> JsonSchema:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float) -> JsonSchema:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _enum(*values: str) -> JsonSchema:
    return {"type": "string", "enum": list(values)}


SCHEMAS: list[SchemaCase] = [
    SchemaCase(
        name="person",
        schema=_obj({"name": _STR, "age": _int(0, 150), "is_student": _BOOL}),
        prompt="Describe a fictional person as a JSON object with their name, age and whether they are a student.",
        example={"name": "Alice Martin", "age": 29, "is_student": False},
        invalid=({"name": "Bob", "age": 200, "is_student": True}, {"name": "Bob", "age": 30}),
        features=("integer bounds", "boolean"),
    ),
    SchemaCase(
        name="nested_address",
        schema=_obj(
            {
                "user": _obj(
                    {
                        "full_name": _STR,
                        "address": _obj(
                            {
                                "street": _STR,
                                "city": _STR,
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                            }
                        ),
                    }
                ),
            }
        ),
        prompt="Give a user with their full name and postal address (street, city, 5-digit zip) as JSON.",
        example={
            "user": {
                "full_name": "Jean Dupont",
                "address": {"street": "12 Rue de la Paix", "city": "Paris", "zip": "75002"},
            }
        },
        invalid=({"user": {"full_name": "X", "address": {"street": "A", "city": "B", "zip": "7500"}}},),
        features=("nested objects", "pattern"),
    ),
    SchemaCase(
        name="order_items",
        schema=_obj(
            {
                "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
                "items": {
                    "type": "array",
                    "items": _obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "quantity": _int(1, 100),
                            "unit_price": _num(0, 10000),
                        }
                    ),
                    "minItems": 1,
                    "maxItems": 5,
                },
            }
        ),
        prompt=(
            "Write a shop order as JSON: an order id like ORD-123456 and 1 to 5 items, each with a SKU like "
            "ABC-1234, a quantity and a unit price."
        ),
        example={
            "order_id": "ORD-004217",
            "items": [
                {"sku": "TEA-0042", "quantity": 2, "unit_price": 4.5},
                {"sku": "MUG-1001", "quantity": 1, "unit_price": 12.99},
            ],
        },
        invalid=(
            {"order_id": "ORD-004217", "items": []},
            {"order_id": "ORD-42", "items": [{"sku": "TEA-0042", "quantity": 2, "unit_price": 4.5}]},
        ),
        features=("array of objects", "minItems/maxItems", "pattern", "number bounds"),
    ),
    SchemaCase(
        name="weather_report",
        schema=_obj(
            {
                "city": _STR,
                "condition": _enum("sunny", "partly_cloudy", "cloudy", "rain", "snow", "storm"),
                "temperature_c": _num(-80, 60),
                "humidity_pct": _int(0, 100),
                "wind": _obj(
                    {"speed_kmh": _num(0, 400), "direction": _enum("N", "NE", "E", "SE", "S", "SW", "W", "NW")}
                ),
            }
        ),
        prompt=(
            "Report today's weather in Lisbon as JSON: city, condition, temperature in Celsius, humidity percent "
            "and wind speed and direction."
        ),
        example={
            "city": "Lisbon",
            "condition": "partly_cloudy",
            "temperature_c": 21.5,
            "humidity_pct": 64,
            "wind": {"speed_kmh": 18, "direction": "NW"},
        },
        invalid=(
            {
                "city": "Lisbon",
                "condition": "hail",
                "temperature_c": 21.5,
                "humidity_pct": 64,
                "wind": {"speed_kmh": 18, "direction": "NW"},
            },
        ),
        features=("enum", "number bounds", "nested object"),
    ),
    SchemaCase(
        name="task_optional",
        schema=_obj(
            {
                "title": {"type": "string", "minLength": 1, "maxLength": 80},
                "priority": _enum("low", "medium", "high"),
                "due_date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "tags": {"type": "array", "items": _STR, "maxItems": 4},
                "done": _BOOL,
            },
            required=["title", "priority"],
        ),
        prompt=(
            "Create a to-do item as JSON with a title and a priority; add a due date (YYYY-MM-DD), tags or a done "
            "flag if useful."
        ),
        example={"title": "Renew passport", "priority": "high", "due_date": "2026-03-15", "done": False},
        invalid=({"title": "", "priority": "high"}, {"title": "Renew passport", "priority": "urgent"}),
        features=("optional fields", "minLength/maxLength", "pattern", "enum"),
    ),
    SchemaCase(
        name="product_review",
        schema=_obj(
            {
                "product": _STR,
                "rating": _int(1, 5),
                "recommend": _BOOL,
                "pros": {"type": "array", "items": _STR, "maxItems": 3},
                "cons": {"type": "array", "items": _STR, "maxItems": 3},
                "summary": {"type": "string", "maxLength": 200},
            }
        ),
        prompt=(
            "Review a pair of wireless headphones as JSON: product name, a rating from 1 to 5, whether you "
            "recommend it, up to 3 pros and cons, and a one-sentence summary."
        ),
        example={
            "product": "Aurora X2 headphones",
            "rating": 4,
            "recommend": True,
            "pros": ["long battery life", "comfortable"],
            "cons": ["bulky case"],
            "summary": "Great sound and battery for the price, though the case is large.",
        },
        invalid=({"product": "A", "rating": 6, "recommend": True, "pros": [], "cons": [], "summary": ""},),
        features=("array of strings", "integer bounds", "maxLength"),
    ),
    SchemaCase(
        name="classification",
        schema=_obj(
            {
                "label": _enum("positive", "negative", "neutral"),
                "confidence": _num(0, 1),
            }
        ),
        prompt=(
            'Classify the sentiment of "The service was slow but the food was excellent." as JSON with a label '
            "and a confidence between 0 and 1."
        ),
        example={"label": "positive", "confidence": 0.72},
        invalid=({"label": "mixed", "confidence": 0.5}, {"label": "positive", "confidence": 1.5}),
        features=("enum (choice)", "number bounds"),
    ),
    SchemaCase(
        name="recipe_steps",
        schema=_obj(
            {
                "title": _STR,
                "servings": _int(1, 12),
                "ingredients": {"type": "array", "items": _STR, "minItems": 1},
                "steps": {
                    "type": "array",
                    "items": _obj({"step": _int(1, 20), "instruction": _STR}),
                    "minItems": 1,
                },
                "vegetarian": _BOOL,
            }
        ),
        prompt=(
            "Give a simple pancake recipe as JSON: title, servings, a list of ingredients and numbered steps, and "
            "whether it is vegetarian."
        ),
        example={
            "title": "Simple pancakes",
            "servings": 4,
            "ingredients": ["200 g flour", "2 eggs", "300 ml milk"],
            "steps": [
                {"step": 1, "instruction": "Whisk flour, eggs and milk."},
                {"step": 2, "instruction": "Fry ladlefuls in a hot pan."},
            ],
            "vegetarian": True,
        },
        invalid=(
            {
                "title": "P",
                "servings": 4,
                "ingredients": [],
                "steps": [{"step": 1, "instruction": "x"}],
                "vegetarian": True,
            },
        ),
        features=("array of objects", "array of strings", "integer bounds", "boolean"),
    ),
    SchemaCase(
        name="calendar_event",
        schema=_obj(
            {
                "title": _STR,
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                "duration_min": _int(5, 480),
                "location": _obj({"room": _STR, "online": _BOOL}, required=["online"]),
                "attendees": {
                    "type": "array",
                    "items": _obj(
                        {"name": _STR, "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"}}
                    ),
                    "maxItems": 5,
                },
            }
        ),
        prompt=(
            "Schedule a project kick-off meeting as JSON: title, date (YYYY-MM-DD), start time (HH:MM), duration "
            "in minutes, location (room, online or not) and attendees with name and email."
        ),
        example={
            "title": "Project kick-off",
            "date": "2026-02-10",
            "start": "09:30",
            "duration_min": 60,
            "location": {"room": "Orion", "online": True},
            "attendees": [
                {"name": "Dana Lee", "email": "dana.lee@example.com"},
                {"name": "Sam Ortiz", "email": "sam@example.org"},
            ],
        },
        invalid=(
            {
                "title": "K",
                "date": "2026-02-10",
                "start": "9:30",
                "duration_min": 60,
                "location": {"online": True},
                "attendees": [],
            },
            {
                "title": "K",
                "date": "2026-02-10",
                "start": "09:30",
                "duration_min": 1,
                "location": {"online": True},
                "attendees": [],
            },
        ),
        features=("patterns", "optional nested field", "array of objects", "integer bounds"),
    ),
    SchemaCase(
        name="server_config",  # schema-heavy: 12 fixed keys, most values enums/booleans
        schema=_obj(
            {
                "service": _STR,
                "environment": _enum("development", "staging", "production"),
                "region": _enum("us-east-1", "us-west-2", "eu-west-1", "eu-central-1", "ap-southeast-1"),
                "protocol": _enum("http", "https", "grpc"),
                "port": _int(1, 65535),
                "tls_enabled": _BOOL,
                "log_level": _enum("debug", "info", "warning", "error"),
                "replicas": _int(1, 16),
                "autoscaling": _BOOL,
                "max_connections": _int(1, 100000),
                "timeout_seconds": _num(0.1, 600),
                "health_check": _obj(
                    {"path": {"type": "string", "pattern": "^/[a-z/]*$"}, "interval_seconds": _int(1, 300)}
                ),
            }
        ),
        prompt=(
            "Write the deployment configuration of a production web API in eu-west-1 as JSON: service name, "
            "environment, region, protocol, port, TLS, log level, replicas, autoscaling, max connections, timeout "
            "and health check."
        ),
        example={
            "service": "orders-api",
            "environment": "production",
            "region": "eu-west-1",
            "protocol": "https",
            "port": 8443,
            "tls_enabled": True,
            "log_level": "info",
            "replicas": 3,
            "autoscaling": True,
            "max_connections": 5000,
            "timeout_seconds": 30,
            "health_check": {"path": "/healthz", "interval_seconds": 15},
        },
        invalid=(
            {
                "service": "orders-api",
                "environment": "prod",
                "region": "eu-west-1",
                "protocol": "https",
                "port": 8443,
                "tls_enabled": True,
                "log_level": "info",
                "replicas": 3,
                "autoscaling": True,
                "max_connections": 5000,
                "timeout_seconds": 30,
                "health_check": {"path": "/healthz", "interval_seconds": 15},
            },
        ),
        features=("schema-heavy: many fixed keys", "enums", "integer/number bounds", "nested object", "pattern"),
    ),
    SchemaCase(
        name="employee_record",  # schema-heavy: 10 fixed keys, enums, a nested array
        schema=_obj(
            {
                "employee_id": {"type": "string", "pattern": "^E[0-9]{5}$"},
                "first_name": _STR,
                "last_name": _STR,
                "department": _enum("engineering", "sales", "marketing", "finance", "support", "legal"),
                "level": _enum("junior", "mid", "senior", "staff", "principal"),
                "full_time": _BOOL,
                "remote": _BOOL,
                "start_year": _int(1990, 2030),
                "salary_band": _enum("A", "B", "C", "D"),
                "skills": {
                    "type": "array",
                    "items": _enum("python", "go", "rust", "sql", "java", "kubernetes"),
                    "maxItems": 4,
                },
            }
        ),
        prompt=(
            "Create an HR record as JSON for a senior backend engineer: employee id like E01234, first and last "
            "name, department, level, full-time and remote flags, start year, salary band and up to 4 skills."
        ),
        example={
            "employee_id": "E04821",
            "first_name": "Priya",
            "last_name": "Nair",
            "department": "engineering",
            "level": "senior",
            "full_time": True,
            "remote": False,
            "start_year": 2019,
            "salary_band": "C",
            "skills": ["python", "go", "kubernetes"],
        },
        invalid=(
            {
                "employee_id": "E4821",
                "first_name": "P",
                "last_name": "N",
                "department": "engineering",
                "level": "senior",
                "full_time": True,
                "remote": False,
                "start_year": 2019,
                "salary_band": "C",
                "skills": [],
            },
        ),
        features=("schema-heavy: many fixed keys", "enums", "array of enums", "pattern", "integer bounds"),
    ),
]


def by_name(name: str) -> SchemaCase:
    for case in SCHEMAS:
        if case.name == name:
            return case
    raise KeyError(f"no schema case {name!r}; have {[c.name for c in SCHEMAS]}")


def instance_text(instance: dict[str, Any]) -> str:
    """The JSON text a constrained model would emit: one line, ``", "`` and ``": "`` separators
    (single spaces fit every library's default whitespace rule)."""
    return json.dumps(instance, ensure_ascii=False)


def chat_messages(case: SchemaCase) -> list[dict[str, str]]:
    """An OpenAI-style chat for the case: the schema in the system turn, the prompt in the user turn."""
    system = "Answer with one JSON object that follows this JSON schema, and nothing else:\n" + json.dumps(case.schema)
    return [{"role": "system", "content": system}, {"role": "user", "content": case.prompt}]
