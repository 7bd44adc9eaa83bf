"""A decoder-only transformer (GPT-style causal blocks) whose depth and width come from the hyperparameters, made to
be sharded: :meth:`TokenDecoder.shard_units` names its blocks, so an ``fsdp`` stage gathers one block at a time.

Use it with ``model: {spec: "stagewise.examples.decoder:TokenDecoder"}`` over a data set that declares a token column
``{column: tokens, dtype: int64, max_length: N}`` (examples/decoder.yaml). Each row's tokens are read left to right
under a causal mask; the representation at the row's last real token classifies it. Width ``dim`` x ``layers`` blocks
of 12 x dim² parameters each: dim 1024 and 24 layers make a 300M-parameter model that a ddp rank holds whole (about
5 GB of weights, gradients and AdamW moments) and an fsdp rank holds a 1/world share of. It imports only
``stagewise.spec``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stagewise.spec import Classifier, DataInfo, Features, UserError


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, each added back to the residual stream."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, hidden: torch.Tensor, causal: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        normed = self.attention_norm(hidden)
        attended, _ = self.attention(normed, normed, normed, attn_mask=causal, key_padding_mask=padding,
                                     need_weights=False)
        hidden = hidden + attended
        return hidden + self.mlp(self.mlp_norm(hidden))


class Decoder(nn.Module):
    """Hashed token embeddings plus positions, ``layers`` causal blocks, a final norm and a classification head."""

    def __init__(self, data: DataInfo, params: dict[str, Any], column: str) -> None:
        super().__init__()
        dim, self.buckets, self.column = int(params["dim"]), int(params["buckets"]), column
        self.tokens = nn.Embedding(self.buckets, dim)
        self.positions = nn.Embedding(data.input(column).shape[0], dim)
        self.blocks = nn.ModuleList(Block(dim, int(params["heads"]), float(params["dropout"]))
                                    for _ in range(int(params["layers"])))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, data.num_classes)

    def forward(self, features: Features) -> torch.Tensor:
        ids, mask = features[self.column], features.mask(self.column)
        length = ids.shape[1]
        positions = torch.arange(length, device=ids.device)
        hidden = self.tokens(torch.remainder(ids, self.buckets)) + self.positions(positions)
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=ids.device), diagonal=1)
        padding = ~mask
        for block in self.blocks:
            hidden = block(hidden, causal, padding)
        # Rows are left-aligned: the last real token sits at (real tokens - 1); an empty row reads position 0.
        last = (mask.sum(1) - 1).clamp(min=0)
        return self.head(self.norm(hidden[torch.arange(len(ids), device=ids.device), last]))


class TokenDecoder(Classifier):
    """Classifies token sequences with a decoder-only transformer (loss, accuracy and predictions: Classifier).

    The framework's optimizer (AdamW with ``optimizer: adamw``: no weight decay on biases, norms) and the stage's
    schedule apply; an ``fsdp`` stage shards it block by block (:meth:`shard_units`)."""

    default_params = {"dim": 64, "heads": 4, "layers": 4, "buckets": 4096, "dropout": 0.0, "optimizer": "adamw",
                      "weight_decay": 0.01}

    def __init__(self, column: str = "tokens") -> None:
        super().__init__(column=column)
        self.column = column

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        names = [column.name for column in data.layout.columns] if data.layout is not None else []
        if not data.typed or self.column not in names or not data.input(self.column).variable:
            raise UserError(f"TokenDecoder needs dataset.features to declare {{column: {self.column}, dtype: int64, "
                            f"max_length: ...}}")
        if int(params["dim"]) % int(params["heads"]):
            raise UserError(f"TokenDecoder: dim {params['dim']} must be a multiple of heads {params['heads']}")
        return Decoder(data, params, self.column)

    def shard_units(self, module: nn.Module) -> list[nn.Module]:
        # One unit a block (the largest thing gathered at once), the embeddings one more; the root keeps norm and head.
        return [module.tokens, *module.blocks]
