"""PipelineOverrides: a partial pipeline config (every field optional, unknown keys refused) whose JSON schema lets
Prefect refuse a bad deployment-run override at submission, before any worker sees the run."""
from __future__ import annotations

import types
from typing import Annotated, Any, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, create_model

from draftline.config import PipelineConfig, Strict

_PARTIALS: dict[type[BaseModel], type[BaseModel]] = {}


def _partial_annotation(annotation: Any) -> Any:
    """The annotation with each config section replaced by its partial model; a list keeps whole items, since an
    override's list replaces the configured one instead of merging into it."""
    if isinstance(annotation, type) and issubclass(annotation, Strict):
        return partial_model(annotation)
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return Union[tuple(_partial_annotation(arg) for arg in get_args(annotation))]
    return annotation


def partial_model(model: type[Strict]) -> type[BaseModel]:
    """`model` with every field optional (unset by default) and the same descriptions, bounds and patterns; unknown
    keys stay errors. Cross-field checks are not copied: the merged config is validated whole afterwards."""
    if model not in _PARTIALS:
        fields = {}
        for name, info in model.model_fields.items():
            annotation = _partial_annotation(info.annotation)
            if info.metadata:  # bounds and patterns, so that the schema refuses what the config would
                annotation = Annotated[(annotation, *info.metadata)]
            fields[name] = (Optional[annotation], Field(None, description=info.description))
        _PARTIALS[model] = create_model(
            f"{model.__name__}Override", __config__=ConfigDict(extra="forbid", regex_engine="python-re"), __doc__=model.__doc__, **fields)
    return _PARTIALS[model]


PipelineOverrides = partial_model(PipelineConfig)


def overrides_dict(overrides: BaseModel | dict | None) -> dict:
    """The keys an override set, as the mapping merge_overrides lays over a config (nulls it set explicitly kept)."""
    if overrides is None:
        return {}
    if isinstance(overrides, BaseModel):
        return overrides.model_dump(mode="json", exclude_unset=True)
    return overrides
