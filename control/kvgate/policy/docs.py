"""Generate the policy reference (docs/policy-reference.md) from the model's field descriptions.

``python -m kvgate.policy.docs > docs/policy-reference.md`` rewrites it; a unit
test fails when the file and the model disagree.
"""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel

from .model import Policy


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (list, typing.List):
        (arg,) = typing.get_args(annotation) or (str,)
        return f"list of {_type_name(arg)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.__name__
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value)}`"


def _summary(doc: str | None) -> str:
    """A docstring's first paragraph on one line (its first line alone may stop mid-sentence)."""
    para = []
    for line in (doc or "").strip().splitlines():
        if not line.strip():
            break
        para.append(line.strip())
    return " ".join(para)


def markdown() -> str:
    """The reference as Markdown: one table per section, in the order of the YAML file."""
    out = ["# Policy reference", "",
           "Generated from `control/kvgate/policy/model.py` by `python -m kvgate.policy.docs`; do not edit by hand.",
           "Unknown keys are errors. A bad file is rejected with the YAML path of each bad field.", ""]
    sections: list[tuple[str, type[BaseModel]]] = [("(top level)", Policy)]
    seen: set[type] = set()
    while sections:
        path, model = sections.pop(0)
        if model in seen:
            continue
        seen.add(model)
        out += [f"## `{path}` — {model.__name__}", "", _summary(model.__doc__), "",
                "| field | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            ann = field.annotation
            sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
            args = typing.get_args(ann)
            if typing.get_origin(ann) is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                sub = args[0]
            elif sub is None and type(None) in args:  # `X | None`: X's own table too
                models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
                sub = models[0] if len(models) == 1 else None
            if sub is not None:
                prefix = "" if path == "(top level)" else path + "."
                sections.append((f"{prefix}{name}" + ("[]" if typing.get_origin(ann) is list else ""), sub))
            desc = field.description or _summary(sub.__doc__) if sub else field.description
            desc = (desc or "").replace("|", "\\|")
            out.append(f"| `{name}` | {_type_name(ann)} | {_default(field)} | {desc} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
