"""The running rows and their shared, left-padded KV cache (used only on the worker thread).

The batch shares one ``DynamicCache`` whose rows are left-padded to a common length: a
2D attention mask hides each row's padding and explicit ``position_ids`` keep each row's
rotary positions its own. Keys are cached after rotary, so padding a row on the left
never changes what it computed. Rows that leave are dropped with
``batch_select_indices`` and padding columns no row needs any more are cut from the
left; prompts are never re-run.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.backends.hf.state import Row


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class Batch:
    """The running rows and their shared, left-padded KV cache; used only on the worker thread."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # long [rows, cached columns], 0 on padding

    def clear(self) -> None:
        self.rows, self.cache, self.mask = [], None, None

    def retain(self, keep: list[int]) -> None:
        """Keep only the rows at these batch positions, in order."""
        if len(keep) == len(self.rows):
            return
        if not keep or self.cache is None or self.mask is None:
            self.clear()
            return
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.rows = [self.rows[i] for i in keep]
        self._trim_left()

    def _trim_left(self) -> None:
        # A long request that left may have forced padding on every other row.
        assert self.cache is not None and self.mask is not None
        lead = int(self.mask.any(dim=0).int().argmax())
        if lead == 0:
            return
        for layer in _layers(self.cache):
            keys, values = _keys_values(layer)
            layer.keys, layer.values = keys[:, :, lead:], values[:, :, lead:]
        self.mask = self.mask[:, lead:]

    def join(self, pieces: list[tuple[list[Row], DynamicCache]]) -> None:
        """Add prefilled rows, padding every cache on the left to the longest one."""
        if not pieces:
            return
        caches = ([self.cache] if self.cache is not None else []) + [cache for _, cache in pieces]
        masks = [self.mask] if self.mask is not None else []
        for rows, cache in pieces:
            masks.append(torch.ones(len(rows), cache.get_seq_length(), dtype=torch.long, device=_device_of(cache)))
        width = max(mask.shape[1] for mask in masks)
        base = caches[0]
        for depth, layer in enumerate(_layers(base)):
            parts = [_keys_values(_layers(cache)[depth]) for cache in caches]
            layer.keys = torch.cat([_pad_left(keys, width, 2) for keys, _ in parts])
            layer.values = torch.cat([_pad_left(values, width, 2) for _, values in parts])
        self.cache = base
        self.mask = torch.cat([_pad_left(mask, width, 1) for mask in masks])
        for rows, _ in pieces:
            self.rows.extend(rows)

    def decode_inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, position_ids and a 4D additive attention mask for one decode step.

        One query per row sees every column it owns, so the padding mask is the
        whole mask. It is handed over prepared because transformers would build
        a boolean one, and torch 2.13's CPU SDPA takes ~2.6 ms on a broadcast
        boolean mask where an additive float one takes ~7 us (q=2, kv=100).
        """
        assert self.mask is not None
        device = self.mask.device
        ids = torch.tensor([[row.output_ids[-1]] for row in self.rows], device=device)
        positions = torch.tensor([[row.next_position()] for row in self.rows], device=device)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        hidden = (self.mask == 0)[:, None, None, :]
        additive = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, torch.finfo(dtype).min)
        return ids, positions, additive


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    # load_model checked that every layer of this model's cache is a plain DynamicLayer.
    return cast(list[DynamicLayer], cache.layers)


def _keys_values(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    return cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values)


def _device_of(cache: DynamicCache) -> torch.device:
    return _keys_values(_layers(cache)[0])[0].device

