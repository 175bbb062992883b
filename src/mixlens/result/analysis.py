"""`Analysis`: everything one `Lens.analyze` call computed (methods by name, mixing ratios, self-checks), its JSON,
its files and the concatenation of several."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mixlens.errors import MixlensError
from mixlens.result import loading, segmented, views
from mixlens.result.attribution import Attribution
from mixlens.result.files import ANALYSIS_FORMAT, json_default, read_manifest, write_store
from mixlens.result.rows import InputBiasRows, InputRows


class Analysis:
    """Everything one `Lens.analyze` call computed: methods by name, mixing ratios and self-checks.

    `ratios` (variant → [batch, layer, target]) and `bias` ([batch, layer, target, d], g_i(b_O) + β) are stored per
    batch like the attributions and padded to the longest input only when read; both are empty / None and
    `reconstruction_error` ([batch], max abs over layers) is None when no requested method used the norm engine.
    An analysis read from `mixlens analyze`'s JSON knows only each input's per-layer mean ratio
    (`ratio_means_only`): its per-token `ratios` repeat that mean on every token (exact means, pooled means and
    sums), and `mixing_ratio(per_token=True)` is refused.
    """

    def __init__(
        self,
        model: str,
        version: str,
        texts: list[str],
        tokens: list[list[str]],
        attributions: dict[str, Attribution],
        ratios: Mapping[str, np.ndarray | InputRows],
        reconstruction_error: np.ndarray | None,
        bias: np.ndarray | InputRows | None = None,
        ratio_means_only: bool = False,
        explained: list[dict[str, Any]] | None = None,
        error_share: np.ndarray | None = None,
    ):
        self.model, self.version, self.texts, self.tokens = model, version, texts, tokens
        self.explained = explained  # per input, the target its scores explain (`Explanation`); None otherwise
        self.attributions = attributions
        self.reconstruction_error = reconstruction_error
        # [batch] the error as a share of the exactness check's tolerance for the run's dtype (≤ 1: passed); set by
        # `Lens.analyze`, not saved
        self.error_share = error_share
        self.ratio_means_only = ratio_means_only
        self._ratio_means: dict[str, np.ndarray] | None = None  # read from analyze's JSON: [batch, layer] per variant
        lengths = [len(t) for t in tokens]
        self.ratio_store = {
            v: r if isinstance(r, InputRows) else InputRows.of(r, ("layer", "target"), lengths)
            for v, r in ratios.items()
        }
        self.bias_store = (
            bias
            if bias is None or isinstance(bias, InputRows)
            else InputRows.of(bias, ("layer", "target", "hidden"), lengths)
        )

    @property
    def ratios(self) -> dict[str, np.ndarray]:
        """variant → [batch, layer, target] per-token mixing ratios, padding 0 (built on first use)."""
        return {v: r.full() for v, r in self.ratio_store.items()}

    @property
    def bias(self) -> np.ndarray | None:
        """[batch, layer, target, d] g_i(b_O) + β, padding 0 (built on first use)."""
        return None if self.bias_store is None else self.bias_store.full()

    @property
    def nbytes(self) -> int:
        """Bytes of per-input arrays held (attributions, ratios, bias)."""
        return (
            sum(a.nbytes for a in self.attributions.values())
            + sum(s.nbytes for s in self.ratio_store.values())
            + (self.bias_store.nbytes if self.bias_store is not None else 0)
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, method: str) -> Attribution:
        try:
            return self.attributions[method]
        except KeyError:
            raise MixlensError(f"'{method}' was not computed; have {sorted(self.attributions)}") from None

    def __contains__(self, method: str) -> bool:
        return method in self.attributions

    def mixing_ratio(self, variant: str = "ResLN-N", per_token: bool = False) -> np.ndarray:
        """Context-mixing ratio r (Kobayashi 2021): [batch, layer], mean over real tokens, or
        [batch, layer, target] per token (padding 0)."""
        if not self.ratio_store:
            raise MixlensError("no mixing ratios: none of the methods used the norm engine (e.g. add 'norm')")
        if variant not in self.ratio_store:
            raise MixlensError(f"unknown mixing-ratio variant '{variant}'; valid: {', '.join(self.ratio_store)}")
        store = self.ratio_store[variant]
        if per_token:
            if self.ratio_means_only:
                raise MixlensError(
                    "this analysis was read from analyze's JSON, which holds only per-layer means "
                    "of the mixing ratios; save it with Analysis.save for per-token ratios"
                )
            return store.full()
        if self._ratio_means is not None:
            return self._ratio_means[variant]
        lengths = np.array([len(t) for t in self.tokens])
        out = np.zeros((len(self.tokens), store.parts[0][1].shape[1]), store.parts[0][1].dtype)
        for idx, r in store.parts:
            out[idx] = r.sum(-1) / lengths[idx, None].astype(r.dtype)
        return out

    def _repr_html_(self) -> str:
        """Interactive report view in notebooks (offline; unique ids, so several outputs share a page)."""
        return str(views.view("analysis.notebook")(self))

    def to_json(self) -> dict[str, Any]:
        """The documented JSON contract (README, 'JSON output')."""
        means = {v: self.mixing_ratio(v) for v in self.ratio_store}
        err = self.reconstruction_error
        return {
            "model": self.model,
            "version": self.version,
            "inputs": [
                {
                    "text": self.texts[b],
                    "tokens": self.tokens[b],
                    "methods": {k: a.to_json_dict(b) for k, a in self.attributions.items()},
                    "mixing_ratio": {v: means[v][b].tolist() for v in means},
                    "reconstruction_error": None if err is None else float(err[b]),
                    **({} if self.explained is None else {"target": self.explained[b]}),
                }
                for b in range(len(self.texts))
            ],
        }

    # ---- files ----

    def save(self, path: str | Path) -> None:
        """`path.safetensors` (every per-batch block: methods `method.NAME.`, their extras `extra.NAME.KEY.`,
        ratios `ratio.VARIANT.`, `bias.`, each as `values.k` / `index.k`; `reconstruction_error`) + `path.json`
        (manifest). No pickles; atomic writes; reload with `Analysis.load`."""
        rowed = [name for name, a in self.attributions.items() if a.rows is not None]
        if rowed:
            raise MixlensError(
                f"saving an analysis of target rows ({', '.join(rowed)}) is not supported; save each "
                "Attribution with .save(), or analyse all rows"
            )
        tensors: dict[str, np.ndarray] = {}
        methods: dict[str, Any] = {}
        for name, a in self.attributions.items():
            tensors |= a.store.tensors(f"method.{name}.")
            for k, s in a.extra_store.items():
                tensors |= s.tensors(f"extra.{name}.{k}.")
            methods[name] = {
                "dims": list(a.dims),
                "params": a.params,
                "blocks": len(a.store.parts),
                "extras": {k: {"dims": list(s.dims), "blocks": len(s.parts)} for k, s in a.extra_store.items()},
            }
        for v, s in self.ratio_store.items():
            tensors |= s.tensors(f"ratio.{v}.")
        if self.bias_store is not None:
            tensors |= self.bias_store.tensors("bias.")
        if self.reconstruction_error is not None:
            tensors["reconstruction_error"] = np.ascontiguousarray(self.reconstruction_error)
        first = next(iter(self.attributions.values()), None)
        manifest = {
            "format": ANALYSIS_FORMAT,
            "model": self.model,
            "version": self.version,
            "texts": self.texts,
            "tokens": self.tokens,
            "words": first.words if first is not None else None,
            "methods": methods,
            "ratios": {v: len(s.parts) for v, s in self.ratio_store.items()},
            "ratio_means_only": self.ratio_means_only,
            "bias": None if self.bias_store is None else len(self.bias_store.parts),
            "reconstruction_error": self.reconstruction_error is not None,
            "explained": self.explained,
            "segments": segmented.saved(self),
        }
        write_store(Path(path), tensors, manifest)

    @classmethod
    def load(cls, path: str | Path) -> Analysis:
        """Read a saved analysis (`save`), or the JSON written by `mixlens analyze` (per-layer mean ratios only,
        see the class doc). Every field and tensor is checked (`MixlensError` on a bad or crafted file)."""
        path = Path(path)
        man_path = path if path.suffix == ".json" else path.with_suffix(".json")
        man = read_manifest(man_path)
        if man.get("format") == ANALYSIS_FORMAT:
            return _typed(loading.from_saved(cls, man, man_path))
        if "inputs" in man and "format" not in man:
            return _typed(cls.from_json(man, str(man_path)))
        raise MixlensError(f"{man_path} is neither a saved analysis nor the JSON of `mixlens analyze`")

    @classmethod
    def from_json(cls, obj: object, where: str = "the JSON") -> Analysis:
        """Rebuild an analysis from `to_json()`'s output (the JSON of `mixlens analyze`), checking its structure."""
        return loading.from_json(cls, obj, where)

    @classmethod
    def concat(cls, analyses: Sequence[Analysis]) -> Analysis:
        """One analysis holding the inputs of several, in order; they must come from the same model, mixlens
        version and methods (axes, options, extras, ratio variants)."""
        if not analyses:
            raise MixlensError("nothing to concatenate")
        first = analyses[0]

        def shape(a: Analysis) -> object:
            return (
                {
                    k: (
                        x.dims,
                        json.dumps(x.params, sort_keys=True, default=json_default),
                        {e: s.dims for e, s in x.extra_store.items()},
                        x.rows is None,
                    )
                    for k, x in a.attributions.items()
                },
                sorted(a.ratio_store),
                a.bias_store is None,
                a.reconstruction_error is None,
                a.ratio_means_only,
                a.explained is None,
                getattr(a, "segments", None) is None,
            )

        for k, a in enumerate(analyses[1:], 2):
            if a.model != first.model or a.version != first.version:
                raise MixlensError(
                    f"analysis {k} comes from {a.model} (mixlens {a.version}), analysis 1 from "
                    f"{first.model} (mixlens {first.version})"
                )
            if shape(a) != shape(first):
                raise MixlensError(
                    f"analysis {k} has other methods, options, extras, ratios, segments or rows (row mode or every "
                    "row) than analysis 1"
                )
        tokens = [t for a in analyses for t in a.tokens]
        lengths = [len(t) for t in tokens]
        words = (
            [w for a in analyses for w in (next(iter(a.attributions.values())).words or [])]
            if first.attributions and all(next(iter(a.attributions.values())).words for a in analyses)
            else None
        )
        attributions = {}
        for name, x in first.attributions.items():
            parts = [a.attributions[name] for a in analyses]
            extras = {e: InputRows.concat([p.extra_store[e] for p in parts], lengths) for e in x.extra_store}
            attributions[name] = Attribution(
                InputRows.concat([p.store for p in parts], lengths),
                x.dims,
                tokens,
                name,
                x.model,
                x.params,
                words,
                extras,
                None if x.rows is None else [r for p in parts for r in p.rows or []],
            )
        ratios = {v: InputRows.concat([a.ratio_store[v] for a in analyses], lengths) for v in first.ratio_store}
        bias = (
            None
            if first.bias_store is None
            else InputBiasRows.concat([a.bias_store for a in analyses if a.bias_store is not None], lengths)
        )
        err = (
            None
            if first.reconstruction_error is None
            else np.concatenate([a.reconstruction_error for a in analyses if a.reconstruction_error is not None])
        )
        explained = None if first.explained is None else [t for a in analyses for t in a.explained or []]
        joined = _typed(
            cls(
                first.model,
                first.version,
                [t for a in analyses for t in a.texts],
                tokens,
                attributions,
                ratios,
                err,
                bias,
                first.ratio_means_only,
                explained,
            )
        )
        if getattr(first, "segments", None) is not None:
            joined.segments = [s for a in analyses for s in a.segments]  # type: ignore[attr-defined]
        return joined


def _typed(res: Analysis) -> Analysis:
    """An analysis that explains targets is an `Explanation` (its views); any other stays an `Analysis`."""
    from mixlens.result.explanation import Explanation

    if res.explained is None or isinstance(res, Explanation):
        return res
    out = Explanation.__new__(Explanation)
    out.__dict__.update(res.__dict__)
    out.timings = {}
    return out
