"""Token-type masses (Clark et al. 2019) and row entropy of [..., target, source] maps (docs/DESIGN.md §3.8)."""

from __future__ import annotations

import unicodedata
from functools import lru_cache

import torch

from mixlens.protocol import LensLike

TOKEN_TYPES = ("cls", "sep", "punct", "self", "prev", "next")


@lru_cache(maxsize=1 << 16)  # called for every token of a corpus; vocabularies repeat
def is_punct(token: str) -> bool:
    """A token made only of punctuation (word-piece / byte-level markers stripped)."""
    t = token.removeprefix("##").lstrip("Ġ▁")
    return bool(t) and all(unicodedata.category(c).startswith("P") for c in t)


def token_kinds(lens: LensLike, input_ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Boolean source masks [B, n] for 'cls' (or bos), 'sep' (or eos) and 'punct', found by role."""
    tok = lens.tokenizer
    cls_ids = {i for i in (tok.cls_token_id,) if i is not None} or {i for i in (tok.bos_token_id,) if i is not None}
    sep_ids = {i for i in (tok.sep_token_id, tok.eos_token_id) if i is not None} - cls_ids or {
        i for i in (tok.sep_token_id, tok.eos_token_id) if i is not None
    }
    ids = input_ids.cpu()
    punct = torch.tensor([[is_punct(t) for t in tok.convert_ids_to_tokens(row.tolist())] for row in ids])
    m = mask.cpu().bool()
    return {
        "cls": torch.isin(ids, torch.tensor(sorted(cls_ids))) & m,
        "sep": torch.isin(ids, torch.tensor(sorted(sep_ids))) & m,
        "punct": punct & m,
    }


def token_type_masses(
    maps: torch.Tensor, kinds: dict[str, torch.Tensor], mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Mean over real target rows i of Σ_{j∈S} A_ij, for each type S in TOKEN_TYPES.

    maps [B, ..., n, n] (rows should sum to 1), kinds from `token_kinds`, mask [B, n] → {type: [B, ...]}.
    """
    a = maps.float()
    extra = a.dim() - 3  # axes between batch and (target, source)
    m = mask.float().view(mask.shape[0], *([1] * extra), -1)  # [B, 1.., n]
    rows = m.sum(-1).clamp_min(1)
    out = {}
    for k in ("cls", "sep", "punct"):
        s = kinds[k].float().view(mask.shape[0], *([1] * extra), 1, -1)
        out[k] = ((a * s).sum(-1) * m).sum(-1) / rows
    diag = {"self": 0, "prev": -1, "next": 1}
    for k, off in diag.items():
        d = a.diagonal(offset=off, dim1=-2, dim2=-1)  # [B, ..., n-|off|]
        mm = m[..., max(0, -off) : m.shape[-1] - max(0, off)] if off else m
        out[k] = (d * mm).sum(-1) / rows
    return out


def row_entropy(maps: torch.Tensor, mask: torch.Tensor, smooth: float = 1e-4) -> torch.Tensor:
    """Mean over real rows of the entropy (nats) of rows smoothed as (1−ε)A + ε/n over real keys.

    maps [B, ..., n, n], mask [B, n] → [B, ...].
    """
    a = maps.float()
    extra = a.dim() - 3
    m = mask.float().view(mask.shape[0], *([1] * extra), -1)
    n = m.sum(-1, keepdim=True)  # real keys per input
    p = ((1 - smooth) * a + smooth / n.unsqueeze(-1)) * m.unsqueeze(-2)
    h = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # [B, ..., n]
    return (h * m).sum(-1) / m.sum(-1).clamp_min(1)
