"""Validate a planner input document (catalog, workload profile, LLM spec) against a pydantic model that
forbids unknown keys, turning the first error into one sentence naming the file, the key and the keys allowed."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from cocoweave.cluster.yamlio import shorten
from cocoweave.errors import PlanningError

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """Base of every planner input schema: unknown keys are refused, values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The schema class that holds the field at `loc` (to list its allowed keys), following nested models."""
    current: Any = model
    for part in loc[:-1]:
        fields = getattr(current, "model_fields", {})
        if not isinstance(part, int) and part in fields:  # otherwise a list index or a dict key: same model
            current = _inner_model(fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _inner_model(annotation: Any) -> Any:
    """The BaseModel inside an annotation such as `list[X]`, `dict[str, X]` or `X | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _inner_model(arg)
        if found is not None:
            return found
    return None


def _where(loc: tuple) -> tuple[str, str]:
    """(`machines[0]`, `'name'`) for loc ('machines', 0, 'name'): the entry holding the key, and the key."""
    *path, last = loc
    prefix = ""
    for part in path:
        prefix += (f"[{part}]" if isinstance(part, int) else f"[{part!r}]") if prefix else str(part)
    return prefix, repr(last) if not isinstance(last, int) else f"[{last}]"


def validate(model: type[M], doc: Any, source: str, what: str) -> M:
    """`model` validated from `doc`; a PlanningError (one sentence: file, key, allowed keys) otherwise."""
    if not isinstance(doc, dict):
        raise PlanningError(f"{source}: a {what} must be a mapping with the keys {', '.join(model.model_fields)}.")
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        msg = err["msg"][0].lower() + err["msg"][1:]
        if not loc:
            why = shorten(msg.removeprefix("value error, "))
            raise PlanningError(f"{source}: the {what} is inconsistent: {why}.") from None
        prefix, key = _where(loc)
        where = f"{source}: {prefix}: " if prefix else f"{source}: "
        if err["type"] == "extra_forbidden":
            holder = _model_at(model, loc)
            allowed = ", ".join(holder.model_fields) if holder is not None else "see the documentation"
            raise PlanningError(f"{where}unknown key {key} in the {what} (allowed keys: {allowed}).") from None
        if err["type"] == "missing":
            raise PlanningError(f"{where}the {what} is missing the key {key}.") from None
        raise PlanningError(f"{where}{key} in the {what}: {msg}, got {shorten(repr(err.get('input')))}.") from None
