"""BERTology studies: head statistics beyond the engine, head/layer disabling sweeps."""
