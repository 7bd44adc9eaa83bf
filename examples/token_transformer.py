"""A small transformer over variable-length token ids: typed inputs, the spec's own optimizer and, optionally, schedule.

Use it with ``model: {spec: "stagewise.examples.token_transformer:TokenTransformer"}`` and a data set that declares
its token column as ``{column: tokens, dtype: int64, max_length: 16}`` (see examples/token_transformer.yaml). The
tokens reach :meth:`TokenTransformer.batch` as exact int64 ids, each batch padded to its longest row with a mask;
``channel`` arrives as categorical ids, ``hour`` as a standardised float. It imports only ``stagewise.spec``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stagewise.spec import Classifier, DataInfo, Features, UserError


class _Encoder(nn.Module):
    """Hashed token embeddings plus positions, a transformer encoder over the real tokens, a masked mean, a head."""

    def __init__(self, data: DataInfo, params: dict[str, Any], column: str) -> None:
        super().__init__()
        dim, self.buckets, self.column = int(params["dim"]), int(params["buckets"]), column
        self.tokens = nn.Embedding(self.buckets, dim)
        self.positions = nn.Embedding(data.input(column).shape[0], dim)
        self.channels = nn.Embedding(data.input("channel").num_categories, dim) if "channel" in _names(data) else None
        self.dense = nn.Linear(data.num_features, dim) if data.num_features else None
        layer = nn.TransformerEncoderLayer(dim, int(params["heads"]), dim_feedforward=2 * dim,
                                           dropout=float(params["dropout"]), batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, int(params["layers"]), enable_nested_tensor=False)
        self.head = nn.Linear(dim, data.num_classes)

    def forward(self, features: Features) -> torch.Tensor:
        ids, mask = features[self.column], features.mask(self.column)
        # ids are arbitrary int64 (here above 2^60): hash them into the table, exactly, in integer arithmetic
        hashed = torch.remainder(ids, self.buckets)
        positions = torch.arange(ids.shape[1], device=ids.device)
        encoded = self.encoder(self.tokens(hashed) + self.positions(positions), src_key_padding_mask=~mask)
        weights = mask.unsqueeze(-1).to(encoded.dtype)
        pooled = (encoded * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        if self.channels is not None:
            pooled = pooled + self.channels(features["channel"])
        if self.dense is not None:
            pooled = pooled + self.dense(features.dense)
        return self.head(pooled)


def _names(data: DataInfo) -> list[str]:
    return [column.name for column in data.layout.columns] if data.layout is not None else []


class TokenTransformer(Classifier):
    """Classifies token sequences (loss, accuracy and predictions: Classifier).

    ``schedule="inverse_sqrt"`` brings the spec's own learning-rate schedule (the stage's ``lr_schedule`` is then not
    used); by default the stage's is. The optimizer is always the spec's: AdamW without weight decay on embeddings,
    biases and norms, the embeddings at ``embedding_lr_scale`` times the lr.
    """

    default_params = {"dim": 32, "heads": 4, "layers": 1, "buckets": 1024, "dropout": 0.0, "embedding_lr_scale": 1.0}

    def __init__(self, column: str = "tokens", schedule: str = "stage") -> None:
        super().__init__(column=column, schedule=schedule)
        if schedule not in ("stage", "inverse_sqrt"):
            raise UserError(f"TokenTransformer schedule '{schedule}' is not 'stage' or 'inverse_sqrt'")
        self.column, self.schedule = column, schedule

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        if not data.typed or self.column not in _names(data) or not data.input(self.column).variable:
            raise UserError(f"TokenTransformer needs dataset.features to declare {{column: {self.column}, dtype: int64, "
                            f"max_length: ...}}")
        return _Encoder(data, params, self.column)

    def optimizer(self, module: nn.Module, params: dict[str, Any]) -> torch.optim.Optimizer:
        embeddings, decayed, plain = [], [], []
        for name, parameter in module.named_parameters():
            if isinstance(module.get_submodule(name.rsplit(".", 1)[0]), nn.Embedding):
                embeddings.append(parameter)
            elif parameter.ndim >= 2:
                decayed.append(parameter)
            else:
                plain.append(parameter)
        lr, decay = float(params["lr"]), float(params["weight_decay"])
        return torch.optim.AdamW([
            {"params": decayed, "weight_decay": decay},
            {"params": plain, "weight_decay": 0.0},
            {"params": embeddings, "weight_decay": 0.0, "lr_scale": float(params["embedding_lr_scale"])},
        ], lr=lr)

    def lr_schedule(self, step: int, total_steps: int) -> float | None:
        if self.schedule == "stage":
            return None
        return 1.0 / math.sqrt(1.0 + step / 10.0)  # inverse square root decay, as in the original transformer
