"""Corpus runs: stream a dataset, batch it by length, run methods, write resumable Parquet shards."""

from mixlens.corpus.readers import Example, ReadStats, count_records, iter_examples

__all__ = ["Example", "ReadStats", "count_records", "iter_examples"]
