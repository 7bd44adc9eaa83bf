"""The optimizer of a trial or stage: the spec's own, else SGD (Nesterov) or AdamW with decay on weights only.

Used by :func:`stagewise.training.loop.start_loop` and the benchmarks; each group keeps ``lr_scale`` so the loop's
rescaled, warmed-up, scheduled lr keeps per-group ratios.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stagewise.core.errors import UserError
from stagewise.definitions.spec import ModelSpec, user_hook
from stagewise.training.recipe import mark_source


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups with weight decay on weight matrices and kernels only: biases and norm scales (1-d tensors)
    are not pulled towards zero, as in most transformer and CNN recipes."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def make_optimizer(model: nn.Module, params: dict, spec: ModelSpec | None = None) -> torch.optim.Optimizer:
    """The spec's own optimizer (``ModelSpec.optimizer``) when it builds one, else SGD with Nesterov momentum (what
    the linear scaling rule was shown on) or AdamW over :func:`decay_groups`. Each group keeps its lr as a multiple of
    ``params["lr"]`` (``lr_scale``), so the stage's rescaled, warmed-up, scheduled lr keeps per-group ratios."""
    optimizer = None
    if spec is not None:
        with user_hook(spec, "optimizer"):
            optimizer = spec.optimizer(model, params)
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"{type(spec).__name__}.optimizer() returned {type(optimizer).__name__}, not a "
                            "torch.optim.Optimizer")
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
        if missing:
            raise UserError(f"{type(spec).__name__}.optimizer() leaves trainable parameters out: {missing[:5]}")
        mark_source(optimizer, "spec")
    elif params.get("optimizer", "sgd") == "adamw":
        optimizer = torch.optim.AdamW(decay_groups(model, params["weight_decay"]), lr=params["lr"])
    else:
        momentum = params["momentum"]
        optimizer = torch.optim.SGD(decay_groups(model, params["weight_decay"]), lr=params["lr"], momentum=momentum,
                                    nesterov=momentum > 0)
    for group in optimizer.param_groups:
        group.setdefault("lr_scale", group["lr"] / params["lr"] if params["lr"] else 1.0)
    return optimizer
