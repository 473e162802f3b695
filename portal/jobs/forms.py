"""The submit form's side of the one spec validation: turn the posted fields (or a pasted or
uploaded YAML spec) into the spec dict that `elastic.spec.validate_spec` checks, and describe
each workload's hyperparameters for the template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import User
from django.http import QueryDict
from django.utils.datastructures import MultiValueDict

from elastic.spec import FieldError
from elastic.workloads import CATALOGUE
from portal.bodies import BodyError, parse_yaml
from portal.errors import ApiError
from portal.jobs.code import store, upload_for

SPEC_FIELDS = (
    "name", "workload", "min_workers", "max_workers", "priority", "consistency", "precision", "seed", "eval_every_steps",
)
STRICT_FIELDS = ("virtual_workers",)
HYBRID_FIELDS = ("batch_per_worker", "min_batch_size", "max_batch_size", "lr_scaling", "warmup_steps")
"""Each mode's own inputs; those of the mode not chosen are ignored (the script disables them)."""
ERROR_SLOTS = (
    *SPEC_FIELDS, *STRICT_FIELDS, *HYBRID_FIELDS, "length", "code_file", "entrypoint", "code_hyperparameters", "spec_yaml",
)
"""The inputs that show their own error beside them in the form (templates/jobs/submit.html); a
workload's hyperparameters add theirs, and `hp-WORKLOAD` for an error about several of them."""
MAX_YAML_BYTES = 64 * 1024
OWN_CODE = "own-code"
"""The form's choice of what to train (its `source`) that means: the job's own code, uploaded
with the form; the other is "catalogue", a workload of the `workload` list."""


def chosen_workload(post: QueryDict) -> str:
    """The workload the form asks for: OWN_CODE where its `source` is the job's own code (or, as
    a client of the older form sends it, its `workload`), else the `workload` list's choice."""
    if post.get("source") == OWN_CODE or post.get("workload") == OWN_CODE:
        return OWN_CODE
    return post.get("workload", "")


@dataclass(frozen=True)
class HyperparameterField:
    name: str
    label: str
    kind: str  # "integer" or "number"
    default: Any
    minimum: Any
    maximum: Any
    description: str

    def input_id(self, workload: str) -> str:
        return f"hp-{workload}-{self.name}"


def hyperparameter_fields(workload: str) -> list[HyperparameterField]:
    schema = CATALOGUE[workload].schema()
    fields = []
    for name, prop in schema["properties"].items():
        fields.append(
            HyperparameterField(
                name=name,
                label=name,
                kind=prop.get("type", "number"),
                default=prop.get("default"),
                minimum=prop.get("minimum", prop.get("exclusiveMinimum")),
                maximum=prop.get("maximum", prop.get("exclusiveMaximum")),
                description=prop.get("description", ""),
            )
        )
    return fields


def spec_from_yaml(text: str) -> Any:
    """Parse a YAML (or JSON) spec, with portal.bodies's bounds. Raises ApiError 400 quoting the
    parser's complaint."""
    try:
        return parse_yaml(text)
    except BodyError as exc:
        raise ApiError(400, "malformed_body", str(exc), [FieldError("spec_yaml", str(exc), text[:200])]) from exc


def uses_yaml(post: QueryDict, files: MultiValueDict) -> bool:
    """Whether the person gave the spec as YAML (which then replaces the form's fields)."""
    return files.get("spec_file") is not None or bool(post.get("spec_yaml", "").strip())


def code_from_post(post: QueryDict, files: MultiValueDict, owner: User) -> str:
    """The digest of the code the form brings: the uploaded archive (stored now), or the digest
    an earlier try of this form stored. Raises ApiError on `code_file`."""
    archive = files.get("code_file")
    if archive is not None:
        try:
            _, packed = store(owner, archive, archive.size or 0, archive.name or "upload")
        except ApiError as exc:
            raise ApiError(exc.status, exc.code, exc.message,
                           [FieldError("code_file", f.message, f.value) for f in exc.fields]) from exc
        return packed.digest
    digest = post.get("code_digest", "").strip()
    if digest and upload_for(owner, digest) is not None:
        return digest
    raise ApiError(400, "invalid_spec", "choose your code: a tar.gz or zip of your task's directory",
                   [FieldError("code_file", "choose a tar.gz or zip of your task's directory", None)])


def _code_hyperparameters(text: str) -> Any:
    if not text.strip():
        return {}
    try:
        return parse_yaml(text)
    except BodyError as exc:
        raise ApiError(400, "invalid_spec", f"the hyperparameters do not parse: {exc}",
                       [FieldError("code_hyperparameters", str(exc), text[:200])]) from exc


def spec_from_post(post: QueryDict, files: MultiValueDict, owner: User) -> Any:
    """The spec a person submitted: the uploaded or pasted YAML if there is one, else the form's
    fields (empty ones left out so that defaults apply). A job with its own code has its archive
    stored first (`code_from_post`)."""
    upload = files.get("spec_file")
    if upload is not None:
        if upload.size > MAX_YAML_BYTES:
            raise ApiError(400, "invalid_spec", f"the uploaded spec is {upload.size} bytes; at most {MAX_YAML_BYTES}",
                           [FieldError("spec_file", "too large", upload.size)])
        return spec_from_yaml(upload.read().decode("utf-8", errors="replace"))
    spec_yaml = post.get("spec_yaml", "")
    if spec_yaml.strip():
        return spec_from_yaml(spec_yaml)
    mode_fields = HYBRID_FIELDS if post.get("consistency") == "hybrid" else STRICT_FIELDS
    spec: dict[str, Any] = {
        key: post[key] for key in (*SPEC_FIELDS, *mode_fields) if post.get(key, "").strip() != ""
    }
    length_kind = post.get("length_kind", "steps")
    if post.get("length", "").strip():
        spec["epochs" if length_kind == "epochs" else "steps"] = post["length"]
    workload = chosen_workload(post)
    if workload == OWN_CODE:
        spec.pop("workload", None)
        spec["code"] = code_from_post(post, files, owner)
        spec["entrypoint"] = post.get("entrypoint", "").strip()
        spec["hyperparameters"] = _code_hyperparameters(post.get("code_hyperparameters", ""))
    elif workload in CATALOGUE:
        spec["hyperparameters"] = {
            field.name: post[field.input_id(workload)]
            for field in hyperparameter_fields(workload)
            if post.get(field.input_id(workload), "").strip() != ""
        }
    return spec


def errors_by_input(error: ApiError, workload: str, from_yaml: bool) -> dict[str, str]:
    """Map the API's field errors to the form's input ids (a YAML spec's keep the spec's names)."""
    mapped: dict[str, str] = {}
    for field in error.fields:
        name = field.field
        if from_yaml:
            if name not in {"spec_yaml", "spec_file"}:
                name = f"spec.{name}"
        elif workload == OWN_CODE and (name == "hyperparameters" or name.startswith("hyperparameters.")):
            name = "code_hyperparameters"
        elif workload == OWN_CODE and name == "code":
            name = "code_file"
        elif name.startswith("hyperparameters."):
            name = f"hp-{workload}-{name.removeprefix('hyperparameters.')}"
        elif name == "hyperparameters":  # a rule across several of them: d_model and heads
            name = f"hp-{workload}"
        elif name in {"steps", "epochs"}:
            name = "length"
        mapped.setdefault(name, field.message)
    return mapped
