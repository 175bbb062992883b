"""BERTology studies over datasets (docs/bertology.md)."""
