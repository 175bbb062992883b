"""Corpus runs: stream a dataset, batch it by length, run methods, write resumable Parquet shards."""

from mixlens.corpus.readers import Example, ReadStats, count_records, iter_examples
from mixlens.corpus.runner import CorpusResult, run_corpus

__all__ = ["CorpusResult", "Example", "ReadStats", "count_records", "iter_examples", "run_corpus"]
