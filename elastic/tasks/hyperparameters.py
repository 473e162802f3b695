"""A task's hyperparameters: validated by the schema the task declares, and read by name
whether they are a pydantic instance or a plain dict."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from elastic.tasks.api import TaskDefinitionError


def validate_hyperparameters(task_class: type[Any], given: dict[str, Any]) -> Any:
    """Returns `given` validated by the task's `Hyperparameters` model, or `given` itself when
    the task declares none. Raises TaskDefinitionError naming each refused field, or if there is
    no positive integer `batch_size`."""
    schema = getattr(task_class, "Hyperparameters", None)
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        try:
            validated: Any = schema.model_validate(given)
        except ValidationError as err:
            fields = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(all)'}: {e['msg']}" for e in err.errors()
            )
            raise TaskDefinitionError(f"hyperparameters refused by the task's schema: {fields}") from err
    else:
        validated = dict(given)
    batch_size = hyperparameter(validated, "batch_size")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise TaskDefinitionError(f"hyperparameter batch_size must be a positive integer, not {batch_size!r}")
    return validated


def hyperparameter(hyperparameters: Any, name: str) -> Any:
    """The value of `name` in a pydantic instance or a dict (None when absent)."""
    if isinstance(hyperparameters, dict):
        return hyperparameters.get(name)
    return getattr(hyperparameters, name, None)
