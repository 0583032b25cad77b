"""The spec models' base classes (and that of a mapping that may be written as its kind
alone), the bounds every number field is checked against, and the discriminator of terms
written as a bare keyword or a single-key mapping.
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    GetJsonSchemaHandler,
    ModelWrapValidatorHandler,
    ValidationError,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, ErrorDetails, InitErrorDetails, PydanticCustomError
from pydantic_core.core_schema import ErrorType

from posgen.spec.diagnostics import closest_name, quoted
from posgen.spec.expr import ExprError

MAX_TABLE_ROWS = 1 << 21
"""Rows of a trained position table (2,097,152): each row is model_dim floats."""
# Every trained table (and projection of one) a spec's defaults create holds at most this
# many floats (512 MiB in float32), whatever its rows and width: a module's memory is
# bounded by its spec.
MAX_TABLE_ELEMENTS = 1 << 27
# An ODE trajectory is integrated step by step (Python loop): a tighter horizon bound.
MAX_ODE_POSITIONS = 1 << 16
MAX_ODE_STEPS = 1 << 18
"""The most integration steps to the horizon (max_positions x steps_per_position): each
is a sequential evaluation of h (four with rk4), about 90 us at hidden 16 on a 2-core
x86 CPU, so the farthest position costs at most about half a minute there."""
MAX_BASE = 1e9
"""Largest sinusoid or rotary base: published bases reach 10^7 (Qwen2.5-1M's rope_theta)."""
MAX_INIT_STD = 10.0
"""Largest initialisation std (published encodings use 0.02 to 1; 1e300 makes inf)."""
MAX_GRID_KERNEL = 63
"""Largest k of a k x k grid_2d convolution (k^2 weights per feature; CPVT uses 3)."""
MAX_EXPR_INIT = 1e4
"""Largest magnitude of an expression parameter's init and bounds."""
MIN_EPS = 1e-12
"""Smallest normalisation eps (BERT's): smaller ones vanish in float32, 0/0 gives NaN."""

_INIT_STD_WHY = (
    f"std of the normal initialisation, in (0, {MAX_INIT_STD:g}] (published: 0.02 to 1): "
    "1e300 makes the parameters inf, and large values push the logits past half precision"
)
BASE_WHY = (
    f"base of the frequencies base^(-2k/d), in (1, {MAX_BASE:g}]: published bases are "
    "10,000 to 10^7; a base of 1 or less gives no decreasing frequencies"
)
EPS_WHY = (
    f"added to the variance, in [{MIN_EPS:g}, 0.1]: a smaller eps vanishes in float32 and "
    "a constant row gives 0/0 = NaN; larger ones flatten the normalisation"
)


def init_std(default: float) -> Any:
    """The ``init_std`` field every trained parameter has: bounded, documented."""
    return Field(default, gt=0, le=MAX_INIT_STD, description=_INIT_STD_WHY)


class SpecModel(BaseModel):
    """Base of every spec model: frozen, strict, unknown keys rejected with a hint."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="wrap")
    @classmethod
    def _reject_unknown_keys(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        """Unknown keys are errors beside those of the known ones: the known keys are
        still validated, so one mapping's typo and its bad value are reported together."""
        if not isinstance(data, dict):
            return handler(data)
        allowed = {info.alias or name for name, info in cls.model_fields.items()}
        unknown = [key for key in data if key not in allowed]
        if not unknown:
            return handler(data)
        errors = [_unknown_key_error(key, allowed, data) for key in unknown]
        # a required field that an unknown key is a misspelling of is not missing twice
        meant = {closest_name(str(key), allowed) for key in unknown}
        try:
            handler({key: value for key, value in data.items() if key in allowed})
        except ValidationError as error:
            errors.extend(
                _reraised(item)
                for item in error.errors(include_url=False)
                if not (
                    item["type"] == "missing" and len(item["loc"]) == 1 and item["loc"][0] in meant
                )
            )
        raise ValidationError.from_exception_data(cls.__name__, errors)


class KeywordModel(SpecModel):
    """A spec model with a ``kind`` field whose whole mapping may be written as that kind
    alone: ``scale: none`` is ``scale: {kind: none}``, the other fields at their defaults.

    The keyword is read as that mapping before validation, and the model's JSON Schema
    (``posgen schema``) takes either form: ``anyOf`` the kinds as keywords and the
    mapping, so that an editor accepts what the loader accepts.
    """

    @model_validator(mode="before")
    @classmethod
    def _from_keyword(cls, data: Any) -> Any:
        return {"kind": data} if isinstance(data, str) else data

    @classmethod
    def keywords(cls) -> list[str]:
        """The kinds that stand for a whole mapping, in their declared order."""
        return [a for a in get_args(cls.model_fields["kind"].annotation) if isinstance(a, str)]

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        mapping = dict(handler(core_schema))  # the mapping's schema, this definition
        keyword = {
            "type": "string",
            "enum": cls.keywords(),
            "description": "the kind alone, for {kind: ...} with the other fields at their "
            "defaults",
        }
        # the title and description are the whole definition's, shown for either form
        shared: JsonSchemaValue = {
            key: mapping.pop(key) for key in ("title", "description") if key in mapping
        }
        return {**shared, "anyOf": [keyword, mapping]}


_BUILT_IN_ERRORS = frozenset(get_args(ErrorType))


def _unknown_key_error(key: Any, allowed: set[str], data: dict[Any, Any]) -> InitErrorDetails:
    """The error of one unknown key of a mapping, with the closest allowed name."""
    hint = closest_name(str(key), allowed)
    suggestion = f" (did you mean {hint!r}?)" if hint else ""
    error = PydanticCustomError(
        "unknown_field",
        "unknown field {shown}{suggestion}; allowed: {allowed}",
        {
            "key": str(key),
            "shown": quoted(str(key)),
            "suggestion": suggestion,
            "allowed": ", ".join(sorted(allowed)),
        },
    )
    return {"type": error, "loc": (), "input": data}


def _reraised(item: ErrorDetails) -> InitErrorDetails:
    """A validation error as raised again: pydantic's own types with their context, and
    posgen's (custom) types with their message and context unchanged."""
    context = item.get("ctx")
    if item["type"] in _BUILT_IN_ERRORS:
        details: InitErrorDetails = {
            "type": item["type"],
            "loc": item["loc"],
            "input": item["input"],
        }
        if context is not None:
            details["ctx"] = context
        return details
    custom = PydanticCustomError(
        item["type"], "{message}", {**(context or {}), "message": item["msg"]}
    )
    return {"type": custom, "loc": item["loc"], "input": item["input"]}


def expression_error(error: ExprError) -> PydanticCustomError:
    """An expression's error for the loader: its message and the character it is at."""
    return PydanticCustomError(
        "expr",
        "{message} (at character {character} of the expression)",
        {"message": error.message, "character": error.offset + 1, "offset": error.offset},
    )


def cross_field_error(at: str, message: str) -> PydanticCustomError:
    """An error about a combination of fields, reported at the sub-field ``at``."""
    return PydanticCustomError("cross_field", "{message}", {"message": message, "at": at})


FORM_SHAPES = "(a keyword, or a mapping with that single key)"
"""How a term's forms are written, in the messages that list them."""


def tagged(*tags: str, what: str, leading: tuple[str, str] | None = None) -> Discriminator:
    """Discriminate a term written as a bare keyword or as a single-key mapping.

    ``leading = (key, tag)`` names a form whose mapping may carry more keys: any mapping
    that holds ``key`` is that form (its model then rejects keys it does not know). Its
    tag differs from the key so that error locations keep the key as a data path.
    """
    allowed = set(tags)
    lead_key, lead_tag = leading if leading is not None else (None, None)

    def tag_of(value: Any) -> str | None:
        if isinstance(value, str):
            return value if value in allowed else None
        if isinstance(value, dict) and lead_key is not None and lead_key in value:
            return lead_tag
        if isinstance(value, dict) and len(value) == 1:
            key = next(iter(value))
            return key if key in allowed else None
        if isinstance(value, BaseModel):  # a built term (validated again, or serialised)
            form = getattr(value, "form", None)
            return lead_tag if form is not None and form == lead_key else form
        return None

    listing = ", ".join(sorted(allowed | ({lead_key} if lead_key else set())))
    return Discriminator(
        tag_of,
        custom_error_type="invalid_form",
        custom_error_message=f"{what} must be one of: {listing} {FORM_SHAPES}",
        custom_error_context={"allowed": listing},
    )
