"""The config reference in Markdown, generated from the schema's field docs (``python -m stagewise.config --reference``)."""

from __future__ import annotations

from pydantic import BaseModel

from stagewise.definitions.config import (
    CategoricalParam,
    EarlyStopping,
    EntryPoint,
    FeatureColumn,
    FloatParam,
    IntParam,
    KubernetesSettings,
    PipelineConfig,
    Profile,
    Pruner,
    SageMakerSettings,
    Sampler,
    SlurmSettings,
    TrainStage,
)
from stagewise.definitions.hyperparams import KNOWN


def reference(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[str]:
    """Markdown rows documenting every config key, from the field descriptions (so docs never drift)."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        nested = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        if nested is None:
            rows.append(f"| `{key}` | {field.description or ''} | {default if len(default) < 40 else '...'} |")
        else:
            rows.append(f"| `{key}` | {field.description or nested.__doc__.splitlines()[0]} | |")
            rows.extend(reference(nested, key + "."))
    return rows


def markdown() -> str:
    """The whole reference: the top-level keys, then each nested model used in lists and unions."""
    parts = ["| key | meaning | default |\n|---|---|---|", "\n".join(reference())]
    for model in (FeatureColumn, Profile, SageMakerSettings, KubernetesSettings, SlurmSettings, TrainStage, EntryPoint, EarlyStopping, Sampler,
                  Pruner, FloatParam, IntParam, CategoricalParam):
        parts.append(f"\n`{model.__name__}` ({model.__doc__.splitlines()[0]})\n\n| key | meaning | default |\n|---|---|---|")
        parts.append("\n".join(reference(model)))
    parts.append("\nHyperparameters the framework knows by name (`train.default_params`, `sweep.search_space`, "
                 "`--params`; a spec's own come from its `default_params`), and what the model card records with "
                 "every version:\n\n| name | meaning | default | domain |\n|---|---|---|---|")
    parts.append("\n".join(f"| `{hyper.name}` | {hyper.doc} | {hyper.default!r} | {hyper.domain} |" for hyper in KNOWN.values()))
    return "\n".join(parts)
