"""Statistics over attribution maps (token-type mass, entropy, head types, syntax, agreement)."""
